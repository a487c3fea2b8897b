"""Holdout groups (docs/model.md, "Holdout groups"): membership is one function of (campaign, user_id)
in Python and SQL; held-out users get a terminal ``holdout`` row where their email would have been
minted (lifecycle) or planned (scheduled provisioning), which is never claimed or sent, blocks a
rerun or backfill of the campaign, and is no contact for any other campaign; the lift query
compares the two groups.

Real PostgreSQL and the emulator over HTTP (tests/lifecycle_rig.py, tests/scheduled_rig.py); every
expected set is computed from :func:`mailflow.model.holdout.in_holdout`.
"""

from __future__ import annotations

import dataclasses
import random
import shutil
from collections import Counter
from datetime import timedelta
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import MAIL_TABLES, UNSUBSCRIBE_SECRET
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lifecycle_rig import END, INTERVAL, D, H, Rig, add_user, simple_campaign
from lifecycle_rig import rig as rig  # noqa: F401  (fixture)

from mailflow.campaigns import EXAMPLES_DIR, CampaignFileError, load_campaigns
from mailflow.cli import report
from mailflow.feedback.unsubscribe_tokens import signer_from_secret
from mailflow.model.holdout import check_share, holdout_fraction, in_holdout
from mailflow.model.outcome import DataInterval
from mailflow.model.tally import Tally
from mailflow.orchestration.ui.progress_queries import load_campaign
from mailflow.sendloop.render import Renderer
from mailflow.store import lift
from mailflow.store.sql import analytics
from mailflow_dev.chaos.audit import audit
from mailflow_dev.demo.loader import install_lift_view

SLOW = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def fresh(db: psycopg.Connection, emulator: Any = None) -> None:
    """Empty the send log and the app (hypothesis runs several examples inside one test)."""
    db.execute(f"truncate {MAIL_TABLES}, app.assessments, app.users restart identity cascade")
    if emulator is not None:
        emulator.reset()


def users(db: psycopg.Connection, ids: range | list[int], signed_up_at: Any = END - 30 * D) -> None:
    for uid in ids:
        add_user(db, uid, signed_up_at=signed_up_at)


def by_status(db: psycopg.Connection, campaign: str) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for uid, status in db.execute("select user_id, status from mail.send_log where campaign = %s", (campaign,)):
        out.setdefault(status, set()).add(int(uid))
    return out


def outbox_users(rig: Rig) -> Counter[tuple[str, int]]:
    """``(campaign, user_id)`` of every email the emulator accepted (the address is user<id>@example.com)."""
    return Counter((e["headers"]["X-Mailflow-Campaign"], int(e["to"][0].removeprefix("user").split("@")[0]))
                   for e in rig.outbox())


# -- one function, two languages ---------------------------------------------------------------------

def test_python_and_sql_agree_on_10k_pairs(db: psycopg.Connection) -> None:
    rnd = random.Random(25)
    names = ["first_practice", "upgrade_offer", "spring_sale_2026", "a", "Ünïcode-Kampagne", "x" * 64]
    pairs = [(rnd.choice(names), rnd.choice([rnd.randrange(1, 10**6), rnd.randrange(-(2**63), 2**63)]))
             for _ in range(10_000)]
    shares = [0.0, 0.01, 0.1, 0.5, 0.9999]
    rows = db.execute(
        "select p.c, p.u, mail.holdout_fraction(p.c, p.u), array(select mail.in_holdout(p.c, p.u, s)"
        " from unnest(%s::float8[]) with ordinality as x(s, i) order by i)"
        " from unnest(%s::text[], %s::bigint[]) with ordinality as p(c, u, n) order by p.n",
        (shares, [c for c, _ in pairs], [u for _, u in pairs])).fetchall()
    assert len(rows) == 10_000
    for campaign, uid, fraction, member in rows:
        assert fraction == holdout_fraction(campaign, uid), (campaign, uid)
        assert member == [in_holdout(campaign, uid, s) for s in shares], (campaign, uid)
    # the draw is uniform enough that a share holds out about that share (10k draws: within 2 points)
    held = sum(in_holdout(c, u, 0.1) for c, u in pairs)
    assert 800 <= held <= 1200
    # exact points, so a change of the definition cannot go unnoticed in either language
    assert holdout_fraction("first_practice", 12) == 1766750675133172 / 2**52
    assert db.execute("select mail.holdout_fraction('first_practice', 12)").fetchone() == (1766750675133172 / 2**52,)
    assert not in_holdout("first_practice", 12, 0.0)


