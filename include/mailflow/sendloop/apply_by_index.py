"""Reconcile a provider batch response with the request, by index (pure functions).

Resend's permissive batch answers ``{"data": [{"id"}...], "errors": [{"index", "message"}...]}``
(provider docs, batch validation modes). It does not state that ``data`` lists the accepted emails
in request order; we rely on it (guarded by a contract test against the emulator and the official
SDK) and refuse to guess whenever the response does not add up: then the outcome is
:class:`~mailflow.sendloop.outcome.Unknown` and the rows stay ``sending`` for the reconciler.
"""

from __future__ import annotations

from typing import Any

from mailflow.sendloop.outcome import Accepted, Outcome, Unknown


def reconcile_by_index(request_size: int, payload: Any) -> Outcome:
    """Map a 2xx batch response onto request indices ``0..request_size-1``.

    Accepted emails take the ``data`` ids in order over the indices not named in ``errors``.

    :returns: :class:`Accepted` when ``len(data) + len(errors) == request_size``, every error index
        is an int in range and unique, and every id is a non-empty string; otherwise
        :class:`Unknown` with the reason (never raises on a malformed payload).
    """
    if not isinstance(payload, dict) or not isinstance(payload.get("data"), list):
        return Unknown(reason=f"ambiguous response: no data array ({str(payload)[:200]})")
    data = payload["data"]
    errors = payload.get("errors") or []
    if not isinstance(errors, list):
        return Unknown(reason="ambiguous response: errors is not an array")
    rejected: dict[int, str] = {}
    for err in errors:
        idx = err.get("index") if isinstance(err, dict) else None
        if not isinstance(idx, int) or isinstance(idx, bool) or not 0 <= idx < request_size or idx in rejected:
            return Unknown(reason=f"ambiguous response: bad error index {err!r}")
        rejected[idx] = str(err.get("message") or "rejected by provider")
    if len(data) + len(rejected) != request_size:
        return Unknown(
            reason=f"ambiguous response: {len(data)} ids + {len(rejected)} errors != {request_size} emails sent"
        )
    ids: dict[int, str] = {}
    accepted_indices = [i for i in range(request_size) if i not in rejected]
    for idx, item in zip(accepted_indices, data, strict=True):
        pid = item.get("id") if isinstance(item, dict) else None
        if not isinstance(pid, str) or not pid:
            return Unknown(reason=f"ambiguous response: data item without id {item!r}")
        ids[idx] = pid
    if len(set(ids.values())) != len(ids):
        return Unknown(reason="ambiguous response: duplicate provider ids")
    return Accepted(ids=ids, rejected=rejected)
