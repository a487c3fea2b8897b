"""The shared send loop.

* :mod:`~mailflow.sendloop.engine`: send one stored chunk through the provider, apply the answer by
  index, re-send a strict refusal permissive once; reserve the request slot before a chunk is made.
* :mod:`~mailflow.sendloop.render`: a chunk -> one deterministic request body.

The vocabulary (outcome, apply_by_index, keys, clock) lives in :mod:`mailflow.model`: the store
and the provider speak it too (see the layer contract in pyproject.toml). No imports here.
"""
