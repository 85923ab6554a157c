"""Stateless prefill worker: batched prefill under a token budget, KV written to the pool."""

from worker.openmp import bound_openmp_spin

bound_openmp_spin()  # before torch loads (worker/openmp.py)
