"""`make bench` / `python -m bench [--only NAME ...] [--quick]`: run the benchmarks against a real
PostgreSQL (TEST_DATABASE_URL or the embedded server) and the emulator, and write
``bench/results/latest.json`` (one object per metric: value, unit, target, met, params) and
``bench/results/latest.md`` (the table). See docs/performance.md.

Suites, cheapest first: pipeline (metric 3), memory (5), dag_import (7), guard (the reputation guard's
cost per call), provider (1, 2),
audience (4, and metric 3 at 1M users), history (the send log at 20M rows beside the 1M population, as
ratios; its population is cached between runs, see bench/history.py), lifecycle_e2e (8: end-to-end lifecycle utilisation),
dispatch (6), webhooks (webhook ingestion and outcome coverage). A suite that fails is recorded as a failed
metric and the others still run; the exit code is 1 if any suite failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import traceback
import uuid
from datetime import UTC, datetime
from pathlib import Path

from bench import (
    audience,
    dag_import,
    dispatch,
    guard,
    history,
    lifecycle_e2e,
    memory,
    pipeline,
    population,
    provider,
    webhooks,
)

RESULTS = Path(__file__).parent / "results"
SUITES = {
    "pipeline": pipeline.run,
    "memory": memory.run,
    "dag_import": dag_import.run,
    "guard": guard.run,
    "provider": provider.run,
    "audience": audience.run,
    "history": history.run,
    "lifecycle_e2e": lifecycle_e2e.run,
    "dispatch": dispatch.run,
    "webhooks": webhooks.run,
}


def _fmt(value: float) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "-"
    return f"{value:.4g}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="*", choices=list(SUITES), help="run only these suites")
    p.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run, not the reported numbers)")
    args = p.parse_args(argv)

    from mailflow.store.migrate import migrate
    from mailflow_dev import devenv

    admin = os.environ.get("TEST_DATABASE_URL") or devenv.embedded_dsn(devenv.STATE / "pgdata-bench")
    name = f"mailflow_bench_{uuid.uuid4().hex[:6]}"
    dsn = devenv.create_database(admin, name)
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn)
    metrics: list[dict] = []
    suites: dict[str, float] = {}
    failed: list[str] = []
    load_before = os.getloadavg()
    t0 = time.monotonic()
    try:
        for suite in args.only or list(SUITES):
            print(f"== {suite}", flush=True)
            ts = time.monotonic()
            try:
                for m in SUITES[suite](dsn=dsn, quick=args.quick):
                    m["suite"] = suite
                    met = {True: "", False: "  ** target missed **", None: ""}[m.get("met")]
                    print(f"  {m['name']}: {_fmt(m['value'])} {m['unit']} (target {m.get('target') or '-'}){met}",
                          flush=True)
                    metrics.append(m)
            except Exception as exc:  # noqa: BLE001 - record it and go on with the next suite
                traceback.print_exc()
                failed.append(suite)
                metrics.append({"name": f"{suite}: suite failed", "value": float("nan"), "unit": "error",
                                "target": "runs", "met": False, "suite": suite,
                                "params": {"error": f"{type(exc).__name__}: {exc}"[:2000]}})
            suites[suite] = round(time.monotonic() - ts, 1)
            print(f"   ({suites[suite]} s)", flush=True)
    finally:
        population.drop_shared()  # the shared populations' templates live on the bench database's server
        devenv.drop_database(admin, name)
    doc = {"written_at": datetime.now(UTC).isoformat(), "seconds": round(time.monotonic() - t0, 1),
           "suite_seconds": suites,
           "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform(),
                       "loadavg_1_5_15_before": [round(x, 2) for x in load_before],
                       "loadavg_1_5_15_after": [round(x, 2) for x in os.getloadavg()]},
           "quick": args.quick, "only": args.only, "metrics": metrics}
    RESULTS.mkdir(exist_ok=True)
    text = json.dumps(doc, indent=2, default=str).replace("NaN", "null") + "\n"
    (RESULTS / "latest.json").write_text(text)
    (RESULTS / "latest.md").write_text(markdown(doc))
    print(markdown(doc))
    return 1 if failed else 0


def markdown(doc: dict) -> str:
    m = doc["machine"]
    lines = [f"Benchmarks of {doc['written_at'][:16]} UTC ({m['cpus']} CPUs, load average "
             f"{m.get('loadavg_1_5_15_before', ['?'])[0]} at start; {doc['seconds']} s"
             f"{', quick sizes' if doc['quick'] else ''}"
             f"{', only ' + ', '.join(doc['only']) if doc.get('only') else ''})", "",
             "| metric | value | unit | target | met |", "|---|---:|---|---|---|"]
    for x in doc["metrics"]:
        met = {True: "yes", False: "**no**", None: "-"}[x.get("met")]
        lines.append(f"| {x['name']} | {_fmt(x['value'])} | {x['unit']} | {x.get('target') or '-'} | {met} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
