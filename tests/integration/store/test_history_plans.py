"""Statements that must cost the same however long the send log's history and the campaigns' backlogs
grow (docs/performance.md, "The send log at 20M rows"): each plans as a bounded, index-backed read on
a send log with history and big planned backlogs, and answers exactly what the unbounded formulation
answers."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from mailflow.store.migrate import migrate
from mailflow.store.sql import query
from mailflow_dev import devenv
from mailflow_dev.demo.loader import schema_sql

CAMPAIGNS = """
insert into mail.campaign (name, status, template, subject, from_address, recipients_table)
values ('big_a', 'scheduled', 'outreach', 'A', 'a@mail.example.com', 'mail.campaign_recipient'),
       ('big_b', 'scheduled', 'outreach', 'B', 'b@mail.example.com', 'mail.campaign_recipient'),
       ('paused', 'paused', 'outreach', 'P', 'p@mail.example.com', 'mail.campaign_recipient'),
       ('old', 'completed', 'outreach', 'O', 'o@mail.example.com', 'mail.campaign_recipient')
"""
# Two active campaigns with 30,000 planned rows each over the coming week (big_a's first 300 due, in
# the last hour), a paused one with earlier rows, 100,000 sent rows of history, a few in flight.
ROWS = """
insert into mail.send_log (user_id, campaign, kind, email, status, scheduled_at, minted_at, claimed_at, sent_at,
                           provider_message_id, attempts)
select g, c, 'scheduled', 'user' || g || '@example.com', st,
       case when st in ('pending', 'sending') then t end, now() - interval '8 days',
       case when st <> 'pending' then t end, case when st = 'sent' then t end,
       case when st = 'sent' then 'pm-' || c || '-' || g end, case when st = 'pending' then 0 else 1 end
from (select g, c, case when c = 'old' then 'sent' when g % 1000 = 7 then 'sending' else 'pending' end as st,
             case when c = 'old' then now() - interval '300 days' * random()
                  when c = 'big_a' and g <= 300 then now() - interval '1 hour' + interval '10 seconds' * g
                  when c = 'paused' then now() - interval '2 days'
                  else now() + interval '7 days' * random() end as t
      from (select g, 'big_a' as c from generate_series(1, 30000) g
            union all select g, 'big_b' from generate_series(1, 30000) g
            union all select g, 'paused' from generate_series(1, 500) g
            union all select g, 'old' from generate_series(1, 100000) g) as x) as y
"""

#: due_wait as it was: the active campaigns joined to all their pending rows, sorted (the reference).
DUE_WAIT_UNBOUNDED = """
with p as (
    select d.scheduled_at
    from mail.send_log d
    join mail.campaign c on c.name = d.campaign and c.status = 'scheduled'
    where d.status = 'pending' and d.kind = 'scheduled'
      and (c.canary_share is null or c.canary_released_at is not null or d.id <= c.canary_last_id)
      and not exists (select 1 from mail.reputation_guard g
                      where g.state = 'tripped' and g.scope = 'campaign' and g.name = c.name)
      and not exists (select 1 from mail.reputation_guard g where g.state = 'tripped' and g.scope = 'account')
    order by d.scheduled_at
    limit %(batch)s
)
select extract(epoch from least(min(scheduled_at) + make_interval(secs => %(coalesce)s),
                                case when count(*) >= %(batch)s then max(scheduled_at) end) - now())::float8
