"""Public holidays in the planner (PlanSpec.holidays, the holidays library): a plan day whose local
date is a holiday of the campaign's calendar sends nothing, like a weekday not allowed; exact UTC
instants around DST changes; an overnight window belongs to the date it opens on."""

from __future__ import annotations

from datetime import UTC, date, datetime
from zoneinfo import ZoneInfo

import pytest

from mailflow.sources.scheduled.planning import (
    PlanSpec,
    describe_schedule,
    holiday_calendar,
    holidays_skipped,
    plan_send_times,
)

EVERY_DAY = frozenset(range(1, 8))


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def plan(holidays: str | None, zone: str, count: int, start: datetime, *, windows: tuple[str, ...] = ("09:00-17:00",),
         per_day: int = 1, weekdays: frozenset[int] = EVERY_DAY) -> list[datetime]:
    spec = PlanSpec(timezone=zone, emails_per_day=per_day, weekdays=weekdays, windows=windows,  # type: ignore[arg-type]
                    holidays=holidays)
    return list(plan_send_times(spec, count, start))


def test_german_christmas_holidays_are_skipped() -> None:
    start = datetime(2026, 12, 24, tzinfo=ZoneInfo("Europe/Berlin"))
    # 25th and 26th are public holidays in all of Germany; the 24th is not one (a working day in the
    # holidays library's DE calendar), so it sends; 09:00 CET = 08:00 UTC
    assert plan("DE", "Europe/Berlin", 3, start) == [utc(2026, 12, 24, 8), utc(2026, 12, 27, 8), utc(2026, 12, 28, 8)]
    assert plan(None, "Europe/Berlin", 3, start) == [utc(2026, 12, 24, 8), utc(2026, 12, 25, 8), utc(2026, 12, 26, 8)]
    assert date(2026, 12, 24) not in holiday_calendar("DE")


def test_epiphany_is_skipped_in_bavaria_not_in_berlin() -> None:
    start = datetime(2026, 1, 5, tzinfo=ZoneInfo("Europe/Berlin"))  # Monday; Tuesday 01-06 is Epiphany
    weekdays = frozenset({1, 2, 3, 4, 5})
    assert plan("DE-BY", "Europe/Berlin", 2, start, weekdays=weekdays) == [utc(2026, 1, 5, 8), utc(2026, 1, 7, 8)]
    assert plan("DE-BE", "Europe/Berlin", 2, start, weekdays=weekdays) == [utc(2026, 1, 5, 8), utc(2026, 1, 6, 8)]
    assert plan("DE", "Europe/Berlin", 2, start, weekdays=weekdays) == [utc(2026, 1, 5, 8), utc(2026, 1, 6, 8)]


def test_easter_after_the_spring_dst_change_in_berlin() -> None:
    # Clocks go forward on Sunday 2026-03-29 (CET +1 -> CEST +2); Good Friday 04-03 and Easter Monday
    # 04-06 are skipped; 09:00 local is 08:00 UTC before the change and 07:00 UTC after it.
    start = datetime(2026, 3, 26, tzinfo=ZoneInfo("Europe/Berlin"))  # Thursday
    got = plan("DE", "Europe/Berlin", 7, start, weekdays=frozenset({1, 2, 3, 4, 5}))
    assert got == [utc(2026, 3, 26, 8), utc(2026, 3, 27, 8), utc(2026, 3, 30, 7), utc(2026, 3, 31, 7),
                   utc(2026, 4, 1, 7), utc(2026, 4, 2, 7), utc(2026, 4, 7, 7)]


def test_a_holiday_the_day_after_the_autumn_dst_change_in_dublin() -> None:
    # Europe/Dublin leaves IST (+1) for GMT (+0) on Sunday 2026-10-25; Monday 10-26 is the October Bank Holiday
    start = datetime(2026, 10, 24, tzinfo=ZoneInfo("Europe/Dublin"))
    assert plan("IE", "Europe/Dublin", 3, start) == [utc(2026, 10, 24, 8), utc(2026, 10, 25, 9), utc(2026, 10, 27, 9)]


