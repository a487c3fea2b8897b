"""The Airflow-facing glue: everything that imports Airflow lives here (and in the provider hook).

* :mod:`~mailflow.orchestration.tasks`: the task callables the DAG files import lazily; they build the
  store, provider and renderer from Connections and call the plain Python below.
* :mod:`~mailflow.orchestration.alerts`, :mod:`~mailflow.orchestration.assets`, :mod:`~mailflow.orchestration.budgets`:
  notifiers, the send-log asset, time budgets against ``execution_timeout``.
* :mod:`~mailflow.orchestration.provider_info`: the ``resend`` connection type (entry point).
* :mod:`~mailflow.orchestration.ui`, :mod:`~mailflow.orchestration.unsubscribe`: the apps the plugins mount.

No imports here: the DAG files import ``mailflow.orchestration.alerts`` etc. at parse time.
"""
