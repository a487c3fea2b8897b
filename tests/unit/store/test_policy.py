"""The contact policy's rules (mailflow.store.policy.evaluate) and address hygiene, without a database."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from mailflow.campaigns import CAMPAIGNS_DIR, load_campaigns, load_policy
from mailflow.model.policy import Cap, ContactPolicy, policy_from_mapping
from mailflow.store.policy import (
    Contact,
    evaluate,
    mailbox_key,
    normalise_address,
)

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
D, US = timedelta(days=1), timedelta(microseconds=1)
WEEK = ContactPolicy(cooldown=7 * D)


def sent(at: datetime, rid: int = 1) -> Contact:
    return Contact(rid, "c", "sent", at)


@pytest.mark.parametrize(("contact", "held"), [
    (sent(NOW - 7 * D), True),                       # exactly the cooldown ago: the lower bound is inclusive
    (sent(NOW - 7 * D - US), False),
    (Contact(1, "c", "pending", NOW + 7 * D - US), True),
    (Contact(1, "c", "pending", NOW + 7 * D), False),  # the upper bound is exclusive
    (Contact(1, "c", "sending", None), True),          # in flight: now, inside every window
])
def test_cooldown_window_bounds(contact: Contact, held: bool) -> None:
    assert (evaluate(WEEK, [contact], ref=NOW, now=NOW) is not None) is held


def test_a_hold_says_which_rule_which_contacts_and_when_it_frees() -> None:
    hold = evaluate(WEEK, [sent(NOW - 2 * D, 41), Contact(42, "x", "sending", None)], ref=NOW, now=NOW)
    assert hold is not None and hold.cooldown and hold.rule == Cap(7 * D, 1)
    assert hold.free_at == NOW + 7 * D  # the in-flight email counts as now
    assert hold.reason() == ("contact policy: cooldown 7 days: row 42 (x, sending), row 41 (c, sent "
                             "2026-11-29T12:00:00+00:00); free from 2026-12-08T12:00:00+00:00")


def test_a_backfill_sees_what_was_sent_after_its_interval_and_what_is_planned_after_now() -> None:
    ref = NOW - 3 * D  # a 3-day-old interval
    assert evaluate(WEEK, [sent(NOW - D)], ref=ref, now=NOW) is not None
    assert evaluate(WEEK, [Contact(1, "s", "pending", NOW + 5 * D)], ref=ref, now=NOW) is not None
    assert evaluate(WEEK, [Contact(1, "s", "pending", NOW + 8 * D)], ref=ref, now=NOW) is None


def test_frequency_caps_count_every_contact_in_the_window() -> None:
    policy = ContactPolicy(cooldown=D, caps=(Cap(7 * D, 3),))
    three = [sent(NOW - 3 * D, 1), sent(NOW - 2 * D, 2), sent(NOW - 5 * D, 3)]
    hold = evaluate(policy, three, ref=NOW, now=NOW)
    assert hold is not None and not hold.cooldown and hold.rule == Cap(7 * D, 3)
    assert hold.free_at == NOW - 5 * D + 7 * D  # once the oldest of the three leaves the window
    assert hold.reason().startswith("contact policy: frequency cap 3 per 7 days: row 2 (c, sent")
    assert evaluate(policy, three[:2], ref=NOW, now=NOW) is None
    assert evaluate(policy, [*three[:2], sent(NOW - 7 * D - US, 3)], ref=NOW, now=NOW) is None


def test_rules_and_the_caps_the_cooldown_implies() -> None:
    policy = ContactPolicy(cooldown=7 * D, caps=(Cap(28 * D, 3), Cap(D, 1)))
    assert policy.rules == (Cap(7 * D, 1), Cap(D, 1), Cap(28 * D, 3))
    assert policy.extra_caps() == (Cap(28 * D, 3),)
    assert policy.widest() == 28 * D
    assert ContactPolicy(cooldown=timedelta(0)).rules == ()
    assert evaluate(ContactPolicy(cooldown=timedelta(0)), [sent(NOW)], ref=NOW, now=NOW) is None


def test_the_shipped_policy_and_its_errors(tmp_path: Path) -> None:
    assert load_policy() == ContactPolicy(cooldown=7 * D, caps=(Cap(D, 1), Cap(28 * D, 3)))
    assert policy_from_mapping({}) == ContactPolicy(cooldown=7 * D)
    with pytest.raises(ValueError, match=r"^\[policy\]: caps\[0\] must be \{ emails = N, per = \"P7D\" \}"):
        policy_from_mapping({"caps": [{"emails": 3}]})
    with pytest.raises(ValueError, match=r"^\[policy\]: a frequency cap allows at least 1 email, got 0$"):
        policy_from_mapping({"caps": [{"emails": 0, "per": "P1D"}]})
    with pytest.raises(ValueError, match=r"not an ISO-8601 duration"):
        policy_from_mapping({"cooldown": "1 week"})
    toml = (CAMPAIGNS_DIR / "lifecycle.toml").read_text(encoding="utf-8")
    bad = tmp_path / "lifecycle.toml"
    for name in ("audiences", "templates"):
        (tmp_path / name).symlink_to(CAMPAIGNS_DIR / name)
    bad.write_text(toml.replace('priority = 1\n', 'priority = 1\ncooldown = "P1D"\n', 1), encoding="utf-8")
    with pytest.raises(ValueError, match=r"campaign 'finish_assessment': the cooldown is set once for every campaign"):
        load_campaigns(bad)
    bad.write_text(toml.replace('priority = 1\n', 'priority = 1\npolicy = "exempt"\n', 1), encoding="utf-8")
    exempt = {c.name: c.exempt for c in load_campaigns(bad)}
    assert exempt == {"finish_assessment": True, "first_practice": False, "upgrade_offer": False,
                      "practice_tips": False}
    assert all(c.caps == (Cap(D, 1), Cap(28 * D, 3)) and c.cooldown == 7 * D for c in load_campaigns())


@pytest.mark.parametrize(("raw", "send", "key"), [
    ("  User@Example.COM\t", "User@example.com", "user@example.com"),
    ("jörg@Bücher.example", "jörg@xn--bcher-kva.example", "jörg@xn--bcher-kva.example"),
    ("Jo\u0308rg@example.com", "Jörg@example.com", "jörg@example.com"),  # NFC: o + combining diaeresis
    ("x@münchen.example", "x@xn--mnchen-3ya.example", "x@xn--mnchen-3ya.example"),
])
def test_addresses_are_trimmed_normalised_and_idna_encoded(raw: str, send: str, key: str) -> None:
    a = normalise_address(raw)
    assert (a.valid, a.send, a.key) == (True, send, key)


def test_the_unicode_domain_and_the_punycode_spelling_have_one_mailbox_key() -> None:
    # suppressions store this key too, so one typed with the Unicode domain matches the punycode one
    assert normalise_address("Jörg@Bücher.example").keys == ("jörg@xn--bcher-kva.example",)
    assert mailbox_key(" Jörg@Bücher.example") == mailbox_key("JÖRG@XN--BCHER-KVA.example") == "jörg@xn--bcher-kva.example"


@pytest.mark.parametrize(("raw", "error"), [
    ("anna@@example.com", "The part after the @-sign contains invalid characters: '@'."),
    ("anna mueller@example.com", "The email address contains invalid characters before the @-sign: SPACE."),
    ("anna.mueller@localhost", "The part after the @-sign is not valid. It should have a period."),
    ("", "the address is empty"),
    (None, "the address is empty"),
])
def test_invalid_addresses_carry_the_validators_reason(raw: str | None, error: str) -> None:
    a = normalise_address(raw)
    assert (a.valid, a.error, a.send, a.key) == (False, error, "", "")


@pytest.mark.parametrize(("spellings", "key"), [
    (["ΟΔΟΣ@example.gr", "οδος@example.gr", "οδοσ@example.gr", "ΟΔΟΣ@EXAMPLE.GR"], "οδοσ@example.gr"),
    (["İnci@example.com", "i\u0307nci@example.com", "İNCI@example.com"], "i\u0307nci@example.com"),
    (["Äpfel@example.de", "äpfel@example.de", "A\u0308pfel@example.de", " äPFEL@Example.DE\t"], "äpfel@example.de"),
    (["Straße@example.de", "STRASSE@example.de", "strasse@example.de", "STRA\u1e9eE@example.de"], "strasse@example.de"),
    (["jörg@bücher.example", "JÖRG@XN--BCHER-KVA.example", " jo\u0308rg@Bücher.example "], "jörg@xn--bcher-kva.example"),
])
def test_one_mailbox_key_for_every_case_spelling_of_a_mailbox(spellings: list[str], key: str) -> None:
    # one case-folding rule (Unicode full case folding, then NFC): the same key for capital, small
    # and final sigma, for İ and i + combining dot, for Ä in any normal form, for ß, ẞ and SS
    assert {mailbox_key(s) for s in spellings} == {key}
    assert mailbox_key(key) == key  # idempotent: a stored key is its own key


def test_an_invalid_address_has_no_mailbox_key() -> None:
    assert mailbox_key("anna@@example.com") is None
    assert mailbox_key("   ") is None
    assert mailbox_key(None) is None
