"""The runtime set installs into a team's Airflow without moving it, measured as such an image is
built: a clean venv with ``apache-airflow==3.3.2`` and the postgres provider under a constraint
file (the official image installs Airflow under its constraints; here the project's known-good pin
set), then ``requirements.txt`` and the package (``--no-deps``), as the Dockerfile does.

The base venv (about 300 MB, ~40 s to build from the package index) is built once per pin set and
reused (``MAILFLOW_TEST_CACHE``, default ``~/.cache/mailflow-tests``); every run installs the
runtime set into a fresh copy of it (~16 s), so a change to requirements.txt, pyproject.toml or the
package is measured each time. The development environment's ``pip check`` is the cheap half.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import ROOT

from mailflow_dev import runtime_install

AIRFLOW_VERSION = "3.3.2"
# the constraint file the base is installed under: the project's known-good pin set where the machine
# has it, else requirements-dev.txt (the same versions for every name both hold, plus the dev tools,
# which constrain nothing Airflow installs)
_KNOWN_GOOD = Path(os.environ.get("MAILFLOW_KNOWN_GOOD_PINS", "/work/shared/reference/known-good-pins.txt"))
PINS = _KNOWN_GOOD if _KNOWN_GOOD.is_file() else ROOT / "requirements-dev.txt"
CACHE = Path(os.environ.get("MAILFLOW_TEST_CACHE", Path.home() / ".cache" / "mailflow-tests"))
# what the runtime set adds to Airflow 3.3.2 with the postgres provider: everything else it names
# (psycopg, httpx, Jinja2, email-validator, starlette, uvicorn, click) is already there at a version it
# admits; holidays (the planner's public holidays) brings only python-dateutil, which Airflow has
ADDED = {"mailflow", "standardwebhooks", "holidays"}


def test_pip_check_is_clean_in_the_development_environment() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the venv as installed, not a source tree
    res = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "check"], text=True,
                         capture_output=True, env=env, timeout=120)
    assert (res.returncode, res.stdout.strip()) == (0, "No broken requirements found."), res.stdout + res.stderr


@pytest.mark.slow
def test_the_runtime_set_changes_no_distribution_of_a_clean_airflow(tmp_path: Path,
                                                                     record_property: Callable[[str, object], None]) -> None:
    base = runtime_install.cached_base(CACHE, AIRFLOW_VERSION, PINS)
    base_dists = runtime_install.freeze(base)
    assert base_dists["apache-airflow"] == AIRFLOW_VERSION and "apache-airflow-providers-postgres" in base_dists
    assert "mailflow" not in base_dists and "faker" not in base_dists

    result = runtime_install.measure(base, tmp_path, ROOT / "requirements.txt", AIRFLOW_VERSION, ROOT)

    assert "error" not in result, result.get("error")
    assert (result["downgraded"], result["upgraded"], result["removed"]) == ({}, {}, [])
    assert set(result["added"]) == ADDED, result["added"]
    assert result["pip_check"] == "No broken requirements found."
    assert result["ok"] is True
    grown = round(result["size_mb"]["after"] - result["size_mb"]["before"], 1)
    # the package, standardwebhooks and holidays (about 9 MB: every country's calendar and its
    # translations), no tools: 12.4 MB measured on 2026-12-03
    assert 0 < grown < 16, result["size_mb"]
    # the report: what a team's image gains
    record_property("added", result["added"])
    record_property("size_mb", result["size_mb"])
    print(f"\nruntime install over Airflow {AIRFLOW_VERSION} ({len(base_dists)} distributions): "
          f"added {result['added']}, {result['size_mb']['before']} MB -> {result['size_mb']['after']} MB")
