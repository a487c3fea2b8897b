"""Run conf strictness: a run's ``conf`` may only set the DAG's declared Params.

Airflow merges ``dag_run.conf`` into the Params without complaint about keys no Param declares, so
a typo (``{"dryrun": true}`` for ``dry_run``) would silently be ignored and the run would do the
real thing. Every mailflow task calls :func:`check_run_conf` before it touches anything.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any


def unknown_conf_keys(conf: Mapping[str, Any] | None, declared: Iterable[str]) -> list[tuple[str, str | None]]:
    """``(key, nearest declared Param or None)`` for each key of ``conf`` that is not in
    ``declared``, in sorted key order; nearest by :func:`difflib.get_close_matches` (cutoff 0.6)."""
    names = sorted(set(declared))
    out = []
    for key in sorted(conf or {}):
        if key not in names:
            near = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
            out.append((key, near[0] if near else None))
    return out


def check_run_conf(context: Mapping[str, Any]) -> None:
    """Refuse a run whose ``dag_run.conf`` has a key that is not a declared Param of its DAG.

    :raises airflow.sdk.exceptions.AirflowFailException: (no retries: the same conf fails again)
        naming each unknown key, the nearest declared Param and the declared ones.
    """
    from airflow.sdk.exceptions import AirflowFailException

    dag_run = context.get("dag_run")
    conf = getattr(dag_run, "conf", None) or {}
    dag = context.get("dag") or getattr(context.get("task"), "dag", None)
    declared = list(getattr(dag, "params", None) or {})
    bad = unknown_conf_keys(conf, declared)
    if not bad:
        return
    parts = [f"{k!r}" + (f" (did you mean {near!r}?)" if near else "") for k, near in bad]
    raise AirflowFailException(
        f"run conf has key(s) that are not Params of {getattr(dag, 'dag_id', 'this DAG')}: {', '.join(parts)}; "
        f"declared Params: {', '.join(sorted(declared)) or 'none'}. Nothing was done.")
