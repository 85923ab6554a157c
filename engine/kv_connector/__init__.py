"""The KV connector: everything a worker does with the KV pool, one module per noun.

- :mod:`.connector`: :class:`KVConnector`, the one object workers use (load a cached prefix,
  load a manifest, save, swap space, release; it decides who releases what).
- :mod:`.pool_io`: :class:`PoolIO`, bytes to and from pool nodes (transfer backends, checksums).
- :mod:`.locator`: :class:`PoolLocator`, where the pool nodes are (the consistent-hash ring).
- :mod:`.swap`: swap spaces for preempted requests (host memory, or the pool through PoolIO).
- :mod:`.manifest`: :class:`Manifest`, a prefill's blocks as domain data.
- :mod:`.decode_start`: :class:`DecodeStart`, how a request reaches a decode worker
  (disaggregated, resumed or colocated).
- :mod:`.blocks`: copying blocks between the paged KV cache and transfer bytes.
- :mod:`.lease_keeper`: :class:`LeaseKeeper`, renews the leases of long reads and proves they held.
- :mod:`.load_failure`: what a failed KV load does (``--kv-load-failure-policy``), counted.
"""

from engine.kv_connector.blocks import ArenaBlock, LoadGuard, pack_blocks, unpack_blocks
from engine.kv_connector.connector import KVConnector
from engine.kv_connector.decode_start import DecodeStart
from engine.kv_connector.lease_keeper import LeaseKeeper, LeaseLostError
from engine.kv_connector.load_failure import KVLoadError, KVLoadFailurePolicy, KVLoadFailures
from engine.kv_connector.locator import PoolLocator
from engine.kv_connector.manifest import Manifest
from engine.kv_connector.pool_io import PoolIO
from engine.kv_connector.swap import HostSwapSpace, PoolSwapSpace, SwapSpace

__all__ = [
    "ArenaBlock", "DecodeStart", "HostSwapSpace", "KVConnector", "KVLoadError", "KVLoadFailurePolicy", "KVLoadFailures",
    "LeaseKeeper", "LeaseLostError", "LoadGuard", "Manifest", "PoolIO", "PoolLocator", "PoolSwapSpace",
    "SwapSpace", "pack_blocks", "unpack_blocks",
]
