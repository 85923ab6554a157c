"""chaos.netfilter on network namespaces made here, the way pods sit on a Kubernetes node: two
"pods" (namespaces with a veth each) on a bridge inside a third namespace, the "node", whose
netfilter sees their packets. Nothing touches this machine's own namespace: the bridge, the veths'
node ends and every rule live in the node namespace, removed with it.

Shown: a partition drops packets silently (a connect times out, it is not refused) and heals;
packet loss fails some connects but not all; a reset rule refuses a new connection (not a
timeout) and breaks an open one; a bandwidth cap slows a bulk transfer to about its rate; a
``tandem chaos --partition`` process stopped by SIGTERM or SIGINT mid-partition removes its rules
and chain before it exits; one killed by SIGKILL leaves them, and ``tandem chaos --cleanup``
removes them. Needs root, ``ip`` and ``iptables`` (skipped otherwise).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from chaos.netfilter import CHAIN, Netfilter
from tests.conftest import poll_until

pytestmark = [
    pytest.mark.netadmin,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("iptables") is None,
                       reason="needs root, ip and iptables (network namespaces and netfilter rules)"),
]

REPO = Path(__file__).resolve().parents[2]
PORT = 7070  # pod b accepts and holds each connection (closed when the peer closes)
BULK_PORT = 7071  # pod b sends BULK_BYTES to each connection, then closes it
BULK_BYTES = 1024 * 1024
CONNECT_TIMEOUT_S = 1.5  # a connect through a DROP rule never completes: the client gives up after this
# pod b's servers: one thread per port, one per held connection
SERVER = f"""
import socket, threading
def serve(port, handle):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(('0.0.0.0', port)); s.listen(64)
    while True:
        c = s.accept()[0]
        threading.Thread(target=handle, args=(c,), daemon=True).start()
def hold(c):
    while c.recv(4096): pass
    c.close()
def bulk(c):
    c.sendall(bytes({BULK_BYTES})); c.close()
threading.Thread(target=serve, args=({BULK_PORT}, bulk), daemon=True).start()
serve({PORT}, hold)
"""


@dataclass
class Pods:
    node: str  # the namespace that holds the bridge and the rules
    a: str
    b: str
    ip_a: str
    ip_b: str
    gateway: str  # the node's address on the bridge

    def exec(self, ns: str, *argv: str, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", ns, *argv], capture_output=True, text=True, timeout=60, **kwargs)

    def connect(self) -> str:
        """One TCP connect from pod a to pod b's server: "connected", "refused" or "timeout"."""
        code = ("import socket,sys\n"
                f"s=socket.socket(); s.settimeout({CONNECT_TIMEOUT_S})\n"
                f"try: s.connect(('{self.ip_b}', {PORT})); print('connected')\n"
                "except ConnectionRefusedError: print('refused')\n"
                "except OSError: print('timeout')\n")
        return self.exec(self.a, sys.executable, "-c", code).stdout.strip()

    def connects(self, n: int, timeout_s: float) -> int:
        """How many of ``n`` TCP connects from pod a to pod b succeed, each given ``timeout_s``."""
        code = ("import socket\nok=0\n"
                f"for _ in range({n}):\n"
                f"    s=socket.socket(); s.settimeout({timeout_s})\n"
                f"    try: s.connect(('{self.ip_b}', {PORT})); ok+=1\n"
                "    except OSError: pass\n"
                "    s.close()\n"
                "print(ok)\n")
        return int(self.exec(self.a, sys.executable, "-c", code).stdout.strip())

    def bulk_s(self) -> float:
        """Seconds pod a takes to receive BULK_BYTES from pod b (raises when it gets fewer)."""
        code = ("import socket,time\n"
                f"s=socket.create_connection(('{self.ip_b}', {BULK_PORT}), timeout=60); t=time.monotonic(); n=0\n"
                "while (b := s.recv(65536)): n += len(b)\n"
                "print(n, time.monotonic() - t)\n")
        n, seconds = self.exec(self.a, sys.executable, "-c", code).stdout.split()
        assert int(n) == BULK_BYTES
        return float(seconds)

    def netfilter(self) -> Netfilter:
        return Netfilter(["ip", "netns", "exec", self.node])


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True, timeout=30)


