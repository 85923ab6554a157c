"""How KV block bytes move between a worker and a pool node (docs/design.md §1): one interface,
:class:`~core.kv_transfer.backend.TransferBackend`, with gRPC, shared-memory and NIXL backends
chosen per pool node. Torch-free: backends move bytes, the KV connector owns tensors."""
