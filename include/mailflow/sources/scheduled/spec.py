"""Campaign specs: read a TOML/JSON spec, validate it (:mod:`.definition`, the one model), create
the ``draft`` campaign or replace a draft's definition, upload a CSV recipient list (COPY), resolve
a campaign by id or name. A campaign name is unique across scheduled and lifecycle campaigns."""

from __future__ import annotations

import csv
import json
import re
import tomllib
from collections.abc import Mapping
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql as pgsql

from mailflow.campaigns import CampaignFolder, declared_names
from mailflow.campaigns.templating import check_campaign_templates
from mailflow.sources.scheduled.approval import void_open
from mailflow.sources.scheduled.campaign_db import CampaignStateError, lock_campaign, record_event
from mailflow.sources.scheduled.definition import (
    CampaignDefinition,
    CampaignDefinitionError,
    parse_definition,
)
from mailflow.store.scheduled import ScheduledStore

UPLOADED_LIST = "mail.campaign_recipient"
"""The recipients table of a campaign whose list was uploaded from a CSV file."""
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
    """Read and validate a campaign spec from a ``.toml`` or ``.json`` file (keys: see
    :class:`~mailflow.sources.scheduled.definition.CampaignDefinition`); return its keys as a dict
    (what :func:`create_campaign` takes). Strict: a key given twice (TOML or JSON), an unknown key, a
    top level that is not a table and every invalid value are refused here, naming the file.

    :raises ValueError: naming the file, for another file type or a file that is not valid TOML/JSON.
    :raises CampaignDefinitionError: (a ValueError) naming the file, the campaign and every refused field.
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    data: Any
    if path.suffix == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: not valid TOML: {exc}") from None
    elif path.suffix == ".json":
        try:
            data = json.loads(text, object_pairs_hook=_no_duplicate_keys)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON: {exc}") from None
        except _DuplicateKey as exc:
            raise ValueError(f"{path}: key {exc.args[0]!r} is given twice") from None
    else:
        raise ValueError(f"campaign spec must be a .toml or .json file, got {path}")
    parse_definition(data, source=str(path))
    return dict(data)


class _DuplicateKey(Exception):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def check_name_available(conn: psycopg.Connection, name: str, *, folder: CampaignFolder | None = None,
                         campaign_id: int | None = None) -> None:
    """Refuse a scheduled campaign name that is taken: campaign names are unique across both kinds
    (the send log's ``campaign`` is the key of the cooldown, the caps and every report). Taken means
    a lifecycle campaign of ``lifecycle.toml`` in ``folder`` (default: the resolved campaigns folder)
    has it, the send log has lifecycle rows under it, or another ``mail.campaign`` has it
    (``campaign_id``: the campaign being updated, which may keep its own name). ``all`` is reserved
    (the model refuses it). Runs in the caller's transaction.

    :raises CampaignDefinitionError: naming the field ``name`` and the reason.
    :raises mailflow.campaigns.CampaignFileError: if ``lifecycle.toml`` exists but cannot be read.
    """
    folder = folder or CampaignFolder.resolve()
    store = ScheduledStore(conn)
    reason = None
    if folder.lifecycle_file.is_file() and name in declared_names(folder=folder):
        reason = f"a lifecycle campaign in {folder.lifecycle_file} has this name (names are unique across both kinds)"
    elif store.lifecycle_name_used(name):
        reason = "the send log has lifecycle emails under this name (names are unique across both kinds)"
    elif (existing := store.campaign_id_by_name(name)) is not None and existing != campaign_id:
        reason = f"a scheduled campaign with this name exists (id {existing})"
    if reason:
        raise CampaignDefinitionError(name, [("name", reason)])


def create_campaign(conn: psycopg.Connection, spec: Mapping[str, Any] | CampaignDefinition, *,
                    actor: str | None = None, base_dir: Path | None = None,
                    folder: CampaignFolder | None = None) -> int:
    """Create a ``draft`` campaign from a definition (a spec mapping, validated by
    :func:`~mailflow.sources.scheduled.definition.parse_definition`, or a
    :class:`~mailflow.sources.scheduled.definition.CampaignDefinition`); return its id.

    Keys and their meaning: :class:`CampaignDefinition` (docs/operations.md, "Campaign spec keys").
    Besides the model's checks: the name must be free (:func:`check_name_available`), the template
    files must exist in ``folder`` (default: the resolved campaigns folder) and render in the
    sandbox (subject included: one that tries to leave it is refused, never run), a
    ``recipients_sql`` file must exist and its query (or the ``recipients_table``) must run and
    return ``user_id`` and ``email`` columns (planned with ``limit 0`` in a savepoint: no row is
    read), and a ``recipients_csv`` file (relative to ``base_dir``) must exist and load. The row, its
    ``draft`` event and an uploaded list are written in one transaction: a refusal writes nothing.

    :raises CampaignDefinitionError: (a ValueError) naming the campaign and the field (``name``,
        ``recipients_sql``, ``recipients_table``, ``recipients_csv`` or a model field).
    :raises mailflow.campaigns.CampaignFileError: (a ValueError) naming the missing template or
        recipients file and the field.
    :raises ValueError: for a subject or template that is not valid Jinja or leaves the sandbox, or
        a CSV file with a bad header or user_id.
    """
    definition, values, csv_path = _prepare(spec, base_dir, folder)
    folder = folder or CampaignFolder.resolve()
    with conn.transaction():
        check_name_available(conn, definition.name, folder=folder)
        try:
            with conn.transaction():
                campaign_id = ScheduledStore(conn).insert_campaign({"name": definition.name, **values})
        except psycopg.errors.UniqueViolation:  # created meanwhile by another session
            raise CampaignDefinitionError(definition.name, [("name", "a scheduled campaign with this name "
                                                                     "exists")]) from None
        _probe_recipients(conn, definition, values, campaign_id, folder)
        record_event(conn, campaign_id, None, "draft", actor, spec=definition.model_dump(mode="json", by_alias=True,
                                                                                          exclude_none=True))
        if csv_path is not None:
            upload_recipients(conn, campaign_id, csv_path)
    return campaign_id


def update_draft(conn: psycopg.Connection, name: str, spec: Mapping[str, Any] | CampaignDefinition, *,
                 actor: str | None = None, base_dir: Path | None = None,
                 folder: CampaignFolder | None = None) -> int:
    """Replace the definition of the ``draft`` campaign ``name`` (nothing has been provisioned for
    it yet); return its id. ``spec`` is a whole definition, checked as by :func:`create_campaign`;
    its ``name`` may be left out and may not differ (a draft keeps its name). An uploaded recipient
    list is replaced by the new definition's (dropped if it has none). In one transaction, with the
    campaign row locked: the new values and a ``draft -> draft`` campaign event recording the
    changed fields (``changed``: field -> [old, new]) and the new definition (``spec``).

    The draft's pending and approved (not yet used) approval requests are voided in the same
    transaction, with the campaign event ``approval_voided``
    (:func:`mailflow.sources.scheduled.approval.void_open`): what they approved is no longer what
    would be sent, so an answer that arrives later, or a provisioning under one of them, changes
    nothing. The update is not refused while an approval waits: the request dies instead.

    :raises LookupError: if no campaign has that name.
    :raises CampaignStateError: (a ValueError) naming the status if the campaign is not a draft.
    :raises CampaignDefinitionError: and the other errors of :func:`create_campaign`.
    """
    if not isinstance(spec, CampaignDefinition):
        spec = {"name": name, **spec}
    given = spec.name if isinstance(spec, CampaignDefinition) else str(spec.get("name"))
    if given != name:
        raise CampaignDefinitionError(name, [("name", f"a draft keeps its name; got {given!r} (create a new "
                                                      f"campaign for another name)")])
    definition, values, csv_path = _prepare(spec, base_dir, folder)
    folder = folder or CampaignFolder.resolve()
    store = ScheduledStore(conn)
    with conn.transaction():
        campaign_id = store.campaign_id_by_name(name)
        if campaign_id is None:
            raise LookupError(f"no campaign named {name!r}")
        old = lock_campaign(conn, campaign_id)
        if old["status"] != "draft":
            raise CampaignStateError(f"campaign {name!r} is {old['status']}: only a draft's definition can be "
                                     f"replaced (provisioning has started; pause or cancel it instead)")
        check_name_available(conn, name, folder=folder, campaign_id=campaign_id)
        if not store.update_definition(campaign_id, values):
            raise CampaignStateError(f"campaign {name!r} is no longer a draft")
        _probe_recipients(conn, definition, values, campaign_id, folder)
        store.clear_recipients(campaign_id)
        if csv_path is not None:
            upload_recipients(conn, campaign_id, csv_path)
        # start_at None: the new start is the update's time (as at create)
        changed = {k: [_plain(old.get(k)), _plain(v)] for k, v in values.items() if _plain(old.get(k)) != _plain(v)}
        record_event(conn, campaign_id, "draft", "draft", actor, reason="definition replaced", changed=changed,
                     spec=definition.model_dump(mode="json", by_alias=True, exclude_none=True))
        void_open(conn, campaign_id, actor=actor, cause="definition replaced")
    return campaign_id


def _plain(v: Any) -> Any:
    """A stored or new value as JSON (for the event's ``changed``): numbers as floats, instants as
    ISO-8601 UTC text."""
    if isinstance(v, Decimal):
        return float(v)
    if isinstance(v, datetime) and v.tzinfo is not None:
        return v.astimezone(UTC).isoformat()
    if isinstance(v, datetime | date):
        return v.isoformat()
    if isinstance(v, timedelta):
        return v.total_seconds() / 60  # canary_max_wait, in minutes as the definition has it
    if isinstance(v, list | tuple):
        return [_plain(x) for x in v]
    return v


def _prepare(spec: Mapping[str, Any] | CampaignDefinition, base_dir: Path | None,
             folder: CampaignFolder | None) -> tuple[CampaignDefinition, dict[str, Any], Path | None]:
    """Validate ``spec`` and the files it names; ``(definition, campaign_insert values without the
    name, CSV file or None)``. Nothing touches the database."""
    d = spec if isinstance(spec, CampaignDefinition) else parse_definition(spec)
    folder = folder or CampaignFolder.resolve()
    check_templates(d.template, d.name, folder)
    # subject and templates render in the sandbox: refuse one that tries to leave it here, not at send
    check_campaign_templates(d.name, d.subject, d.template, folder.templates_dir)
    recipients_sql = recipients_table = None
    csv_path = None
    if d.recipients_sql:
        recipients_sql = recipients_file(d.recipients_sql, d.name, folder).stem
    elif d.recipients_table:
        recipients_table = d.recipients_table
    else:
        csv_path = Path(str(d.recipients_csv))
        if not csv_path.is_absolute() and base_dir is not None:
            csv_path = base_dir / csv_path
        if not csv_path.is_file():
            raise CampaignDefinitionError(d.name, [("recipients_csv", f"file {csv_path} not found")])
        recipients_table = UPLOADED_LIST
    plan = d.plan_spec()
    values = {
        "timezone": d.timezone, "emails_per_day": d.emails_per_day, "weekdays": sorted(plan.weekdays),
        "windows": [str(w) for w in plan.windows], "holidays": d.holidays, "start_at": d.start_at,
        "template": d.template, "subject": d.subject, "from_address": d.from_address, "reply_to": d.reply_to,
        "recipients_sql": recipients_sql, "recipients_table": recipients_table, "marketing": d.marketing,
        "on_policy": d.on_policy, "holdout_share": d.holdout_share, **canary_fields(d),
    }
    return d, values, csv_path


def _probe_recipients(conn: psycopg.Connection, d: CampaignDefinition, values: Mapping[str, Any],
                      campaign_id: int, folder: CampaignFolder) -> None:
    """Run the campaign's recipient query with ``limit 0`` in a savepoint: it must plan and run and
    return ``user_id`` and ``email`` columns. An uploaded list (CSV) is checked by its upload.

    :raises CampaignDefinitionError: naming ``recipients_sql`` or ``recipients_table``.
    """
    source: pgsql.Composable
    if values["recipients_sql"]:
        field = "recipients_sql"
        text = recipients_file(str(values["recipients_sql"]), d.name, folder).read_text(encoding="utf-8")
        source = pgsql.SQL(text.strip().rstrip(";"))  # trusted: a version-controlled file
    elif d.recipients_table:
        field = "recipients_table"
        m = TABLE_NAME.match(d.recipients_table)
        assert m is not None  # the model's pattern
        source = pgsql.SQL("select * from {}").format(pgsql.Identifier(m.group(1) or "public", m.group(2)))
    else:
        return
    try:
        with conn.transaction():
            columns = ScheduledStore(conn).recipient_columns(source, d.name, campaign_id)
    except psycopg.Error as exc:
        reason = exc.diag.message_primary or str(exc).splitlines()[0]
        raise CampaignDefinitionError(d.name, [(field, f"the recipients query fails: {reason}")]) from None
    missing = [c for c in ("user_id", "email") if c not in columns]
    if missing:
        raise CampaignDefinitionError(d.name, [(field, f"the recipients have no {' or '.join(missing)} column "
                                                       f"(columns: {', '.join(columns) or 'none'})")])


def canary_fields(definition: CampaignDefinition) -> dict[str, Any]:
    """The ``campaign_insert`` canary parameters of a definition: ``canary_share`` (None: no
    canary), ``canary_min_outcome_share`` (default 0.9), ``canary_max_wait`` (a timedelta; default
    60 minutes). The ranges are the model's."""
    d = definition
    return {"canary_share": d.canary_share,
            "canary_min_outcome_share": 0.9 if d.canary_min_outcome_share is None else d.canary_min_outcome_share,
            "canary_max_wait": timedelta(minutes=60 if d.canary_max_wait_minutes is None else d.canary_max_wait_minutes)}


def upload_recipients(conn: psycopg.Connection, campaign_id: int, path: Path) -> int:
    """Load a CSV recipient list (header: user_id, email, first_name, extra columns -> ``context``)
    into ``mail.campaign_recipient`` with COPY; return the rows loaded.

    :raises ValueError: naming the file, ``recipients_csv`` and the line: a required column is missing,
        a user_id is not an integer or appears twice.
    """
    with open(path, newline="", encoding="utf-8") as fh, conn.transaction():
        reader = csv.DictReader(fh)
        cols = set(reader.fieldnames or ())
        if not {"user_id", "email"} <= cols:
            raise ValueError(f"recipients_csv {path}: the header needs user_id and email columns, got {sorted(cols)}")
        n = 0
        seen: set[int] = set()
        with conn.cursor().copy("copy mail.campaign_recipient (campaign_id, user_id, email, first_name, context)"
                                " from stdin") as copy:
            for i, rec in enumerate(reader, start=2):
                try:
                    uid = int(rec.pop("user_id"))
                except (TypeError, ValueError):
                    raise ValueError(f"recipients_csv {path}:{i}: user_id is not an integer") from None
                if uid in seen:
                    # one row per user and campaign (the table's key): refused here, naming both lines
                    raise ValueError(f"recipients_csv {path}:{i}: user_id {uid} is listed twice")
                seen.add(uid)
                email = rec.pop("email")
                first = rec.pop("first_name", None)
                copy.write_row((campaign_id, uid, email, first, json.dumps(rec)))
                n += 1
    return n