from p
"""


@pytest.fixture(scope="module")
def backlog(pg_admin_dsn: str) -> Iterator[psycopg.Connection]:
    name = f"mailflow_history_plans_{uuid.uuid4().hex[:8]}"
    dsn = devenv.create_database(pg_admin_dsn, name, exist_ok=False)
    conn = psycopg.connect(dsn, autocommit=True)
    try:
        migrate(conn)
        conn.execute(schema_sql())
        conn.execute("select setseed(0.27)")
        # 100,000 users over two years, two assessments each; a lifecycle run an hour ago
        conn.execute("insert into app.users (user_id, email, signed_up_at, plan, timezone)"
                     " select g, 'user' || g || '@example.com', now() - interval '730 days' * (1 - g / 100000.0),"
                     " 'free', 'UTC' from generate_series(1, 100000) g")
        conn.execute("insert into app.assessments (assessment_id, user_id, kind, is_free, started_at)"
                     " select g * 2 + k, g, 'verbal', true, now() - interval '700 days' * random()"
                     " from generate_series(1, 100000) g, generate_series(0, 1) k")
        conn.execute("insert into mail.send_log (user_id, campaign, kind, email, status, minted_at, claimed_at,"
                     " sent_at, provider_message_id, attempts, run_id, data_interval_start, data_interval_end)"
                     " select g, 'first_practice', 'lifecycle', 'user' || g || '@example.com', 'sent',"
                     " now() - interval '1 hour', now() - interval '1 hour', now() - interval '1 hour',"
                     " 'pm-fp-' || g, 1, 'scheduled__run', now() - interval '2 hours', now() - interval '1 hour'"
                     " from generate_series(99000, 99500) g")
        conn.execute("vacuum analyze app.users")
        conn.execute("vacuum analyze app.assessments")
        conn.execute(CAMPAIGNS)
        conn.execute(ROWS)
        # an event per row (a contact-policy deferral for 1 in 100, spread over the last 300 days)
        conn.execute("insert into mail.send_event (send_log_id, from_status, to_status, at, error)"
                     " select id, null, status, now() - interval '300 days' * random(),"
                     " case when id % 100 = 0 then 'contact policy: cooldown: sent 1 email; free from later' end"
                     " from mail.send_log")
        conn.execute("vacuum analyze mail.send_log")
        conn.execute("vacuum analyze mail.send_event")
        conn.execute("analyze mail.campaign")
        yield conn
    finally:
        conn.close()
        devenv.drop_database(pg_admin_dsn, name)


def _nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    out = [node]
    for child in node.get("Plans", []):
        out += _nodes(child)
    return out


def _analyze(conn: psycopg.Connection, sql: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    with conn.transaction(force_rollback=True):
        conn.execute("set local jit = off")
        [[doc]] = conn.execute(f"explain (analyze, format json) {sql}", params).fetchall()  # type: ignore[arg-type]
    return _nodes((doc if isinstance(doc, list) else json.loads(doc))[0]["Plan"])


def _both(conn: psycopg.Connection, params: dict[str, Any]) -> tuple[float | None, float | None]:
    """(due_wait, the unbounded reference) at the same now()."""
    with conn.transaction(force_rollback=True):
        got = conn.execute(query("scheduled", "due_wait"), params).fetchone()
        ref = conn.execute(DUE_WAIT_UNBOUNDED, params).fetchone()
    assert got is not None and ref is not None
    return got[0], ref[0]


def test_due_wait_reads_only_the_head_of_each_active_campaign(backlog: psycopg.Connection) -> None:
    nodes = _analyze(backlog, query("scheduled", "due_wait"), {"batch": 100, "coalesce": 60})
    send_log = [n for n in nodes if n.get("Relation Name") == "send_log"
                or n.get("Index Name", "").startswith("send_log")]
    assert [(n["Node Type"], n.get("Index Name")) for n in send_log] == [
        ("Index Scan", "send_log_campaign_open_idx")]
    # one ordered range per active campaign, stopped after its first 100 pending rows (+ the few in flight)
    assert send_log[0]["Actual Loops"] == 2
    assert send_log[0]["Actual Rows"] == 100
    assert sum(int(n.get("Rows Removed by Filter", 0)) for n in send_log) < 50


def test_due_wait_answers_what_the_unbounded_read_answers(backlog: psycopg.Connection) -> None:
    for params in ({"batch": 100, "coalesce": 60}, {"batch": 1000, "coalesce": 0}, {"batch": 10, "coalesce": 3600}):
        got, ref = _both(backlog, params)
        assert got is not None and ref is not None and got == pytest.approx(ref, abs=1e-6), params
    # a full batch is due in big_a (300 rows in the last hour): claim now
    got, _ = _both(backlog, {"batch": 100, "coalesce": 60})
    assert got is not None and got <= 0


def test_due_wait_leaves_out_what_pick_due_would_not_take(backlog: psycopg.Connection) -> None:
    with backlog.transaction(force_rollback=True):
        # big_a's guard tripped: only big_b counts (its rows are all in the future)
        backlog.execute("insert into mail.reputation_guard (scope, name, state, reason, tripped_at)"
                        " values ('campaign', 'big_a', 'tripped', 'test', now())")
        got = backlog.execute(query("scheduled", "due_wait"), {"batch": 100, "coalesce": 60}).fetchone()
        ref = backlog.execute(DUE_WAIT_UNBOUNDED, {"batch": 100, "coalesce": 60}).fetchone()
        assert got == ref and got is not None and got[0] > 0
        # big_b holds back behind a canary of its 50 first ids: only those count
        backlog.execute("update mail.campaign set canary_share = 0.01, canary_last_id ="
                        " (select min(id) + 49 from mail.send_log where campaign = 'big_b') where name = 'big_b'")
        got = backlog.execute(query("scheduled", "due_wait"), {"batch": 100, "coalesce": 60}).fetchone()
        ref = backlog.execute(DUE_WAIT_UNBOUNDED, {"batch": 100, "coalesce": 60}).fetchone()
        assert got == ref
        # the account tripped: nothing pending that pick_due would take
        backlog.execute("insert into mail.reputation_guard (scope, name, state, reason, tripped_at)"
                        " values ('account', 'default', 'tripped', 'test', now())")
        got = backlog.execute(query("scheduled", "due_wait"), {"batch": 100, "coalesce": 60}).fetchone()
        assert got == (None,)


def test_q13_reads_the_guards_only(backlog: psycopg.Connection) -> None:
    """docs/send_log.md Q13 answers from mail.reputation_guard alone: never every campaign's whole history
    of sent emails and outcomes (mail.campaign_outcomes computes those for every campaign before a
    filter on the guard's state applies: 86 s at 2M rows)."""
    from send_log_demo import doc_query

    _, sql = doc_query(13)
    with backlog.transaction(force_rollback=True):
        [[doc]] = backlog.execute(f"explain (format json) {sql}").fetchall()
    relations = {n.get("Relation Name") for n in _nodes(doc[0]["Plan"])} - {None}
    assert relations == {"reputation_guard"}
    with backlog.transaction(force_rollback=True):
        assert backlog.execute(sql).fetchall() == []
        backlog.execute("insert into mail.reputation_guard (scope, name, state, reason, tripped_at, sample)"
                        " values ('campaign', 'big_a', 'tripped', 'hard-bounce rate over 0.04', now(), 50),"
                        " ('campaign', 'big_b', 'ok', null, null, 80)")
        rows = backlog.execute(sql).fetchall()
        assert [(r[0], r[1], r[2], r[6], r[7]) for r in rows] == [("big_a", "tripped", "hard-bounce rate over 0.04",
                                                                  50, "ok")]
        backlog.execute("insert into mail.reputation_guard (scope, name, state, reason, tripped_at)"
                        " values ('account', 'default', 'tripped', 'complaint rate over 0.001', now())")
        rows = backlog.execute(sql).fetchall()
        assert [(r[0], r[1], r[7], r[8]) for r in rows] == [
            ("big_a", "tripped", "tripped", "default: complaint rate over 0.001"),
            ("big_b", "ok", "tripped", "default: complaint rate over 0.001")]


def test_q11_reads_the_contact_policy_decisions_since_the_day(backlog: psycopg.Connection) -> None:
    """docs/send_log.md Q11 reads the range of send_event_contact_policy_idx (0027) since its day, then
    each decision's row by primary key: never every event ever recorded."""
    from send_log_demo import doc_query

    _, sql = doc_query(11)
    since = backlog.execute("select (now() - interval '30 days')::date").fetchone()[0]  # type: ignore[index]
    nodes = _analyze(backlog, sql, {"since": since.isoformat()})
    scans = [(n["Node Type"], n.get("Relation Name"), n.get("Index Name")) for n in nodes if n.get("Relation Name")]
    assert "send_event_contact_policy_idx" in {n.get("Index Name") for n in nodes}  # index or bitmap scan
    assert not [s for s in scans if s[0] == "Seq Scan" and s[1] in ("send_event", "send_log")], scans
    got = backlog.execute(sql, {"since": since.isoformat()}).fetchall()
    expected = backlog.execute("select count(*) from mail.send_event where error like 'contact policy:%%'"
                               " and at >= %s::date::timestamp at time zone 'UTC'", (since,)).fetchone()
    assert expected is not None and len(got) == expected[0] > 0


def test_q3_probes_each_audience_user_by_index(backlog: psycopg.Connection) -> None:
    """docs/send_log.md Q3 plans its dedupe, cooldown and assessment checks as index probes per
    audience user: the run's window is unknown when it plans (a ninth of all users guessed), and as
    anti-joins the planner hashed every assessment and the campaign's whole send log (9.2 s at 20M rows)."""
    from send_log_demo import doc_query

    _, sql = doc_query(3)
    params = {"run_id": "scheduled__run", "cooldown": "7 days"}
    with backlog.transaction(force_rollback=True):
        backlog.execute("set local jit = off")
        [[doc]] = backlog.execute(f"explain (format json) {sql}", params).fetchall()  # type: ignore[arg-type]
    scans = [(n["Node Type"], n.get("Relation Name"), n.get("Index Name")) for n in _nodes(doc[0]["Plan"])]
    assert not [x for x in scans if x[0] == "Seq Scan" and x[1] in ("send_log", "assessments", "send_event")], scans
    assert ("Index Only Scan", "assessments", "assessments_user_id_started_at_cover_idx") in scans

    def unlimited(node: dict[str, Any], limited: bool = False) -> list[str]:
        """Scans of send_log / assessments with no LIMIT above them (a whole-table anti-join input)."""
        limited = limited or node["Node Type"] == "Limit"
        own = [f"{node['Node Type']} {node.get('Index Name')}"] if (
            node.get("Relation Name") in ("send_log", "assessments") and not limited
            and node.get("Index Name") != "send_log_run_idx") else []
        return own + [x for c in node.get("Plans", []) for x in unlimited(c, limited)]

    assert unlimited(doc[0]["Plan"]) == []  # each check is a `lateral (... limit 1)` probe per audience user
    [[n]] = backlog.execute(sql, params).fetchall()
    assert n == 0  # the run's audience (signed up in its 2 days) had no other email


OUTCOMES_DAILY_RECOUNT = """
select l.campaign, (l.sent_at at time zone coalesce(c.timezone, 'UTC'))::date as day, count(*),
       count(d.delivered_at), count(d.hard_bounced_at), count(d.first_opened_at),
       count(*) filter (where d.outcome is null or d.outcome = 'delayed')
from mail.send_log l
left join mail.campaign c on l.kind = 'scheduled' and c.name = l.campaign
left join mail.delivery_status d on d.send_log_id = l.id
where l.status = 'sent' and l.campaign = %(campaign)s
group by 1, 2
order by 2
"""


def test_q12_reads_the_campaigns_day_counters_not_its_sent_emails(backlog: psycopg.Connection) -> None:
    """docs/send_log.md Q12 over a campaign's whole history (100,000 emails sent over 300 days, outcomes for
    a third of them) reads that campaign's day counters (0031), never its sent emails or their outcomes
    (the count 0021's view made on every read: 1.5-3 s at 20M rows), and gives the same numbers, folded or
    not."""
    from send_log_demo import doc_query

    _, sql = doc_query(12)
    params = {"campaign": "old", "since": "-infinity"}
    with backlog.transaction(force_rollback=True):
        backlog.execute("insert into mail.delivery_status (send_log_id, provider_message_id, last_event, delivered_at,"
                        " hard_bounced_at, first_opened_at, outcome)"
                        " select id, provider_message_id, 'x', case when id % 7 <> 0 then sent_at end,"
                        " case when id % 7 = 0 then sent_at end, case when id % 2 = 0 then sent_at end,"
                        " case when id % 7 = 0 then 'hard_bounced' else 'delivered' end"
                        " from mail.send_log where campaign = 'old' and id % 3 = 0")
        expected = backlog.execute(OUTCOMES_DAILY_RECOUNT, {"campaign": "old"}).fetchall()
        assert len(expected) > 250 and sum(r[2] for r in expected) == 100_000
        for folded in (False, True):
            if folded:
                assert backlog.execute("select mail.fold_campaign_day_counters()").fetchone() != (None,)
            got = [(r[0], r[1], r[2], r[3], r[4], r[8], r[10])
                   for r in backlog.execute(sql, params).fetchall()]  # type: ignore[arg-type]
            assert got == expected
            nodes = _analyze(backlog, sql, params)
            read = {(n.get("Relation Name"), n.get("Index Name")) for n in nodes
                    if n.get("Relation Name") and n.get("Actual Loops", 0) > 0}
            assert {r for r, _ in read} <= {"campaign_day_counter", "campaign_day_counter_delta",
                                           "campaign_day_counter_state", "campaign"}, read
            assert ("campaign_day_counter", "campaign_day_counter_pkey") in read
            rows = sum(int(n.get("Actual Rows", 0)) * int(n.get("Actual Loops", 1)) for n in nodes
                       if n.get("Relation Name") in ("campaign_day_counter", "campaign_day_counter_delta"))
            assert rows <= 6 * len(expected) + (0 if folded else 2_000), rows  # a row per day and key


def test_q15_reads_the_folded_days_and_the_rows_since_the_watermark(backlog: psycopg.Connection) -> None:
    """docs/send_log.md Q15 for a lifecycle campaign that has sent for 300 days (50,000 emails, 10% held
    out): before a fold it reads every row of the campaign (index ranges, one conversion probe each); after
    mail.fold_campaign_lift it reads the campaign's folded days and only the rows of its last 8 days by
    index (about 1,300 of them), never the campaign's history or the send log, and gives the same lift."""
    from send_log_demo import doc_query

    from mailflow.store import lift

    _, sql = doc_query(15)
    with backlog.transaction(force_rollback=True):
        backlog.execute("insert into mail.send_log (user_id, campaign, kind, email, status, minted_at, claimed_at,"
                        " sent_at, provider_message_id, attempts)"
                        " select g, 'lc_lift', 'lifecycle', 'user' || g || '@example.com',"
                        " case when mail.in_holdout('lc_lift', g, 0.1) then 'holdout' else 'sent' end, t, t,"
                        " case when not mail.in_holdout('lc_lift', g, 0.1) then t + interval '2 seconds' end,"
                        " case when not mail.in_holdout('lc_lift', g, 0.1) then 'pm-lift-' || g end, 1"
                        " from (select g, now() - interval '300 days' * (1 - g / 50001.0) as t"
                        "       from generate_series(1, 50000) g) as x")
        backlog.execute("update app.assessments set finished_at = started_at + interval '20 minutes'"
                        " where assessment_id % 3 = 0")
        backlog.execute("analyze mail.send_log")
        unfolded = backlog.execute(sql).fetchall()
        [row] = [r for r in unfolded if r[0] == "lc_lift"]
        assert row[2] + row[5] == 50_000 and 4_000 < row[5] < 6_000
        nodes = _analyze(backlog, sql, {})
        read = sum(int(n.get("Actual Rows", 0)) * int(n.get("Actual Loops", 1)) for n in nodes
                   if n.get("Index Name") in ("send_log_campaign_sent_idx", "send_log_holdout_slot_idx"))
        assert read >= 50_000  # no watermark yet: the whole campaign
        lift.install(backlog)
        assert backlog.execute("select mail.fold_campaign_lift()").fetchone() not in ((None,), (0,))
        assert backlog.execute(sql).fetchall() == unfolded
        nodes = _analyze(backlog, sql, {})
        scans = [(n["Node Type"], n.get("Relation Name"), n.get("Index Name")) for n in nodes if n.get("Relation Name")]
        assert not [s for s in scans if s[0].startswith(("Seq Scan", "Bitmap")) and s[1] == "send_log"], scans
        read = sum(int(n.get("Actual Rows", 0)) * int(n.get("Actual Loops", 1)) for n in nodes
                   if n.get("Index Name") in ("send_log_campaign_sent_idx", "send_log_holdout_slot_idx"))
        assert read < 50_000 * 9 / 300 + 100, read  # the last 8 days (and a latest-send probe)
        probes = sum(int(n.get("Actual Loops", 0)) for n in nodes if n.get("Relation Name") == "assessments")
        assert probes < 50_000 * 9 / 300, probes
