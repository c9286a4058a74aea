"""The router's own load (D22 in docs/decisions.md): requests this worker has sent
upstream and not yet finished, and CAR's ``waiting`` estimate built from them (§11).

§11's ``waiting`` only moves when an instance reports load (heartbeats, about once a second), so
a burst routed between two reports would all see the same queues. :class:`InFlight` (one per
service, fed by the proxy) counts the requests this worker has dispatched and not yet finished;
CAR's ``waiting`` of an instance is its reported ``waiting_requests_num`` plus the requests in
flight that were dispatched *after* that report was received, the first of them excepted when
the report showed an empty queue (that one is admitted, not queued) (:func:`waiting_estimate`).
Requests dispatched before the report are already in it (queued ones in ``waiting``, admitted
ones not waiting at all), so adding them would count them twice. With nothing in flight the
estimate is the reported value: §11 exactly.

Threads: request threads call :meth:`InFlight.begin`, :meth:`Dispatch.release` and
:meth:`InFlight.snapshot` concurrently; one lock guards the ledger, held only to copy or update
it (no I/O under it). Nothing here raises.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping, Optional, Sequence

from kvsvc.cluster.model import Instance


@dataclass(frozen=True)
class InFlightSnapshot:
    """The requests one worker had in flight at one moment, per instance.

    :ivar dispatched_at: instance ``host:port`` -> the ``time.monotonic()`` seconds at which
        each request still in flight was sent to it, ascending (the clock of
        :attr:`~kvsvc.cluster.registry.LoadMetrics.received_at`).
    """

    dispatched_at: Mapping[str, tuple[float, ...]] = field(
        default_factory=lambda: MappingProxyType({}))
    #: ``(host:port, dp_rank)`` -> the same, for the requests sent to one DP rank with
    #: ``X-data-parallel-rank`` (§15); requests sent without a rank are absent.
    by_rank: Mapping[tuple[str, int], tuple[float, ...]] = field(
        default_factory=lambda: MappingProxyType({}))

    def rank_total(self, name: str, dp_rank: int) -> int:
        """Requests in flight to rank ``dp_rank`` of ``name`` (sent with that rank)."""
        return len(self.by_rank.get((name, dp_rank), ()))

    def rank_after(self, name: str, dp_rank: int, since: float) -> int:
        """Requests in flight to rank ``dp_rank`` of ``name`` dispatched strictly after
        ``since`` (monotonic s)."""
        times = self.by_rank.get((name, dp_rank), ())
        return len(times) - bisect.bisect_right(times, since)

    def total(self, name: str) -> int:
        """Requests in flight to ``name``."""
        return len(self.dispatched_at.get(name, ()))

    def after(self, name: str, since: float) -> int:
        """Requests in flight to ``name`` dispatched strictly after ``since`` (monotonic s)."""
        times = self.dispatched_at.get(name, ())
        return len(times) - bisect.bisect_right(times, since)


#: Nothing in flight (policies called without a ledger).
NO_IN_FLIGHT = InFlightSnapshot()


class Dispatch:
    """One request in flight, counted against each of its instances until :meth:`release`.

    Built by :meth:`InFlight.begin` only.
    """

    __slots__ = ("_ledger", "_key", "names", "rank")

    def __init__(self, ledger: "InFlight", key: int, names: tuple[str, ...],
                 rank: Optional[tuple[str, int]] = None) -> None:
        self._ledger = ledger
        self._key = key
        self.names = names
        self.rank = rank

    def release(self) -> bool:
        """Stop counting this request. Idempotent and thread-safe: only the first call counts.

        :returns: True on the call that released it, False on later calls.
        """
        return self._ledger._end(self._key, self.names, self.rank)


class InFlight:
    """Requests this worker has dispatched upstream and not yet finished, per instance
    (D22 in docs/decisions.md: CAR's waiting estimate). One per service, built by
    :class:`kvsvc.service.Service` and shared by its proxy and router; the proxy calls :meth:`begin` when it sends a
    request and releases the :class:`Dispatch` exactly once when the response has been
    relayed, failed, or the client went away; the policy reads a :meth:`snapshot` on the
    request path (a copy under the lock, no I/O). Thread-safe.

    :param clock: monotonic seconds, the registry's clock (``time.monotonic``).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._keys = itertools.count(1)
        # name -> dispatch key -> dispatch time. Times are taken under the lock, so each dict
        # is in ascending time order (insertion order survives deletions).
        self._open: dict[str, dict[int, float]] = {}
        self._open_rank: dict[tuple[str, int], dict[int, float]] = {}

    def begin(self, names: Sequence[str], rank: Optional[tuple[str, int]] = None) -> Dispatch:
        """Count one request as in flight on each of ``names`` (e.g. its P and its D), from
        now.

        :param names: instance ``host:port`` names; duplicates count once.
        :param rank: ``(host:port, dp_rank)`` when the request is sent to one DP rank
            (``X-data-parallel-rank``, §15): counted for that rank too.
        :returns: the handle whose :meth:`Dispatch.release` ends the count.
        """
        unique = tuple(dict.fromkeys(names))
        with self._lock:
            key = next(self._keys)
            now = self._clock()
            for name in unique:
                self._open.setdefault(name, {})[key] = now
            if rank is not None:
                self._open_rank.setdefault(rank, {})[key] = now
        return Dispatch(self, key, unique, rank)

    def _end(self, key: int, names: tuple[str, ...],
             rank: Optional[tuple[str, int]] = None) -> bool:
        ended = False
        with self._lock:
            for name in names:
                open_ = self._open.get(name)
                if open_ is not None and open_.pop(key, None) is not None:
                    ended = True
                    if not open_:
                        del self._open[name]
            if rank is not None:
                by_rank = self._open_rank.get(rank)
                if by_rank is not None and by_rank.pop(key, None) is not None \
                        and not by_rank:
                    del self._open_rank[rank]
        return ended

    def counts(self) -> dict[str, int]:
        """Instance ``host:port`` -> requests in flight (instances with none are absent)."""
        with self._lock:
            return {name: len(open_) for name, open_ in self._open.items()}

    def snapshot(self) -> InFlightSnapshot:
        """The dispatch times of every request in flight (copied under the lock)."""
        with self._lock:
            copy = {name: tuple(open_.values()) for name, open_ in self._open.items()}
            ranks = {key: tuple(open_.values()) for key, open_ in self._open_rank.items()}
        return InFlightSnapshot(MappingProxyType(copy), MappingProxyType(ranks))


def waiting_estimate(inst: Instance, in_flight: InFlightSnapshot) -> int:
    """CAR's ``waiting`` of a candidate (D22): its reported
    ``waiting_requests_num`` plus the requests this worker dispatched to it after that report
    was received and that are still in flight, less one when the report showed an empty queue.

    ``waiting`` counts queued requests, not admitted ones. Dispatches made before the report
    are part of it (queued or admitted), so they are not added again. After a report of a
    non-empty queue every new request queues behind it; after a report of an empty queue the
    instance admits the first new request at once, and only the ones after it queue.

    :returns: requests, >= 0; 0 without a load report.
    """
    if inst.load is None:
        return 0
    reported = inst.load.waiting_requests_num
    unreported = in_flight.after(inst.name, inst.load.received_at)
    if reported == 0:
        return max(0, unreported - 1)
    return reported + unreported


def rank_waiting_estimate(inst: Instance, dp_rank: int, in_flight: InFlightSnapshot) -> float:
    """CAR's ``waiting`` of one (instance, DP rank) pair (§15), the rule of
    :func:`waiting_estimate` applied to that rank: the rank's reported queue (its own value
    when the load report has per-rank values, else the instance's queue shared evenly over
    its ranks) plus the requests this worker sent to that rank after the report and still in
    flight, less one after a report of an empty queue.

    :returns: requests, >= 0 (a float: the even share need not be whole); 0 without a load
        report.
    """
    load = inst.load
    if load is None:
        return 0.0
    own = load.rank(dp_rank)
    reported = (float(own.waiting_requests_num) if own is not None
                else load.waiting_requests_num / max(1, inst.dp_size))
    unreported = in_flight.rank_after(inst.name, dp_rank, load.received_at)
    if reported == 0:
        return float(max(0, unreported - 1))
    return reported + unreported
