"""The one model of a scheduled campaign (mailflow.sources.scheduled.definition): every refused input
names its field exactly; spec files are read strictly; stored rows are re-checked by the same rules;
the lifecycle file refuses the reserved name and misspelled keys."""

from __future__ import annotations

import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from mailflow.campaigns import CAMPAIGNS_DIR, CampaignFileError, load_campaigns
from mailflow.sources.scheduled.definition import (
    CampaignDefinitionError,
    check_stored,
    parse_definition,
)
from mailflow.sources.scheduled.spec import canary_fields, load_spec

BASE: dict[str, Any] = {"name": "spring_outreach", "template": "outreach", "subject": "Hi {{ user.first_name }}",
                        "from": "Outreach <outreach@mail.example.com>", "recipients_sql": "free_plan_users"}


def refused(**changes: Any) -> CampaignDefinitionError:
    spec = {k: v for k, v in (BASE | changes).items() if v is not None}
    with pytest.raises(CampaignDefinitionError) as info:
        parse_definition(spec)
    return info.value


@pytest.mark.parametrize(("changes", "field", "reason"), [
    ({"emails_per_dya": 30}, "emails_per_dya", "unknown key (a typo?)"),
    ({"from": "not-an-address"}, "from", "'not-an-address' is not a valid address"),
    ({"from": "Outreach <outreach@mail.example.com"}, "from", "is not one email address"),
    ({"from": "Team\r\nBcc: x@evil.com <team@example.com>"}, "from", "contains a control character"),
    ({"from": "a@example.com, b@example.com"}, "from", "is not one email address"),
    ({"from": "team@example.com>"}, "from", "is not one email address"),
    ({"from": "Team <team@example.com> garbage"}, "from", "is not one email address"),
    ({"reply_to": "x@example.com; y@example.com"}, "reply_to", "is not one email address"),
    ({"start_at": "9999-12-31T23:59:59+00:00"}, "start_at", "is after 2200: a typo?"),
    ({"reply_to": "support@"}, "reply_to", "reply_to 'support@' is not"),
    ({"reply_to": "Support <support at example.com>"}, "reply_to", "reply_to 'Support <support at example.com>'"),
    ({"timezone": "Mars/Olympus"}, "timezone", "unknown IANA timezone 'Mars/Olympus'"),
    ({"windows": ["25:00-26:00"]}, "windows", "invalid window '25:00-26:00': not a valid time of day"),
    ({"windows": ["17:00-09:00"]}, "windows", "window '17:00-09:00' ends before it starts: if it runs overnight "
                                              "into the next day, write '17:00-09:00+1'"),
    ({"windows": ["09:00-17:00+1"]}, "windows", "+1 says it ends the next day"),
    ({"windows": ["09:00-12:00", "11:00-13:00"]}, "windows", "windows 09:00-12:00 and 11:00-13:00 overlap"),
    ({"windows": ["23:00-01:00+1", "00:30-09:00"]}, "windows", "(the first runs past midnight"),
    ({"name": "all"}, "name", "'all' is reserved"),
    ({"name": "Spring Outreach"}, "name", "String should match pattern"),
    ({"holidays": "XX"}, "holidays", "unknown holiday country 'XX'"),
    ({"holidays": "DE-XX"}, "holidays", "unknown holiday region 'DE-XX': DE has the subdivisions BB, BE,"),
    ({"emails_per_day": "20"}, "emails_per_day", "Input should be a valid integer"),
    ({"weekdays": [1, 8]}, "weekdays", "ISO weekday numbers are 1..7 (1 = Monday), got [8]"),
    ({"start_at": datetime(2026, 12, 7, 9)}, "start_at", "must carry a UTC offset"),
    ({"on_policy": "later"}, "on_policy", "Input should be 'defer', 'skip' or 'ignore'"),
    ({"canary_share": 1.5}, "canary_share", "Input should be less than 1"),
    ({"canary_max_wait_minutes": 30.0}, "canary_max_wait_minutes", "needs a canary_share"),
    ({"recipients_sql": None}, "recipients_sql", "give exactly one of recipients_sql, recipients_table, "
                                                 "recipients_csv (got none)"),
])
def test_each_refused_input_names_its_field(changes: dict[str, Any], field: str, reason: str) -> None:
    err = refused(**changes)
    assert err.fields == [field]
    assert reason in err.errors[0][1]
    assert str(err).startswith("campaign ")
    assert f"{field}: " in str(err)


