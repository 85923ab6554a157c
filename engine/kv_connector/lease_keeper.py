"""Keeps a worker's pool leases alive while it reads their blocks, and proves they held.

A read leases its blocks (``LocateBlocks``, TTL ``ttl_s``) and then copies them (GetBlocks,
a shared-memory copy, a NIXL transfer; mapped views wait for the step loop's copy). The pool
frees a lapsed request's blocks by itself, so a read that outlives its lease could copy slots
already freed or reused. The keeper closes that gap in two ways:

- **renewal**: one thread renews (``RenewLease``) the lease of every read still running
  ``renew_after`` x ``ttl_s`` after the lease was last known good. A read that ends sooner
  costs no RPC at all (the hot path is unchanged);
- **proof**: when a read ends, its lease is known to have held throughout if it ended within
  ``ttl_s`` x ``safety`` of the last good point (the pool's deadline is at least ``ttl_s``
  after it received the call, which we sent after that point); otherwise one ``RenewLease``
  naming the read's ``lease_id`` asks the pool. A lease the pool no longer holds under that id
  (released, lapsed, the pool restarted) fails the read with :class:`LeaseLostError`: its
  bytes are never handed to the model.

::

    t0 ──LocateBlocks──► copy ..................► end
    │◄──── renew_after·ttl ────►│ RenewLease      │ ended before t_good + safety·ttl: held
                                t_good ◄──────────┘ else RenewLease(lease_id) must say held
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from core.pool_client import PoolClient

log = logging.getLogger(__name__)


class LeaseLostError(Exception):
    """A read's pool lease lapsed or was released before the read ended: its bytes may be freed
    or reused ones."""


@dataclass(eq=False)
class LeaseWatch:
    """One running read of ``request_id``'s blocks on one pool node."""

    request_id: str
    client: PoolClient
    good_s: float  # monotonic: the lease surely held until good_s + safety * ttl_s
    next_s: float = 0.0  # monotonic: when the renewal thread renews it next
    lease_id: int = 0  # 0 until the read's LocateBlocks answered
    lost: bool = False  # a renewal found the lease gone
    num_renewals: int = 0


class LeaseKeeper:
    """Renews the leases of reads that run long; thread-safe (reads run in worker threads).

    ``ttl_s``: the lease TTL the reads ask for (seconds); ``renew_after`` and ``safety``: the
    fractions of it described above. Raises ValueError quoting a bad value.
    """

    def __init__(self, ttl_s: float, renew_after: float = 1 / 3, safety: float = 0.8,
                 clock: Callable[[], float] = time.monotonic):
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
        if not 0 < renew_after < safety <= 1:
            raise ValueError(f"need 0 < renew_after < safety <= 1, got {renew_after!r}, {safety!r}")
        self.ttl_s, self.renew_after, self.safety, self._clock = ttl_s, renew_after, safety, clock
        self.num_renewals = 0  # RenewLease calls that found the lease held
        self.num_lost = 0  # reads whose lease was found gone
        self._watches: set[LeaseWatch] = set()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def watch(self, request_id: str, client: PoolClient) -> LeaseWatch:
        """Starts watching a read about to lease its blocks; :meth:`finish` or :meth:`unwatch` it."""
        now_s = self._clock()
        watch = LeaseWatch(request_id, client, now_s, now_s + self.renew_after * self.ttl_s)
        with self._cond:
            self._watches.add(watch)
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="pool-lease-renew", daemon=True)
                self._thread.start()
            self._cond.notify()
        return watch

    def unwatch(self, watch: LeaseWatch) -> None:
        """Stops renewing (the read failed, or its views were copied). Idempotent."""
        with self._cond:
            self._watches.discard(watch)

    def finish(self, watch: LeaseWatch, lease_id: int, keep: bool = False) -> None:
        """The read ended with blocks leased under ``lease_id``: returns when the lease surely
        held throughout (no RPC when it ended in time). ``keep``: renew on while the blocks'
        mapped views wait to be copied (then :meth:`unwatch` it).

        Raises:
            LeaseLostError: the pool no longer holds that lease (or cannot say so).
        """
        with self._cond:
            stale = watch.lease_id and watch.lease_id != lease_id
            watch.lease_id = lease_id
            lost = watch.lost or stale
            in_time = self._clock() < watch.good_s + self.safety * self.ttl_s
        if not lost and not in_time:
            lost = not self._renew(watch)
        if lost or not keep:
            self.unwatch(watch)
        if lost:
            with self._cond:
                self.num_lost += 1
            raise LeaseLostError(f"the pool lease of {watch.request_id} on {watch.client.address} "
                                 f"did not hold until its read ended")

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._watches.clear()
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _renew(self, watch: LeaseWatch) -> bool:
        """One RenewLease; True when held (the watch's good point moves to when it was sent)."""
        with self._cond:
            sent_s, lease_id = self._clock(), watch.lease_id
        try:
            held = watch.client.renew_lease(watch.request_id, lease_id, self.ttl_s)
        except grpc.RpcError as err:  # cannot prove the lease: treat it as gone
            log.warning("lease renewal failed (%s)", err.code() if hasattr(err, "code") else err,
                        extra={"request_id": watch.request_id})
            held = False
        with self._cond:
            watch.next_s = sent_s + self.renew_after * self.ttl_s
            if held:
                watch.num_renewals += 1
                self.num_renewals += 1
                if lease_id:  # "whichever it holds" keeps the lease alive but proves nothing
                    watch.good_s = max(watch.good_s, sent_s)
            elif lease_id:  # before LocateBlocks answered, "none held" proves nothing either
                watch.lost = True
        if not held and lease_id:
            log.warning("pool lease %d on %s is gone while its read runs", lease_id, watch.client.address,
                        extra={"request_id": watch.request_id})
        return held

    def _run(self) -> None:
        """The renewal thread: renews each watched read ``renew_after`` x ttl after its good point."""
        while True:
            with self._cond:
                if self._closed:
                    return
                now_s = self._clock()
                live = [w for w in self._watches if not w.lost]
                due = [w for w in live if now_s >= w.next_s]
                if not due:
                    next_s = min((w.next_s for w in live), default=now_s + self.renew_after * self.ttl_s)
                    self._cond.wait(timeout=max(0.005, next_s - now_s))
                    continue
            for watch in due:
                self._renew(watch)
