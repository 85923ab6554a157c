"""Stateless prefill worker: batched prefill under a token budget, KV written to the pool."""
