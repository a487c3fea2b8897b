"""mailflow: lifecycle and scheduled email campaigns for Apache Airflow 3, with an honest send log.

The engine (this package) is plain Python: it talks to a *store* of send-log rows (PostgreSQL)
and a *provider* of batches (a Resend-compatible HTTP API). Airflow DAGs in ``dags/`` only wire
connections, schedules and params to it.

The map (one loop, two sources; docs/model.md; contracts in pyproject.toml ``[tool.importlinter]``):

* ``sources/`` (lifecycle per data interval, scheduled/ campaigns) feed ``sendloop/`` (engine,
  render, outcome model, apply by index, keys, clock), which sends through ``provider/`` (hook,
  client, shared pacer) and records in ``store/`` (send log, contact guard, policy, migrations, SQL).
* ``reconciler`` repairs claimed-but-unsent rows; ``feedback/`` polls bounces and serves unsubscribes.
* ``orchestration/`` is the Airflow glue (task callables, alerts, assets, budgets, provider info,
  UI); ``campaigns/`` holds the declarations; ``emulator/`` is the shipped Resend test double.
* Development tools live in the separate package ``mailflow_dev`` (never imported from here).
"""

__version__ = "0.1.0"
