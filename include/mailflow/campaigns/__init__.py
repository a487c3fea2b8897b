"""Campaign declarations: version-controlled TOML + audience SQL files + Jinja2 templates.

``load_campaigns()`` reads ``campaigns/lifecycle.toml`` (or another file) and returns the campaigns
sorted by priority (1 = highest). Validation errors name the campaign and the field.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from mailflow.campaigns.templating import check_campaign_templates
from mailflow.model.outcome import DataInterval, as_timedelta
from mailflow.model.policy import Cap, ContactPolicy, policy_from_mapping

CAMPAIGNS_DIR = Path(__file__).parent
_REQUIRED = ("name", "priority", "audience", "template", "subject")


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
    :ivar max_interval_age: a run whose data interval ended longer ago than this (a backfill of an
        old interval) sends nothing for this campaign unless the run allows old intervals: its
        moment has passed (default 6 hours).
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

    @property
    def contact_policy(self) -> ContactPolicy:
        """The contact policy this campaign's emails are checked against."""
        return ContactPolicy(cooldown=self.cooldown, caps=self.caps)

    def window(self, interval: DataInterval) -> tuple:
        """Return ``(window_start, window_end)`` (aware, UTC) for a run's data interval."""
        width = max(self.audience_window, interval.end - interval.start)
        return interval.end - width, interval.end


def declared_names(path: Path | None = None) -> list[str]:
    """Names of the campaigns declared in ``lifecycle.toml`` (or ``path``), in file order.

    Cheap enough for DAG parse time (one TOML read, no database, no audience or template checks):
    the lifecycle DAG offers them as the ``campaigns`` Param's enum. Full validation stays in
    :func:`load_campaigns`. A file without names gives ``[]``.
    """
    path = path or CAMPAIGNS_DIR / "lifecycle.toml"
    doc = tomllib.loads(path.read_text(encoding="utf-8"))
    return [str(c["name"]) for c in doc.get("campaign", []) if "name" in c]


def load_policy(path: Path | None = None) -> ContactPolicy:
    """The policy of ``campaigns/lifecycle.toml`` (or ``path``): its ``[policy]`` section, the cooldown
    falling back to ``[defaults].cooldown`` (then 7 days).

    :raises ValueError: for a bad entry (naming it).
    """
    path = path or CAMPAIGNS_DIR / "lifecycle.toml"
    doc = tomllib.loads(path.read_text(encoding="utf-8"))
    default = str(doc.get("defaults", {}).get("cooldown", "P7D"))
    return policy_from_mapping(doc.get("policy", {}), default_cooldown=default, label=f"{path.name} [policy]")


def load_campaigns(path: Path | None = None, only: list[str] | None = None) -> list[Campaign]:
    """Load and validate campaigns from a TOML file, sorted by priority.

    :param only: keep just these campaign names (a DAG Param); unknown names raise.
    :raises ValueError: naming the campaign and field for a missing field, a duplicate name or
        priority, a bad duration, a missing audience/template file, or a subject or template that
        is not valid Jinja or tries to leave the sandbox (:mod:`mailflow.campaigns.templating`).
    """
    path = path or CAMPAIGNS_DIR / "lifecycle.toml"
    doc = tomllib.loads(path.read_text(encoding="utf-8"))
    defaults = doc.get("defaults", {})
    policy = policy_from_mapping(doc.get("policy", {}), default_cooldown=str(defaults.get("cooldown", "P7D")),
                                 label=f"{path.name} [policy]")
    out: list[Campaign] = []
    for i, raw in enumerate(doc.get("campaign", [])):
        merged = {**defaults, **raw}
        label = merged.get("name", f"campaign #{i + 1}")
        missing = [k for k in _REQUIRED if k not in merged]
        if missing:
            raise ValueError(f"{path.name}: campaign {label!r} lacks {', '.join(missing)}")
        base = path.parent
        audience = base / merged["audience"]
        if not audience.is_file():
            raise ValueError(f"{path.name}: campaign {label!r}: audience file {audience} not found")
        for suffix in (".html.j2", ".txt.j2"):
            t = base / "templates" / f"{merged['template']}{suffix}"
            if not t.is_file():
                raise ValueError(f"{path.name}: campaign {label!r}: template {t} not found")
        try:  # subject and templates render in the sandbox: refuse one that tries to leave it now
            check_campaign_templates(str(label), str(merged["subject"]), str(merged["template"]), base / "templates")
        except ValueError as exc:
            raise ValueError(f"{path.name}: {exc}") from None
        if "cooldown" in raw:
            raise ValueError(f"{path.name}: campaign {label!r}: the cooldown is set once for every campaign, "
                             f"in [policy] (a transactional campaign sets policy = \"exempt\")")
        if merged.get("policy", "apply") not in ("apply", "exempt"):
            raise ValueError(f"{path.name}: campaign {label!r}: policy must be \"apply\" or \"exempt\", "
                             f"got {merged.get('policy')!r}")
        try:
            cooldown = policy.cooldown
            window = as_timedelta(merged.get("audience_window", "PT1H"))
            max_age = as_timedelta(merged.get("max_interval_age", "PT6H"))
        except ValueError as exc:
            raise ValueError(f"{path.name}: campaign {label!r}: {exc}") from None
        out.append(
            Campaign(
                name=str(merged["name"]),
                priority=int(merged["priority"]),
                audience_sql=audience.read_text(encoding="utf-8").strip().rstrip(";"),
                template=str(merged["template"]),
                subject=str(merged["subject"]),
                from_address=str(merged["from"]),
                reply_to=merged.get("reply_to"),
                cooldown=cooldown,
                audience_window=window,
                marketing=bool(merged.get("marketing", True)),
                max_interval_age=max_age,
                caps=policy.caps,
                exempt=merged.get("policy", "apply") == "exempt",
            )
        )
    names = [c.name for c in out]
    for label, values in (("name", names), ("priority", [str(c.priority) for c in out])):
        dup = {v for v in values if values.count(v) > 1}
        if dup:
            raise ValueError(f"{path.name}: duplicate campaign {label}: {sorted(dup)}")
    if only:
        unknown = sorted(set(only) - set(names))
        if unknown:
            raise ValueError(f"unknown campaign(s) {unknown}; declared: {names}")
        out = [c for c in out if c.name in only]
    return sorted(out, key=lambda c: c.priority)