def test_election_day_after_the_us_dst_change_is_a_holiday_in_new_york_not_california() -> None:
    # US clocks fall back on Sunday 2026-11-01; Election Day, Tuesday 11-03, is a public holiday in US-NY
    ny = datetime(2026, 10, 31, tzinfo=ZoneInfo("America/New_York"))
    assert plan("US-NY", "America/New_York", 4, ny) == [utc(2026, 10, 31, 13), utc(2026, 11, 1, 14), utc(2026, 11, 2, 14),
                                                        utc(2026, 11, 4, 14)]
    la = datetime(2026, 11, 1, tzinfo=ZoneInfo("America/Los_Angeles"))
    # US-CA has no holiday on 11-01..11-03: every day sends, 09:00 PDT (-7) then PST (-8)
    assert plan("US-CA", "America/Los_Angeles", 3, la) == [utc(2026, 11, 1, 17), utc(2026, 11, 2, 17),
                                                           utc(2026, 11, 3, 17)]
    assert plan("US-CA", "America/Los_Angeles", 1, datetime(2026, 10, 31, tzinfo=ZoneInfo("America/Los_Angeles"))) == \
        [utc(2026, 10, 31, 16)]


def test_an_overnight_window_belongs_to_its_first_date() -> None:
    # 22:00-02:00+1 with 2 a day: slots at 22:00 and 00:00 local (CET, +1). The window opened on the 24th
    # (not a holiday) sends into Christmas Day's morning; the windows opened on the 25th and the 26th
    # (holidays) send nothing, the 26th's tail on the 27th included; the 27th's window sends.
    start = datetime(2026, 12, 24, 12, tzinfo=ZoneInfo("Europe/Berlin"))
    got = plan("DE", "Europe/Berlin", 4, start, windows=("22:00-02:00+1",), per_day=2)
    assert got == [utc(2026, 12, 24, 21), utc(2026, 12, 24, 23), utc(2026, 12, 27, 21), utc(2026, 12, 27, 23)]


def test_sends_on_combines_weekdays_and_holidays() -> None:
    spec = PlanSpec(holidays="DE-BY")
    assert [spec.sends_on(date(2026, 1, d)) for d in (5, 6, 7, 10)] == [True, False, True, False]  # 10th: Saturday


def test_holidays_skipped_counts_holidays_on_sending_weekdays() -> None:
    every = PlanSpec(weekdays=EVERY_DAY, holidays="DE")
    assert holidays_skipped(every, date(2026, 12, 24), date(2026, 12, 28)) == 2  # 25th (Fri), 26th (Sat)
    weekdays = PlanSpec(holidays="DE")
    assert holidays_skipped(weekdays, date(2026, 12, 24), date(2026, 12, 28)) == 1  # the 26th is a Saturday anyway
    assert holidays_skipped(PlanSpec(), date(2026, 12, 24), date(2026, 12, 28)) == 0
    assert holidays_skipped(every, date(2026, 12, 28), date(2026, 12, 24)) == 0


@pytest.mark.parametrize(("spec", "text"), [
    (PlanSpec(holidays="DE-BY"), "09:00-12:00, 14:00-17:00 Europe/Berlin, Mon-Fri, DE-BY holidays skipped"),
    (PlanSpec(timezone="UTC", weekdays=frozenset({1, 3, 4, 6, 7}), windows=("20:00-21:00", "23:00-01:00+1")),  # type: ignore[arg-type]
     "20:00-21:00, 23:00-01:00+1 UTC, Mon, Wed-Thu, Sat-Sun"),
    (PlanSpec(weekdays=EVERY_DAY, windows=("22:00-24:00",)), "22:00-24:00 Europe/Berlin, Mon-Sun"),  # type: ignore[arg-type]
])
def test_describe_schedule_shows_local_send_hours(spec: PlanSpec, text: str) -> None:
    assert describe_schedule(spec) == text
