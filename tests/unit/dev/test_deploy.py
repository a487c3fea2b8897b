"""docs/deploy.md and deploy/ hold what the product reads: every YAML snippet of the guide is a file
under deploy/ and parses; the connection ids, ``MAILFLOW_*`` variables, the pool, the DAG named
for the per-task executor and the public paths are the ones the code uses. (``helm template`` is not
run: no helm binary or chart is obtainable from a package registry here; see docs/deploy.md.)"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from mailflow import settings

ROOT = Path(__file__).resolve().parents[3]
DOC = (ROOT / "docs" / "deploy.md").read_text()
DEPLOY = ROOT / "deploy"
YAML_FILES = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```$", DOC, flags=re.M | re.S)


def _docs(text: str) -> list[Any]:
    return [d for d in yaml.safe_load_all(text) if d is not None]


def _product_text() -> str:
    return "\n".join(p.read_text() for p in (ROOT / "include" / "mailflow").rglob("*.py"))


def test_every_yaml_snippet_of_the_guide_is_a_file_under_deploy_and_every_file_is_in_the_guide() -> None:
    snippets = _blocks("yaml")
    assert len(snippets) == len(YAML_FILES) == 4
    files = {p.relative_to(ROOT).as_posix(): _docs(p.read_text()) for p in YAML_FILES}
    for snippet in snippets:
        parsed = _docs(snippet)  # parses, or the test fails here
        assert parsed in files.values(), f"a YAML snippet of docs/deploy.md is no file under deploy/: {snippet[:80]}"
    for name, parsed in files.items():
        assert parsed, name
        assert f"`{name}`" in DOC, f"docs/deploy.md does not name {name}"
    for lang, path in (("nginx", "deploy/nginx/mailflow.conf"), ("dockerfile", "deploy/astro/Dockerfile")):
        assert _blocks(lang) == [(ROOT / path).read_text()], path


def _by_kind(kind: str, name: str) -> dict[str, Any]:
    for p in YAML_FILES:
        for d in _docs(p.read_text()):
            if isinstance(d, dict) and d.get("kind") == kind and d["metadata"]["name"] == name:
                return d
    raise AssertionError(f"no {kind} {name} under deploy/")


def test_the_connections_secret_holds_exactly_the_connection_ids_of_the_settings_as_json() -> None:
    import json

    secret = _by_kind("Secret", "mailflow-connections")
    expected = {settings.SEND_LOG_CONN_ID, settings.RESEND_CONN_ID, settings.UNSUBSCRIBE_CONN_ID,
                settings.WEBHOOK_CONN_ID}
    assert {k.removeprefix("AIRFLOW_CONN_").lower() for k in secret["stringData"]} == expected
    types = {k: json.loads(v)["conn_type"] for k, v in secret["stringData"].items()}
    assert types == {"AIRFLOW_CONN_SEND_LOG_DB": "postgres", "AIRFLOW_CONN_RESEND_DEFAULT": "resend",
                     "AIRFLOW_CONN_MAIL_UNSUBSCRIBE": "generic", "AIRFLOW_CONN_MAIL_WEBHOOK": "generic"}
    values = yaml.safe_load((DEPLOY / "helm" / "values.yaml").read_text())
    assert yaml.safe_load(values["extraEnvFrom"]) == [{"secretRef": {"name": "mailflow-connections"}}]
    job = _by_kind("Job", "mailflow-migrate")["spec"]["template"]["spec"]["containers"][0]
    assert job["envFrom"] == [{"secretRef": {"name": "mailflow-connections"}}]


def test_every_mailflow_variable_the_deploy_files_set_is_read_by_the_product() -> None:
    text = "\n".join(p.read_text() for p in DEPLOY.rglob("*") if p.is_file()) + DOC
    names = set(re.findall(r"\bMAILFLOW_[A-Z_]+\b", text))
    assert {"MAILFLOW_PUBLIC_URL", "MAILFLOW_APP_URL", "MAILFLOW_ALERT", "MAILFLOW_DSN"} <= names
    product = _product_text()
    unread = sorted(n for n in names if f'"{n}"' not in product and f"'{n}'" not in product
                    and not re.search(rf"\b{n}\b\s*=", product))
    assert unread == [], f"set in deploy/ or docs/deploy.md but read nowhere in include/mailflow: {unread}"


def test_the_migrate_job_runs_the_cli_and_creates_the_pool_the_dags_use() -> None:
    from mailflow.cli import main

    pools = set(re.findall(r'pool="([a-z_]+)"', "\n".join(p.read_text() for p in (ROOT / "dags").glob("*.py"))))
    assert pools == {"email_provider"}
    job = _by_kind("Job", "mailflow-migrate")
    assert set(job["metadata"]["annotations"]["helm.sh/hook"].split(",")) == {"pre-install", "pre-upgrade"}
    [script] = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert script.startswith("mailflow migrate && airflow pools set email_provider 4 ")
    with pytest.raises(SystemExit) as exc:
        main(["migrate", "--help"])  # the subcommand exists
    assert exc.value.code == 0


def test_executors_retention_and_the_public_paths_match_the_product() -> None:
    from mailflow.orchestration.webhooks import URL_PREFIX

    values = yaml.safe_load((DEPLOY / "helm" / "values.yaml").read_text())
    assert values["executor"] == "KubernetesExecutor,CeleryExecutor"
    assert values["dags"]["gitSync"]["subPath"] == "dags"
    [dag_id] = re.findall(r'task\.dag_id == "([a-z_]+)"', DOC)
    assert f'dag_id="{dag_id}"' in (ROOT / "dags" / f"{dag_id}.py").read_text()
    cron = _by_kind("CronJob", "airflow-db-clean")["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    assert cron["args"][0].startswith("airflow db clean --yes ") and "dag_run" in cron["args"][0]
    locations = re.findall(r"location (/\S+) \{", (DEPLOY / "nginx" / "mailflow.conf").read_text())
    assert locations == [f"{settings.UNSUBSCRIBE_PATH}/", f"{URL_PREFIX}/"]
    [base] = re.findall(r"^FROM (\S+)", (DEPLOY / "astro" / "Dockerfile").read_text(), flags=re.M)
    assert base.startswith("astrocrpublic.azurecr.io/runtime:3.")