def test_two_recipient_sources_name_both() -> None:
    err = refused(recipients_table="mail.campaign_recipient")
    assert err.fields == ["recipients_sql", "recipients_table"]
    assert err.errors[0][1] == ("give exactly one of recipients_sql, recipients_table, recipients_csv "
                                "(got recipients_sql, recipients_table)")


def test_every_refused_field_is_reported_at_once() -> None:
    err = refused(**{"from": "not-an-address", "timezone": "Mars/Olympus", "emails_per_dya": 3})
    assert sorted(err.fields) == ["emails_per_dya", "from", "timezone"]
    assert str(err).startswith("campaign 'spring_outreach' refused: ")


def test_an_overnight_window_needs_plus_one_and_is_stored_in_one_spelling() -> None:
    d = parse_definition(BASE | {"windows": ["17:00-09:00+1"], "weekdays": [1, 2, 3]})
    assert d.windows == ["17:00-09:00+1"]
    assert [str(w) for w in d.plan_spec().windows] == ["17:00-09:00+1"]
    # midnight needs no +1, written 24:00 or 00:00
    assert parse_definition(BASE | {"windows": ["20:00-00:00"]}).windows == ["20:00-24:00"]
    assert parse_definition(BASE | {"windows": [" 09:00-12:00 ", "22:00-24:00"]}).windows == ["09:00-12:00",
                                                                                           "22:00-24:00"]


def test_holidays_code_is_normalised_and_reaches_the_plan() -> None:
    d = parse_definition(BASE | {"holidays": "de-by"})
    assert d.holidays == "DE-BY"
    assert d.plan_spec().holidays == "DE-BY"
    assert parse_definition(BASE | {"holidays": ""}).holidays is None


def test_canary_fields_come_from_the_model() -> None:
    plain = canary_fields(parse_definition(BASE))
    assert (plain["canary_share"], plain["canary_min_outcome_share"], plain["canary_max_wait"].total_seconds()) == \
        (None, 0.9, 3600.0)
    c = canary_fields(parse_definition(BASE | {"canary_share": 0.05, "canary_min_outcome_share": 0.5,
                                               "canary_max_wait_minutes": 15}))
    assert (c["canary_share"], c["canary_min_outcome_share"], c["canary_max_wait"].total_seconds()) == (0.05, 0.5, 900.0)


# -- spec files ---------------------------------------------------------------------------------------


def test_a_toml_spec_with_a_typo_is_refused_naming_file_and_field(tmp_path: Path) -> None:
    f = tmp_path / "spring.toml"
    f.write_text('name = "spring_outreach"\ntemplate = "outreach"\nsubject = "Hi"\n'
                 'from = "outreach@mail.example.com"\nrecipients_sql = "free_plan_users"\nemails_per_dya = 30\n')
    with pytest.raises(CampaignDefinitionError) as info:
        load_spec(f)
    assert info.value.fields == ["emails_per_dya"]
    assert str(info.value).startswith(f"{f}: campaign 'spring_outreach' refused: emails_per_dya: unknown key")


def test_a_json_spec_with_a_key_twice_or_not_a_table_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "spring.json"
    f.write_text('{"name": "a", "name": "b"}')
    with pytest.raises(ValueError, match=r"spring\.json: key 'name' is given twice"):
        load_spec(f)
    f.write_text('["name"]')
    with pytest.raises(CampaignDefinitionError, match=r"spring\.json: campaign '\?' refused: \(definition\): "
                                                      r"expected a table of keys, got list"):
        load_spec(f)
    f.write_text('{"name": ')
    with pytest.raises(ValueError, match=r"spring\.json: not valid JSON"):
        load_spec(f)


