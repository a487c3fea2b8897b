"""The DAG files: import cleanly through a DagBag, follow the house rules, and `dag.test()` runs the
lifecycle task end to end (real PostgreSQL send log, the emulator as the Resend API)."""

from __future__ import annotations

import json
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import ROOT, UNSUBSCRIBE_SECRET

from mailflow.campaigns import load_campaigns
from mailflow.emulator.testing import EmulatorProcess
from mailflow_dev import devenv

DAGS = ROOT / "dags"


@pytest.fixture(scope="module")
def dagbag() -> Any:
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(DAGS))


def test_dag_folder_imports_without_errors(dagbag: Any) -> None:
    assert dagbag.import_errors == {}
    assert "lifecycle_emails" in dagbag.dag_ids
    # every DAG file in dags/ defines at least one DAG (none silently empty)
    assert {Path(d.fileloc).name for d in dagbag.dags.values()} == {p.name for p in DAGS.glob("*.py")}


def test_every_dag_has_tags_owner_retries_no_catchup_and_an_interval_timetable(dagbag: Any) -> None:
    from airflow.sdk import CronDataIntervalTimetable

    assert dagbag.dags
    for dag_id, dag in dagbag.dags.items():
        assert dag.tags, f"{dag_id} has no tags"
        assert dag.catchup is False, dag_id
        # scheduled DAGs use an interval timetable (a run's data interval is a real period);
        # a manually triggered DAG (schedule=None) has none
        if dag.timetable.can_be_scheduled:
            assert isinstance(dag.timetable, CronDataIntervalTimetable), dag_id
        else:
            assert type(dag.timetable).__name__ == "NullTimetable", dag_id
        for task in dag.tasks:
            assert task.retries >= 1, f"{dag_id}.{task.task_id}"
            assert task.owner and task.owner != "airflow", f"{dag_id}.{task.task_id} has no owner"


def test_lifecycle_emails_shape(dagbag: Any) -> None:
    from airflow.sdk import CronDataIntervalTimetable

    dag = dagbag.dags["lifecycle_emails"]
    assert set(dag.tags) == {"email", "lifecycle", "mailflow"}
    assert dag.max_active_runs == 1
    assert dag.catchup is False
    assert isinstance(dag.timetable, CronDataIntervalTimetable)
    assert (dag.timetable.expression, str(dag.timetable.timezone)) == ("0 * * * *", "UTC")
    assert dag.start_date == datetime(2026, 1, 1, tzinfo=UTC)
    assert [t.task_id for t in dag.tasks] == ["send_campaigns"]
    task = dag.get_task("send_campaigns")
    assert task.pool == "email_provider"
    assert (task.owner, task.retries, task.retry_delay) == ("data-eng", 2, timedelta(minutes=2))
    assert task.execution_timeout == timedelta(minutes=15)


def test_lifecycle_emails_params_and_their_documented_defaults(dagbag: Any) -> None:
    params = dagbag.dags["lifecycle_emails"].params
    assert params.dump() == {"time_budget_seconds": 240, "chunk_size": 100, "campaigns": [], "dry_run": False,
                             "allow_old_interval": False}
    chunk = params.get_param("chunk_size").schema
    assert (chunk["type"], chunk["minimum"], chunk["maximum"]) == ("integer", 1, 100)
    budget = params.get_param("time_budget_seconds").schema
    assert (budget["type"], budget["minimum"], budget["maximum"]) == ("integer", 10, 500)  # tests/airflow/test_budgets.py
    names = [c.name for c in load_campaigns()]
    assert params.get_param("campaigns").schema["items"] == {"type": "string", "enum": names}
    assert params.get_param("campaigns").schema["examples"] == names  # the trigger form's multi-select
    assert params.get_param("dry_run").schema["type"] == "boolean"
    assert params.get_param("allow_old_interval").schema["type"] == "boolean"


def test_chunk_size_param_refuses_101(dagbag: Any) -> None:
    from airflow.sdk.exceptions import ParamValidationError

    param = dagbag.dags["lifecycle_emails"].params.get_param("chunk_size")
    assert param.resolve(100) == 100
    with pytest.raises(ParamValidationError):
        param.resolve(101)


