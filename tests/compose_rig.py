"""docker-compose.yaml as the tests read it: resolved by ``docker compose config`` where the CLI
answers, else by PyYAML after compose's variable interpolation (no Docker engine is needed)."""

from __future__ import annotations

import os
from typing import Any

from conftest import ROOT

COMPOSE_SECRETS = {"MAILFLOW_DB_PASSWORD": "db-pw", "MAILFLOW_UNSUBSCRIBE_SECRET": "unsub-secret-0123456789",
                   "AIRFLOW_JWT_SECRET": "jwt-secret", "AIRFLOW_API_SECRET_KEY": "api-secret"}
AIRFLOW_SERVICES = ("airflow-init", "airflow-apiserver", "airflow-scheduler", "airflow-dag-processor",
                    "airflow-triggerer", "airflow-worker-1", "airflow-worker-2")


def compose_cli() -> list[str] | None:
    """``docker compose`` (v2 plugin) or ``docker-compose`` (v1), whichever answers."""
    import shutil
    import subprocess

    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]) and subprocess.run([*cmd, "version"], capture_output=True).returncode == 0:
            return cmd
    return None


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable interpolation (``$$``, ``${V}``, ``${V:-d}``, ``${V-d}``, ``${V:?e}``, ``${V?e}``)
    for machines without the compose CLI."""
    import re

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group("name") or m.group("bare"), m.group("op"), m.group("arg") or ""
        value = env.get(name)
        if op in (":-", ":?") and not value or op in ("-", "?") and value is None:
            if op.endswith("?"):
                raise ValueError(f"required variable {name} is missing a value: {arg}")
            return arg if op else ""
        return value or ""

    return re.sub(r"\$\$|\$\{(?P<name>\w+)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|\$(?P<bare>\w+)", sub, text)


def compose_config(env: dict[str, str]) -> tuple[dict[str, Any], str]:
    """The resolved compose model and how it was obtained."""
    import subprocess

    import yaml

    cli_cmd = compose_cli()
    if cli_cmd is not None:
        res = subprocess.run([*cli_cmd, "-f", str(ROOT / "docker-compose.yaml"), "config"], cwd=ROOT, text=True,
                             capture_output=True, env={**{k: v for k, v in os.environ.items()
                                                          if k not in COMPOSE_SECRETS}, **env})
        if res.returncode != 0:
            raise ValueError(res.stderr)
        return yaml.safe_load(res.stdout), " ".join(cli_cmd) + " config"
    return yaml.safe_load(interpolate((ROOT / "docker-compose.yaml").read_text(), env)), "PyYAML + interpolation"


def env_of(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}
