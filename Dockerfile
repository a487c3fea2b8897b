# The image of docker-compose.yaml: the official Airflow 3.3.2 image (Python 3.11) plus the
# project's pinned requirements and the mailflow package. Build: docker compose build
FROM apache/airflow:3.3.2-python3.11

# Pinned dependencies first (the layer is reused until requirements.txt changes). Installing
# apache-airflow at the image's own version keeps pip from up- or downgrading Airflow itself.
COPY --chown=airflow:0 requirements.txt /opt/mailflow/requirements.txt
RUN pip install --no-cache-dir "apache-airflow==3.3.2" -r /opt/mailflow/requirements.txt

# The package (include/mailflow), editable: docker-compose.yaml mounts ./include over
# /opt/mailflow/include, so code changes need no rebuild; the entry point registers the
# `resend` connection type with Airflow's providers manager.
COPY --chown=airflow:0 pyproject.toml README.md /opt/mailflow/
COPY --chown=airflow:0 include /opt/mailflow/include
RUN pip install --no-cache-dir --no-deps -e /opt/mailflow \
 && python -c "import mailflow.sendloop.engine, mailflow.provider.hook; print('mailflow importable')"
