"""`mailflow` commands given wrong input say what was wrong and exit non-zero: nothing passes
silently with rc=0, nothing crashes with a traceback."""

from __future__ import annotations

import pytest
from scheduled_rig import Rig, provisioned, rig  # noqa: F401  (fixture)

from mailflow.cli import main as mailflow_cli

DECIDE = ["--by", "ops@example.com", "--reason", "checked with the provider"]


def _dead(rig: Rig, n: int = 3, name: str = "spring_offer") -> list[int]:
    """``n`` rows of campaign ``name`` made undecided dead letters (as the reconciler leaves them)."""
    provisioned(rig, n, name=name)
    ids = [r["id"] for r in rig.rows()]
    rig.db.execute("update mail.send_log set status = 'failed', attempts = 1, claimed_at = now(),"
                   " dead_lettered_at = now(), error = 'idempotency window passed' where id = any(%s)", (ids,))
    return ids


def test_malformed_id_is_a_usage_error_naming_it(rig: Rig, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        mailflow_cli(["dead-letters", "resend", "--ids", "12,abc", *DECIDE, "--dsn", rig.dsn])
    assert exc.value.code == 2
    assert "Invalid value for '--ids': 'abc' is not a send-log id (a positive integer)" in capsys.readouterr().err


def test_ids_with_all_are_mutually_exclusive(rig: Rig, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        mailflow_cli(["dead-letters", "close", "--ids", "1", "--all", *DECIDE, "--dsn", rig.dsn])
    assert exc.value.code == 2
    assert "--ids and --all exclude each other" in capsys.readouterr().err


def test_unknown_and_already_decided_ids_are_reported_not_silently_skipped(
        rig: Rig, capsys: pytest.CaptureFixture[str]) -> None:
    dead = _dead(rig)
    dsn = ["--dsn", rig.dsn]
    assert mailflow_cli(["dead-letters", "close", "--ids", "999999", "--by", "ops", *dsn]) == 2  # no --reason
    assert "names who took it (--by) and why (--reason)" in capsys.readouterr().err
    assert mailflow_cli(["dead-letters", "close", "--ids", "999999", *DECIDE, *dsn]) == 1
    out = capsys.readouterr()
    assert "close: 0 dead letter(s) decided" in out.out
    assert "  999999: no such row in the send log" in out.err
    assert mailflow_cli(["dead-letters", "close", "--ids", str(dead[0]), *DECIDE, *dsn]) == 0
    capsys.readouterr()
    # the same id again: already decided, when and by whom; nothing changed
    assert mailflow_cli(["dead-letters", "close", "--ids", f"{dead[0]},{dead[1]}", *DECIDE, *dsn]) == 1
    out = capsys.readouterr()
    assert f"close: 1 dead letter(s) decided ({dead[1]})" in out.out
    assert f"  {dead[0]}: already decided (close) at " in out.err and " UTC by ops@example.com" in out.err
    assert rig.rows(f"id = {dead[0]}")[0]["dead_letter_decision"] == "close"
    assert len([r for r in rig.rows() if r["dead_letter_decision"] is not None]) == 2


def test_ids_outside_campaign_are_reported(rig: Rig, capsys: pytest.CaptureFixture[str]) -> None:
    dead = _dead(rig)
    rig.db.execute("update mail.send_log set campaign = 'other_camp' where id = %s", (dead[0],))
    assert mailflow_cli(["dead-letters", "close", "--campaign", "spring_offer", "--ids", f"{dead[0]},{dead[1]}",
                         *DECIDE, "--dsn", rig.dsn]) == 1
    out = capsys.readouterr()
    assert f"close: 1 dead letter(s) decided ({dead[1]})" in out.out
    assert f"  {dead[0]}: belongs to campaign 'other_camp', not 'spring_offer'" in out.err


@pytest.mark.parametrize("argv", [
    ["dead-letters", "list", "--campaign", "spring_ofer"],
    ["dead-letters", "close", "--all", "--campaign", "spring_ofer", *DECIDE],
    ["reopen-refused", "--campaign", "spring_ofer"],
])
def test_unknown_campaign_is_named_with_close_matches(rig: Rig, capsys: pytest.CaptureFixture[str],
                                                      argv: list[str]) -> None:
    _dead(rig)
    assert mailflow_cli([*argv, "--dsn", rig.dsn]) == 2
    assert ("error: no campaign 'spring_ofer' in the send log; did you mean 'spring_offer'?"
            in capsys.readouterr().err)
    assert all(r["dead_letter_decision"] is None for r in rig.rows())


def test_reopen_refused_field_is_case_insensitive(rig: Rig, capsys: pytest.CaptureFixture[str]) -> None:
    provisioned(rig, 1, name="bad_from")
    rig.db.execute("update mail.send_log set status = 'failed', attempts = 1, claimed_at = now(),"
                   " error = 'Invalid `from` field. The email address needs to follow the `email@example.com`'")
    assert mailflow_cli(["reopen-refused", "--campaign", "bad_from", "--field", "FROM", "--dsn", rig.dsn]) == 0
    assert '"found": 1' in capsys.readouterr().out


def test_breaker_close_of_unknown_account_lists_the_known(rig: Rig, capsys: pytest.CaptureFixture[str]) -> None:
    rig.db.execute("insert into mail.circuit_breaker (account, state, opened_at, reason, failures, opened_total,"
                   " updated_at) values ('http://acct-a', 'open', now(), 'x', 1, 1, now())")
    assert mailflow_cli(["breaker", "--close", "http://acct-b", "--by", "ops", "--dsn", rig.dsn]) == 1
    assert "error: no breaker for account 'http://acct-b'; known accounts: http://acct-a" in capsys.readouterr().err
    assert mailflow_cli(["breaker", "--close", "http://acct-a", "--by", "ops", "--dsn", rig.dsn]) == 0
    assert "closed the breaker of http://acct-a" in capsys.readouterr().out


def test_breaker_by_without_close_is_refused(rig: Rig, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        mailflow_cli(["breaker", "--by", "ops", "--dsn", rig.dsn])
    assert exc.value.code == 2
    assert "--by names who closes a breaker; it needs --close ACCOUNT" in capsys.readouterr().err


def test_usage_line_names_only_real_breaker_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        mailflow_cli(["-h"])
    out = capsys.readouterr().out
    assert "mailflow breaker [--close ACCOUNT --by NAME]" in out and "--close --by NAME --reason" not in out
