"""Continuous-batching decode worker: pulls prompt KV from the pool, streams tokens."""

from worker.openmp import bound_openmp_spin

bound_openmp_spin()  # before torch loads (worker/openmp.py)
