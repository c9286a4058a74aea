"""One snapshot (replay) attempt of a stream (§7), run on the stream's own thread.

The subscriber opens a :class:`SnapshotAttempt` per recovery or resync: a fresh ``DEALER``
(linger 0) connected to the stream's replay endpoint sends ``[b"", start_seq]``. Because the
socket is new for every attempt, a late reply to an attempt that already timed out can never be
taken for a reply to the current one. The subscriber registers :attr:`SnapshotAttempt.socket`
in its own poller and calls :meth:`SnapshotAttempt.receive` when it is readable, so the reply
is consumed without ever blocking live reception.

Each data message (at most ``max_message_bytes``, all with the same watermark) is decoded
(§2) and applied with ``snapshot=True`` to a private new :class:`TierIndex` (unknown parents
become orphans, §5). The end marker completes the attempt with a :class:`SnapshotResult`.
Errors: a malformed message or reply raises :class:`~kvsvc.errors.SnapshotError` (its text
says what and why); the whole reply not arriving within ``replay_timeout_ms`` raises
:class:`~kvsvc.errors.SnapshotTimeout`. After either the attempt is finished: the owner closes
it and retries later (§6).

Keeping the request path responsive while streams recover (bench 8, ``bench/load_recovering.py``).
A build is pure CPU under the GIL, and a request thread that wants the GIL waits until the
holder drops it: voluntarily, or forced after the 5 ms switch interval, and with many runnable
stream threads the forced hand-over often goes to another stream thread. Three measures:

- **Gate.** A directory shares one :class:`SnapshotGate` (``max_concurrent_snapshots``
  permits; FIFO, recoveries before periodic resyncs) among its streams. A gated attempt connects its ``DEALER`` at once but sends
  its request only once connected *and* holding a permit; while queued nothing is sent, no
  reply deadline runs, and the owner polls the ticket's wake-up pipe. An unreachable engine
  never takes a permit; one that accepts the request and never answers holds it until
  ``replay_timeout_ms``. :meth:`SnapshotAttempt.close` returns the permit, and the owner
  closes the attempt on every way out (success, timeout, malformed reply, buffer overflow, a
  newer attempt, thread exit). §6/§7 are unchanged: a queued stream is recovering (a resync:
  still serving) and buffers live deltas into its attempt as for any attempt in flight.
- **Sliced decode.** ``ormsgpack.unpackb`` of one 1 MiB reply message holds the GIL for 5-9 ms
  in one C call. :func:`split_batch` cuts a batch into groups of events of ~16 kB (event
  boundaries from ``msgpack``'s skipping, ~0.7 us per event), each unpacked by ``ormsgpack``
  in ~0.1 ms; see there for how it stays exact.
- **Yields.** Every :data:`BUILD_SLICE_S` (0.3 ms) of decode/index work the building thread
  sleeps :data:`BUILD_YIELD_S` (20 us), which hands the GIL to a waiting request thread. While
  it builds, the thread's timer slack is :data:`BUILD_TIMER_SLACK_NS` (:func:`set_timer_slack`;
  Linux's default 50 us made every such sleep cost ~60-80 us).

Measured (bench 8, 16 streams x 2,048 blocks recovering at once, 2 cores, 3 runs): query p99
while recovering 2.6-3.5x idle (recovering p99 ~475 us), route 1.8-2.4x; before, 14-44x and
28-84x. With a request thread spinning on a core the builder gets one slice per 5 ms switch
interval, and recovery takes seconds. Recovery with no request load: ~160-210 ms unsliced and
unbounded; ~350-540 ms with the gate, the re-packing split (each event packed again to find its
end, ~+35% decode CPU) and 60-80 us yields; ~180-190 ms now (side by side: 325 ms before;
query p99 while recovering 451-473 us against 458 us, 3.5-3.9x idle).
``max_concurrent_snapshots`` 2: ~250-350 ms, but query p99 ~5x. Bench 6 (one 262,144-block
snapshot, 1 MiB messages): the build's CPU went from 3.45 s to 2.35 s, its time from ~4.1-4.4 s
to ~2.4-2.6 s (raw decode + keys of the same payloads: 2.0-2.3 s).
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import msgpack
import ormsgpack
import zmq

from kvsvc.config import KvEventsConfig, StreamConfig
from kvsvc.errors import DecodeError, SnapshotError, SnapshotTimeout, StreamError
from kvsvc.events import Event
from kvsvc.index.tier_index import TierIndex
from kvsvc.streams.decoder import decode_event, decode_batch
from kvsvc.streams.frame import encode_snapshot_request, parse_reply

log = logging.getLogger(__name__)

#: ``zmq.MAXMSGSIZE`` is set this far above ``max_message_bytes``: it is a memory guard only
#: (libzmq drops the connection, so the error would be a timeout); the exact limit is checked
#: in frame parsing so the error names ``max_message_bytes``.
MAXMSGSIZE_HEADROOM = 4096

#: Reply messages handled per :meth:`SnapshotAttempt.receive` call, so that a large snapshot
#: does not starve live reception and the stop check of the stream loop.
MESSAGES_PER_RECEIVE = 64
#: ... and at most this much time (seconds) per call: the rest stays queued in the ``DEALER``
#: (still readable, so the owner's next poll returns at once).
RECEIVE_BUDGET_S = 0.010
#: Longest stretch (seconds) of decode/index work between two GIL yields while building
#: (bench 8: 0.3 ms keeps query p99 while recovering at ~3.5x idle, 0.5 ms at 4-5.3x).
BUILD_SLICE_S = 0.0003
#: The yield: a sleep this long releases the GIL so that a request thread waiting for it takes
#: it. Shorter sleeps let this thread take the GIL back before the waiter has woken up: with a
#: thread spinning on the other core it got the GIL at 10% of 0-5 us sleeps, 54% at 10 us, 92%
#: at 20 us (a sleep costs ~30-40 us then, with :data:`BUILD_TIMER_SLACK_NS`).
BUILD_YIELD_S = 0.00002
#: The building thread's timer slack (ns) while it builds: the kernel may end a sleep this
#: much late (Linux's default is 50 us, which made each yield cost 60-80 us instead of 30-40).
BUILD_TIMER_SLACK_NS = 1
#: Reply payloads shorter than this (bytes) are unpacked whole: at ~130 kB/ms one ``unpackb``
#: of them holds the GIL about one slice, and splitting costs up to ~10% more CPU there.
SPLIT_MIN_BYTES = 32 * 1024

_UNSET = object()


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


@dataclass(frozen=True, slots=True)
class SnapshotResult:
    """A complete snapshot reply (§7).

    :param index: the private new index holding the snapshot (not yet serving).
    :param empty: True when the reply held only the end marker: the engine state is empty and
        the watermark unknown (the first live batch received afterwards is the baseline).
    :param watermark: seq of the last live batch included; ``None`` when ``empty`` or when the
        engine had published no live batch yet (next expected seq 0).
    :param messages: data messages received.
    :param wire_bytes: total bytes of all reply messages, end marker included.
    """

    index: TierIndex
    empty: bool
    watermark: Optional[int]
    messages: int
    wire_bytes: int


class SnapshotAttempt:
    """One request/reply exchange on a fresh ``DEALER``; use :meth:`open`.

    Not thread-safe: created, used and closed on the stream's thread only.

    Without a gate the request is sent at once (queued by ZMQ until the connection is up).
    With a gate an attempt goes through three phases, each polled through :attr:`socket`:

    1. *connecting*: the ``DEALER`` (``ZMQ_IMMEDIATE``: nothing is queued to an incomplete
       connection) polled for ``POLLOUT`` until its connection is up. An engine that cannot
       be reached never takes a permit, and fails as before: no reply within
       ``replay_timeout_ms`` of :meth:`open`.
    2. *queued*: waiting for a permit, polling the ticket's pipe; nothing sent, no deadline.
    3. *requested*: the request is sent when the permit comes; the ``DEALER`` is polled for
       the reply, due within ``replay_timeout_ms`` of the request.

    :ivar socket: what the owner polls for this attempt (the ``DEALER``, or an ``int`` fd
        while queued). With a poller given to :meth:`open` the attempt keeps the
        registration current itself.
    :ivar start_seq: the ``start_seq`` sent (§7).
    :ivar deadline: ``time.monotonic()`` value by which the whole reply must have arrived;
        infinite while queued for a permit (no request is open then).
    :ivar requested_at: ``time.monotonic()`` when the request was sent; ``None`` before.
    """

    def __init__(self, stream: StreamConfig, limits: KvEventsConfig, start_seq: int,
                 context: zmq.Context, poller: Optional[zmq.Poller],
                 gate: Optional[SnapshotGate], urgent: bool = True) -> None:
        """Internal: use :meth:`open`."""
        self.socket: Union[zmq.Socket, int, None] = None
        self.start_seq = start_seq
        self.deadline = float("inf")
        self.requested_at: Optional[float] = None
        self._stream = stream
        self._context = context
        self._poller = poller
        self._gate = gate
        self._urgent = urgent
        self._ticket: Optional[GateTicket] = None
        self._dealer: Optional[zmq.Socket] = None
        self._max_message_bytes = limits.max_message_bytes
        self._timeout_ms = limits.replay_timeout_ms
        self._index = TierIndex(stream.block_size, stream.hash_seed, limits.max_blocks_per_stream)
        self._watermark: object = _UNSET
        self._messages = 0
        self._wire_bytes = 0
        self._done = False
        self._closed = False
        self._slice_start = time.perf_counter()

    @classmethod
    def open(cls, context: zmq.Context, stream: StreamConfig, limits: KvEventsConfig,
             start_seq: int, *, poller: Optional[zmq.Poller] = None,
             gate: Optional[SnapshotGate] = None, urgent: bool = True) -> "SnapshotAttempt":
        """Create the ``DEALER``, connect it to ``stream.replay_endpoint``, and send the
        request: at once without ``gate``, else once connected and holding a permit.

        :param context: the ZMQ context (thread-safe; the socket belongs to the caller's thread).
        :param stream: the stream (replay endpoint, block size, seed, rank).
        :param limits: ``max_message_bytes``, ``replay_timeout_ms``, ``max_blocks_per_stream``.
        :param start_seq: last applied seq + 1, or 0 (§7).
        :param poller: the owner's poller; :attr:`socket` is registered in it and re-registered
            from phase to phase, and unregistered by :meth:`close`. ``None``: the caller polls
            (or just calls :meth:`receive`).
        :param gate: the directory's :class:`SnapshotGate`; ``None``: no permit needed.
        :param urgent: a recovery (False: a periodic resync, queued behind recoveries).
        :raises SnapshotError: the socket could not be created, connected or written.
        """
        attempt = cls(stream, limits, start_seq, context, poller, gate, urgent)
        try:
            attempt._connect(immediate=gate is not None)
            if gate is None:
                attempt._send_request()
            else:
                attempt.deadline = time.monotonic() + attempt._timeout_ms / 1000.0
                attempt._watch(attempt._dealer, zmq.POLLOUT)
        except BaseException:
            attempt.close()
            raise
        return attempt

    @property
    def waiting(self) -> bool:
        """True until the request is sent (connecting, or queued for a gate permit)."""
        return self.requested_at is None and not self._closed

    def receive(self) -> Optional[SnapshotResult]:
        """Advance the attempt: consume the reply messages available now (at most
        ``MESSAGES_PER_RECEIVE`` and about ``RECEIVE_BUDGET_S``); before that, once connected
        take a gate permit or queue for one, and once holding one send the request.

        :returns: the :class:`SnapshotResult` once the end marker arrived, else ``None``.
        :raises SnapshotError: malformed message, watermark changing mid-reply, a payload that
            does not decode (§2) or cannot be applied (§5: hash conflict, block size, capacity),
            a socket error, or no pipe for queueing (out of file descriptors).
        :raises SnapshotTimeout: the deadline passed before the end marker.
        """
        if self.requested_at is None:
            self._advance()
            return None
        self._slice_start = started = time.perf_counter()
        for _ in range(MESSAGES_PER_RECEIVE):
            if time.perf_counter() - started >= RECEIVE_BUDGET_S:
                break
            try:
                frames = self._dealer.recv_multipart(flags=zmq.NOBLOCK)  # type: ignore[union-attr]
            except zmq.Again:
                break
            except zmq.ZMQError as exc:
                raise SnapshotError(f"snapshot receive failed: {exc}") from exc
            result = self._on_message(frames)
            if result is not None:
                return result
        self.check_deadline(time.monotonic())
        return None

    def _advance(self) -> None:
        """Phases 1 -> 2 -> 3 of a gated attempt (see the class docstring)."""
        ticket = self._ticket
        if ticket is None:
            try:
                events = self._dealer.getsockopt(zmq.EVENTS)  # type: ignore[union-attr]
            except zmq.ZMQError as exc:
                raise SnapshotError(f"snapshot socket failed: {exc}") from exc
            if not events & zmq.POLLOUT:  # not connected yet
                self.check_deadline(time.monotonic())
                return
            try:
                ticket = self._ticket = self._gate.request(self._urgent)  # type: ignore[union-attr]
            except OSError as exc:
                raise SnapshotError(f"snapshot permit queue failed: {exc}") from exc
            if not ticket.granted:
                self.deadline = float("inf")
                self._watch(ticket.fileno, zmq.POLLIN)
                return
        else:
            ticket.consume_wakeup()
            if not ticket.granted:
                return  # spurious wake-up: keep waiting
        self._send_request()

    def check_deadline(self, now: float) -> None:
        """:raises SnapshotTimeout: if ``now`` (monotonic seconds) is past the deadline."""
        if not self._done and now >= self.deadline:
            raise SnapshotTimeout(
                f"snapshot timeout: no complete reply within replay_timeout_ms={self._timeout_ms}")

    def close(self) -> None:
        """Unregister from the poller, close the ``DEALER`` (linger 0; a late reply is dropped
        with it) and return the gate permit or leave the gate's queue; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._watch(None, 0)
        if self._dealer is not None:
            self._dealer.close(linger=0)
        if self._ticket is not None and self._gate is not None:
            self._gate.release(self._ticket)

    def _watch(self, target: Union[zmq.Socket, int, None], events: int) -> None:
        """Make ``target`` the polled :attr:`socket` for ``events`` (unregistering the
        previous one)."""
        if self._poller is not None:
            if self.socket is not None:
                try:
                    self._poller.unregister(self.socket)
                except KeyError:
                    pass
            if target is not None:
                self._poller.register(target, events)
        self.socket = target

    def _connect(self, immediate: bool) -> None:
        """Create the ``DEALER`` and connect it to the replay endpoint.

        :param immediate: set ``ZMQ_IMMEDIATE`` (POLLOUT then means "connected").
        :raises SnapshotError: the socket could not be created or connected.
        """
        try:
            sock = self._context.socket(zmq.DEALER)
        except zmq.ZMQError as exc:
            raise SnapshotError(f"snapshot request to {self._stream.replay_endpoint} "
                                f"failed: {exc}") from exc
        self._dealer = sock
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes + MAXMSGSIZE_HEADROOM)
            if immediate:
                sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.connect(self._stream.replay_endpoint)
        except zmq.ZMQError as exc:
            raise SnapshotError(f"snapshot request to {self._stream.replay_endpoint} "
                                f"failed: {exc}") from exc

    def _send_request(self) -> None:
        """Send ``[b"", start_seq]`` on the ``DEALER`` and start the deadline.

        :raises SnapshotError: the socket could not be written (with ``ZMQ_IMMEDIATE``: the
            connection went down while queued).
        """
        try:
            # Without IMMEDIATE the DEALER queues the request until the connection is up;
            # NOBLOCK only guards against a full queue, which a fresh socket cannot have.
            self._dealer.send_multipart(  # type: ignore[union-attr]
                encode_snapshot_request(self.start_seq), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            raise SnapshotError(f"snapshot request to {self._stream.replay_endpoint} "
                                f"failed: {exc}") from exc
        self.requested_at = time.monotonic()
        self.deadline = self.requested_at + self._timeout_ms / 1000.0
        self._watch(self._dealer, zmq.POLLIN)

    def _on_message(self, frames: list[bytes]) -> Optional[SnapshotResult]:
        try:
            reply = parse_reply(frames, self._max_message_bytes)
        except StreamError as exc:
            raise SnapshotError(str(exc)) from exc  # its text already says "snapshot reply"
        self._wire_bytes += reply.wire_bytes
        if reply.is_end:
            self._done = True
            empty = self._messages == 0
            watermark = None if empty else self._watermark
            return SnapshotResult(index=self._index, empty=empty, watermark=watermark,  # type: ignore[arg-type]
                                  messages=self._messages, wire_bytes=self._wire_bytes)
        if self._watermark is _UNSET:
            self._watermark = reply.watermark
        elif reply.watermark != self._watermark:
            raise SnapshotError(f"snapshot reply watermark changed from {_wm(self._watermark)} "
                                f"to {_wm(reply.watermark)}")
        self._messages += 1
        slack = set_timer_slack(BUILD_TIMER_SLACK_NS)
        try:
            events = self._decode(reply.payload)
            apply = self._index.apply
            for i in range(0, len(events), APPLY_SLICE_EVENTS):
                apply(events[i:i + APPLY_SLICE_EVENTS], snapshot=True)
                self._pace()
        except StreamError as exc:
            raise SnapshotError(f"snapshot reply: {exc}") from exc
        finally:
            if slack is not None:
                set_timer_slack(slack)
        return None

    def _pace(self) -> None:
        """Yield the GIL when this thread has worked :data:`BUILD_SLICE_S` since the last
        yield (see the module docstring of :mod:`kvsvc.streams.snapshot`)."""
        now = time.perf_counter()
        if now - self._slice_start >= BUILD_SLICE_S:
            time.sleep(BUILD_YIELD_S)
            self._slice_start = time.perf_counter()

    def _decode(self, payload: bytes) -> list[Event]:
        """The events of one reply payload (§2): from :data:`SPLIT_MIN_BYTES` on, unpacked in
        groups of events (:func:`split_batch`) with GIL yields in between; a payload of another
        shape (or any unpack or decode error) goes through
        :func:`~kvsvc.streams.decoder.decode_batch` whole, which gives the exact answer and
        error text.

        :raises DecodeError: as :func:`~kvsvc.streams.decoder.decode_batch`, and bytes after
            the batch (:func:`check_single_object`).
        """
        rank = self._stream.dp_rank
        groups = (split_batch(payload, rank, self._pace, SPLIT_GROUP_BYTES)
                  if len(payload) >= SPLIT_MIN_BYTES else None)
        if groups is None:
            events = decode_batch(payload, rank).events
            check_single_object(payload)  # split_batch checks this itself
            return events
        events: list[Event] = []
        append = events.append
        try:
            for group in groups:
                for raw in ormsgpack.unpackb(group)[0]:
                    append(decode_event(raw))
                self._pace()
        except (DecodeError, ValueError):  # ValueError: ormsgpack.MsgpackDecodeError included
            # The whole payload gives the exact answer: the error with its text ("event i:
            # ...", "payload is not valid MessagePack: ...").
            return decode_batch(payload, rank).events
        return events


#: Events applied to the snapshot index per call between two :meth:`SnapshotAttempt._pace`.
APPLY_SLICE_EVENTS = 4

#: :func:`split_batch` cuts a batch's events into groups of at least this many bytes (one
#: event more at most): one ``ormsgpack.unpackb`` of a group takes ~0.1 ms.
SPLIT_GROUP_BYTES = 16 * 1024
#: What ``msgpack`` raises for a payload it cannot skip through: ``FormatError``,
#: ``StackError`` and its length limits are ``ValueError``; ``OutOfData`` (truncated) is not.
_SCAN_ERRORS = (ValueError, msgpack.UnpackException)


def split_batch(payload: bytes, expected_rank: int, pace: Callable[[], None],
                group_bytes: int = SPLIT_GROUP_BYTES) -> Optional[list[bytes]]:
    """The events of a batch ``[ts, events(, dp_rank)]`` (§2) cut into groups, each a small
    MessagePack payload ``[[event, ...]]`` that ``ormsgpack.unpackb`` decodes in ~0.1 ms, so
    that no single call holds the GIL for the whole payload (one 1 MiB reply message takes
    5-9 ms).

    ``ormsgpack`` does not say where an object ends, so the boundaries come from a
    ``msgpack.Unpacker`` that only skips (C code, ~0.7 us per event, no objects built);
    ``ormsgpack`` stays the parser. Each group's events sit inside two arrays, as in the batch,
    so ``ormsgpack``'s nesting limit applies to them exactly as to the whole payload. MessagePack
    lengths are self-describing, so both libraries end every object at the same byte.

    :param payload: the batch payload.
    :param expected_rank: the stream's DP rank; a batch carrying another gives ``None``.
    :param pace: called after each group (the caller's GIL yield).
    :param group_bytes: a group ends at the first event boundary this many bytes or more
        after its start (so a group holds at least one event).
    :returns: the groups, in order: ``ormsgpack.unpackb(group)[0]`` are the events a
        whole-payload ``unpackb`` holds at that place. ``None`` when the payload is not such
        an array, is malformed where ``msgpack`` looks (headers, lengths, truncation, nesting),
        has bytes after it, or has a ``ts`` or rank that :func:`decode_batch` would refuse: the
        caller then decodes it whole (same answer or error as before, just not sliced). A group
        can still fail in ``ormsgpack`` (say, invalid UTF-8, which ``msgpack`` does not check
        when skipping); the caller then decodes whole too.
    """
    size = len(payload)
    if size < 2 or payload[0] not in (0x92, 0x93):
        return None
    view = memoryview(payload)
    scan = _scanner(payload)
    groups: list[bytes] = []
    try:
        scan.read_array_header()
        ts = _scalar(scan, view)
        if type(ts) is not float and type(ts) is not int:
            return None
        count = scan.read_array_header()
        start = scan.tell()
        in_group = 0
        for _ in range(count):
            scan.skip()
            in_group += 1
            end = scan.tell()
            if end - start >= group_bytes:
                groups.append(_group(view[start:end], in_group))
                start, in_group = end, 0
                pace()
        if in_group:
            groups.append(_group(view[start:scan.tell()], in_group))
        if payload[0] == 0x93:
            rank = _scalar(scan, view)
            if rank is not None and (type(rank) is not int or rank != expected_rank):
                return None
    except _SCAN_ERRORS:  # ormsgpack's MsgpackDecodeError is a ValueError too
        return None
    return groups if scan.tell() == size else None


def check_single_object(payload: bytes) -> None:
    """Refuse bytes after the first MessagePack object of ``payload`` (§2: a payload is one
    batch). ``ormsgpack.unpackb`` decodes the first object and ignores the rest, so a snapshot
    message holding a batch plus anything (a second batch with removals, say) would otherwise
    be taken for that batch alone. Costs a ``msgpack`` skip (~0.6 us per kB): paid on snapshot
    messages, not on live ones (README "Where the spec is silent").

    :param payload: a payload ``ormsgpack`` decoded without error.
    :raises DecodeError: naming how many bytes follow the batch.
    """
    scan = _scanner(payload)
    try:
        scan.skip()
    except _SCAN_ERRORS:
        # Beyond msgpack's own limits (nesting) where ormsgpack decoded it: nothing to say.
        return
    extra = len(payload) - scan.tell()
    if extra:
        raise DecodeError(f"payload has {extra} byte{'' if extra == 1 else 's'} after its "
                          f"batch (a payload is one batch, §2)")


def _scanner(payload: bytes) -> msgpack.Unpacker:
    """A ``msgpack.Unpacker`` fed with ``payload``, for skipping through it. Every
    ``max_*_len`` limit defaults from ``max_buffer_size``: no valid object of this payload can
    exceed them."""
    scan = msgpack.Unpacker(max_buffer_size=max(len(payload), 1))
    scan.feed(payload)
    return scan


def _scalar(scan: msgpack.Unpacker, view: memoryview) -> Any:
    """The next object of ``scan`` (skipped there), decoded by ``ormsgpack``.

    :raises ValueError: either library refuses it (or ``msgpack.OutOfData``: truncated).
    """
    start = scan.tell()
    scan.skip()
    return ormsgpack.unpackb(view[start:scan.tell()])


def _group(events: memoryview, count: int) -> bytes:
    """``[[events...]]``: ``count`` encoded events wrapped in two array headers."""
    if count < 16:
        head = bytes((0x91, 0x90 | count))
    elif count < 0x10000:
        head = b"\x91\xdc" + count.to_bytes(2, "big")
    else:
        head = b"\x91\xdd" + count.to_bytes(4, "big")
    return head + events


def _load_prctl() -> Optional[Callable[..., int]]:
    """libc's ``prctl`` on Linux, else ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover - a Linux without a usable libc
        return None


_PRCTL = _load_prctl()
_PR_SET_TIMERSLACK, _PR_GET_TIMERSLACK = 29, 30


def set_timer_slack(ns: int) -> Optional[int]:
    """Set the calling thread's timer slack (Linux ``PR_SET_TIMERSLACK``: how late the kernel
    may end its sleeps and timed waits, to batch wake-ups).

    :param ns: the new slack in nanoseconds, >= 1 (0 would mean "the default").
    :returns: the slack it had, to set back; ``None`` where the call is not available or
        failed (then nothing changed).
    """
    if _PRCTL is None:
        return None
    previous = _PRCTL(_PR_GET_TIMERSLACK, ctypes.c_ulong(0), ctypes.c_ulong(0),
                      ctypes.c_ulong(0), ctypes.c_ulong(0))
    if previous <= 0 or _PRCTL(_PR_SET_TIMERSLACK, ctypes.c_ulong(ns), ctypes.c_ulong(0),
                                ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
        return None
    return previous


def _wm(value: object) -> str:
    return "none" if value is None else str(value)