@pytest.mark.parametrize("value", [1, 1.0, -0.1, float("nan"), True, "0.1", None])
def test_a_share_outside_0_1_is_refused(value: Any) -> None:
    with pytest.raises(ValueError, match="campaign 'x': holdout_share must"):
        check_share(value, "campaign 'x': holdout_share")


def test_lifecycle_toml_holdout_share(tmp_path: Path) -> None:
    assert {c.name: c.holdout_share for c in load_campaigns()}["first_practice"] == 0.1
    folder = tmp_path / "campaigns"
    shutil.copytree(EXAMPLES_DIR, folder)
    toml = folder / "lifecycle.toml"
    text = toml.read_text(encoding="utf-8")
    toml.write_text(text.replace("holdout_share = 0         #", "holdout_share = 0.25      #"), encoding="utf-8")
    shares = {c.name: c.holdout_share for c in load_campaigns(toml)}
    assert shares == {"finish_assessment": 0.25, "first_practice": 0.1, "upgrade_offer": 0.25, "practice_tips": 0.25}
    for bad, why in (("1.0", "must be in [0, 1)"), ('"0.1"', "holdout_share must be a int/float")):
        toml.write_text(text.replace("holdout_share = 0.1 ", f"holdout_share = {bad} "), encoding="utf-8")
        with pytest.raises(CampaignFileError) as exc:
            load_campaigns(toml)
        assert exc.value.field == "holdout_share" and why in str(exc.value)
        assert "campaign 'first_practice'" in str(exc.value)


# -- lifecycle -----------------------------------------------------------------------------------------

def test_lifecycle_holds_out_exactly_the_members_and_never_sends_them(rig: Rig) -> None:
    users(rig.db, range(1, 41))
    campaign = dataclasses.replace(simple_campaign("lc_hold", 1), holdout_share=0.3)
    held = {u for u in range(1, 41) if in_holdout("lc_hold", u, 0.3)}
    assert 5 < len(held) < 35  # the draw really splits this population
    [s] = rig.run([campaign], chunk_size=7)
    assert by_status(rig.db, "lc_hold") == {"holdout": held, "sent": set(range(1, 41)) - held}
    assert outbox_users(rig) == Counter(("lc_hold", u) for u in set(range(1, 41)) - held)
    assert (s.eligible, s.minted, s.sent, s.holdout, s.not_reached) == (40, 40 - len(held), 40 - len(held), len(held), 0)
    assert s.as_dict()["holdout"] == len(held) and s.as_dict()["total"] == 40
    for r in rig.rows("status = 'holdout'"):
        assert (r["claimed_at"], r["sent_at"], r["scheduled_at"], r["attempts"], r["idempotency_key"],
                r["provider_message_id"], r["error"]) == (None, None, None, 0, None, None, None)
        assert r["email"] == f"user{r['user_id']}@example.com" and r["run_id"] == "scheduled__2026-03-10T11:00:00+00:00"
        assert rig.events(r["id"]) == [(None, "holdout")]
    # a rerun decides nobody again: the holdout rows hold the (user, campaign) key
    [again] = rig.run([campaign])
    assert (again.eligible, again.minted, again.holdout) == (0, 0, 0)
    assert len(rig.outbox()) == 40 - len(held)
    # counted as every summary counts: the views, the report, the progress page's JSON
    truth = Tally.of_rows(rig.db.execute(
        "select status, released_at is not null, dead_lettered_at is not null, claimed_at is not null"
        " from mail.send_log where campaign = 'lc_hold'").fetchall())
    assert (truth.holdout, truth.sent, truth.total) == (len(held), 40 - len(held), 40)
    cur = rig.db.execute("select * from mail.campaign_progress where campaign = 'lc_hold'")
    progress = dict(zip([d.name for d in cur.description or []], cur.fetchone() or (), strict=True))
    assert Tally.of_mapping(progress) == truth and progress["done"] == 40 and progress["percent_done"] == 100
    assert rig.db.execute("select sum(holdout), sum(minted) from mail.campaign_daily where campaign = 'lc_hold'"
                          ).fetchone() == (len(held), 40)
    assert rig.db.execute("select holdout from mail.campaign_outcomes where campaign = 'lc_hold'").fetchone() == (len(held),)
    [row] = [r for r in report(rig.db) if r[0] == "lc_hold"]
    assert row[1:] == tuple(truth.as_dict().values())
    page = load_campaign(rig.db, "lc_hold", show=False)
    assert page is not None and Tally.of_mapping(page["progress"]) == truth
    assert sum(d["holdout"] for d in page["days"]) == len(held)