def test_campaigns_param_is_an_enum_of_the_declared_names_and_refuses_a_typo(dagbag: Any) -> None:
    from airflow.sdk.exceptions import ParamValidationError

    from mailflow.campaigns import declared_names

    assert declared_names() == ["finish_assessment", "first_practice", "upgrade_offer", "practice_tips"]
    param = dagbag.dags["lifecycle_emails"].params.get_param("campaigns")
    assert param.resolve(["upgrade_offer", "first_practice"]) == ["upgrade_offer", "first_practice"]
    assert param.resolve([]) == []
    with pytest.raises(ParamValidationError, match="'upgrade_ofer' is not one of"):
        param.resolve(["upgrade_ofer"])
    with pytest.raises(ParamValidationError, match="non-unique"):
        param.resolve(["upgrade_offer", "upgrade_offer"])


def test_a_bad_campaigns_param_fails_the_task_at_once_without_retries() -> None:
    from airflow.sdk.exceptions import AirflowFailException

    from mailflow.orchestration.tasks import campaigns_param

    assert [c.name for c in campaigns_param({"campaigns": ["upgrade_offer"]})] == ["upgrade_offer"]
    assert len(campaigns_param({"campaigns": []})) == len(load_campaigns())
    with pytest.raises(AirflowFailException, match=r"Param campaigns: unknown campaign\(s\) \['upgrade_ofer'\]; "
                                                   r"declared: \['finish_assessment'"):
        campaigns_param({"campaigns": ["upgrade_ofer"]})
    with pytest.raises(AirflowFailException, match=r"Param campaigns must be a list of campaign names, got 'upgrade'"):
        campaigns_param({"campaigns": "upgrade"})


def test_declared_names_at_parse_time_cost_one_toml_read(tmp_path: Path) -> None:
    from mailflow.campaigns import declared_names

    # no audience/template files next to it: declared_names does not look at them (load_campaigns would)
    toml = tmp_path / "lifecycle.toml"
    toml.write_text('[defaults]\ncooldown = "P7D"\n[[campaign]]\nname = "b"\n[[campaign]]\nname = "a"\n')
    assert declared_names(toml) == ["b", "a"]
    with pytest.raises(ValueError, match="audience"):
        load_campaigns(toml)


# -- dag.test() ------------------------------------------------------------------------------------

H, D = timedelta(hours=1), timedelta(days=1)


def latest_complete_hour() -> datetime:
    """An hour boundary no older than an hour: within every campaign's max_interval_age (6 h)."""
    return datetime.now(UTC).replace(minute=0, second=0, microsecond=0)


def populate(db: psycopg.Connection, end: datetime, base: int = 0) -> dict[int, str]:
    """A small population (user ids ``base + 1..7``); returns user_id -> the campaign it must get
    for the run whose data interval ends at ``end``."""

    def user(uid: int, signed_up_at: datetime = end - 90 * D, last_active_at: datetime | None = None,
             plan: str = "free") -> None:
        db.execute("insert into app.users (user_id, email, first_name, signed_up_at, timezone, plan, last_active_at)"
                   " values (%s, %s, %s, %s, 'UTC', %s, %s)",
                   (base + uid, f"dag{base + uid}@example.com", f"N{uid}", signed_up_at, plan, last_active_at))

    def assessment(aid: int, uid: int, started: datetime, finished: datetime | None = None) -> None:
        db.execute("insert into app.assessments (assessment_id, user_id, kind, is_free, started_at, finished_at, score)"
                   " values (%s, %s, 'numerical', true, %s, %s, %s)",
                   (base + aid, base + uid, started, finished, 60 if finished else None))

    user(1, signed_up_at=end - 5 * H)  # first_practice
    user(2, signed_up_at=end - 30 * H)  # first_practice (2-day window)
    user(3, last_active_at=end - 10 * timedelta(minutes=1))  # finish_assessment (and practice_tips)
    assessment(31, 3, end - 30 * timedelta(minutes=1))
    user(4)  # upgrade_offer (and practice_tips through the assessment)
    assessment(41, 4, end - 2 * D - H, end - 2 * D)
    user(5, plan="pro", last_active_at=end - 3 * D)  # practice_tips
    user(6, last_active_at=end - 20 * D)  # nobody
    user(7, signed_up_at=end)  # signed up at the interval end (half-open): nobody
    return {base + 1: "first_practice", base + 2: "first_practice", base + 3: "finish_assessment",
            base + 4: "upgrade_offer", base + 5: "practice_tips"}


