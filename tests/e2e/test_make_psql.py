"""`make psql` before `make demo`, as a newcomer tries it: a clear hint naming `make demo`, exit 1,
and the embedded server it had to start for the look-up is stopped again (nothing left running)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT

from mailflow_dev import devenv


@pytest.fixture
def state() -> Iterator[Path]:
    # world-readable: as root the embedded server runs as its own user (see test_demo_twice)
    path = Path(tempfile.mkdtemp(prefix="mf-psql-"))
    path.chmod(0o755)
    yield path
    devenv.stop_embedded(path / "pgdata")
    shutil.rmtree(path, ignore_errors=True)


def test_make_psql_before_make_demo_says_what_to_run_and_leaves_no_server(state: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update({"MAILFLOW_DEMO_STATE": str(state), "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT / "include")})
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "psql.py")], env=env, text=True,
                         capture_output=True, timeout=180, stdin=subprocess.DEVNULL, cwd=str(ROOT))
    assert res.returncode == 1, res.stdout + res.stderr
    assert res.stderr.splitlines()[-2:] == [
        f"make psql: there is no send log yet (database 'mailflow_demo' does not exist in {state / 'pgdata'}).",
        "Run `make demo` (or `make airflow`) first, then `make psql` (the embedded server it started for this is "
        "stopped again)."]
    assert "Traceback" not in res.stderr
    assert (state / "pgdata").is_dir() and not devenv.embedded_running(state / "pgdata")