def test_holdout_share_zero_changes_nothing(rig: Rig) -> None:
    users(rig.db, range(1, 31))
    [s] = rig.run([simple_campaign("lc_zero", 1)], chunk_size=7)
    assert s.as_dict() == {"campaign": "lc_zero", "eligible": 30, "minted": 30, "held": 0, "not_reached": 0,
                           "chunks": 5, "stopped": None, "total": 30, "pending": 0, "sending": 0, "sent": 30,
                           "failed": 0, "cancelled": 0, "duplicate": 0, "skipped": 0, "holdout": 0, "invalid": 0,
                           "dead_lettered": 0, "rolled_back": 0}
    assert by_status(rig.db, "lc_zero") == {"sent": set(range(1, 31))}
    assert len(rig.outbox()) == 30


def test_a_holdout_row_is_no_contact_for_another_campaign(rig: Rig) -> None:
    """Campaign a (priority 1) holds out some users; campaign b (priority 2, same audience) may then
    email exactly those, since the cooldown counts emails; a's treated users are in its cooldown."""
    users(rig.db, range(1, 31))
    a = dataclasses.replace(simple_campaign("lc_a", 1), holdout_share=0.5)
    b = simple_campaign("lc_b", 2)
    held = {u for u in range(1, 31) if in_holdout("lc_a", u, 0.5)}
    renderer = Renderer(signer_from_secret(UNSUBSCRIBE_SECRET), "https://mail.example.com", "https://app.example.com")
    preview = rig.store().preview([b, a], INTERVAL, renderer, sample=40)
    assert [(p["campaign"], p["eligible"], p["holdout"], len(p["sample"])) for p in preview] == [
        ("lc_a", 30, len(held), 30 - len(held)), ("lc_b", len(held), 0, len(held))]  # what the run then does
    sa, sb = rig.run([a, b])
    assert by_status(rig.db, "lc_a") == {"holdout": held, "sent": set(range(1, 31)) - held}
    assert by_status(rig.db, "lc_b") == {"sent": held}
    assert (sa.holdout, sa.sent, sb.eligible, sb.sent) == (len(held), 30 - len(held), len(held), len(held))
    assert (sa.held, sb.held) == (0, 0)  # the guard's re-check under the contact lock agrees
    # the live audience (no snapshot: lifecycle.eligible's anti-joins) agrees too
    fresh(rig.db, rig.emulator)
    users(rig.db, range(1, 31))
    store = rig.store()
    store.open_audience = None  # type: ignore[method-assign]
    store.close_audience = None  # type: ignore[method-assign]
    rig.run([a, b], store=store)
    assert by_status(rig.db, "lc_b") == {"sent": held}


