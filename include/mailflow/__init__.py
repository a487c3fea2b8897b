"""mailflow: lifecycle and scheduled email campaigns for Apache Airflow 3, with an honest send log.

The engine (this package) is plain Python: it talks to a *store* of send-log rows (PostgreSQL)
and a *provider* of batches (a Resend-compatible HTTP API). Airflow DAGs in ``dags/`` only wire
connections, schedules and params to it.
"""

__version__ = "0.1.0"
