"""Holdout groups (docs/model.md, "Holdout groups"): who of a campaign's audience is held out.

A campaign may declare a holdout share ``s`` in [0, 1): a user whose :func:`holdout_fraction` for the
campaign is below ``s`` gets a send-log row with status ``holdout`` (never claimed, never sent) instead
of an email, so an analyst can compare the treated and the held-out users (``mail.campaign_lift``,
docs/send_log.md). Membership is a pure function of (campaign name, user id): the same in every run, a
backfill, a re-provisioning, on any worker, whatever the order or the page size.

The same function is defined in SQL by migration 0025 (``mail.holdout_fraction``, ``mail.in_holdout``);
tests hold the two against each other. The fraction is the first 52 bits of
``sha256(utf8(campaign + ":" + str(user_id)))`` divided by 2**52: a float8 holds every such value
exactly, so Python and PostgreSQL compare the same number with the share (the 64 bits of the
first 8 bytes would be rounded, differently near the boundary).
"""

from __future__ import annotations

import hashlib
import math

_BITS = 52
_SCALE = float(2**_BITS)


def holdout_fraction(campaign: str, user_id: int) -> float:
    """The user's uniform draw for the campaign, in [0, 1): exact, identical to ``mail.holdout_fraction``."""
    digest = hashlib.sha256(f"{campaign}:{int(user_id)}".encode()).hexdigest()
    return int(digest[: _BITS // 4], 16) / _SCALE


def in_holdout(campaign: str, user_id: int, share: float) -> bool:
    """Whether the user is in the campaign's holdout group for ``share`` (0: nobody), as ``mail.in_holdout``."""
    return share > 0 and holdout_fraction(campaign, user_id) < share


def check_share(value: object, where: str) -> float:
    """A holdout share as a float in [0, 1).

    :param where: names the campaign and field in the error (``campaign 'x': holdout_share``).
    :raises ValueError: for a bool, a non-number, NaN, or a value outside [0, 1) (1 would hold out
        everybody: nothing would be sent).
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where} must be a number in [0, 1), got {value!r}")
    share = float(value)
    if math.isnan(share) or not 0 <= share < 1:
        raise ValueError(f"{where} must be in [0, 1) (e.g. 0.1 holds out 10% of the audience), got {value!r}")
    return share
