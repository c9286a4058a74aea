"""The snapshot gate: a bound on the snapshot attempts running at once across streams (§6, §7).

A directory shares one :class:`SnapshotGate` (``max_concurrent_snapshots`` permits) among its
streams. Decoding and indexing a snapshot is pure CPU under the GIL; with the gate, streams that
recover at once take turns instead of all competing with the request threads. Permits are
handed out first come, first served, recoveries (``urgent``) before periodic resyncs (D3 in
docs/decisions.md).

A stream asks for a :class:`GateTicket` once its ``DEALER`` is connected
(:class:`~kvsvc.streams.snapshot_client.SnapshotAttempt`); a ticket that had to queue carries a
pipe whose read end the stream thread polls, so a waiting stream sleeps instead of spinning.
§6/§7 are unchanged by the gate: a queued stream is recovering (a resync: still serving) and
buffers live batches into its attempt as for any attempt in flight.

Thread-safe: stream threads request and release; anyone may read :meth:`SnapshotGate.stats`.
"""

from __future__ import annotations

import collections
import os
import threading
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True, slots=True)
class GateStats:
    """Counters of a :class:`SnapshotGate` (a copy taken under its lock).

    :param permits: snapshot builds allowed at once.
    :param in_use: permits held right now.
    :param waiting: tickets queued for a permit right now.
    :param max_in_use: most permits ever held at the same time (never above ``permits``).
    :param granted: permits handed out since the gate was built.
    :param waited: of those, permits that had to be queued for.
    """

    permits: int
    in_use: int
    waiting: int
    max_in_use: int
    granted: int
    waited: int


class GateTicket:
    """One claim on a :class:`SnapshotGate` permit; get it from :meth:`SnapshotGate.request`.

    A ticket that had to queue owns a non-blocking pipe: the gate writes one byte to it when
    it grants the permit, so the waiting stream thread sleeps in its poll (the read end is
    :attr:`fileno`) instead of spinning. :meth:`SnapshotGate.release` must be called exactly
    once per ticket (extra calls are no-ops); it also closes the pipe.
    """

    __slots__ = ("granted", "released", "_read_fd", "_write_fd")

    def __init__(self) -> None:
        self.granted = False
        self.released = False
        self._read_fd: Optional[int] = None
        self._write_fd: Optional[int] = None

    @property
    def fileno(self) -> Optional[int]:
        """The pipe's read end to poll while queued; ``None`` when granted at once."""
        return self._read_fd

    def _open_pipe(self) -> None:
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)

    def _notify(self) -> None:
        """Write the wake-up byte; caller holds the gate lock (so the pipe is still open)."""
        if self._write_fd is not None:
            try:
                os.write(self._write_fd, b"\x01")
            except BlockingIOError:  # pragma: no cover - one byte never fills a pipe
                pass

    def consume_wakeup(self) -> None:
        """Read the wake-up byte(s) (non-blocking); nothing to read is fine."""
        if self._read_fd is not None:
            try:
                os.read(self._read_fd, 64)
            except BlockingIOError:
                pass

    def _close_pipe(self) -> None:
        for fd in (self._read_fd, self._write_fd):
            if fd is not None:
                os.close(fd)
        self._read_fd = self._write_fd = None


class SnapshotGate:
    """Bounds the snapshot attempts (request, receive, build) that run at once across the
    streams sharing it. Permits are handed out first come, first served, recoveries before
    periodic resyncs (a recovering stream answers 0 hits; a resyncing one keeps serving).

    Thread-safe: stream threads request and release; anyone may read :meth:`stats`.

    :param permits: attempts allowed at once, >= 1.
    :raises ValueError: ``permits`` < 1.
    """

    def __init__(self, permits: int) -> None:
        if type(permits) is not int or permits < 1:
            raise ValueError(f"snapshot gate permits must be an integer >= 1, got {permits!r}")
        self._permits = permits
        self._lock = threading.Lock()
        self._in_use = 0
        self._urgent: collections.deque[GateTicket] = collections.deque()
        self._background: collections.deque[GateTicket] = collections.deque()
        self._max_in_use = 0
        self._granted = 0
        self._waited = 0

    @property
    def permits(self) -> int:
        """Attempts allowed at once."""
        return self._permits

    def request(self, urgent: bool = True) -> GateTicket:
        """A ticket: granted at once when a permit is free, else queued (with a wake-up pipe).

        :param urgent: a recovery (served before every queued non-urgent ticket); False for a
            periodic resync.
        :raises OSError: no pipe could be created (out of file descriptors).
        """
        ticket = GateTicket()
        with self._lock:
            # A permit is only ever free while nothing is queued (release hands it on).
            if self._in_use < self._permits:
                self._grant_locked(ticket)
                return ticket
            ticket._open_pipe()
            (self._urgent if urgent else self._background).append(ticket)
            self._waited += 1
            return ticket

    def release(self, ticket: GateTicket) -> None:
        """Give a ticket back: return its permit (handing it to the next queued ticket) or
        leave the queue. Idempotent; closes the ticket's pipe."""
        with self._lock:
            if ticket.released:
                return
            ticket.released = True
            if ticket.granted:
                self._in_use -= 1
                queue = self._urgent or self._background
                if queue:
                    nxt = queue.popleft()
                    self._grant_locked(nxt)
                    nxt._notify()
            elif ticket in self._urgent:
                self._urgent.remove(ticket)
            else:
                self._background.remove(ticket)
        # Outside the lock: the gate never writes to a released ticket's pipe any more.
        ticket._close_pipe()

    def stats(self) -> GateStats:
        """A copy of the counters (:class:`GateStats`)."""
        with self._lock:
            return GateStats(self._permits, self._in_use,
                             len(self._urgent) + len(self._background), self._max_in_use,
                             self._granted, self._waited)

    def _grant_locked(self, ticket: GateTicket) -> None:
        ticket.granted = True
        self._in_use += 1
        self._granted += 1
        if self._in_use > self._max_in_use:
            self._max_in_use = self._in_use

