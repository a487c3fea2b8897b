"""Campaign specs: read a TOML/JSON spec, validate it, create the ``draft`` campaign, upload a
CSV recipient list (COPY), resolve a campaign by id or name."""

from __future__ import annotations

import csv
import json
import re
import tomllib
from collections.abc import Mapping
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg

from mailflow.campaigns import CampaignFolder
from mailflow.campaigns.templating import check_campaign_templates
from mailflow.model.holdout import check_share
from mailflow.sources.scheduled.campaign_db import record_event
from mailflow.sources.scheduled.planning import PlanSpec
from mailflow.store.policy import ON_POLICY
from mailflow.store.scheduled import ScheduledStore

_NAME = re.compile(r"^[a-z0-9_]{1,64}$")
TABLE_NAME = re.compile(r"^(?:([a-z_][a-z0-9_]*)\.)?([a-z_][a-z0-9_]*)$")


def resolve_campaign(conn: psycopg.Connection, ref: str | int) -> int:
    """A campaign id from an id or a name (CLI arguments).

    :raises LookupError: if no campaign has that name.
    """
    if isinstance(ref, int) or str(ref).isdigit():
        return int(ref)
    with conn.transaction():
        found = ScheduledStore(conn).campaign_id_by_name(str(ref))
    if found is None:
        raise LookupError(f"no campaign named {ref!r}")
    return found


def check_templates(template: str, label: str, folder: CampaignFolder | None = None) -> None:
    """Both files of ``template`` exist in the campaigns folder (default: the resolved one).

    :raises mailflow.campaigns.CampaignFileError: (a ValueError) naming the file and the campaign.
    """
    (folder or CampaignFolder.resolve()).check_template_files(template, label)


def recipients_file(name: str, label: str, folder: CampaignFolder | None = None) -> Path:
    """The recipients SQL file ``name`` of the campaigns folder (default: the resolved one).

    :raises mailflow.campaigns.CampaignFileError: (a ValueError) naming the file and the campaign.
    """
    return (folder or CampaignFolder.resolve()).recipients_file(name, label)


def load_spec(path: Path) -> dict[str, Any]:
    """Read a campaign spec from a ``.toml`` or ``.json`` file (keys: see :func:`create_campaign`).

    :raises ValueError: for another file type.
    """
    text = Path(path).read_text(encoding="utf-8")
    if str(path).endswith(".toml"):
        return dict(tomllib.loads(text))
    if str(path).endswith(".json"):
        return dict(json.loads(text))
    raise ValueError(f"campaign spec must be a .toml or .json file, got {path}")


def create_campaign(conn: psycopg.Connection, spec: Mapping[str, Any], *, actor: str | None = None,
                    base_dir: Path | None = None, folder: CampaignFolder | None = None) -> int:
    """Create a ``draft`` campaign from a spec mapping; return its id.

    Keys: ``name`` (``[a-z0-9_]``, = the send log's campaign), ``template``, ``subject`` (Jinja over
    ``user``), ``from``, optional ``reply_to``, ``timezone`` (IANA, default Europe/Berlin),
    ``emails_per_day`` (20), ``weekdays`` (ISO, [1..5]), ``windows`` (["09:00-12:00",
    "14:00-17:00"], local), ``start_at`` (aware datetime or ISO text; default now), ``marketing``
    (true), ``on_policy`` (``defer``: a due email the contact policy holds back moves to the first
    planned slot after the window; ``skip``: it becomes ``skipped`` with the reason; ``ignore``: it
    is sent anyway, for transactional mail; default defer), optionally a canary: ``canary_share`` (a
    fraction in (0, 1): that share of the rows, the first in plan order, is sent first and the rest is
    held until its outcomes are in), ``canary_min_outcome_share`` ((0, 1], default 0.9: the share of
    the canary's sent emails that must have an outcome) and ``canary_max_wait_minutes`` (> 0, default
    60: release anyway this long after the canary's last send; docs/operations.md, "Reputation
    guard"), and exactly one recipient source: ``recipients_sql`` (a file name in
    ``campaigns/recipients/``), ``recipients_table`` (``schema.table`` with user_id, email,
    first_name columns) or ``recipients_csv`` (a CSV file with user_id, email, first_name and any
    extra columns, uploaded into ``mail.campaign_recipient``; relative to ``base_dir``).
    Templates and recipients files come from ``folder`` (default: the resolved campaigns folder).

    :raises ValueError: naming the campaign and the field for anything invalid, including a subject
        or template that is not valid Jinja or tries to leave the sandbox (it is refused, never run).
    """
    label = str(spec.get("name", "?"))
    if not _NAME.match(label):
        raise ValueError(f"campaign name {label!r} must be 1-64 of [a-z0-9_]")
    missing = [k for k in ("template", "subject", "from") if not spec.get(k)]
    if missing:
        raise ValueError(f"campaign {label!r} lacks {', '.join(missing)}")
    sources = [k for k in ("recipients_sql", "recipients_table", "recipients_csv") if spec.get(k)]
    if len(sources) != 1:
        raise ValueError(f"campaign {label!r}: give exactly one of recipients_sql, recipients_table, "
                         f"recipients_csv (got {sources or 'none'})")
    plan = PlanSpec(timezone=str(spec.get("timezone", "Europe/Berlin")),
                    emails_per_day=int(spec.get("emails_per_day", 20)),
                    weekdays=frozenset(int(d) for d in spec.get("weekdays", (1, 2, 3, 4, 5))),
                    windows=tuple(spec.get("windows", ("09:00-12:00", "14:00-17:00"))))
    folder = folder or CampaignFolder.resolve()
    check_templates(str(spec["template"]), label, folder)
    # subject and templates render in the sandbox: refuse one that tries to leave it here, not at send
    check_campaign_templates(label, str(spec["subject"]), str(spec["template"]), folder.templates_dir)
    start_at = spec.get("start_at")
    if isinstance(start_at, str):
        start_at = datetime.fromisoformat(start_at)
    if start_at is not None and (not isinstance(start_at, datetime) or start_at.tzinfo is None):
        raise ValueError(f"campaign {label!r}: start_at must be an aware datetime (with an offset), got {start_at!r}")
    on_policy = str(spec.get("on_policy", "defer"))
    if on_policy not in ON_POLICY:
        raise ValueError(f"campaign {label!r}: on_policy must be one of {', '.join(ON_POLICY)}, got {on_policy!r}")
    canary = canary_fields(spec, label)
    recipients_sql = recipients_table = None
    if spec.get("recipients_sql"):
        recipients_sql = recipients_file(str(spec["recipients_sql"]), label, folder).stem
    elif spec.get("recipients_table"):
        recipients_table = str(spec["recipients_table"])
        if not TABLE_NAME.match(recipients_table):
            raise ValueError(f"campaign {label!r}: recipients_table {recipients_table!r} is not a table name")
    else:
        recipients_table = "mail.campaign_recipient"
    with conn.transaction():
        campaign_id = ScheduledStore(conn).insert_campaign({
            "name": label, "timezone": plan.timezone, "emails_per_day": plan.emails_per_day,
            "weekdays": sorted(plan.weekdays), "windows": [str(w) for w in plan.windows], "start_at": start_at,
            "template": str(spec["template"]), "subject": str(spec["subject"]), "from_address": str(spec["from"]),
            "reply_to": spec.get("reply_to"), "recipients_sql": recipients_sql,
            "recipients_table": recipients_table, "marketing": bool(spec.get("marketing", True)),
            "on_policy": on_policy, **canary,
            "holdout_share": check_share(spec.get("holdout_share", 0.0), f"campaign {label!r}: holdout_share"),
        })
        record_event(conn, campaign_id, None, "draft", actor, spec={k: str(v) for k, v in spec.items()})
        if spec.get("recipients_csv"):
            path = Path(str(spec["recipients_csv"]))
            if not path.is_absolute() and base_dir is not None:
                path = base_dir / path
            upload_recipients(conn, campaign_id, path)
    return campaign_id


