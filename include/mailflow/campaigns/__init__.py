"""Campaign declarations: version-controlled TOML + audience SQL files + Jinja2 templates.

The one loader of campaign files. They live in a campaigns folder (:mod:`mailflow.campaigns.folder`:
``MAILFLOW_CAMPAIGNS_DIR``, else ``campaigns/`` in the DAG bundle, else the packaged examples).
``load_campaigns()`` reads its ``lifecycle.toml`` and returns the campaigns sorted by priority
(1 = highest), each with the hash of its content. Validation is strict (an unknown key is an
error) and every error names the file and the field (:class:`CampaignFileError`).
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from mailflow.campaigns.folder import EXAMPLES_DIR, CampaignFileError, CampaignFolder, hash_content
from mailflow.campaigns.templating import check_campaign_templates
from mailflow.model.holdout import check_share
from mailflow.model.outcome import DataInterval, as_timedelta
from mailflow.model.policy import Cap, ContactPolicy, policy_from_mapping

__all__ = ["CAMPAIGNS_DIR", "EXAMPLES_DIR", "RESERVED_NAMES", "Campaign", "CampaignFileError", "CampaignFolder", "check_templates", "declared_names",
           "load_campaigns", "load_policy", "scheduled_content_hash"]

CAMPAIGNS_DIR = EXAMPLES_DIR
"""The packaged examples (tests and the demo copy from it); the sending code resolves a folder."""

_REQUIRED = ("name", "priority", "audience", "template", "subject")
#: every key a ``[[campaign]]`` may set, and its type (strict: any other key is an error)
_CAMPAIGN_KEYS: dict[str, type | tuple[type, ...]] = {
    "name": str, "priority": int, "audience": str, "template": str, "subject": str, "from": str,
    "reply_to": str, "audience_window": str, "marketing": bool, "max_interval_age": str, "policy": str,
    "holdout_share": (int, float)}
#: ``[defaults]`` holds any campaign key but name and priority, plus the policy's fallback cooldown
_DEFAULT_KEYS = {k: v for k, v in _CAMPAIGN_KEYS.items() if k not in ("name", "priority")} | {"cooldown": str}
_TOP_KEYS = ("policy", "defaults", "campaign")
#: names no campaign may take (``all`` means every campaign in the CLI, the DAG forms and reports);
#: the scheduled definition model reserves the same (mailflow.sources.scheduled.definition)
RESERVED_NAMES = frozenset({"all"})
_POLICY_KEYS = ("cooldown", "caps")


@dataclass(frozen=True)
class Campaign:
    """One lifecycle campaign.

    :ivar priority: 1 is the highest; campaigns run in ascending priority and a minted row excludes
        the user from every later campaign of the run (cooldown).
    :ivar audience_sql: the campaign's own rule (SQL text, ``%(window_start)s``/``%(window_end)s``).
    :ivar cooldown: nobody with a live or sent email (any campaign) within this span is selected
        (the contact policy's cooldown, ``[policy] cooldown``).
    :ivar caps: the contact policy's frequency caps (``[policy] caps``), see :mod:`mailflow.store.policy`.
    :ivar exempt: transactional mail (``policy = "exempt"``): not held back by the cooldown or caps
        (its emails still count as contacts for every other campaign).
    :ivar audience_window: the audience looks at ``[interval.end - audience_window, interval.end)``.
    :ivar content_hash: see the field.
    :ivar max_interval_age: a run whose data interval ended longer ago than this (a backfill of an
        old interval) sends nothing for this campaign unless the run allows old intervals: its
        moment has passed (default 6 hours).
    :ivar holdout_share: share [0, 1) of the audience held out as a control group (``holdout_share``,
        default 0: nobody): the users :func:`mailflow.model.holdout.in_holdout` selects get a
        ``holdout`` row at mint instead of an email (docs/model.md, "Holdout groups").
    """

    name: str
    priority: int
    audience_sql: str
    template: str
    subject: str
    from_address: str
    reply_to: str | None
    cooldown: timedelta
    audience_window: timedelta
    marketing: bool = True
    max_interval_age: timedelta = timedelta(hours=6)
    caps: tuple[Cap, ...] = ()
    exempt: bool = False
    holdout_share: float = 0.0
    content_hash: str | None = None
    """16 hex of sha256 over the campaign's definition (its ``[[campaign]]`` table with the
    ``[defaults]`` it takes), its audience SQL and the templates it renders (layouts included);
    recorded on every batch (``mail.send_batch.campaign_content_hash``). None: not from files."""

    @property
    def contact_policy(self) -> ContactPolicy:
        """The contact policy this campaign's emails are checked against."""
        return ContactPolicy(cooldown=self.cooldown, caps=self.caps)

    def window(self, interval: DataInterval) -> tuple:
        """Return ``(window_start, window_end)`` (aware, UTC) for a run's data interval."""
        width = max(self.audience_window, interval.end - interval.start)
        return interval.end - width, interval.end


