"""The contact policy's rules: a cooldown across all campaigns plus frequency caps.

The campaign files configure them (``[policy]`` of ``campaigns/lifecycle.toml``) and the store
enforces them (:mod:`mailflow.store.policy`, docs/model.md "The contact policy"); both read these
types from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from mailflow.model.outcome import as_timedelta


@dataclass(frozen=True, order=True)
class Cap:
    """At most ``emails`` emails per user within any ``window`` (a rolling span of elapsed time)."""

    window: timedelta
    emails: int

    def __post_init__(self) -> None:
        if self.emails < 1:
            raise ValueError(f"a frequency cap allows at least 1 email, got {self.emails}")
        if self.window <= timedelta(0):
            raise ValueError(f"a frequency cap's window must be positive, got {self.window}")

    def __str__(self) -> str:
        return f"{self.emails} per {human_duration(self.window)}"


@dataclass(frozen=True)
class ContactPolicy:
    """Cooldown (across all campaigns and kinds) plus frequency caps; see the module docstring."""

    cooldown: timedelta = timedelta(days=7)
    caps: tuple[Cap, ...] = ()

    @property
    def rules(self) -> tuple[Cap, ...]:
        """Every cap, the cooldown as ``Cap(cooldown, 1)`` first; empty if there is no rule."""
        out = [Cap(self.cooldown, 1)] if self.cooldown > timedelta(0) else []
        return tuple(out + sorted(self.caps))

    def extra_caps(self) -> tuple[Cap, ...]:
        """Caps not implied by the cooldown (a cap whose window is not longer than the cooldown
        allows at least the one email the cooldown allows in it): the SQL pre-filter checks these."""
        return tuple(c for c in sorted(self.caps) if c.window > self.cooldown)

    def widest(self) -> timedelta:
        """The longest window of any rule (how far back contacts matter)."""
        return max((c.window for c in self.rules), default=timedelta(0))


def policy_from_mapping(raw: Mapping[str, Any], *, default_cooldown: str = "P7D", label: str = "[policy]") -> ContactPolicy:
    """Build a policy from ``{"cooldown": "P7D", "caps": [{"emails": 3, "per": "P7D"}, ...]}``.

    :raises ValueError: naming the entry for a bad duration or count.
    """
    try:
        cooldown = as_timedelta(str(raw.get("cooldown", default_cooldown)))
        caps = []
        for i, cap in enumerate(raw.get("caps", ())):
            if not isinstance(cap, Mapping) or "emails" not in cap or "per" not in cap:
                raise ValueError(f"caps[{i}] must be {{ emails = N, per = \"P7D\" }}, got {cap!r}")
            caps.append(Cap(as_timedelta(str(cap["per"])), int(cap["emails"])))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{label}: {exc}") from None
    return ContactPolicy(cooldown=cooldown, caps=tuple(caps))


def human_duration(d: timedelta) -> str:
    """``d`` in the largest whole unit that divides it (``"7 days"``, ``"1 hour"``, ``"90 s"``)."""
    secs = int(d.total_seconds())
    for unit, n in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if secs % n == 0 and secs >= n:
            k = secs // n
            return f"{k} {unit}{'s' if k != 1 else ''}"
    return f"{secs} s"