@SLOW
@given(data=st.data())
def test_lifecycle_membership_is_stable_under_backfills(rig: Rig, data: st.DataObject) -> None:
    """Users sign up over 10 hours; runs over overlapping intervals (hourly, then a 4-hour backfill, then
    a rerun of them all, in a drawn order) hold out the same users: exactly the members among those
    decided, and never one of them twice."""
    fresh(rig.db, rig.emulator)
    n = data.draw(st.integers(10, 30), label="users")
    share = data.draw(st.sampled_from([0.2, 0.5, 0.7]), label="share")
    for uid in range(1, n + 1):
        add_user(rig.db, uid, signed_up_at=END - timedelta(minutes=20 * uid))
    campaign = dataclasses.replace(simple_campaign("lc_prop", 1, "signed_up_at >= %(window_start)s"
                                                   " and signed_up_at < %(window_end)s"), holdout_share=share)
    ends = [END - k * H for k in range(0, 11)]
    intervals = [DataInterval(e - H, e) for e in ends] + [DataInterval(e - 4 * H, e) for e in ends[::3]]
    order = data.draw(st.permutations(intervals), label="order")
    client, store = rig.client(), rig.store()  # one of each for every run of this example
    for interval in order[: data.draw(st.integers(1, len(order)), label="runs")]:
        rig.run([campaign], interval=interval, allow_old_interval=True, chunk_size=data.draw(st.integers(1, 8)),
                client=client, store=store)
    decided = by_status(rig.db, "lc_prop")
    everyone = set().union(*decided.values()) if decided else set()
    assert set(decided) <= {"holdout", "sent"}
    assert decided.get("holdout", set()) == {u for u in everyone if in_holdout("lc_prop", u, share)}
    assert rig.db.execute("select count(*) = count(distinct user_id) from mail.send_log").fetchone() == (True,)
    # every interval once more: nothing new is decided, nobody held out is ever emailed
    for interval in intervals:
        rig.run([campaign], interval=interval, allow_old_interval=True, client=client, store=store)
    for c in (client, store.conn):
        c.close()
    final = by_status(rig.db, "lc_prop")
    assert set().union(*final.values()) == set(range(1, n + 1))
    assert final.get("holdout", set()) == {u for u in range(1, n + 1) if in_holdout("lc_prop", u, share)}
    assert {u for (_, u) in outbox_users(rig)} == final.get("sent", set())
    assert max(outbox_users(rig).values(), default=1) == 1


# -- the lift --------------------------------------------------------------------------------------------

def test_campaign_lift_on_a_known_dataset(rig: Rig) -> None:
    """60 users, a lifecycle campaign holding out 40%: users 3k convert (an assessment finished 2 days
    after their row was minted), users 3k+1 finish one 8 days after (outside the 7-day window) and one
    before their row (outside too); the lift query, unmodified, and the demo's view give the exact
    group sizes, conversions, rates and lift."""
    users(rig.db, range(1, 61))
    campaign = dataclasses.replace(simple_campaign("lc_lift", 1), holdout_share=0.4)
    rig.run([campaign, dataclasses.replace(simple_campaign("lc_none", 2), exempt=True)])
    minted = dict(rig.db.execute("select user_id, minted_at from mail.send_log where campaign = 'lc_lift'").fetchall())
    aid = 0
    for uid, at in minted.items():
        for k, offset in ((0, [2 * D]), (1, [8 * D, -H])):
            if uid % 3 == k:
                for o in offset:
                    aid += 1
                    rig.db.execute("insert into app.assessments (assessment_id, user_id, kind, is_free, started_at,"
                                   " finished_at, score) values (%s, %s, 'numerical', true, %s, %s, 50)",
                                   (aid, uid, at + o - H, at + o))
    held = {u for u in range(1, 61) if in_holdout("lc_lift", u, 0.4)}
    treated = set(range(1, 61)) - held
    assert 10 < len(held) < 50

    def rate(group: set[int]) -> Decimal:
        return (Decimal(sum(1 for u in group if u % 3 == 0)) / len(group)).quantize(Decimal("0.000001"))

    exact_lift = (Decimal(sum(1 for u in treated if u % 3 == 0)) / len(treated)
                  - Decimal(sum(1 for u in held if u % 3 == 0)) / len(held)).quantize(Decimal("0.000001"))
    want = [("lc_lift", "lifecycle", len(treated), sum(1 for u in treated if u % 3 == 0), rate(treated),
             len(held), sum(1 for u in held if u % 3 == 0), rate(held), exact_lift, timedelta(days=7), 60)]
    cur = rig.db.execute(analytics("campaign_lift"))
    assert cur.fetchall() == want  # lc_none has no holdout group: not listed; every window still open
    # the demo loader's view (rolled back: the session database keeps exactly the migrations' views)
    with rig.db.transaction(force_rollback=True), rig.db.cursor() as c:
        assert install_lift_view(c)
        assert c.execute("select * from mail.campaign_lift").fetchall() == want
    # docs/send_log.md (Q15) shows the query as shipped, from its first statement on
    doc = (Path(__file__).resolve().parents[3] / "docs" / "send_log.md").read_text(encoding="utf-8")
    text = analytics("campaign_lift")
    assert text[text.index("with recursive params as ("):] + ";\n```" in doc


