"""The requests waiting for an xLLM engine's ``Generations`` (§13 "Answer assembly"): a registry
keyed by ``service_req_id``, the sink the baidu_std server hands every entry to.

- :meth:`PendingRequests.open` registers a request before it is dispatched (an engine may send
  its first entry before the dispatch call returns) and gives its :class:`PendingRequest`;
  the request's HTTP thread reads its entries with :meth:`PendingRequest.next`.
- :meth:`PendingRequests.deliver` (the server's thread) puts each entry on its request's queue
  and answers at once, one bool per entry, in order: ``True`` when it was taken, ``False`` for
  an unknown ``service_req_id`` (never dispatched here, or already ended), a request whose
  client went away or that was cancelled (:meth:`PendingRequest.cancel`), or whose queue is full
  (the client reads slower than the engine writes: the request fails visibly rather than
  holding unbounded memory). The engine cancels a request that gets ``False`` (§13). It never
  waits on client I/O.
- :meth:`PendingRequest.fail` ends a request from outside (its instance died, went silent or
  was replaced): the HTTP thread's next read raises the error given.
- A request is removed from the registry when it ends (:meth:`PendingRequest.close`, always
  called by its reader), so later entries for it get ``False``.

Threads: the server's threads call :meth:`PendingRequests.deliver`, request threads the rest;
one lock for the registry's map and one condition per request. Nothing here blocks on I/O.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from kvsvc.errors import UpstreamError
from kvsvc.routing.answers import Generation

log = logging.getLogger(__name__)

#: Entries one request may hold unread before it fails (a client reading far slower than the
#: engine writes); a token per entry makes that several thousand tokens of lag.
MAX_QUEUED_ENTRIES = 8192


@dataclass(frozen=True, slots=True)
class PendingStats:
    """Counters of a registry since start.

    :ivar open: requests waiting now.
    :ivar delivered: entries taken.
    :ivar refused_unknown: entries answered ``False`` for an unknown ``service_req_id``.
    :ivar refused_cancelled: entries answered ``False`` for a request whose client went away
        or that was cancelled or failed.
    :ivar overflowed: requests failed because their queue was full.
    """

    open: int
    delivered: int
    refused_unknown: int
    refused_cancelled: int
    overflowed: int


class PendingRequest:
    """One request waiting for its entries (module docstring).

    :ivar service_req_id: the id sent to the engine.
    :ivar prefill: the P (or DEFAULT) instance, ``host:port``.
    :ivar decode: the D in P/D, ``""`` without.
    :ivar opened_at: ``time.monotonic()`` seconds of :meth:`PendingRequests.open`.
    """

    def __init__(self, owner: "PendingRequests", service_req_id: str, prefill: str,
                 decode: str, max_queued: int) -> None:
        self._owner = owner
        self.service_req_id = service_req_id
        self.prefill = prefill
        self.decode = decode
        self.opened_at = time.monotonic()
        self._cond = threading.Condition()
        self._queue: collections.deque[Generation] = collections.deque()
        self._max_queued = max_queued
        self._cancelled: Optional[str] = None
        self._failure: Optional[UpstreamError] = None
        self._closed = False
        self.last_entry_at = self.opened_at

    # -- the server's side ---------------------------------------------------------------

    def _put(self, gen: Generation) -> Optional[str]:
        """Queue one entry; ``None`` when taken, else why not."""
        with self._cond:
            if self._closed:
                return "ended"
            if self._cancelled is not None:
                return self._cancelled
            if self._failure is not None:
                return "failed"
            if len(self._queue) >= self._max_queued:
                self._failure = UpstreamError(
                    f"request {self.service_req_id}: more than {self._max_queued} entries "
                    "unread (the client reads slower than the engine writes)")
                self._cond.notify_all()
                return "overflow"
            self._queue.append(gen)
            self.last_entry_at = time.monotonic()
            self._cond.notify_all()
            return None

    # -- the reader's side ---------------------------------------------------------------

    def next(self, timeout_s: float) -> Optional[Generation]:
        """The next entry, waiting up to ``timeout_s`` seconds; ``None`` when none came.

        :raises UpstreamError: the request was failed (:meth:`fail`, or its queue overflowed).
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                if self._queue:
                    return self._queue.popleft()
                if self._failure is not None:
                    raise self._failure
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def drain(self) -> list[Generation]:
        """Every entry queued now, without waiting (empty when none)."""
        with self._cond:
            out = list(self._queue)
            self._queue.clear()
            return out

    def cancel(self, reason: str = "client went away") -> None:
        """The client went away or the request was cancelled: the next entry is answered
        ``False`` (the engine then cancels it). Idempotent."""
        with self._cond:
            if self._cancelled is None:
                self._cancelled = reason
            self._cond.notify_all()

    @property
    def cancelled(self) -> Optional[str]:
        """Why the request was cancelled, ``None`` while it was not."""
        with self._cond:
            return self._cancelled

    def fail(self, error: UpstreamError) -> None:
        """End the request with ``error`` (raised by the reader's :meth:`next` once the entries
        already queued are read); later entries are answered ``False``. The first failure
        wins."""
        with self._cond:
            if self._failure is None:
                self._failure = error
            self._cond.notify_all()

    def close(self) -> None:
        """The reader is done: remove the request from the registry (later entries get
        ``False``). Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._queue.clear()
        self._owner._remove(self)


class PendingRequests:
    """The registry of requests waiting for ``Generations`` (module docstring). Thread-safe;
    one per service.

    :param max_queued: entries one request may hold unread (>= 1).
    """

    def __init__(self, max_queued: int = MAX_QUEUED_ENTRIES) -> None:
        if max_queued < 1:
            raise ValueError("max_queued must be >= 1")
        self._max_queued = max_queued
        self._lock = threading.Lock()
        self._requests: dict[str, PendingRequest] = {}
        self._delivered = 0
        self._unknown = 0
        self._cancelled = 0
        self._overflowed = 0

    def open(self, service_req_id: str, prefill: str, decode: str = "") -> PendingRequest:
        """Register a request before its dispatch.

        :param service_req_id: unique per request (kvsvc's own id).
        :param prefill: its P (or DEFAULT) instance.
        :param decode: its D, ``""`` without P/D.
        :raises ValueError: ``service_req_id`` is already open.
        """
        req = PendingRequest(self, service_req_id, prefill, decode, self._max_queued)
        with self._lock:
            if service_req_id in self._requests:
                raise ValueError(f"service_req_id {service_req_id} is already open")
            self._requests[service_req_id] = req
        return req

    def get(self, service_req_id: str) -> Optional[PendingRequest]:
        """The open request of that id, ``None`` when there is none."""
        with self._lock:
            return self._requests.get(service_req_id)

    def _remove(self, req: PendingRequest) -> None:
        with self._lock:
            if self._requests.get(req.service_req_id) is req:
                del self._requests[req.service_req_id]

    def deliver(self, gens: Sequence[Generation]) -> list[bool]:
        """Hand one ``Generations`` call's entries to their requests; exactly one answer per
        entry, in order (§13: ``True`` taken, ``False`` unknown id, client gone, cancelled,
        failed or overflowed). Never blocks on a reader."""
        answers: list[bool] = []
        unknown = cancelled = overflowed = delivered = 0
        for gen in gens:
            with self._lock:
                req = self._requests.get(gen.service_req_id)
            if req is None:
                answers.append(False)
                unknown += 1
                continue
            why = req._put(gen)
            if why is None:
                delivered += 1
                answers.append(True)
                continue
            answers.append(False)
            if why == "overflow":
                overflowed += 1
                log.warning("request %s (%s): failed, %d entries unread", req.service_req_id,
                            req.prefill, self._max_queued)
            else:
                cancelled += 1
        if unknown or cancelled or overflowed or delivered:
            with self._lock:
                self._delivered += delivered
                self._unknown += unknown
                self._cancelled += cancelled
                self._overflowed += overflowed
        return answers

    def on_instance(self, name: str) -> list[PendingRequest]:
        """The open requests whose P or D is ``name``."""
        with self._lock:
            return [r for r in self._requests.values() if name in (r.prefill, r.decode)]

    def stats(self) -> PendingStats:
        """Counters since start (see :class:`PendingStats`)."""
        with self._lock:
            return PendingStats(len(self._requests), self._delivered, self._unknown,
                                self._cancelled, self._overflowed)
