"""The approval fingerprint (pure): every field of the definition, every byte of the files and every
recipient is in it; it is the same in another process; a difference is named field by field."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from mailflow.sources.scheduled.approval import (
    DEFINITION_COLUMNS,
    canonical_definition,
    changes,
    fingerprint,
)
from mailflow.sources.scheduled.definition import CampaignDefinition

ROW: dict[str, Any] = {
    "id": 7, "name": "spring", "template": "outreach", "subject": "Hi {{ user.first_name }}",
    "from_address": "Team <team@mail.example.com>", "reply_to": None, "timezone": "Europe/Berlin",
    "emails_per_day": 20, "weekdays": [1, 2, 3, 4, 5], "windows": ["09:00-12:00", "14:00-17:00"], "holidays": None,
    "start_at": datetime(2026, 1, 5, 8, tzinfo=UTC), "marketing": True, "on_policy": "defer",
    "holdout_share": 0.0, "canary_share": None, "canary_min_outcome_share": Decimal("0.9"),
    "canary_max_wait": timedelta(hours=1), "recipients_sql": None, "recipients_table": "app.spring_list",
    # state, not definition: never in the fingerprint
    "status": "draft", "provisioned_count": 0, "provision_cursor": None, "updated_at": datetime.now(UTC),
}
FILES = {"templates/outreach.html.j2": b"<p>Hi</p>", "templates/outreach.txt.j2": b"Hi",
         "templates/_layout.html.j2": b"<html>{% block body %}{% endblock %}</html>"}
IDS = [1, 2, 3, 5, 8]


def fp(row: dict[str, Any] = ROW, files: dict[str, bytes] = FILES, ids: list[int] = IDS) -> Any:
    return fingerprint(canonical_definition(row), files, ids)


def test_the_fingerprint_covers_every_field_of_the_definition_model() -> None:
    model = {f.alias or name for name, f in CampaignDefinition.model_fields.items()}
    # an uploaded CSV is stored as the list table mail.campaign_recipient: its rows are the recipient snapshot
    assert set(DEFINITION_COLUMNS) == model - {"recipients_csv"}
    assert set(canonical_definition(ROW)) == set(DEFINITION_COLUMNS)


@pytest.mark.parametrize(("column", "value"), [
    ("name", "autumn"), ("template", "practice_tips"), ("subject", "Hello {{ user.first_name }}"),
    ("from_address", "Other <x@mail.example.com>"), ("reply_to", "help@mail.example.com"),
    ("timezone", "UTC"), ("emails_per_day", 21), ("weekdays", [1, 2, 3, 4]), ("windows", ["09:00-12:00"]),
    ("holidays", "DE"), ("start_at", datetime(2026, 1, 5, 9, tzinfo=UTC)), ("marketing", False),
    ("on_policy", "skip"), ("holdout_share", 0.1), ("canary_share", Decimal("0.1")),
    ("canary_min_outcome_share", Decimal("0.8")), ("canary_max_wait", timedelta(minutes=61)),
    ("recipients_table", "app.other_list"),
])
def test_a_change_of_any_definition_field_changes_the_fingerprint_and_is_named(column: str, value: Any) -> None:
    before = fp()
    after = fp(ROW | {column: value})
    assert after.value != before.value
    key = next(k for k, c in DEFINITION_COLUMNS.items() if c == column)
    [line] = changes({**before.as_dict(), "recipient_ids": list(before.recipient_ids)}, after)
    assert line.startswith(f"definition {key}: ")


def test_state_columns_and_equal_numbers_do_not_change_it() -> None:
    berlin = ZoneInfo("Europe/Berlin")  # the same instant in another zone, the same share spelled 0.90
    same = fp(ROW | {"status": "paused", "provisioned_count": 9, "canary_min_outcome_share": Decimal("0.90"),
                     "start_at": datetime(2026, 1, 5, 8, tzinfo=UTC).astimezone(berlin)})
    assert same.value == fp().value


def test_one_byte_of_one_file_changes_it_and_names_the_file() -> None:
    before = fp()
    after = fp(files=FILES | {"templates/_layout.html.j2": FILES["templates/_layout.html.j2"] + b" "})
    assert after.value != before.value
    assert changes(before.as_dict(), after) == ["file templates/_layout.html.j2 changed"]
    gone = fp(files={k: v for k, v in FILES.items() if "layout" not in k})
    assert changes(before.as_dict(), gone) == ["file templates/_layout.html.j2 removed"]


def test_recipients_added_and_removed_are_counted() -> None:
    before = fp()
    after = fp(ids=[2, 3, 5, 8, 13, 21, 34])
    assert after.value != before.value and after.recipient_count == 7
    assert changes({**before.as_dict(), "recipient_ids": IDS}, after) == [
        "recipients: 3 added, 1 removed (5 approved, 7 now)"]


def test_the_ids_must_be_ascending() -> None:
    with pytest.raises(ValueError, match="ascending"):
        fingerprint(canonical_definition(ROW), FILES, [2, 1])


def test_the_same_campaign_gives_the_same_fingerprint_in_another_process() -> None:
    here = fp()
    code = ("import json, sys; from datetime import datetime, timedelta, timezone; from decimal import Decimal\n"
            "from mailflow.sources.scheduled.approval import canonical_definition, fingerprint\n"
            "row = json.loads(sys.argv[1]); row['start_at'] = datetime(2026, 1, 5, 8, tzinfo=timezone.utc)\n"
            "row['canary_min_outcome_share'] = Decimal('0.9'); row['canary_max_wait'] = timedelta(hours=1)\n"
            "files = {k: v.encode() for k, v in json.loads(sys.argv[2]).items()}\n"
            "print(fingerprint(canonical_definition(row), dict(reversed(list(files.items()))), [1, 2, 3, 5, 8]).value)")
    row = {k: v for k, v in ROW.items() if k not in ("start_at", "canary_min_outcome_share", "canary_max_wait",
                                                      "updated_at")}
    out = subprocess.run([sys.executable, "-c", code, json.dumps(row), json.dumps({k: v.decode() for k, v in
                                                                                    FILES.items()})],
                         check=True, capture_output=True, text=True, env={"PYTHONHASHSEED": "123",
                                                                           "PYTHONPATH": ":".join(sys.path)})
    assert out.stdout.strip() == here.value
    assert len(here.value) == 64 and int(here.value, 16) >= 0