@pytest.fixture
def airflow_conns(airflow_db: Path, db_dsn: str, emulator: EmulatorProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_SEND_LOG_DB", devenv.airflow_conn_json(db_dsn))
    monkeypatch.setenv("AIRFLOW_CONN_RESEND_DEFAULT", json.dumps({
        "conn_type": "resend", "host": emulator.base_url, "password": emulator.api_key,
        "extra": {"requests_per_second": 50}}))
    monkeypatch.setenv("AIRFLOW_CONN_MAIL_UNSUBSCRIBE", json.dumps({"conn_type": "generic",
                                                                    "password": UNSUBSCRIBE_SECRET}))


def send_log(db: psycopg.Connection) -> list[tuple[Any, ...]]:
    return db.execute("select user_id, campaign, status, data_interval_start, data_interval_end, dag_id, run_id,"
                      " task_id, provider_message_id from mail.send_log order by id").fetchall()


def summary_of(dr: Any) -> list[dict[str, Any]]:
    ti = dr.get_task_instance("send_campaigns")
    assert ti.state == "success"
    return ti.xcom_pull(task_ids="send_campaigns")


def assert_sent_run(dr: Any, end: datetime, rows: list[tuple[Any, ...]], expected: dict[int, str],
                    outbox: list[dict[str, Any]]) -> None:
    assert dr.state == "success"
    # an interval timetable: the run's data interval is the hour that ends at the logical date
    assert (dr.logical_date, dr.data_interval_start, dr.data_interval_end) == (end, end - H, end)
    assert {r[0]: r[1] for r in rows} == expected
    assert len(rows) == len(expected)
    for r in rows:
        assert r[2] == "sent"
        assert (r[3], r[4]) == (end - H, end)
        assert (r[5], r[6], r[7]) == ("lifecycle_emails", dr.run_id, "send_campaigns")
    # sent per campaign in the send log == delivered per campaign in the outbox
    sent = Counter(r[1] for r in rows if r[2] == "sent")
    delivered = Counter(e["tags"][0]["value"] for e in outbox)
    assert sent == delivered == Counter(expected.values())
    assert {e["id"] for e in outbox} == {r[8] for r in rows}
    # the task's return value (XCom) is the per-campaign summary, in priority order
    summary = summary_of(dr)
    names = [c.name for c in load_campaigns()]
    assert [s["campaign"] for s in summary] == names
    for s in summary:
        n = sent[s["campaign"]]
        assert s == {"campaign": s["campaign"], "eligible": n, "minted": n, "held": 0, "not_reached": 0, "chunks": 1, "stopped": None, "total": n, "pending": 0, "sending": 0, "sent": n, "failed": 0, "cancelled": 0, "duplicate": 0, "skipped": 0, "holdout": 0, "invalid": 0, "dead_lettered": 0, "rolled_back": 0}


@pytest.mark.airflow
@pytest.mark.usefixtures("airflow_conns")
def test_dag_test_sends_one_run_for_the_interval_ending_at_the_logical_date(
    db: psycopg.Connection, emulator: EmulatorProcess, dagbag: Any,
) -> None:
    end = latest_complete_hour()
    expected = populate(db, end)
    dr = dagbag.dags["lifecycle_emails"].test(logical_date=end)
    assert_sent_run(dr, end, send_log(db), expected, emulator.read_outbox())


@pytest.mark.airflow
@pytest.mark.usefixtures("airflow_conns")
def test_dag_test_of_an_old_interval_sends_only_with_allow_old_interval(
    db: psycopg.Connection, emulator: EmulatorProcess, dagbag: Any,
) -> None:
    dag = dagbag.dags["lifecycle_emails"]
    old = latest_complete_hour() - 60 * D  # far past every campaign's max_interval_age (6 h)
    expected_old = populate(db, old)
    dr = dag.test(logical_date=old)
    assert dr.state == "success"
    assert send_log(db) == [] and emulator.read_outbox() == []
    summary = summary_of(dr)
    assert [(s["campaign"], s["eligible"], s["minted"], s["not_reached"]) for s in summary] == [
        ("finish_assessment", 1, 0, 1), ("first_practice", 2, 0, 2), ("upgrade_offer", 1, 0, 1),
        ("practice_tips", 3, 0, 3)]
    for s in summary:
        assert s["stopped"].startswith("interval ended ")
        assert s["stopped"].endswith(" ago, over max_interval_age 6:00:00")
    # the same kind of backfill, another old hour (its own population), with the Param set: it sends
    older = old - 30 * D  # so the first population is outside every window of this one
    expected = populate(db, older, base=100)
    assert not set(expected) & set(expected_old)
    dr2 = dag.test(logical_date=older, run_conf={"allow_old_interval": True})
    assert_sent_run(dr2, older, send_log(db), expected, emulator.read_outbox())


# -- campaign files at parse time ------------------------------------------------------------------


def bad_campaigns_bag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, edit: Any) -> tuple[Any, str]:
    """A DagBag of the lifecycle DAG file in a bundle whose ``campaigns/`` (a copy of the examples)
    was changed by ``edit(folder)``; returns the bag and the file's import error text."""
    import shutil

    from airflow.dag_processing.dagbag import DagBag

    from mailflow.campaigns import EXAMPLES_DIR

    monkeypatch.delenv("MAILFLOW_CAMPAIGNS_DIR", raising=False)
    bundle = tmp_path / "dags"
    bundle.mkdir()
    shutil.copy(DAGS / "lifecycle_emails.py", bundle)
    shutil.copytree(EXAMPLES_DIR, bundle / "campaigns", ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    edit(bundle / "campaigns")
    bag = DagBag(dag_folder=str(bundle))
    [(path, error)] = bag.import_errors.items()
    assert Path(path).name == "lifecycle_emails.py"
    assert "lifecycle_emails" not in bag.dag_ids
    return bag, error


def replace_in(path: Path, old: str, new: str) -> None:
    text = path.read_text(encoding="utf-8")
    assert old in text
    path.write_text(text.replace(old, new, 1), encoding="utf-8")


@pytest.mark.parametrize(("edit", "expected"), [
    (lambda f: replace_in(f / "lifecycle.toml", 'priority = 2', 'priorty = 2'),
     r"campaigns/lifecycle\.toml: campaign 'first_practice': unknown key 'priorty'"),
    (lambda f: replace_in(f / "lifecycle.toml", '[defaults]', '[defaults]\nfrom_adress = "x@example.com"'),
     r"campaigns/lifecycle\.toml: \[defaults\]: unknown key 'from_adress'"),
    (lambda f: replace_in(f / "lifecycle.toml", 'name = "upgrade_offer"', 'name = "upgrade_offer'),
     r"campaigns/lifecycle\.toml: not valid TOML: .*line \d+"),
    (lambda f: (f / "templates" / "practice_tips.txt.j2").unlink(),
     r"campaigns/lifecycle\.toml: campaign 'practice_tips': template = 'practice_tips': "
     r"file \S+/campaigns/templates/practice_tips\.txt\.j2 not found"),
    (lambda f: replace_in(f / "lifecycle.toml", 'audience_window = "P14D"', 'audience_window = "two weeks"'),
     r"campaigns/lifecycle\.toml: campaign 'upgrade_offer': audience_window: "),
    (lambda f: replace_in(f / "lifecycle.toml", 'priority = 4', 'priority = "4"'),
     r"campaigns/lifecycle\.toml: campaign 'practice_tips': priority must be a int, got '4'"),
    (lambda f: replace_in(f / "templates" / "outreach.html.j2", "{%- endblock %}", "{% if %}{%- endblock %}"),
     r"campaigns/templates/outreach\.html\.j2: campaign 'template outreach': template outreach\.html\.j2 is not a "
     r"valid Jinja template"),
], ids=["unknown campaign key", "unknown defaults key", "malformed toml", "missing template",
        "bad duration", "wrong type", "template syntax"])
def test_a_bad_campaign_file_is_an_import_error_naming_the_file_and_the_field(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, edit: Any, expected: str) -> None:
    import re

    _, error = bad_campaigns_bag(tmp_path, monkeypatch, edit)
    assert re.search(expected, error), error
    assert "CampaignFileError" in error


def test_the_dag_file_parses_with_a_campaigns_folder_of_its_own_and_offers_its_names(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    from airflow.dag_processing.dagbag import DagBag

    from mailflow.campaigns import EXAMPLES_DIR

    monkeypatch.delenv("MAILFLOW_CAMPAIGNS_DIR", raising=False)
    bundle = tmp_path / "dags"
    bundle.mkdir()
    shutil.copy(DAGS / "lifecycle_emails.py", bundle)
    # no campaigns/ yet: the packaged examples
    bag = DagBag(dag_folder=str(bundle))
    assert bag.import_errors == {}
    assert bag.dags["lifecycle_emails"].params.get_param("campaigns").schema["items"]["enum"] == \
        ["finish_assessment", "first_practice", "upgrade_offer", "practice_tips"]
    shutil.copytree(EXAMPLES_DIR, bundle / "campaigns", ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    replace_in(bundle / "campaigns" / "lifecycle.toml", 'name = "practice_tips"', 'name = "study_tips"')
    bag = DagBag(dag_folder=str(bundle))
    assert bag.import_errors == {}
    assert bag.dags["lifecycle_emails"].params.get_param("campaigns").schema["items"]["enum"] == \
        ["finish_assessment", "first_practice", "upgrade_offer", "study_tips"]
