"""Continuous-batching decode worker: pulls prompt KV from the pool, streams tokens."""