def test_a_valid_toml_spec_loads_as_its_keys(tmp_path: Path) -> None:
    f = tmp_path / "spring.toml"
    f.write_text('name = "spring_outreach"\ntemplate = "outreach"\nsubject = "Hi"\nfrom = "o@mail.example.com"\n'
                 'recipients_sql = "free_plan_users"\nwindows = ["21:00-01:00+1"]\nholidays = "DE-BE"\n'
                 'start_at = 2026-12-07T09:00:00+01:00\n')
    spec = load_spec(f)
    assert spec["windows"] == ["21:00-01:00+1"] and spec["holidays"] == "DE-BE"
    assert parse_definition(spec).start_at == datetime(2026, 12, 7, 8, tzinfo=UTC)


# -- stored rows, re-checked at provisioning ----------------------------------------------------------


def _row(**changes: Any) -> dict[str, Any]:
    return {"name": "old_outreach", "from_address": "o@mail.example.com", "reply_to": None,
            "timezone": "Europe/Berlin", "weekdays": [1, 2, 3, 4, 5], "windows": ["09:00-12:00"],
            "holidays": None} | changes


@pytest.mark.parametrize(("changes", "field"), [
    ({"from_address": "not-an-address"}, "from"),
    ({"reply_to": "nobody@"}, "reply_to"),
    ({"timezone": "Mars/Olympus"}, "timezone"),
    ({"windows": ["17:00-09:00"]}, "windows"),
    ({"windows": ["09:00-12:00", "11:00-13:00"]}, "windows"),
    ({"holidays": "XX"}, "holidays"),
    ({"weekdays": [0]}, "weekdays"),
    ({"name": "all"}, "name"),
])
def test_a_stored_row_is_checked_by_the_same_rules(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(CampaignDefinitionError) as info:
        check_stored(_row(**changes))
    assert info.value.fields == [field]
    assert str(info.value).startswith("mail.campaign: campaign ")


def test_a_valid_stored_row_passes() -> None:
    check_stored(_row(windows=["09:00-12:00", "23:00-01:00+1"], holidays="DE-BY", reply_to="Help <h@example.com>"))


# -- the lifecycle file: the same reserved name, strict keys ------------------------------------------


def _lifecycle(tmp_path: Path, old: str, new: str) -> Path:
    folder = tmp_path / "campaigns"
    shutil.copytree(CAMPAIGNS_DIR, folder)
    toml = folder / "lifecycle.toml"
    text = toml.read_text(encoding="utf-8")
    assert old in text
    toml.write_text(text.replace(old, new, 1), encoding="utf-8")
    return toml


def test_a_lifecycle_campaign_named_all_is_refused(tmp_path: Path) -> None:
    toml = _lifecycle(tmp_path, 'name = "first_practice"', 'name = "all"')
    with pytest.raises(CampaignFileError) as info:
        load_campaigns(toml)
    assert info.value.field == "name"
    assert "campaign 'all': the name 'all' is reserved" in str(info.value)


def test_a_misspelled_lifecycle_key_is_refused(tmp_path: Path) -> None:
    toml = _lifecycle(tmp_path, 'name = "first_practice"\n', 'name = "first_practice"\naudiance_window = "P1D"\n')
    with pytest.raises(CampaignFileError) as info:
        load_campaigns(toml)
    assert info.value.field == "audiance_window"
    assert "campaign 'first_practice': unknown key 'audiance_window'" in str(info.value)


@pytest.mark.parametrize("sender", ["a@example.com", "Team <team@example.com>", '"Doe, Jane" <jane@example.com>',
                                    "José <jose@exämple.com>"])
def test_one_mailbox_in_every_spelling_is_accepted(sender: str) -> None:
    assert parse_definition(BASE | {"from": sender}).from_address == sender
