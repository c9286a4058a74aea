"""One snapshot (replay) attempt of a stream (§7): a ``DEALER`` request/reply client run on the
stream's own thread.

The stream thread opens a :class:`SnapshotAttempt` per recovery or resync: a fresh ``DEALER``
(linger 0) connected to the stream's replay endpoint sends ``[b"", start_seq]``. Because the
socket is new for every attempt, a late reply to an attempt that already timed out can never be
taken for a reply to the current one. The owner polls :attr:`SnapshotAttempt.socket` in its own
poller and calls :meth:`SnapshotAttempt.receive` when it is readable, so the reply is consumed
without ever blocking live reception.

Each data message (at most ``max_message_bytes``, all with the same watermark) is decoded (§2)
and applied with ``snapshot=True`` to a private new :class:`TierIndex` (unknown parents become
orphans, §5). The end marker completes the attempt with a :class:`SnapshotResult`.

Errors: a malformed message or reply raises :class:`~kvsvc.errors.SnapshotError` (its text says
what and why); the whole reply not arriving within ``replay_timeout_ms`` raises
:class:`~kvsvc.errors.SnapshotTimeout`. After either the attempt is finished: the owner closes
it and retries later (§6, :mod:`kvsvc.streams.recovery`).

Keeping the request path responsive while streams recover:

- **Gate** (:mod:`kvsvc.streams.gate`). A gated attempt connects its ``DEALER`` at once but
  sends its request only once connected *and* holding a permit; while queued nothing is sent,
  no reply deadline runs, and the owner polls the ticket's wake-up pipe. An unreachable engine
  never takes a permit; one that accepts the request and never answers holds it until
  ``replay_timeout_ms``. :meth:`SnapshotAttempt.close` returns the permit, and the owner closes
  the attempt on every way out (success, timeout, malformed reply, buffer overflow, a newer
  attempt, thread exit).
- **Sliced decode** (:mod:`kvsvc.streams.split`). A payload from :data:`SPLIT_MIN_BYTES` on is
  cut into groups of events of ~16 kB, each unpacked by ``ormsgpack`` in one short call.
- **Yields** (:mod:`kvsvc.streams.pacing`). Every ``BUILD_SLICE_S`` of decode/index work the
  building thread sleeps ``BUILD_YIELD_S``, which hands the GIL to a waiting request thread.
"""

from __future__ import annotations

import logging
import time
from typing import Generic, Optional, Self, Sequence, TypeVar, Union, cast

import ormsgpack
import zmq

from kvsvc.clock import MONOTONIC, Clock
from kvsvc.config import KvEventsConfig, StreamConfig
from kvsvc.errors import DecodeError, SnapshotError, SnapshotTimeout, StreamError
from kvsvc.events import Event
from kvsvc.index.tier_index import TierIndex
from kvsvc.streams.decoder import decode_batch, decode_event
from kvsvc.streams.frame import encode_snapshot_request, parse_reply
from kvsvc.streams.gate import GateTicket, SnapshotGate
from kvsvc.streams.pacing import BUILD_SLICE_S, BUILD_YIELD_S, build_timer_slack
from kvsvc.streams.state import SnapshotResult
from kvsvc.streams.split import SPLIT_GROUP_BYTES, check_single_object, split_batch

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
#: Reply payloads shorter than this (bytes) are unpacked whole: one ``unpackb`` of them holds
#: the GIL about one build slice, and splitting would cost more CPU than it saves there.
SPLIT_MIN_BYTES = 32 * 1024
#: Events applied to the snapshot index per call between two :meth:`SnapshotAttempt._pace`.
APPLY_SLICE_EVENTS = 4

_UNSET = object()

#: What an attempt's reply ends with (SnapshotResult; a history attempt's HistoryReply).
R = TypeVar("R")


