"""The send log store: PostgreSQL, named SQL statements, migrations and the contact policy.

* :mod:`~mailflow.store.send_log`: :class:`~mailflow.store.send_log.PostgresStore` (mint, save a
  batch, apply an outcome by index) and the contact guard (lock the users' contact rows, reserve
  addresses).
* :mod:`~mailflow.store.policy`: the contact policy (cooldown, frequency caps) and address hygiene.
* :mod:`~mailflow.store.migrate`: numbered migrations applied in order under an advisory lock.
* ``sql/queries/*.sql``: every statement, by name (:func:`mailflow.store.sql.query`);
  ``sql/migrations/NNNN_*.sql``: the schema.
"""
