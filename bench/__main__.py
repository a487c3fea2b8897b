"""`make bench` / `python -m bench [--only NAME ...] [--quick]`: run the benchmarks against a real
PostgreSQL (TEST_DATABASE_URL or the embedded server) and the emulator, and write
``bench/results/latest.json`` (one object per metric: value, unit, target, params) and
``bench/results/latest.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

from bench import provider

RESULTS = Path(__file__).parent / "results"
SUITES = {"provider": provider.run}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--only", nargs="*", choices=sorted(SUITES), help="run only these suites")
    p.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run, not the reported numbers)")
    args = p.parse_args(argv)

    from mailflow import devenv
    from mailflow.migrate import migrate

    admin = os.environ.get("TEST_DATABASE_URL") or devenv.embedded_dsn(devenv.STATE / "pgdata-bench")
    name = f"mailflow_bench_{uuid.uuid4().hex[:6]}"
    dsn = devenv.create_database(admin, name)
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn)
    metrics: list[dict] = []
    t0 = time.monotonic()
    try:
        for suite in args.only or list(SUITES):
            print(f"== {suite}", flush=True)
            for m in SUITES[suite](dsn=dsn, quick=args.quick):
                print(f"  {m['name']}: {m['value']:.4g} {m['unit']} (target {m.get('target') or '-'})", flush=True)
                metrics.append(m)
    finally:
        devenv.drop_database(admin, name)
    doc = {"written_at": datetime.now(UTC).isoformat(), "seconds": round(time.monotonic() - t0, 1),
           "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
           "quick": args.quick, "metrics": metrics}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "latest.json").write_text(json.dumps(doc, indent=2) + "\n")
    (RESULTS / "latest.md").write_text(markdown(doc))
    print(markdown(doc))
    return 0


def markdown(doc: dict) -> str:
    lines = [f"Benchmarks of {doc['written_at'][:16]} UTC ({doc['machine']['cpus']} CPUs, "
             f"{doc['seconds']} s{', quick sizes' if doc['quick'] else ''})", "",
             "| metric | value | unit | target | met |", "|---|---:|---|---|---|"]
    for m in doc["metrics"]:
        met = {True: "yes", False: "**no**", None: "-"}[m.get("met")]
        lines.append(f"| {m['name']} | {m['value']:.4g} | {m['unit']} | {m.get('target') or '-'} | {met} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