class ReplayAttempt(Generic[R]):
    """One request/reply exchange on a fresh ``DEALER`` (§7, §7h); use :meth:`open`. The
    socket, gate, pacing and decoding of both replay modes; :meth:`feed` (what a reply message
    means) is the subclass's: :class:`SnapshotAttempt` (§7) and
    :class:`~kvsvc.streams.history_client.HistoryAttempt` (§7h).

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
    :ivar deadline: the clock's time by which the whole reply must have arrived;
        infinite while queued for a permit (no request is open then).
    :ivar requested_at: the clock's time when the request was sent; ``None`` before.
    """

    #: ``ZMQ_RCVHWM`` of the ``DEALER`` (``None``: libzmq's default, 1000 messages). A history
    #: reply sets 0 (unbounded): its engine sends every buffered batch at once from a ``ROUTER``
    #: that silently drops messages at its own send high-water mark when the receiver's queue
    #: is full, which would leave a hole in the reply's seqs (§7h).
    RCVHWM: Optional[int] = None

    def __init__(self, stream: StreamConfig, limits: KvEventsConfig, start_seq: int,
                 context: zmq.Context, poller: Optional[zmq.Poller],
                 gate: Optional[SnapshotGate], urgent: bool = True,
                 clock: Clock = MONOTONIC) -> None:
        """Build an attempt without a socket: use :meth:`open` for a real one. Built directly,
        an attempt only decodes what :meth:`feed` is given (tests of the reply rules).
        ``clock`` gives the deadlines' time (:mod:`kvsvc.clock`)."""
        self._clock = clock
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
        #: History-mode streams decode byte hashes to their integer form (§2).
        self._int_hashes = False

    @classmethod
    def open(cls, context: zmq.Context, stream: StreamConfig, limits: KvEventsConfig,
             start_seq: int, *, poller: Optional[zmq.Poller] = None,
             gate: Optional[SnapshotGate] = None, urgent: bool = True,
             clock: Clock = MONOTONIC) -> Self:
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
        :param clock: the time of :attr:`deadline` and :attr:`requested_at` (the owner's).
        :raises SnapshotError: the socket could not be created, connected or written.
        """
        attempt = cls(stream, limits, start_seq, context, poller, gate, urgent, clock)
        try:
            attempt._connect(immediate=gate is not None)
            if gate is None:
                attempt._send_request()
            else:
                attempt.deadline = attempt._clock.now() + attempt._timeout_ms / 1000.0
                attempt._watch(attempt._dealer, zmq.POLLOUT)
        except BaseException:
            attempt.close()
            raise
        return attempt

    @property
    def waiting(self) -> bool:
        """True until the request is sent (connecting, or queued for a gate permit)."""
        return self.requested_at is None and not self._closed

    def receive(self) -> Optional[R]:
        """Advance the attempt: consume the reply messages available now (at most
        ``MESSAGES_PER_RECEIVE`` and about ``RECEIVE_BUDGET_S``); before that, once connected
        take a gate permit or queue for one, and once holding one send the request.

        :returns: the reply's result (:meth:`feed`) once it ended, else ``None``.
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
            result = self.feed(frames)
            if result is not None or self._closed:
                # (Closed: a history catch-up's batch ended the attempt from inside feed.)
                return result
        self.check_deadline(self._clock.now())
        return None

    def _advance(self) -> None:
        """Phases 1 -> 2 -> 3 of a gated attempt (see the class docstring)."""
        ticket = self._ticket
        if ticket is None:
            try:
                events = cast(int, self._dealer.getsockopt(zmq.EVENTS))  # type: ignore[union-attr]
            except zmq.ZMQError as exc:
                raise SnapshotError(f"snapshot socket failed: {exc}") from exc
            if not events & zmq.POLLOUT:  # not connected yet
                self.check_deadline(self._clock.now())
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
            if self.RCVHWM is not None:
                sock.setsockopt(zmq.RCVHWM, self.RCVHWM)
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
        self.requested_at = self._clock.now()
        self.deadline = self.requested_at + self._timeout_ms / 1000.0
        self._watch(self._dealer, zmq.POLLIN)

    def feed(self, frames: list[bytes]) -> Optional[R]:
        """Handle one reply message (the subclass's rules).

        :param frames: the message's frames after the ``DEALER``.
        :returns: the reply's result once it ended, else ``None``.
        :raises SnapshotError: a malformed message or reply.
        """
        raise NotImplementedError

    def _apply_sliced(self, events: Sequence[Event]) -> None:
        """Apply a reply's ``events`` to the private index as a snapshot (§7: no unknown
        parent errors) in slices of :data:`APPLY_SLICE_EVENTS`, with :meth:`_pace` after each.

        :raises StreamError: an index error of an event (the caller adds the context).
        """
        apply = self._index.apply
        for i in range(0, len(events), APPLY_SLICE_EVENTS):
            apply(events[i:i + APPLY_SLICE_EVENTS], snapshot=True)
            self._pace()

    def _pace(self) -> None:
        """Yield the GIL when this thread has worked :data:`BUILD_SLICE_S` since the last
        yield (:mod:`kvsvc.streams.pacing`)."""
        now = time.perf_counter()
        if now - self._slice_start >= BUILD_SLICE_S:
            time.sleep(BUILD_YIELD_S)
            self._slice_start = time.perf_counter()

    def decode(self, payload: bytes) -> Sequence[Event]:
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
            whole = decode_batch(payload, rank, self._int_hashes).events
            check_single_object(payload)  # split_batch checks this itself
            return whole
        events: list[Event] = []
        append = events.append
        try:
            for group in groups:
                for raw in ormsgpack.unpackb(group)[0]:
                    append(decode_event(raw, self._int_hashes))
                self._pace()
        except (DecodeError, ValueError):  # ValueError: ormsgpack.MsgpackDecodeError included
            # The whole payload gives the exact answer: the error with its text ("event i:
            # ...", "payload is not valid MessagePack: ...").
            return decode_batch(payload, rank, self._int_hashes).events
        return events



def _wm(value: object) -> str:
    return "none" if value is None else str(value)


class SnapshotAttempt(ReplayAttempt[SnapshotResult]):
    """One snapshot request/reply exchange (§7); use :meth:`open` (see :class:`ReplayAttempt`)."""

    def feed(self, frames: list[bytes]) -> Optional[SnapshotResult]:
        """Handle one reply message (§7): a data message is decoded and applied to the
        attempt's private index; the end marker completes the attempt.

        :param frames: the message's frames after the ``DEALER`` (``[b"", watermark, payload]``
            or the 4-frame form).
        :returns: the :class:`SnapshotResult` on the end marker, else ``None``.
        :raises SnapshotError: as :meth:`receive`.
        """
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
        with build_timer_slack():
            try:
                self._apply_sliced(self.decode(reply.payload))
            except StreamError as exc:
                raise SnapshotError(f"snapshot reply: {exc}") from exc
        return None
