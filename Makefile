# One target per thing a person does. Everything runs from the project venv (.venv).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: help venv demo airflow test test-fast lint typecheck bench chaos psql stop emulator clean

help:            ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

$(VENV)/.installed: requirements.txt requirements-dev.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -r requirements-dev.txt
	$(VENV)/bin/pip install --quiet --disable-pip-version-check --no-deps -e .
	touch $@

venv: $(VENV)/.installed  ## create .venv with the pinned development set (requirements-dev.txt) and the package (editable)

demo: venv       ## embedded Postgres + emulator + demo data + `airflow dags test lifecycle_emails` (DEMO_ARGS="--reset --users N --seed N --keep-db")
	$(PY) scripts/demo.py $(DEMO_ARGS)

airflow: venv    ## a local Airflow 3 UI (standalone) with the DAGs, plugins, connections, pool and demo data; prints URL + login (AIRFLOW_PORT=8080)
	$(PY) scripts/airflow_local.py up

test: venv       ## the whole suite (embedded Postgres, or TEST_DATABASE_URL when set)
	$(PY) -m pytest

test-fast: venv  ## unit tests only (no database, no HTTP server)
	$(PY) -m pytest tests/unit -q

lint: venv       ## ruff (incl. Airflow AIR rules), the import contracts (pyproject.toml), no import circle, mypy
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache
	PYTHONPATH=include $(PY) -m mailflow_dev.import_cycles
	$(VENV)/bin/mypy

bench: venv      ## benchmarks against a real Postgres and the emulator (not part of `make test`)
	$(PY) -m bench

chaos: venv      ## 200 kills of sender/dispatcher/reconciler under every provider fault kind (CHAOS_ARGS="--kills N --dsn ..."); then the contact-policy race (CONTACT_CHAOS_ARGS); then 30 kills of the webhook receiver under every webhook fault (FEEDBACK_CHAOS_ARGS); then bad audiences at full speed against the reputation guard (GUARD_CHAOS_ARGS); exit 1 if an invariant breaks
	$(PY) -m mailflow_dev.chaos $(CHAOS_ARGS)
	$(PY) -m mailflow_dev.contact_chaos $(CONTACT_CHAOS_ARGS)
	$(PY) -m mailflow_dev.chaos_feedback $(FEEDBACK_CHAOS_ARGS)
	$(PY) -m mailflow_dev.chaos_guard $(GUARD_CHAOS_ARGS)

psql: venv       ## open the demo's send log in psql (starts the embedded server if needed)
	$(PY) scripts/psql.py

stop: venv       ## stop `make airflow` (SIGINT to airflow standalone, then the emulator) and the embedded PostgreSQL servers
	$(PY) scripts/airflow_local.py down
	$(PY) -c "from mailflow_dev import devenv; [print(f'embedded PostgreSQL {p}:', devenv.stop_if_unused(p)) for p in (devenv.STATE / 'pgdata', devenv.TEST_PGDATA)]"

emulator: venv   ## the Resend-compatible emulator in the foreground on port 8025; accepts API key re_test_emulator (EMULATOR_ARGS="--api-key re_...")
	@echo "emulator: http://127.0.0.1:8025, API key re_test_emulator (Authorization: Bearer re_test_emulator)"
	$(VENV)/bin/mailflow emulator --port 8025 --outbox .demo/emulator-outbox.jsonl --control $(EMULATOR_ARGS)

clean: stop      ## remove the demo state (.demo: embedded database, outbox, Airflow home)
	rm -rf .demo

.PHONY: scale-demo
scale-demo: venv ## CeleryExecutor + 2 Celery workers (local Redis): per-worker tasks, aggregate rate, 429s
	$(PY) scripts/scale_demo.py $(SCALE_ARGS)
