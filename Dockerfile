# The image of docker-compose.yaml (and a model for a team's own): the official Airflow 3.3.2 image
# (Python 3.11) plus mailflow's RUNTIME set and the package. Build: docker compose build
FROM apache/airflow:3.3.2-python3.11

# requirements.txt holds lower bounds only and nothing Airflow owns; naming apache-airflow at the
# image's own version (the official image's advice) keeps pip from moving Airflow, its providers or
# their libraries (mailflow_dev.runtime_install measures it). No test, lint or demo tools here:
# they are in requirements-dev.txt, which only the development venv and CI install.
COPY --chown=airflow:0 requirements.txt /opt/mailflow/requirements.txt
RUN pip install --no-cache-dir "apache-airflow==3.3.2" -r /opt/mailflow/requirements.txt

# The package (include/mailflow; not the development tools of include/mailflow_dev), editable:
# docker-compose.yaml mounts ./include over /opt/mailflow/include, so code changes need no rebuild; the entry point registers the
# `resend` connection type with Airflow's providers manager. --no-deps: its dependencies are the
# runtime set above (pyproject.toml declares the same set, plus Airflow and the postgres provider).
COPY --chown=airflow:0 pyproject.toml README.md /opt/mailflow/
COPY --chown=airflow:0 include/mailflow /opt/mailflow/include/mailflow
RUN pip install --no-cache-dir --no-deps -e /opt/mailflow \
 && python -c "import mailflow.sendloop.engine, mailflow.provider.hook; print('mailflow importable')"