def _where(path: Path | str | os.PathLike[str] | None, folder: CampaignFolder | None) -> tuple[Path, CampaignFolder]:
    """The lifecycle file and its folder: ``path`` (its folder is its parent) or ``folder`` or the
    resolved folder."""
    if path is not None:
        path = Path(path)
        return path, CampaignFolder(path.parent.resolve())
    folder = folder or CampaignFolder.resolve()
    return folder.lifecycle_file, folder


def _read(path: Path) -> dict[str, Any]:
    """The TOML document of ``path``, its top-level and ``[policy]`` keys checked.

    :raises CampaignFileError: for a missing file, invalid TOML (with line and column) or an unknown key.
    """
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CampaignFileError(path, None, "file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise CampaignFileError(path, None, f"not valid TOML: {exc}") from None
    _unknown(path, doc, _TOP_KEYS, "top level")
    for section in ("policy", "defaults"):
        if not isinstance(doc.get(section, {}), Mapping):
            raise CampaignFileError(path, section, f"[{section}] must be a table")
    _unknown(path, doc.get("policy", {}), _POLICY_KEYS, "[policy]")
    for i, cap in enumerate(doc.get("policy", {}).get("caps", ())):
        if isinstance(cap, Mapping):
            _unknown(path, cap, ("emails", "per"), f"[policy] caps[{i}]")
    campaigns = doc.get("campaign", [])
    if not isinstance(campaigns, list) or not all(isinstance(c, Mapping) for c in campaigns):
        raise CampaignFileError(path, "campaign", "campaign must be an array of tables ([[campaign]])")
    return doc


def _unknown(path: Path, table: Mapping[str, Any], known: Any, where: str) -> None:
    for key in table:
        if key not in known:
            raise CampaignFileError(path, str(key), f"{where}: unknown key {key!r} (known: {', '.join(sorted(known))})")


def _typed(path: Path, table: Mapping[str, Any], types: Mapping[str, Any], where: str) -> None:
    for key, value in table.items():
        want = types.get(key)
        if want is None:
            continue
        ok = isinstance(value, want) and not (want is int and isinstance(value, bool))
        if not ok:
            name = want.__name__ if isinstance(want, type) else "/".join(t.__name__ for t in want)
            raise CampaignFileError(path, key, f"{where}: {key} must be a {name}, got {value!r}")


def declared_names(path: Path | None = None, *, folder: CampaignFolder | None = None) -> list[str]:
    """Names of the campaigns declared in ``lifecycle.toml`` (of ``folder``, or ``path``), in file order.

    Cheap (one TOML read, no database, no audience or template checks). Full validation is
    :func:`load_campaigns`. A file without names gives ``[]``.

    :raises CampaignFileError: if the file is missing or not valid TOML.
    """
    path, _ = _where(path, folder)
    doc = _read(path)
    return [str(c["name"]) for c in doc.get("campaign", []) if "name" in c]


def load_policy(path: Path | None = None, *, folder: CampaignFolder | None = None) -> ContactPolicy:
    """The policy of ``lifecycle.toml`` (of ``folder``, or ``path``): its ``[policy]`` section, the
    cooldown falling back to ``[defaults].cooldown`` (then 7 days).

    :raises CampaignFileError: for a bad entry (naming the file and the entry).
    """
    path, _ = _where(path, folder)
    return _policy(path, _read(path))


def _policy(path: Path, doc: Mapping[str, Any]) -> ContactPolicy:
    default = str(doc.get("defaults", {}).get("cooldown", "P7D"))
    try:
        return policy_from_mapping(doc.get("policy", {}), default_cooldown=default, label="[policy]")
    except ValueError as exc:
        raise CampaignFileError(path, "policy", str(exc)) from None


def load_campaigns(path: Path | None = None, only: list[str] | None = None, *,
                   folder: CampaignFolder | None = None) -> list[Campaign]:
    """Load and validate the lifecycle campaigns, sorted by priority, each with its content hash.

    Reads the files on every call (no cache outlives it): an edit is seen by the next call.

    :param path: a ``lifecycle.toml`` (its folder holds the audiences and templates); default: the
        one of ``folder``, default :meth:`CampaignFolder.resolve`.
    :param only: keep just these campaign names (a DAG Param); unknown names raise.
    :raises CampaignFileError: (a ValueError) naming the file and the field for invalid TOML, an
        unknown key, a value of the wrong type, a missing field, a reserved name (``all``), a
        duplicate name or priority, a
        bad duration, a missing audience or template file, or a subject or template that is not
        valid Jinja or tries to leave the sandbox (:mod:`mailflow.campaigns.templating`).
    :raises ValueError: for a name in ``only`` that is not declared.
    """
    path, folder = _where(path, folder)
    doc = _read(path)
    defaults = doc.get("defaults", {})
    _unknown(path, defaults, _DEFAULT_KEYS, "[defaults]")
    _typed(path, defaults, _DEFAULT_KEYS, "[defaults]")
    policy = _policy(path, doc)
    out: list[Campaign] = []
    for i, raw in enumerate(doc.get("campaign", [])):
        merged = {**defaults, **raw}
        label = merged.get("name", f"campaign #{i + 1}")
        where = f"campaign {label!r}"
        if "cooldown" in raw:
            raise CampaignFileError(path, "cooldown", f"{where}: the cooldown is set once for every campaign, "
                                    f"in [policy] (a transactional campaign sets policy = \"exempt\")")
        _unknown(path, raw, _CAMPAIGN_KEYS, where)
        _typed(path, raw, _CAMPAIGN_KEYS, where)
        if raw.get("name") in RESERVED_NAMES:
            raise CampaignFileError(path, "name", f"{where}: the name {raw['name']!r} is reserved (it means every "
                                    f"campaign); choose another")
        missing = [k for k in (*_REQUIRED, "from") if k not in merged]
        if missing:
            raise CampaignFileError(path, missing[0], f"{where} lacks {', '.join(missing)}")
        audience = folder.root / merged["audience"]
        if not audience.is_file():
            raise CampaignFileError(path, "audience", f"{where}: audience = {merged['audience']!r}: "
                                    f"file {audience} not found")
        for suffix in (".html.j2", ".txt.j2"):
            t = folder.template_file(merged["template"], suffix)
            if not t.is_file():
                raise CampaignFileError(path, "template", f"{where}: template = {merged['template']!r}: "
                                        f"file {t} not found")
        try:  # subject and templates render in the sandbox: refuse one that tries to leave it now
            check_campaign_templates(str(label), str(merged["subject"]), str(merged["template"]), folder.templates_dir)
        except ValueError as exc:
            field = "subject" if "subject" in str(exc).split(":", 2)[1] else "template"
            raise CampaignFileError(path, field, str(exc)) from None
        if merged.get("policy", "apply") not in ("apply", "exempt"):
            raise CampaignFileError(path, "policy", f"{where}: policy must be \"apply\" or \"exempt\", "
                                    f"got {merged.get('policy')!r}")
        durations = {}
        for key, default in (("audience_window", "PT1H"), ("max_interval_age", "PT6H")):
            try:
                durations[key] = as_timedelta(merged.get(key, default))
            except ValueError as exc:
                raise CampaignFileError(path, key, f"{where}: {key}: {exc}") from None
        try:
            holdout_share = check_share(merged.get("holdout_share", 0), f"{where}: holdout_share")
        except ValueError as exc:
            raise CampaignFileError(path, "holdout_share", str(exc)) from None
        audience_sql = audience.read_text(encoding="utf-8")
        files = {folder.relative(audience): audience_sql, **folder.template_sources(str(merged["template"]))}
        out.append(
            Campaign(
                name=str(merged["name"]),
                priority=int(merged["priority"]),
                audience_sql=audience_sql.strip().rstrip(";"),
                template=str(merged["template"]),
                subject=str(merged["subject"]),
                from_address=str(merged["from"]),
                reply_to=merged.get("reply_to"),
                cooldown=policy.cooldown,
                audience_window=durations["audience_window"],
                marketing=bool(merged.get("marketing", True)),
                max_interval_age=durations["max_interval_age"],
                caps=policy.caps,
                exempt=merged.get("policy", "apply") == "exempt",
                holdout_share=holdout_share,
                content_hash=hash_content(merged, files),
            )
        )
    names = [c.name for c in out]
    for label, values in (("name", names), ("priority", [str(c.priority) for c in out])):
        dup = {v for v in values if values.count(v) > 1}
        if dup:
            raise CampaignFileError(path, label, f"duplicate campaign {label}: {sorted(dup)}")
    if only:
        unknown = sorted(set(only) - set(names))
        if unknown:
            raise ValueError(f"unknown campaign(s) {unknown}; declared: {names}")
        out = [c for c in out if c.name in only]
    return sorted(out, key=lambda c: c.priority)


def check_templates(folder: CampaignFolder | None = None) -> list[str]:
    """Check every campaign template of the folder (``templates/<name>.html.j2`` and ``.txt.j2``,
    with the layouts they use) in the sandbox, as a scheduled campaign's would be at dispatch;
    return their names.

    :raises CampaignFileError: naming the file and the field ``template`` for a missing half, a
        syntax error or a template that tries to leave the sandbox.
    """
    folder = folder or CampaignFolder.resolve()
    names = list(folder.template_names())
    for name in names:
        folder.check_template_files(name, f"template {name}")
        try:
            check_campaign_templates(f"template {name}", "", name, folder.templates_dir)
        except ValueError as exc:
            raise CampaignFileError(folder.template_file(name, ".html.j2"), "template", str(exc)) from None
    return names


def scheduled_content_hash(row: Mapping[str, Any], folder: CampaignFolder) -> str:
    """The content hash of a scheduled campaign (a ``mail.campaign`` row): its definition (name,
    template, subject, sender, reply-to, marketing, recipient source), its recipients SQL file if it
    has one, and the templates it renders from the campaigns folder, as they are now (the hash of
    the batches a dispatch run renders).
    """
    definition = {k: row.get(k) for k in ("name", "template", "subject", "from_address", "reply_to", "marketing",
                                          "recipients_sql", "recipients_table")}
    files = folder.template_sources(str(row["template"]))
    if row.get("recipients_sql"):
        try:
            f = folder.recipients_file(str(row["recipients_sql"]), str(row["name"]))
            files[folder.relative(f)] = f.read_text(encoding="utf-8")
        except CampaignFileError:
            pass  # provisioning reports the missing file; the rows exist already
    return hash_content(definition, files)
