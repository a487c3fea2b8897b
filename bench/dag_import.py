"""Metric 7: DAG import time per DAG file, in fresh interpreters.

For each ``dags/*.py``, 5 rounds (1 with ``--quick``; interleaved, so drift hits every file alike)
of a fresh ``python -c`` that imports ``airflow.sdk``, then executes the file as a module the way
the DAG processor loads it (``importlib`` spec from the path, under a unique module name), timing
both spans with ``perf_counter`` (interpreter start-up excluded; the parent also times the whole
process). The value is the median of the file's span: what the file costs above the bare
``import airflow.sdk`` in the same fresh interpreter, in seconds. (The difference between two
medians of separate processes is noisier: on a shared machine the bare import itself varies by
+-0.3 s between processes.) Target <= 0.5 s (the DAG processor's own limits
are 30 s per file, ``dagbag_import_timeout``, and 50 s per parse, ``dag_file_processor_timeout``).
Airflow runs with a throw-away ``AIRFLOW_HOME`` (no examples, no metadata database needed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import median, metric

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 0.5

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import airflow.sdk
t1 = time.perf_counter()
path = sys.argv[1] if len(sys.argv) > 1 else None
dags = 0
if path:
    import importlib.util
    spec = importlib.util.spec_from_file_location("unusual_prefix_bench_" + str(abs(hash(path))), path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    dags = sum(isinstance(v, airflow.sdk.DAG) for v in vars(mod).values())
t2 = time.perf_counter()
print(json.dumps({"sdk": t1 - t0, "file": t2 - t1, "total": t2 - t0, "dags": dags}))
"""


def _child(env: dict[str, str], path: Path | None) -> dict[str, Any]:
    args = [sys.executable, "-c", CHILD] + ([str(path)] if path else [])
    t0 = time.perf_counter()
    p = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"importing {path or 'airflow.sdk'} failed: {p.stderr[-1500:]}")
    return json.loads(p.stdout.strip().splitlines()[-1]) | {"wall": wall}


def run(dsn: str, quick: bool = False) -> list[dict[str, Any]]:
    reps = 1 if quick else 5
    files = sorted((ROOT / "dags").glob("*.py"))
    home = tempfile.mkdtemp(prefix="mailflow-bench-airflow-")
    env = os.environ | {"AIRFLOW_HOME": home, "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                        "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"), "PYTHONDONTWRITEBYTECODE": "0"}
    # Warm-up (not counted): byte-compiles mailflow, fills the OS file cache, writes airflow.cfg.
    _child(env, files[0])
    runs: dict[str, list[dict[str, Any]]] = {f.name: [] for f in files}
    for _ in range(reps):
        for f in files:
            runs[f.name].append(_child(env, f))
    every = [x for r in runs.values() for x in r]
    out = [metric("import_airflow_sdk_seconds", median([x["sdk"] for x in every]), "s", None, None,
                  reps=len(every), note="the bare import airflow.sdk, measured at the start of every child")]
    for f in files:
        r = runs[f.name]
        file_s = median([x["file"] for x in r])
        out.append(metric(f"dag_import_{f.stem}", file_s, "s above bare import airflow.sdk", f"<= {TARGET_S:g} s",
                          file_s <= TARGET_S, reps=reps, dags_defined=r[0]["dags"],
                          process_wall_median_s=round(median([x["wall"] for x in r]), 3),
                          file_runs_s=[round(x["file"], 3) for x in r]))
    return out
