"""chaos.probe.ClusterProbe on addresses alone (pods at their pod IPs), with no cluster of its own."""

from __future__ import annotations

import socket

from chaos.probe import ClusterProbe


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_probe_of_addresses_reads_each_and_has_no_processes():
    port = _closed_port()
    probe = ClusterProbe(None, {"kv_pool": f"127.0.0.1:{port}", "decode-0": f"127.0.0.1:{port}"})
    try:
        # nothing listens: each service counts as unreachable (not idle), none is skipped
        assert probe.busy() == {"kv_pool.unreachable": 1, "decode-0.unreachable": 1}
        assert probe.rss_bytes() == 0 and probe.rss_by_service() == {}
    finally:
        probe.close()
