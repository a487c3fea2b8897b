"""The send loop's vocabulary, spoken by the loop, the provider and the store alike.

* :mod:`~mailflow.model.outcome`: the rows, batches, run context and the outcome model
  (accepted / not sent / unknown / refused).
* :mod:`~mailflow.model.apply_by_index`: a 2xx batch answer mapped onto request indices.
* :mod:`~mailflow.model.keys`: idempotency keys.
* :mod:`~mailflow.model.clock`: the clock the loop reads (a fake one in tests).

These modules import nothing of mailflow outside this package (see the layer contract in
pyproject.toml). No imports here.
"""
