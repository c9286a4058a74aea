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

Waking the readers (:meth:`PendingRequests.deliver_deferred`): a reader that waits is woken
by the first entry for it, but the readers made ready by one call are woken **one at a time**:
the server's thread wakes the first once it has answered the call, and each woken reader
passes the turn to the next ready one (:meth:`PendingRequest.release_turn`) just before it
writes, so at most two readers want the interpreter at once (one computing, one writing)
instead of every reader of the call together. A reader that is awake (writing, or woken by its
instance check) takes its entries itself and is skipped. A reader holding the turn releases it
before it writes, when it waits again, and when it closes: a slow client never holds it.

Threads: the server's threads call :meth:`PendingRequests.deliver`, request threads the rest;
one lock for the registry's map (its writers), one for the queue of ready readers and, per
request, one lock for its queue and state and one its reader sleeps on, released only when
the reader waits. Nothing here blocks on I/O.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

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

    The hand-over from the server's thread to the reader is a deque under one plain lock;
    the reader is woken (a lock it sleeps on, released by the producer) only when it waits:
    entries that arrive while it writes are taken in one go by its next :meth:`take`.

    :ivar service_req_id: the id sent to the engine.
    :ivar prefill: the P (or DEFAULT) instance, ``host:port``.
    :ivar decode: the D in P/D, ``""`` without.
    :ivar opened_at: ``time.monotonic()`` seconds of :meth:`PendingRequests.open`.
    :ivar last_entry_at: ``time.monotonic()`` seconds of the last entry taken (of
        :attr:`opened_at` before the first).
    """

    __slots__ = ("_owner", "service_req_id", "prefill", "decode", "opened_at", "_mutex",
                 "_wakeup", "_waiting", "_scheduled", "_has_turn", "_queue", "_convert",
                 "_max_queued", "_cancelled", "_failure", "_closed", "last_entry_at")

    def __init__(self, owner: "PendingRequests", service_req_id: str, prefill: str,
                 decode: str, max_queued: int) -> None:
        self._owner = owner
        self.service_req_id = service_req_id
        self.prefill = prefill
        self.decode = decode
        self.opened_at = time.monotonic()
        self._mutex = threading.Lock()
        # Held except while a waiting reader is being woken: the reader sleeps acquiring it,
        # the producer releases it once per wait (``_waiting``), both under ``_mutex``.
        self._wakeup = threading.Lock()
        self._wakeup.acquire()
        self._waiting = False
        self._scheduled = False   # in the registry's queue of ready readers
        self._has_turn = False    # woken by the turn: pass it on (release_turn)
        # Entries as delivered; ``_convert`` (the deliverer's) makes them Generations on the
        # reader's thread, outside the lock.
        self._queue: collections.deque[Any] = collections.deque()
        self._convert: Optional[Callable[[Any], Generation]] = None
        self._max_queued = max_queued
        self._cancelled: Optional[str] = None
        self._failure: Optional[UpstreamError] = None
        self._closed = False
        self.last_entry_at = self.opened_at

    def _wake(self) -> None:
        """Wake the reader if it waits (call under ``_mutex``)."""
        if self._waiting:
            self._waiting = False
            self._wakeup.release()

    # -- the server's side ---------------------------------------------------------------

    def _put(self, gen: Any, now: float, ready: list["PendingRequest"],
             convert: Optional[Callable[[Any], Generation]]) -> Optional[str]:
        """Queue one entry (``now``: ``time.monotonic()``; ``convert``: what makes it a
        :class:`Generation`, ``None``: it is one); ``None`` when taken, else why not. A reader
        that waits is appended to ``ready`` (once) to be woken in turn."""
        with self._mutex:
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
                self._wake()
                return "overflow"
            self._queue.append(gen)
            if convert is not None:
                self._convert = convert
            self.last_entry_at = now
            if self._waiting and not self._scheduled:
                self._scheduled = True
                ready.append(self)
            return None

    def _give_turn(self) -> bool:
        """Wake the reader with the turn; False when it does not wait (it is awake and takes
        its entries itself)."""
        with self._mutex:
            self._scheduled = False
            if not self._waiting:
                return False
            self._waiting = False
            self._has_turn = True
            self._wakeup.release()
            return True

    def release_turn(self) -> None:
        """Pass the turn to the next ready reader if this reader holds it (module docstring);
        the reader's thread calls it before it writes. Idempotent."""
        if self._has_turn:
            self._has_turn = False
            self._owner._next_turn()

    # -- the reader's side ---------------------------------------------------------------

    def _wait(self, deadline: float) -> bool:
        """Sleep until woken or ``deadline``; False when the deadline passed first (call
        with ``_mutex`` held: it is released while sleeping and held again on return)."""
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        self._waiting = True
        self._mutex.release()
        try:
            self._wakeup.acquire(timeout=left)
        finally:
            self._mutex.acquire()
        if self._waiting:   # timed out (or not yet woken): disarm
            self._waiting = False
        else:               # woken: the producer released it; hold it again
            self._wakeup.acquire(blocking=False)
        return True

    def take(self, timeout_s: float) -> list[Generation]:
        """Every entry queued, waiting up to ``timeout_s`` seconds for the first; ``[]`` when
        none came. Woken in turn, the reader holds the turn on return: it calls
        :meth:`release_turn` before it writes.

        :raises UpstreamError: the request was failed (:meth:`fail`, or its queue overflowed)
            and every entry queued before was taken.
        """
        self.release_turn()
        deadline = time.monotonic() + timeout_s
        try:
            with self._mutex:
                while True:
                    queue = self._queue
                    if queue:
                        out = list(queue)
                        queue.clear()
                        convert = self._convert
                        break
                    if self._failure is not None:
                        raise self._failure
                    if not self._wait(deadline):
                        self.release_turn()
                        return []
        except BaseException:
            self.release_turn()
            raise
        return out if convert is None else [convert(g) for g in out]

    def next(self, timeout_s: float) -> Optional[Generation]:
        """The next entry, waiting up to ``timeout_s`` seconds; ``None`` when none came.

        :raises UpstreamError: the request was failed (:meth:`fail`, or its queue overflowed).
        """
        self.release_turn()
        deadline = time.monotonic() + timeout_s
        try:
            with self._mutex:
                while True:
                    if self._queue:
                        gen = self._queue.popleft()
                        convert = self._convert
                        break
                    if self._failure is not None:
                        raise self._failure
                    if not self._wait(deadline):
                        return None
        finally:
            self.release_turn()
        return gen if convert is None else convert(gen)

    def drain(self) -> list[Generation]:
        """Every entry queued now, without waiting (empty when none)."""
        with self._mutex:
            out = list(self._queue)
            self._queue.clear()
            convert = self._convert
        return out if convert is None else [convert(g) for g in out]

    def cancel(self, reason: str = "client went away") -> None:
        """The client went away or the request was cancelled: the next entry is answered
        ``False`` (the engine then cancels it). Idempotent."""
        with self._mutex:
            if self._cancelled is None:
                self._cancelled = reason
            self._wake()

    @property
    def cancelled(self) -> Optional[str]:
        """Why the request was cancelled, ``None`` while it was not."""
        return self._cancelled

    def fail(self, error: UpstreamError) -> None:
        """End the request with ``error`` (raised by the reader's :meth:`next` once the entries
        already queued are read); later entries are answered ``False``. The first failure
        wins."""
        with self._mutex:
            if self._failure is None:
                self._failure = error
            self._wake()

    def close(self) -> None:
        """The reader is done: remove the request from the registry (later entries get
        ``False``). Idempotent."""
        self.release_turn()
        with self._mutex:
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
        # Readers made ready and not yet woken, in order; whether a reader holds the turn.
        self._ready_lock = threading.Lock()
        self._ready: collections.deque[PendingRequest] = collections.deque()
        self._turn_taken = False
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
        failed or overflowed). Never blocks on a reader; the readers are woken before it
        returns (in turn, module docstring)."""
        answers, wake = self.deliver_deferred(gens)
        if wake is not None:
            wake()
        return answers

    def deliver_deferred(self, gens: Sequence[Any],
                         convert: Optional[Callable[[Any], Generation]] = None
                         ) -> tuple[list[bool], Optional[Callable[[], None]]]:
        """:meth:`deliver` without waking the readers: the answers and the function that
        wakes them (in turn; ``None`` when no reader waits), for the caller to call once it
        has sent the answer (the engine waits on it; the readers do not hold up its thread
        meanwhile). The entries are queued already: a reader that is awake takes them without
        being woken.

        :param gens: the entries: :class:`Generation` values, or anything with a
            ``service_req_id`` that ``convert`` turns into one.
        :param convert: applied by the reader to each of its entries as it takes them (so
            only entries of open requests are converted, and not on the caller's thread);
            ``None``: the entries are Generations already.
        """
        # dict.get is atomic: the registry's lock is only for its writers and counters.
        requests = self._requests
        now = time.monotonic()
        ready: list[PendingRequest] = []
        answers: list[bool] = []
        unknown = cancelled = overflowed = delivered = 0
        for gen in gens:
            req = requests.get(gen.service_req_id)
            if req is None:
                answers.append(False)
                unknown += 1
                continue
            why = req._put(gen, now, ready, convert)
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
        with self._lock:
            self._delivered += delivered
            self._unknown += unknown
            self._cancelled += cancelled
            self._overflowed += overflowed
        return answers, (lambda: self._schedule(ready)) if ready else None

    def _schedule(self, ready: list[PendingRequest]) -> None:
        """Queue readers made ready; wake the first unless a reader holds the turn."""
        with self._ready_lock:
            self._ready.extend(ready)
            if self._turn_taken:
                return
            self._turn_taken = True
        self._next_turn()

    def _next_turn(self) -> None:
        """Give the turn to the next ready reader that waits, or end the turns."""
        while True:
            with self._ready_lock:
                if not self._ready:
                    self._turn_taken = False
                    return
                req = self._ready.popleft()
            if req._give_turn():
                return

    def on_instance(self, name: str) -> list[PendingRequest]:
        """The open requests whose P or D is ``name``."""
        with self._lock:
            return [r for r in self._requests.values() if name in (r.prefill, r.decode)]

    def stats(self) -> PendingStats:
        """Counters since start (see :class:`PendingStats`)."""
        with self._lock:
            return PendingStats(len(self._requests), self._delivered, self._unknown,
                                self._cancelled, self._overflowed)