def test_lift_window_anchored_on_each_users_send_time_lifecycle(rig: Rig) -> None:
    """A lifecycle run whose emails went out 20 minutes after they were minted (an ambiguous request, resent
    and accepted then), a month ago. A treated user's window starts when their email was sent: 3k convert 2
    days after it, 3k+1 converted between the minting and the email (not because of it), 3k+2 ten minutes
    before its window closes (a window from the minting had closed ten minutes earlier). A held-out user's
    starts at the minting of their row, the moment the run decided about them with the users it emailed: 3k
    convert 2 days after, 3k+1 an hour before, 3k+2 8 days after. The query and its fold give the exact
    numbers; a window from the minting for everybody would count 3k+1 and miss 3k+2."""
    users(rig.db, range(1, 91))
    campaign = dataclasses.replace(simple_campaign("lc_late", 1), holdout_share=0.4)
    rig.run([campaign])
    month = 30 * D
    rig.db.execute("update mail.send_log set minted_at = minted_at - %(m)s, claimed_at = claimed_at - %(m)s,"
                   " sent_at = sent_at - %(m)s + interval '20 minutes' where campaign = 'lc_late'", {"m": month})
    rows = {int(r["user_id"]): r for r in rig.rows("campaign = 'lc_late'")}
    held = {u for u in rows if rows[u]["status"] == "holdout"}
    treated = {u for u in rows if rows[u]["status"] == "sent"}
    assert held == {u for u in range(1, 91) if in_holdout("lc_late", u, 0.4)} and treated == set(range(1, 91)) - held
    assert all(rows[u]["sent_at"] - rows[u]["minted_at"] > timedelta(minutes=19) for u in treated)
    at: dict[int, Any] = {}
    for u in treated:
        minted, sent = rows[u]["minted_at"], rows[u]["sent_at"]
        at[u] = {0: sent + 2 * D, 1: minted + timedelta(minutes=10), 2: sent + 7 * D - timedelta(minutes=10)}[u % 3]
    for u in held:
        at[u] = rows[u]["minted_at"] + {0: 2 * D, 1: -H, 2: 8 * D}[u % 3]
    for aid, (u, f) in enumerate(sorted(at.items()), start=1):
        rig.db.execute("insert into app.assessments (assessment_id, user_id, kind, is_free, started_at, finished_at,"
                       " score) values (%s, %s, 'numerical', true, %s, %s, 50)", (aid, u, f - timedelta(minutes=5), f))
    tc = sum(1 for u in treated if u % 3 != 1)
    hc = sum(1 for u in held if u % 3 == 0)
    q = Decimal("0.000001")
    want = [("lc_late", "lifecycle", len(treated), tc, (Decimal(tc) / len(treated)).quantize(q, ROUND_HALF_UP),
             len(held), hc, (Decimal(hc) / len(held)).quantize(q, ROUND_HALF_UP),
             (Decimal(tc) / len(treated) - Decimal(hc) / len(held)).quantize(q, ROUND_HALF_UP), timedelta(days=7), 0)]
    assert rig.db.execute(analytics("campaign_lift")).fetchall() == want
    # the fold counts the same closed windows; a second fold has nothing new
    lift.install(rig.db)
    assert (lift.fold(rig.db) or 0) > 0 and lift.fold(rig.db) == 0
    assert rig.db.execute("select count(*) from mail.campaign_lift_fold where campaign = 'lc_late'").fetchone() == (1,)
    assert rig.db.execute(analytics("campaign_lift")).fetchall() == want


# -- the chaos audit --------------------------------------------------------------------------------------

def test_the_chaos_audit_counts_a_delivered_holdout_row(db: psycopg.Connection) -> None:
    [(rid,)] = db.execute("insert into mail.send_log (user_id, campaign, email, status) values"
                          " (7, 'lc_x', 'u7@example.com', 'holdout') returning id").fetchall()
    clean = audit(db, [], (), set(), 0)
    assert (clean["holdout_rows"], clean["holdout_delivered"], clean["holdout_touched"]) == (1, 0, 0)
    assert clean["delivered_without_sent"] == 0
    line = {"id": "pid-1", "to": ["u7@example.com"], "subject": "s", "idempotency_key": "mf-x-1", "batch_index": 0,
            "headers": {"X-Mailflow-Send-Id": str(rid)}}
    bad = audit(db, [line], (), set(), 0)
    assert (bad["holdout_delivered"], bad["delivered_without_sent"]) == (1, 1)
