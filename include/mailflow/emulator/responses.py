"""Response helpers shared by the emulator's endpoint groups: JSON and error bodies, the aborted
response of a reset-after-accept fault, the hashed API key id and the body digests.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from typing import Any

from starlette.responses import Response

from mailflow.emulator.validation import ApiError


def json_response(status: int, obj: Any, headers: dict[str, str] | None = None) -> Response:
    """A compact JSON response (``application/json``) with ``status`` and the given headers."""
    body = json.dumps(obj, separators=(",", ":")).encode()
    return Response(body, status, headers=headers, media_type="application/json")


def error_response(err: ApiError, headers: dict[str, str] | None = None) -> Response:
    """Resend's error body ``{"statusCode", "name", "message"}`` for ``err``; the error's own headers
    (e.g. ``retry-after``) win over ``headers``."""
    body = {"statusCode": err.status, "name": err.name, "message": err.message}
    return json_response(err.status, body, {**(headers or {}), **err.headers})


@lru_cache(maxsize=64)
def api_key_id(key: str) -> str:
    """A stable, non-secret id of an API key (SHA-256 prefix) for idempotency scopes."""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def sha256_hex(value: str | None) -> str | None:
    """Hex SHA-256 of ``value`` (UTF-8), or None for None: the outbox records body digests, not bodies."""
    return hashlib.sha256(value.encode()).hexdigest() if value is not None else None


class AbortedResponse(Response):
    """Sends 200 headers announcing a body, then returns without it: uvicorn closes the connection,
    so the client sees a transport error (httpx.RemoteProtocolError, requests ChunkedEncodingError)."""

    def __init__(self, body_len: int, headers: dict[str, str]):
        super().__init__(b"", 200, headers=headers, media_type="application/json")
        self._announced = body_len

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        raw = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        raw.append((b"content-length", str(self._announced).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": raw})
        await send({"type": "http.response.body", "body": b"", "more_body": True})
