"""Named SQL statements loaded from ``store/sql/queries/*.sql``.

Each statement is a block that starts with ``-- name: <name>`` followed by one comment line on
its purpose (and, where it matters, why it is safe). Values are always bound parameters
(``%(name)s``); only trusted, version-controlled SQL (a campaign's audience file) is composed in.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

_NAME = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.MULTILINE)


@cache
def queries(domain: str) -> dict[str, str]:
    """Return ``{name: sql}`` for ``store/sql/queries/<domain>.sql``.

    :raises KeyError: never here; a missing name raises ``KeyError`` at lookup.
    :raises ValueError: if a name is declared twice in one file.
    """
    text = resources.files(__package__).joinpath("queries", f"{domain}.sql").read_text(encoding="utf-8")
    parts = _NAME.split(text)
    out: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in out:
            raise ValueError(f"store/sql/queries/{domain}.sql declares {name!r} twice")
        out[name] = body.strip().rstrip(";")
    return out


def query(domain: str, name: str) -> str:
    """Return the named statement ``name`` of ``store/sql/queries/<domain>.sql``."""
    return queries(domain)[name]


def analytics(name: str) -> str:
    """Return the analysts' SQL ``store/sql/analytics/<name>.sql`` without its trailing semicolon, as
    documented in docs/send_log.md: the text runs unmodified in psql. ``campaign_lift`` is one SELECT
    without parameters; ``campaign_lift_fold`` creates the function that folds its rollup.

    :raises FileNotFoundError: if there is no such file.
    """
    text = resources.files(__package__).joinpath("analytics", f"{name}.sql").read_text(encoding="utf-8")
    return text.strip().rstrip(";")
