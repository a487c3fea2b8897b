"""Creating and replacing a scheduled campaign's definition against PostgreSQL: a refusal writes
nothing (no campaign row, no event, no uploaded recipient), names are unique across both kinds,
only a draft's definition can be replaced, stored rows are re-checked at provisioning, and the plan
summary shows local send hours."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest

from mailflow.campaigns import CAMPAIGNS_DIR, CampaignFolder
from mailflow.sources.scheduled import CampaignStateError, pause, provision, resume
from mailflow.sources.scheduled.definition import CampaignDefinitionError, check_stored
from mailflow.sources.scheduled.spec import create_campaign, update_draft
from mailflow.store.migrate import migration_files
from mailflow.store.scheduled import check_name_collisions

BERLIN_START = "2026-01-05T00:00:00+01:00"  # a Monday; Tuesday 01-06 is Epiphany in Bavaria
EARLY = datetime(2025, 12, 1, tzinfo=UTC)
SPEC: dict[str, Any] = {"name": "spring_outreach", "template": "outreach", "subject": "Hi {{ user.first_name }}",
                        "from": "Outreach <outreach@mail.example.com>", "recipients_sql": "free_plan_users",
                        "start_at": BERLIN_START}


@pytest.fixture
def folder(tmp_path: Path) -> CampaignFolder:
    """The packaged campaigns plus recipients files whose query fails or lacks a column."""
    root = tmp_path / "campaigns"
    shutil.copytree(CAMPAIGNS_DIR, root)
    (root / "recipients" / "broken.sql").write_text("select user_id, email from app.no_such_table\n")
    (root / "recipients" / "no_email.sql").write_text("select user_id, first_name from app.users\n")
    return CampaignFolder(root)


@pytest.fixture
def pg(db: psycopg.Connection) -> Iterator[psycopg.Connection]:
    db.execute("truncate mail.campaign_event, mail.campaign_recipient, mail.campaign restart identity cascade")
    yield db


def counts(db: psycopg.Connection) -> tuple[int, int, int]:
    row = db.execute("select (select count(*) from mail.campaign), (select count(*) from mail.campaign_event),"
                     " (select count(*) from mail.campaign_recipient)").fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


def users(db: psycopg.Connection, n: int) -> None:
    db.execute("insert into app.users (user_id, email, first_name, signed_up_at, timezone, plan)"
               " select i, 'user' || i || '@example.com', 'First' || i, '2025-01-01', 'UTC', 'free'"
               " from generate_series(1, %s) as i", (n,))


def campaign_row(db: psycopg.Connection, cid: int) -> dict[str, Any]:
    cur = db.execute("select * from mail.campaign where id = %s", (cid,))
    names = [d.name for d in cur.description or []]
    row = cur.fetchone()
    assert row is not None
    return dict(zip(names, row, strict=True))


def refused_field(fn: Any, *args: Any, **kw: Any) -> tuple[list[str], str]:
    with pytest.raises(CampaignDefinitionError) as info:
        fn(*args, **kw)
    return info.value.fields, str(info.value)


# -- create: every refusal writes nothing -------------------------------------------------------------


@pytest.mark.parametrize(("changes", "field", "reason"), [
    ({"emails_per_dya": 30}, "emails_per_dya", "unknown key"),
    ({"from": "not-an-address"}, "from", "is not a valid address"),
    ({"reply_to": "help@"}, "reply_to", "is not a valid address"),
    ({"timezone": "Mars/Olympus"}, "timezone", "unknown IANA timezone"),
    ({"windows": ["25:00-26:00"]}, "windows", "not a valid time of day"),
    ({"windows": ["17:00-09:00"]}, "windows", "write '17:00-09:00+1'"),
    ({"name": "all"}, "name", "reserved"),
    ({"name": "first_practice"}, "name", "a lifecycle campaign in "),
    ({"recipients_sql": "broken"}, "recipients_sql", 'the recipients query fails: relation "app.no_such_table" '
                                                     "does not exist"),
    ({"recipients_sql": "no_email"}, "recipients_sql", "the recipients have no email column "
                                                       "(columns: user_id, first_name)"),
    ({"recipients_sql": None, "recipients_table": "app.no_such_table"}, "recipients_table",
     'relation "app.no_such_table" does not exist'),
    ({"recipients_sql": None, "recipients_table": "app.assessments"}, "recipients_table", "the recipients have no "
                                                                                         "email column"),
    ({"recipients_table": "app.users"}, "recipients_sql", "give exactly one of"),
    ({"recipients_sql": None, "recipients_csv": "missing.csv"}, "recipients_csv", "missing.csv not found"),
])
def test_a_refused_definition_writes_nothing(pg: psycopg.Connection, folder: CampaignFolder, tmp_path: Path,
                                             changes: dict[str, Any], field: str, reason: str) -> None:
    spec = {k: v for k, v in (SPEC | changes).items() if v is not None}
    fields, message = refused_field(create_campaign, pg, spec, actor="test", folder=folder, base_dir=tmp_path)
    assert fields[0] == field
    assert reason in message
    assert counts(pg) == (0, 0, 0)


def test_an_existing_name_is_refused_and_nothing_more_is_written(pg: psycopg.Connection, folder: CampaignFolder) -> None:
    cid = create_campaign(pg, SPEC, actor="test", folder=folder)
    assert counts(pg) == (1, 1, 0)
    fields, message = refused_field(create_campaign, pg, SPEC | {"subject": "again"}, folder=folder)
    assert fields == ["name"]
    assert f"a scheduled campaign with this name exists (id {cid})" in message
    assert counts(pg) == (1, 1, 0)


def test_a_name_with_lifecycle_emails_in_the_send_log_is_refused(pg: psycopg.Connection, folder: CampaignFolder) -> None:
    # a lifecycle campaign removed from lifecycle.toml still owns its name: its rows are in the send log
    pg.execute("insert into mail.send_log (user_id, campaign, kind, email, status, sent_at, provider_message_id)"
               " values (7, 'winter_promo', 'lifecycle', 'a@example.com', 'sent', now(), 'em_1')")
    fields, message = refused_field(create_campaign, pg, SPEC | {"name": "winter_promo"}, folder=folder)
    assert fields == ["name"]
    assert "the send log has lifecycle emails under this name" in message
    assert counts(pg) == (0, 0, 0)


def test_a_csv_with_a_bad_row_writes_nothing(pg: psycopg.Connection, folder: CampaignFolder, tmp_path: Path) -> None:
    (tmp_path / "list.csv").write_text("user_id,email,first_name\n1,a@example.com,A\nx,b@example.com,B\n")
    spec = {k: v for k, v in SPEC.items() if k != "recipients_sql"} | {"recipients_csv": "list.csv"}
    with pytest.raises(ValueError, match=r"list\.csv:3: user_id is not an integer"):
        create_campaign(pg, spec, folder=folder, base_dir=tmp_path)
    assert counts(pg) == (0, 0, 0)


def test_a_csv_listing_a_user_twice_is_refused_naming_the_file_and_line(pg: psycopg.Connection, folder: CampaignFolder,
                                                                       tmp_path: Path) -> None:
    (tmp_path / "dup.csv").write_text("user_id,email,first_name\n1,a@example.com,A\n1,a@example.com,A\n")
    spec = {k: v for k, v in SPEC.items() if k != "recipients_sql"} | {"recipients_csv": "dup.csv"}
    with pytest.raises(ValueError, match=r"recipients_csv .*dup\.csv:3: user_id 1 is listed twice"):
        create_campaign(pg, spec, folder=folder, base_dir=tmp_path)
    assert counts(pg) == (0, 0, 0)


def test_a_draft_paused_and_resumed_is_a_draft_again(pg: psycopg.Connection, folder: CampaignFolder) -> None:
    cid = create_campaign(pg, SPEC, actor="ops", folder=folder)
    assert pause(pg, cid, actor="ops")["status"] == "paused"
    assert resume(pg, cid, actor="ops")["status"] == "draft"
    assert campaign_row(pg, cid)["status"] == "draft"
    events = pg.execute("select from_status, to_status from mail.campaign_event where campaign_id = %s order by id",
                        (cid,)).fetchall()
    assert events == [(None, "draft"), ("draft", "paused"), ("paused", "draft")]
    update_draft(pg, SPEC["name"], SPEC | {"emails_per_day": 5}, actor="ops", folder=folder)  # still editable


def test_a_valid_definition_is_stored_with_holidays_and_one_window_spelling(pg: psycopg.Connection,
                                                                           folder: CampaignFolder) -> None:
    cid = create_campaign(pg, SPEC | {"holidays": "de-by", "windows": ["09:00-12:00", "22:00-01:00+1"],
                                      "reply_to": "Help <help@example.com>"}, actor="ops", folder=folder)
    row = campaign_row(pg, cid)
    assert (row["status"], row["holidays"], row["windows"], row["reply_to"]) == \
        ("draft", "DE-BY", ["09:00-12:00", "22:00-01:00+1"], "Help <help@example.com>")
    [(to_status, actor, detail)] = pg.execute("select to_status, actor, detail from mail.campaign_event"
                                              " where campaign_id = %s", (cid,)).fetchall()
    assert (to_status, actor, detail["spec"]["holidays"], detail["spec"]["from"]) == \
        ("draft", "ops", "DE-BY", "Outreach <outreach@mail.example.com>")


def test_the_database_refuses_the_reserved_name(pg: psycopg.Connection) -> None:
    with pytest.raises(psycopg.errors.CheckViolation, match="campaign_name_not_reserved"):
        pg.execute("insert into mail.campaign (name, template, subject, from_address, recipients_sql)"
                   " values ('all', 'outreach', 'x', 'a@example.com', 'free_plan_users')")


# -- the lifecycle side: a scheduled campaign's name is taken -----------------------------------------


def test_check_name_collisions_names_lifecycle_campaigns_a_scheduled_one_has(pg: psycopg.Connection,
                                                                            folder: CampaignFolder) -> None:
    create_campaign(pg, SPEC | {"name": "promo_x"}, folder=folder)
    check_name_collisions(pg, ["first_practice", "upgrade_offer"])  # no collision: no error
    with pytest.raises(ValueError, match=r"lifecycle campaign\(s\) promo_x in lifecycle\.toml have the name of a "
                                         r"scheduled campaign"):
        check_name_collisions(pg, ["first_practice", "promo_x"])


# -- update_draft ------------------------------------------------------------------------------------


def events(db: psycopg.Connection, cid: int) -> list[tuple[Any, ...]]:
    return db.execute("select from_status, to_status, detail from mail.campaign_event where campaign_id = %s"
                      " order by id", (cid,)).fetchall()


def test_update_draft_replaces_the_definition_and_records_the_change(pg: psycopg.Connection,
                                                                     folder: CampaignFolder) -> None:
    cid = create_campaign(pg, SPEC, folder=folder)
    assert update_draft(pg, "spring_outreach", {k: v for k, v in SPEC.items() if k != "name"}
                        | {"emails_per_day": 50, "holidays": "DE-BY"}, actor="ops", folder=folder) == cid
    row = campaign_row(pg, cid)
    assert (row["emails_per_day"], row["holidays"], row["status"]) == (50, "DE-BY", "draft")
    last = events(pg, cid)[-1]
    assert (last[0], last[1], last[2]["reason"]) == ("draft", "draft", "definition replaced")
    assert last[2]["changed"] == {"emails_per_day": [20, 50], "holidays": [None, "DE-BY"]}
    assert counts(pg) == (1, 2, 0)


def test_update_draft_refusals_change_nothing(pg: psycopg.Connection, folder: CampaignFolder) -> None:
    cid = create_campaign(pg, SPEC, folder=folder)
    before = campaign_row(pg, cid)
    fields, _ = refused_field(update_draft, pg, "spring_outreach", SPEC | {"recipients_sql": "broken"}, folder=folder)
    assert fields == ["recipients_sql"]
    fields, _ = refused_field(update_draft, pg, "spring_outreach", SPEC | {"windows": ["17:00-09:00"]}, folder=folder)
    assert fields == ["windows"]
    fields, message = refused_field(update_draft, pg, "spring_outreach", SPEC | {"name": "autumn"}, folder=folder)
    assert fields == ["name"] and "a draft keeps its name" in message
    with pytest.raises(LookupError, match="no campaign named 'autumn'"):
        update_draft(pg, "autumn", SPEC | {"name": "autumn"}, folder=folder)
    assert campaign_row(pg, cid) == before
    assert counts(pg) == (1, 1, 0)


def test_update_draft_refuses_a_campaign_that_is_not_a_draft(pg: psycopg.Connection, folder: CampaignFolder) -> None:
    users(pg, 2)
    cid = create_campaign(pg, SPEC, folder=folder)
    provision(pg, cid, now=EARLY, folder=folder)
    before, n_events = campaign_row(pg, cid), len(events(pg, cid))
    with pytest.raises(CampaignStateError, match=r"campaign 'spring_outreach' is scheduled: only a draft's "
                                                 r"definition can be replaced"):
        update_draft(pg, "spring_outreach", SPEC | {"emails_per_day": 50}, folder=folder)
    assert campaign_row(pg, cid) == before
    assert len(events(pg, cid)) == n_events


def test_update_draft_replaces_an_uploaded_list(pg: psycopg.Connection, folder: CampaignFolder, tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text("user_id,email,first_name\n1,a@example.com,A\n2,b@example.com,B\n")
    (tmp_path / "b.csv").write_text("user_id,email,first_name\n3,c@example.com,C\n")
    spec = {k: v for k, v in SPEC.items() if k != "recipients_sql"}
    cid = create_campaign(pg, spec | {"recipients_csv": "a.csv"}, folder=folder, base_dir=tmp_path)
    update_draft(pg, "spring_outreach", spec | {"recipients_csv": "b.csv"}, folder=folder, base_dir=tmp_path)
    assert pg.execute("select user_id from mail.campaign_recipient where campaign_id = %s", (cid,)).fetchall() == [(3,)]
    update_draft(pg, "spring_outreach", SPEC, folder=folder)  # a recipients file now: the upload is dropped
    assert counts(pg) == (1, 3, 0)
    assert campaign_row(pg, cid)["recipients_sql"] == "free_plan_users"


# -- provisioning re-checks the stored row; local send hours in the summary ----------------------------


@pytest.mark.parametrize(("column", "value", "field"), [
    ("from_address", "not-an-address", "from"),
    ("reply_to", "help@", "reply_to"),
    ("windows", ["17:00-09:00"], "windows"),
])
def test_provisioning_refuses_a_stored_row_that_breaks_a_rule(pg: psycopg.Connection, folder: CampaignFolder,
                                                              column: str, value: Any, field: str) -> None:
    users(pg, 2)
    cid = create_campaign(pg, SPEC, folder=folder)
    pg.execute(f"update mail.campaign set {column} = %s where id = %s", (value, cid))  # as created before the rule
    for dry_run in (True, False):
        with pytest.raises(CampaignDefinitionError) as info:
            provision(pg, cid, now=EARLY, folder=folder, dry_run=dry_run)
        assert info.value.fields == [field]
        assert str(info.value).startswith("mail.campaign: campaign 'spring_outreach' refused: ")
    assert campaign_row(pg, cid)["status"] == "draft"
    assert pg.execute("select count(*) from mail.send_log").fetchone() == (0,)
    assert counts(pg) == (1, 1, 0)


def test_the_migration_spells_stored_overnight_windows_with_plus_one(pg: psycopg.Connection) -> None:
    # rows written before 0024 spelled an overnight window without +1; the planner read it as overnight
    rows = {"a": ["09:00-12:00", "23:00-01:00"], "b": ["22:00-24:00"], "c": ["17:00-09:00"], "d": ["20:00-21:00"]}
    for name, windows in rows.items():
        pg.execute("insert into mail.campaign (name, template, subject, from_address, recipients_sql, windows)"
                   " values (%s, 'outreach', 'x', 'a@example.com', 'free_plan_users', %s)", (name, windows))
    [m0024] = [m for m in migration_files() if m.version == 24]
    pg.execute(m0024.sql)  # idempotent: run again over these rows
    got = dict(pg.execute("select name, windows from mail.campaign order by name").fetchall())
    assert got == {"a": ["09:00-12:00", "23:00-01:00+1"], "b": ["22:00-24:00"], "c": ["17:00-09:00+1"],
                   "d": ["20:00-21:00"]}
    for name in got:
        check_stored(campaign_row(pg, int(pg.execute("select id from mail.campaign where name = %s",
                                                       (name,)).fetchone()[0])))  # type: ignore[index]


def test_the_summary_shows_local_send_hours_and_skipped_holidays(pg: psycopg.Connection, folder: CampaignFolder) -> None:
    users(pg, 4)
    cid = create_campaign(pg, SPEC | {"holidays": "DE-BY", "emails_per_day": 2}, folder=folder)
    expected = {"local_windows": "09:00-12:00, 14:00-17:00 Europe/Berlin, Mon-Fri, DE-BY holidays skipped",
                "first_send_local": "2026-01-05T09:00:00+01:00", "last_send_local": "2026-01-07T14:00:00+01:00",
                "holidays_skipped": 1, "first_send": "2026-01-05T08:00:00+00:00",
                "last_send": "2026-01-07T13:00:00+00:00"}
    dry = provision(pg, cid, now=EARLY, folder=folder, dry_run=True).as_dict()
    assert {k: dry[k] for k in expected} == expected
    done = provision(pg, cid, now=EARLY, folder=folder).as_dict()
    assert {k: done[k] for k in expected} == expected
    assert json.loads(json.dumps(done))["holidays_skipped"] == 1  # JSON-ready
    times = [r[0] for r in pg.execute("select scheduled_at from mail.send_log order by scheduled_at").fetchall()]
    assert times == [datetime(2026, 1, 5, 8, tzinfo=UTC), datetime(2026, 1, 5, 13, tzinfo=UTC),
                     datetime(2026, 1, 7, 8, tzinfo=UTC), datetime(2026, 1, 7, 13, tzinfo=UTC)]


def test_a_holdout_share_from_the_definition_is_stored_and_replaced_with_the_draft(
        pg: psycopg.Connection, folder: CampaignFolder) -> None:
    cid = create_campaign(pg, SPEC | {"holdout_share": 0.2}, actor="ops", folder=folder)
    assert float(campaign_row(pg, cid)["holdout_share"]) == 0.2
    update_draft(pg, SPEC["name"], SPEC | {"holdout_share": 0.05}, actor="ops", folder=folder)
    assert float(campaign_row(pg, cid)["holdout_share"]) == 0.05
