"""The producer's side of the public API: enqueue, batches, effects.

Re-exported by :mod:`jobs`; import from there.
"""
