"""The shared send loop and its vocabulary.

* :mod:`~mailflow.sendloop.engine`: send one stored chunk through the provider, apply the answer by
  index, re-send a strict refusal permissive once; reserve the request slot before a chunk is made.
* :mod:`~mailflow.sendloop.render`: a chunk -> one deterministic request body.
* :mod:`~mailflow.sendloop.outcome`: the rows, batches, run context and the outcome model
  (accepted / not sent / unknown / refused).
* :mod:`~mailflow.sendloop.apply_by_index`: a 2xx batch answer mapped onto request indices.
* :mod:`~mailflow.sendloop.keys`: idempotency keys.
* :mod:`~mailflow.sendloop.clock`: the clock the loop reads (a fake one in tests).

The vocabulary modules (outcome, apply_by_index, keys, clock) import nothing of the package: the
store and the provider speak it too (see the layer contract in pyproject.toml). No imports here.
"""
