"""The KV pool: a DRAM block store for KV-cache blocks, served over gRPC (docs/design.md §4-§6).

Torch-free: imports only ``core``, the standard library, grpc, redis and prometheus-client.
Run it with ``python -m kv_pool``.
"""