def canary_fields(spec: Mapping[str, Any], label: str) -> dict[str, Any]:
    """The ``campaign_insert`` canary parameters of a spec: ``canary_share`` (None: no canary),
    ``canary_min_outcome_share`` (default 0.9), ``canary_max_wait`` (a timedelta; default 60 minutes).

    :raises ValueError: naming the campaign and the field, for a value that is not a number in range,
        or canary parameters without a ``canary_share``.
    """
    def number(key: str, default: float | None) -> float | None:
        raw = spec.get(key)
        if raw is None:
            return default
        if isinstance(raw, bool):
            raise ValueError(f"campaign {label!r}: {key} must be a number, got {raw!r}")
        try:
            return float(raw)
        except (TypeError, ValueError):
            raise ValueError(f"campaign {label!r}: {key} must be a number, got {raw!r}") from None

    share = number("canary_share", None)
    min_share = number("canary_min_outcome_share", 0.9)
    wait = number("canary_max_wait_minutes", 60.0)
    assert min_share is not None and wait is not None
    if share is None and any(spec.get(k) is not None for k in ("canary_min_outcome_share", "canary_max_wait_minutes")):
        raise ValueError(f"campaign {label!r}: canary_min_outcome_share and canary_max_wait_minutes need a canary_share")
    if share is not None and not 0 < share < 1:
        raise ValueError(f"campaign {label!r}: canary_share must be a fraction between 0 and 1 (e.g. 0.05 for the "
                         f"first 5%), got {share!r}")
    if not 0 < min_share <= 1:
        raise ValueError(f"campaign {label!r}: canary_min_outcome_share must be in (0, 1], got {min_share!r}")
    if not wait > 0:
        raise ValueError(f"campaign {label!r}: canary_max_wait_minutes must be positive, got {wait!r}")
    return {"canary_share": share, "canary_min_outcome_share": min_share, "canary_max_wait": timedelta(minutes=wait)}


def upload_recipients(conn: psycopg.Connection, campaign_id: int, path: Path) -> int:
    """Load a CSV recipient list (header: user_id, email, first_name, extra columns -> ``context``)
    into ``mail.campaign_recipient`` with COPY; return the rows loaded.

    :raises ValueError: if a required column is missing or a user_id is not an integer.
    """
    with open(path, newline="", encoding="utf-8") as fh, conn.transaction():
        reader = csv.DictReader(fh)
        cols = set(reader.fieldnames or ())
        if not {"user_id", "email"} <= cols:
            raise ValueError(f"{path}: the header needs user_id and email columns, got {sorted(cols)}")
        n = 0
        with conn.cursor().copy("copy mail.campaign_recipient (campaign_id, user_id, email, first_name, context)"
                                " from stdin") as copy:
            for i, rec in enumerate(reader, start=2):
                try:
                    uid = int(rec.pop("user_id"))
                except (TypeError, ValueError):
                    raise ValueError(f"{path}:{i}: user_id is not an integer") from None
                email = rec.pop("email")
                first = rec.pop("first_name", None)
                copy.write_row((campaign_id, uid, email, first, json.dumps(rec)))
                n += 1
    return n
