"""The one ``mailflow`` command: every subcommand is listed, the old ``python -m`` entry points are
deprecated aliases of the same commands, and no argparse program is left in the product."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from mailflow.cli import cli, main

ROOT = Path(__file__).resolve().parents[3]
SUBCOMMANDS = ("audit", "breaker", "campaign", "dead-letters", "emulator", "keys", "migrate", "outcomes",
               "reopen-refused", "report", "reputation", "unsubscribe", "webhooks")
CAMPAIGN = ("cancel", "complete", "create", "pause", "provision", "resume", "status", "update")
#: the old entry point -> the command it now runs (named in its deprecation notice)
ALIASES = {
    "mailflow.sources.scheduled": "mailflow campaign",
    "mailflow.emulator": "mailflow emulator",
    "mailflow.feedback.unsubscribe_app": "mailflow unsubscribe serve",
    "mailflow.feedback.webhooks": "mailflow webhooks serve",
}


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "include"), os.environ.get("PYTHONPATH", "")])}


def _listed(help_text: str) -> list[str]:
    """The command names of a click help's ``Commands:`` section."""
    section = help_text.split("Commands:", 1)[1]
    return [m.group(1) for m in re.finditer(r"^  (\S+)", section, re.M)]


def test_mailflow_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    assert _listed(capsys.readouterr().out) == list(SUBCOMMANDS)
    for group, expected in (("campaign", CAMPAIGN), ("unsubscribe", ("serve",)), ("webhooks", ("serve",))):
        with pytest.raises(SystemExit):
            main([group, "--help"])
        assert _listed(capsys.readouterr().out) == list(expected), group


def test_the_installed_script_is_the_click_main() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"] == {"mailflow": "mailflow.cli:main"}
    assert "click>=8.1" in project["dependencies"]
    done = subprocess.run([sys.executable, "-m", "mailflow.cli", "--help"], capture_output=True, text=True,
                          env=_env(), timeout=60)
    assert done.returncode == 0 and _listed(done.stdout) == list(SUBCOMMANDS) and done.stderr == ""


def test_usage_errors_exit_2_and_name_the_problem(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["campaign", "provision", "x", "--chunk", "0", "--dsn", "postgresql://nowhere"])
    assert exc.value.code == 2
    assert "Invalid value for '--chunk'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["nosuch"])
    assert exc.value.code == 2
    assert "No such command 'nosuch'" in capsys.readouterr().err


@pytest.mark.parametrize("module", sorted(ALIASES))
def test_each_old_entry_point_says_it_is_deprecated_and_runs_the_new_command(module: str) -> None:
    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, env=_env(),
                          timeout=60)
    assert done.returncode == 0, done.stderr
    [notice] = done.stderr.splitlines()
    assert notice.startswith(f"warning: `python -m {module}` is deprecated and goes away in the next minor release")
    assert f"run `{ALIASES[module]}`" in notice
    assert done.stdout.startswith("Usage: ")  # the click command's own help


def test_the_emulator_subcommand_has_the_emulators_options_and_is_loaded_only_when_run() -> None:
    from mailflow.emulator.cli import emulator

    ctx = cli.make_context("mailflow", ["emulator"], resilient_parsing=True)
    assert cli.get_command(ctx, "emulator") is emulator
    assert {"--port", "--outbox", "--control", "--webhook-secret", "--no-store-bodies"} <= {
        o for p in emulator.params for o in (*p.opts, *getattr(p, "secondary_opts", ()))}
    # the product's CLI loads the test double only for `mailflow emulator`
    code = "import sys, mailflow.cli; print(sorted(m for m in sys.modules if m.startswith('mailflow.emulator')))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=60)
    assert done.stdout.strip() == "[]", done.stderr


def test_no_argparse_program_is_left_in_the_product() -> None:
    users = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "include" / "mailflow").rglob("*.py")
                   if re.search(r"^\s*(import argparse|from argparse import)", p.read_text(), re.M))
    assert users == []


@pytest.mark.parametrize(("group", "dsn_env", "secret_env"), [
    ("webhooks", "MAILFLOW_WEBHOOK_DSN", "MAILFLOW_WEBHOOK_SECRETS"),
    ("unsubscribe", "MAILFLOW_UNSUBSCRIBE_DSN", "MAILFLOW_UNSUBSCRIBE_SECRET"),
])
def test_the_servers_take_the_dsn_from_mailflow_and_need_their_secret(
        group: str, dsn_env: str, secret_env: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("MAILFLOW_DSN", dsn_env, secret_env, "AIRFLOW_CONN_MAIL_WEBHOOK", "AIRFLOW_CONN_MAIL_UNSUBSCRIBE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as exc:
        main([group, "serve"])
    assert exc.value.code == 2
    assert f"--dsn, {dsn_env} or MAILFLOW_DSN is required" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # `mailflow --dsn` reaches the server: next it asks for the secret
        main(["--dsn", "postgresql://db.invalid/mailflow", group, "serve"])
    assert exc.value.code == 2
    assert secret_env in capsys.readouterr().err
