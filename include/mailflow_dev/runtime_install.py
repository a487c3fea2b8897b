"""Install mailflow's runtime set over an Airflow that is already there, and say what it changed.

A team adds mailflow to the Airflow it runs (the official image, the Helm chart, an Astro project).
Installing our requirements there must not move any distribution Airflow brought: a changed
``httpx``, ``packaging`` or ``uvicorn`` is a different Airflow from the one the team tested. This
tool measures it the way such an image is built:

1. a clean virtualenv with ``apache-airflow==<version>`` and ``apache-airflow-providers-postgres``
   (with ``--constraints``, as the official image installs Airflow under its constraint file);
2. a copy of it, into which each requirements file is installed (``pip install -r FILE``), then
   the package itself without dependencies (as the Dockerfile does);
3. per file: the distributions whose version changed (downgrades and upgrades), the ones added,
   the environment's size in MB before and after, and ``pip check``.

    python -m mailflow_dev.runtime_install --constraints requirements-dev.txt requirements.txt

Prints one JSON document; exit 1 if a file changed a distribution of the base environment or
``pip check`` failed. It downloads Airflow (about 330 MB installed) unless pip's cache holds it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def _pip(venv: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # `python -m pip` (not bin/pip): a copied venv's scripts still name the original's interpreter;
    # without PYTHONPATH, which would show a source tree's distributions as installed
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", *args],
                          text=True, capture_output=True, env=env)


def freeze(venv: Path) -> dict[str, str]:
    """``{canonical name: version}`` of every distribution in ``venv`` (pip itself included).

    :raises RuntimeError: if pip cannot list them.
    """
    res = _pip(venv, "list", "--format=json")
    if res.returncode != 0:
        raise RuntimeError(f"pip list failed in {venv}: {res.stderr[-2000:]}")
    return {canonicalize_name(d["name"]): d["version"] for d in json.loads(res.stdout)}


def size_mb(path: Path) -> float:
    """Bytes of the regular files under ``path`` (symlinks not followed), in MB (10**6), one decimal."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            p = Path(dirpath, name)
            if not p.is_symlink():
                total += p.stat().st_size
    return round(total / 1e6, 1)


def compare(base: dict[str, str], after: dict[str, str]) -> dict[str, Any]:
    """What ``after`` did to ``base``: ``downgraded``/``upgraded`` (name -> [before, after]),
    ``added`` (name -> version) and ``removed`` (names), each sorted by name."""
    changed = {n: [base[n], after[n]] for n in sorted(base) if n in after and after[n] != base[n]}
    return {
        "downgraded": {n: v for n, v in changed.items() if Version(v[1]) < Version(v[0])},
        "upgraded": {n: v for n, v in changed.items() if Version(v[1]) > Version(v[0])},
        "added": {n: after[n] for n in sorted(after) if n not in base},
        "removed": sorted(n for n in base if n not in after),
    }


def make_base(venv: Path, airflow_version: str, constraints: Path | None, python: str) -> None:
    """A clean venv holding Airflow and the postgres provider (under ``constraints`` when given).

    :raises RuntimeError: if the venv or the install fails (pip's output tail in the message).
    """
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    args = ["install", "--quiet", f"apache-airflow=={airflow_version}", "apache-airflow-providers-postgres"]
    if constraints is not None:
        args += ["--constraint", str(constraints)]
    res = _pip(venv, *args)
    if res.returncode != 0:
        raise RuntimeError(f"installing Airflow failed: {res.stderr[-3000:]}")


def cached_base(cache: Path, airflow_version: str, constraints: Path, python: str = sys.executable) -> Path:
    """The base venv of :func:`make_base` under ``cache``, built once per set of inputs and reused.

    Its folder is named by a hash of the Airflow version, the constraints' text and the
    interpreter's version, so a changed pin set builds a new base and never reuses a stale one. It
    is built under a temporary name and renamed when complete: an interrupted build is never taken
    for a base. Returns the venv's path.

    :raises RuntimeError: as :func:`make_base`.
    """
    version = subprocess.run([python, "-c", "import sys; print(sys.version)"], text=True, capture_output=True,
                             check=True).stdout
    key = hashlib.sha256("\0".join([airflow_version, constraints.read_text(), version]).encode()).hexdigest()[:16]
    base = cache / f"airflow-{airflow_version}-{key}"
    if (base / "bin" / "python").exists():
        return base
    cache.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f"{base.name}.building-", dir=cache))
    try:
        make_base(building / "venv", airflow_version, constraints, python)
        # renaming is safe: every use runs `python -m pip` (a venv's scripts name the old path);
        # a concurrent builder that finished first wins, and this copy is dropped
        try:
            (building / "venv").rename(base)
        except OSError:
            if not (base / "bin" / "python").exists():
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return base


def measure(base_venv: Path, work: Path, requirements: Path, airflow_version: str,
            package: Path | None) -> dict[str, Any]:
    """Install ``requirements`` (and the package at ``package``, ``--no-deps``) into a copy of
    ``base_venv``; return the comparison with the base, sizes in MB and ``pip check``'s verdict."""
    venv = work / f"with-{requirements.name}"
    shutil.rmtree(venv, ignore_errors=True)
    shutil.copytree(base_venv, venv, symlinks=True)
    before = freeze(venv)
    # the Dockerfile's form: Airflow named at the image's version next to the file, so pip keeps it
    res = _pip(venv, "install", "--quiet", f"apache-airflow=={airflow_version}", "-r", str(requirements))
    if res.returncode != 0:
        return {"requirements": str(requirements), "error": res.stderr[-3000:]}
    if package is not None:
        res = _pip(venv, "install", "--quiet", "--no-deps", str(package))
        if res.returncode != 0:
            return {"requirements": str(requirements), "error": res.stderr[-3000:]}
    after = freeze(venv)
    check = _pip(venv, "check")
    result = {"requirements": str(requirements), **compare(before, after),
              "size_mb": {"before": size_mb(base_venv), "after": size_mb(venv)},
              "pip_check": (check.stdout + check.stderr).strip()}
    result["ok"] = not result["downgraded"] and not result["upgraded"] and not result["removed"] \
        and check.returncode == 0
    return result


def main(argv: list[str] | None = None) -> int:
    """Command line (see the module docstring); exit 0 when every file left the base untouched."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("requirements", nargs="+", type=Path, help="requirements files to install over the base")
    ap.add_argument("--airflow-version", default="3.3.2")
    ap.add_argument("--constraints", type=Path, help="constraints for the base install (Airflow's, or a pin set)")
    ap.add_argument("--python", default=sys.executable, help="interpreter for the venvs (default: this one)")
    ap.add_argument("--workdir", type=Path, help="keep the venvs here (default: a temporary directory)")
    ap.add_argument("--package", type=Path, default=ROOT, help="the package installed --no-deps after each file")
    ap.add_argument("--no-package", action="store_true", help="install only the requirements files")
    args = ap.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="mailflow-runtime-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        base = work / "base"
        if not (base / "bin" / "python").exists():
            make_base(base, args.airflow_version, args.constraints, args.python)
        results = [measure(base, work, r.resolve(), args.airflow_version, None if args.no_package else args.package)
                   for r in args.requirements]
        print(json.dumps({"base": {"distributions": len(freeze(base)), "size_mb": size_mb(base),
                                   "constraints": str(args.constraints)}, "results": results}, indent=2))
        return 0 if all(r.get("ok") for r in results) else 1
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
