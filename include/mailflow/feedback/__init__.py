"""What comes back from recipients and the provider.

* :mod:`~mailflow.feedback.deliverability`: poll the provider for bounces and complaints and
  suppress those addresses (the ``deliverability_feedback`` DAG).
* :mod:`~mailflow.feedback.unsubscribe_tokens`: signed per-user unsubscribe tokens (the renderer
  signs them into every email).
* :mod:`~mailflow.feedback.unsubscribe_app`: the one-click unsubscribe endpoint (ASGI), standalone
  with ``mailflow unsubscribe serve`` or mounted by an Airflow plugin.
"""
