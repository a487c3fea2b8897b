"""The data interval of each kind of run (Airflow 3.3.2's CronDataIntervalTimetable, as the DAGs
declare it), the lifecycle task's message for a run without one, and the table in docs/operations.md
that both must agree with."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import ROOT

from mailflow.orchestration.tasks import NO_DATA_INTERVAL


def at(h: int, m: int = 0) -> Any:
    import pendulum

    return pendulum.datetime(2026, 11, 27, h, m, tz="UTC")


def hourly() -> Any:
    from airflow.timetables.interval import CronDataIntervalTimetable

    return CronDataIntervalTimetable("0 * * * *", "UTC")


def test_the_dags_declare_the_timetables_the_table_describes() -> None:
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(ROOT / "dags"))
    expr = {d: (bag.dags[d].timetable.expression, str(bag.dags[d].timetable.timezone)) for d in ("lifecycle_emails", "dispatch_scheduled_emails")}
    assert expr == {"lifecycle_emails": ("0 * * * *", "UTC"), "dispatch_scheduled_emails": ("* * * * *", "UTC")}
    assert {type(bag.dags[d].timetable).__name__ for d in expr} == {"CronDataIntervalTimetable"}


@pytest.mark.parametrize(("logical", "start", "end"), [
    (at(10, 20), at(9), at(10)),  # inside an hour: the last complete hour before it
    (at(10), at(9), at(10)),  # on the hour: the logical date is the interval's END
    (at(10).add(microseconds=1), at(9), at(10)),
])
def test_a_manual_run_covers_the_last_complete_hour_before_its_logical_date(logical: Any, start: Any,
                                                                            end: Any) -> None:
    interval = hourly().infer_manual_data_interval(run_after=logical)
    assert (interval.start, interval.end) == (start, end)


def test_a_scheduled_or_backfilled_run_has_the_intervals_start_as_its_logical_date() -> None:
    from airflow.timetables.base import DataInterval, TimeRestriction

    info = hourly().next_dagrun_info(last_automated_data_interval=DataInterval(at(8), at(9)),
                                     restriction=TimeRestriction(earliest=None, latest=None, catchup=True))
    assert info is not None
    assert (info.logical_date, info.data_interval.start, info.data_interval.end, info.run_after) == (
        at(9), at(9), at(10), at(10))
    # a backfill from 00:00 to 02:00 takes the runs whose logical date (the start) is in [from, to]:
    # iter_dagrun_infos_between asks next_dagrun_info with this restriction until it answers None
    infos = [hourly().next_dagrun_info(last_automated_data_interval=DataInterval(at(h - 1), at(h)) if h else None,
                                       restriction=TimeRestriction(earliest=at(0), latest=at(2), catchup=True))
             for h in range(4)]
    assert [(i.data_interval.start, i.data_interval.end) for i in infos if i is not None] == [
        (at(0), at(1)), (at(1), at(2)), (at(2), at(3))]
    assert infos[3] is None


def test_the_lifecycle_task_refuses_a_run_without_an_interval_with_the_documented_rule() -> None:
    from airflow.sdk.exceptions import AirflowFailException

    from mailflow.orchestration import tasks

    with pytest.raises(AirflowFailException) as exc:
        tasks.lifecycle({"params": {}, "logical_date": None, "data_interval_start": None, "data_interval_end": None})
    assert str(exc.value) == NO_DATA_INTERVAL
    # the message's example is the timetable's answer and the docs' table row
    assert "the last complete hour before its logical date (10:20 or 10:00 -> [09:00, 10:00))" in NO_DATA_INTERVAL
    for logical in (at(10, 20), at(10)):
        assert tuple(hourly().infer_manual_data_interval(run_after=logical)) == (at(9), at(10))
    assert "a backfill's and a scheduled run's logical date is the interval's START" in NO_DATA_INTERVAL
    doc = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    assert "L 10:20 -> `[09:00, 10:00)`, L **10:00** -> `[09:00, 10:00)` (L on the hour is the interval's **end**)" in doc
    assert "`[09:00, 10:00)`, logical date **09:00** (the interval's start)" in doc
    assert "docs/operations.md, 'Data intervals'" in NO_DATA_INTERVAL and "\n### Data intervals\n" in doc