@pytest.fixture
def pods() -> Iterator[Pods]:
    tag = uuid.uuid4().hex[:6]
    names = Pods(f"tc-{tag}-node", f"tc-{tag}-a", f"tc-{tag}-b", "10.231.7.2", "10.231.7.3", "10.231.7.1")
    made: list[str] = []
    server = None
    try:
        for ns in (names.node, names.a, names.b):
            _ip("netns", "add", ns)
            made.append(ns)
        node = ["netns", "exec", names.node, "ip"]
        _ip(*node, "link", "add", "br0", "type", "bridge")
        _ip(*node, "link", "set", "br0", "up")
        # the node's address on the bridge, as a node's pod gateway: the resets a REJECT rule
        # sends from the node's netfilter are routed to the pods through it
        _ip(*node, "addr", "add", f"{names.gateway}/24", "dev", "br0")
        for pod, address, veth in ((names.a, names.ip_a, f"v{tag}a"), (names.b, names.ip_b, f"v{tag}b")):
            _ip(*node, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", pod)
            _ip(*node, "link", "set", veth, "master", "br0", "up")
            _ip("netns", "exec", pod, "ip", "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("netns", "exec", pod, "ip", "link", "set", "eth0", "up")
            _ip("netns", "exec", pod, "ip", "link", "set", "lo", "up")
        # Bridged packets through the node's iptables, as on a Kubernetes node (br_netfilter on;
        # read, not set: on an older kernel the setting is the whole machine's)
        if names.exec(names.node, "cat", "/proc/sys/net/bridge/bridge-nf-call-iptables").stdout.strip() != "1":
            pytest.skip("bridged packets do not cross iptables here (br_netfilter off)")
        server = subprocess.Popen(["ip", "netns", "exec", names.b, sys.executable, "-c", SERVER],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        poll_until(lambda: names.connect() == "connected", timeout_s=30, interval_s=0.2,
                   message="pod b's server to accept from pod a")
        yield names
    finally:
        if server is not None:
            server.kill()
            server.wait(timeout=10)
        for ns in reversed(made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _partition_process(pods: Pods, for_s: float = 600) -> subprocess.Popen:
    argv = [sys.executable, "-m", "tandem_cli.main", "chaos", "--partition", f"{pods.ip_a},{pods.ip_b}",
            "--for-s", str(for_s), "--netns", pods.node]
    return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_partition_drops_silently_and_heals(pods):
    netfilter = pods.netfilter()
    partition = netfilter.partition(pods.ip_a, pods.ip_b)
    try:
        assert netfilter.rules() == [
            f"-A {CHAIN} -s {pods.ip_a}/32 -d {pods.ip_b}/32 -m comment --comment tandem-chaos -j DROP",
            f"-A {CHAIN} -s {pods.ip_b}/32 -d {pods.ip_a}/32 -m comment --comment tandem-chaos -j DROP"]
        assert netfilter.jumps() == ["FORWARD", "OUTPUT"]
        assert pods.connect() == "timeout"  # dropped, not refused
        netfilter.heal(partition)
        assert netfilter.rules() == []
        assert pods.connect() == "connected"
        one_way = netfilter.partition(pods.ip_a, pods.ip_b, "to_client")  # b's answers (the SYN-ACK) dropped
        assert len(netfilter.rules()) == 1 and pods.connect() == "timeout"
        netfilter.heal(one_way)
    finally:
        assert netfilter.cleanup() == 0
    assert netfilter.jumps() == [] and netfilter.rules() == []
    assert pods.exec(pods.node, "iptables", "-n", "-L", CHAIN).returncode != 0  # the chain is gone
    assert pods.connect() == "connected"


def test_packet_loss_fails_some_connects_but_not_all(pods):
    netfilter = pods.netfilter()
    lossy = netfilter.lose(pods.ip_a, pods.ip_b, 0.5, "to_server")  # each SYN dropped with p = 0.5
    try:
        assert netfilter.rules() == [f"-A {CHAIN} -s {pods.ip_a}/32 -d {pods.ip_b}/32 -m statistic --mode random "
                                     "--probability 0.50000000000 -m comment --comment tandem-chaos -j DROP"]
        # 0.3 s is under the first SYN retransmission (1 s): a connect fails iff its SYN was dropped
        succeeded = pods.connects(40, timeout_s=0.3)
        assert 8 <= succeeded <= 32, succeeded  # Binomial(40, 0.5): outside it with p < 1e-4
        netfilter.heal(lossy)
        assert netfilter.rules() == []
        assert pods.connects(10, timeout_s=CONNECT_TIMEOUT_S) == 10
    finally:
        assert netfilter.cleanup() == 0


def test_a_reset_rule_refuses_new_connections_and_breaks_open_ones(pods):
    netfilter = pods.netfilter()
    # an open connection that, told to, sends a byte and waits 5 s for an answer pod b never sends
    code = ("import socket,sys\n"
            f"s=socket.create_connection(('{pods.ip_b}', {PORT}), timeout=5); print('open', flush=True)\n"
            "sys.stdin.readline()\n"
            "try: s.sendall(b'x'); s.recv(1); print('answered')\n"
            "except ConnectionResetError: print('reset')\n"
            "except TimeoutError: print('timeout')\n")
    held = subprocess.Popen(["ip", "netns", "exec", pods.a, sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert held.stdout.readline().strip() == "open"
        resets = netfilter.reset(pods.ip_a, pods.ip_b)
        assert netfilter.rules() == [
            f"-A {CHAIN} -s {pods.ip_a}/32 -d {pods.ip_b}/32 -p tcp -m comment --comment tandem-chaos "
            "-j REJECT --reject-with tcp-reset",
            f"-A {CHAIN} -s {pods.ip_b}/32 -d {pods.ip_a}/32 -p tcp -m comment --comment tandem-chaos "
            "-j REJECT --reject-with tcp-reset"]
        assert pods.connect() == "refused"  # at once, not a timeout: the SYN is answered with a reset
        output, _ = held.communicate("go\n", timeout=30)
        assert output.strip() == "reset"  # the open connection broke at its next packet
        netfilter.heal(resets)
        assert pods.connect() == "connected"
    finally:
        if held.poll() is None:
            held.kill()
            held.wait(timeout=10)
        assert netfilter.cleanup() == 0


def test_a_bandwidth_cap_slows_a_transfer_to_about_its_rate(pods):
    netfilter = pods.netfilter()
    uncapped_s = pods.bulk_s()
    rate = 256 * 1024
    cap = netfilter.cap(pods.ip_a, pods.ip_b, rate)  # burst: one second's bytes
    try:
        assert len(netfilter.rules()) == 2
        capped_s = pods.bulk_s()
        floor_s = (BULK_BYTES - rate) / rate  # the bytes past the burst at the capped rate: 3 s
        # a policer, not a shaper: within a factor of 2 of the rate either way (it counts the
        # segments as they cross the bridge, offloaded ones whole), hundreds of times the uncapped
        assert uncapped_s < 0.5 and 0.5 * floor_s <= capped_s <= 10 * floor_s, (uncapped_s, capped_s)
        netfilter.heal(cap)
        assert netfilter.rules() == [] and pods.bulk_s() < 1.0
    finally:
        assert netfilter.cleanup() == 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_partition_run_stopped_mid_partition_removes_its_rules(pods, sig):
    netfilter = pods.netfilter()
    process = _partition_process(pods)
    try:
        poll_until(lambda: len(netfilter.rules()) == 2, timeout_s=60, interval_s=0.2,
                   message="the partition's two rules")
        assert pods.connect() == "timeout"
        process.send_signal(sig)
        output, _ = process.communicate(timeout=60)
        assert process.returncode == 130, output
        assert "rules removed" in output
        assert netfilter.rules() == [] and netfilter.jumps() == []
        assert pods.connect() == "connected"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
        netfilter.cleanup()


def test_a_killed_partition_run_leaves_rules_that_cleanup_removes(pods):
    netfilter = pods.netfilter()
    process = _partition_process(pods)
    try:
        poll_until(lambda: len(netfilter.rules()) == 2, timeout_s=60, interval_s=0.2,
                   message="the partition's two rules")
        process.kill()  # SIGKILL: no handler runs
        process.wait(timeout=10)
        assert len(netfilter.rules()) == 2 and netfilter.jumps() == ["FORWARD", "OUTPUT"]
        done = subprocess.run([sys.executable, "-m", "tandem_cli.main", "chaos", "--cleanup", "--netns", pods.node],
                              cwd=REPO, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert f"removed 2 rule(s) and the {CHAIN} chain" in done.stdout
        assert netfilter.rules() == [] and netfilter.jumps() == []
        assert pods.connect() == "connected"
    finally:
        if process.poll() is None:
            process.kill()
        netfilter.cleanup()


@pytest.mark.parametrize(("kind", "args"), [("drop", []), ("loss", ["--loss", "0.5"]), ("reset", ["--reset"]),
                                            ("cap", ["--cap-bytes-per-s", "65536"])])
def test_a_partition_that_runs_its_course_heals_and_removes_the_chain(pods, kind, args):
    netfilter = pods.netfilter()
    done = subprocess.run([sys.executable, "-m", "tandem_cli.main", "chaos", "--partition", f"{pods.ip_a},{pods.ip_b}",
                           "--for-s", "0.5", "--direction", "to_server", *args, "--netns", pods.node],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{kind} {pods.ip_a} <-> {pods.ip_b} (to_server)" in done.stdout and "healed" in done.stdout
    assert netfilter.rules() == [] and netfilter.jumps() == []
