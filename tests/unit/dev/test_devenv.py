"""`make stop` never stops an embedded server that a live test session marked as in use."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mailflow_dev import devenv


def test_a_server_marked_by_a_live_process_is_left_running(tmp_path: Path) -> None:
    pgdata = tmp_path / "pgdata-test"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / "pgdata-test.users").mkdir()
        (tmp_path / "pgdata-test.users" / str(child.pid)).write_text(str(child.pid))
        assert devenv.live_users(pgdata) == [child.pid]
        assert devenv.stop_if_unused(pgdata) == f"left running: in use by pid {child.pid}"
    finally:
        child.kill()
        child.wait()
    # the mark of a dead process is stale: removed, and the (absent) server is reported not running
    assert devenv.live_users(pgdata) == []
    assert list((tmp_path / "pgdata-test.users").iterdir()) == []
    assert devenv.stop_if_unused(pgdata) == "not running"


def test_server_in_use_marks_this_process_only_while_inside(tmp_path: Path) -> None:
    import os

    pgdata = tmp_path / "pgdata-test"
    with devenv.server_in_use(pgdata):
        assert devenv.live_users(pgdata) == [os.getpid()]
        assert devenv.stop_if_unused(pgdata) == "not running"  # its own mark does not hold it
    assert devenv.live_users(pgdata) == []
