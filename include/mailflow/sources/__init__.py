"""Audience sources: where a chunk of emails comes from. One loop, two sources.

* :mod:`mailflow.sources.lifecycle`: each run's data interval selects every campaign's audience
  page by page and mints it (``INSERT ... ON CONFLICT DO NOTHING``) through the store's contact
  guard (:meth:`mailflow.store.send_log.PostgresStore.mint_chunk`).
* :mod:`mailflow.sources.scheduled`: a campaign is provisioned once (one planned ``pending`` row per
  recipient) and dispatched as its rows fall due (``UPDATE ... FOR UPDATE SKIP LOCKED``).

Both send every chunk with the shared send loop (:func:`mailflow.sendloop.engine.send_chunk`) and
apply the answer through the same store. Sources never import each other (import contract).
"""
