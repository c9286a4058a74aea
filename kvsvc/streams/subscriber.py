"""The subscriber of one stream: the thread that owns its sockets and carries bytes and time
into its recovery rules (§1, §6, §7, §7h).

One :class:`StreamSubscriber` per (instance, DP rank), a
:class:`~kvsvc.lifecycle.BackgroundThread`. Its thread owns, in one ``zmq.Poller`` loop:

- the live connection (:class:`~kvsvc.streams.live.LiveConnection`: ``SUB`` + monitor),
- an inproc ``PULL`` through which :meth:`StreamSubscriber.close` wakes it,
- during a snapshot, one ``DEALER`` per attempt
  (:class:`~kvsvc.streams.snapshot_client.SnapshotAttempt`).

Each turn it feeds the recovery machine (:class:`~kvsvc.streams.recovery.SnapshotRecovery`,
or :class:`~kvsvc.streams.history.HistoryRecovery` for a ``history``-mode stream, §7h, whose
live batches also carry the XXH3-64 digest of their payload and whose byte hashes are decoded
to their integer form, §2; its attempts are
:class:`~kvsvc.streams.history_client.HistoryAttempt`, whose catch-up batches are handed to
the machine as they arrive):
the time (``tick``), monitor events (handshake, disconnect), live messages (framed §1 and
decoded §2 here: ``on_live_batch`` / ``on_live_error``), the end or failure of the attempt in
flight; and carries the machine's actions out (:mod:`kvsvc.streams.actions`: the serving ones
on the :class:`~kvsvc.streams.serving.ServingState` through
:class:`~kvsvc.streams.carrier.ActionCarrier`, then open or close a replay attempt). The poll
sleeps until the next deadline (attempt timeout, the machine's ``wakeup_at``, a delayed
``SUB`` reopen; at most :data:`POLL_INTERVAL_MS`), so an idle stream costs no CPU. A bug-class
exception in a turn is logged and handed to the machine (``on_internal_error``), which
discards the index and recovers: input must never kill the stream (D21 in docs/decisions.md).

Request threads only call :meth:`StreamSubscriber.match`, :meth:`StreamSubscriber.status` and
:meth:`StreamSubscriber.counters`, which read the :class:`~kvsvc.streams.serving.ServingState`
(under its lock, or its lock-free fast path) and never touch ZMQ.

Live batches are received in turns of at most :data:`LIVE_MESSAGES_PER_TURN` messages, each
turn holding the ``live_turns`` lock the directory shares among its streams, so that stream
threads do not hand the GIL to each other at every received frame (:mod:`kvsvc.directory`).
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import zmq
from xxhash import xxh3_64_intdigest

from kvsvc.clock import MONOTONIC, Clock
from kvsvc.config import KvEventsConfig, ReplayMode, StreamConfig
from kvsvc.errors import DecodeError, SnapshotError, StreamError
from kvsvc.events import Event
from kvsvc.index.overlay import BlockOverlay
from kvsvc.lifecycle import DEFAULT_TIMEOUT_S, BackgroundThread
from kvsvc.streams.counters import DecodeErrorReason, StreamCounters
from kvsvc.streams.decoder import decode_batch
from kvsvc.streams.frame import parse_live
from kvsvc.streams.gate import SnapshotGate
from kvsvc.streams.history import HistoryRecovery
from kvsvc.streams.history_client import HistoryAttempt
from kvsvc.streams.live import DISCONNECTED, HANDSHAKE_SUCCEEDED, LiveConnection
from kvsvc.streams.actions import AbandonSnapshot, Action, RequestHistory, RequestSnapshot
from kvsvc.streams.carrier import ActionCarrier
from kvsvc.streams.recovery import RecoveryRules, RecoveryView, SnapshotRecovery
from kvsvc.streams.serving import ServingState, shown_topic
from kvsvc.streams.snapshot_client import ReplayAttempt, SnapshotAttempt
from kvsvc.streams.state import HistoryReply, SnapshotResult, StreamId, StreamMatch, StreamStatus

log = logging.getLogger(__name__)

#: Longest poll wait when no deadline is nearer. close() wakes the poll through the thread's
#: wake-up socket, so this only bounds how long a lost wake-up could delay a stop.
POLL_INTERVAL_MS = 5_000
#: Live messages handled per poll turn before looking at the other sockets again.
LIVE_MESSAGES_PER_TURN = 256
#: Bound on the messages drained from the ``SUB`` just before a snapshot completes.
DRAIN_LIMIT = 10_000


@dataclass(frozen=True, slots=True)
class SubscriberView:
    """Read-only copy of a subscriber's internals, for tests and debugging (racy: taken off
    the stream thread without a lock).

    :param recovery: the recovery machine's bookkeeping.
    :param attempt_open: a snapshot attempt's socket is open.
    :param live_failures: failed live connections in a row (reopen backoff).
    :param waiting_for_live_turn: the thread has live messages to handle and waits for the
        shared ``live_turns`` lock.
    """

    recovery: RecoveryView
    attempt_open: bool
    live_failures: int
    waiting_for_live_turn: bool


class StreamSubscriber(BackgroundThread):
    """Subscriber of one stream (§1, §6, §7): its thread, sockets and serving state.

    :param stream: the stream's configuration (endpoints, topic, rank, block size, seed).
    :param limits: the §8 limits (message, buffer, capacity, timeouts).
    :param context: the ZMQ context; sockets are created and closed on the stream thread.
    :param gate: bounds the snapshot attempts running at once across the streams sharing it
        (the directory's); ``None``: unbounded. A stream queued for a permit is recovering
        (or, for a resync, still serving) and sends its request when the permit comes.
    :param live_turns: a lock shared by the streams of one directory, held while a stream
        thread drains its live socket (one turn); ``None``: a lock of this stream's own.
    :param pending: the stream's pending blocks (§16, :mod:`kvsvc.index.overlay`), settled by
        every live batch applied; ``None``: none.
    :param clock: the time of every timer rule (:mod:`kvsvc.clock`; a virtual clock in tests,
        which wakes the thread's poll when it jumps).

    :ivar stream_id: the stream's (instance, DP rank).
    :ivar block_size: tokens per block; callers compute query keys with it.
    :ivar hash_seed: the §4 seed; callers compute query keys with it.
    :ivar pending: the ``pending`` overlay given (the directory records dispatches in it).
    :ivar match: this stream's answer to a prefix query (§10):
        :meth:`kvsvc.streams.serving.ServingState.match` (lock-free for a prompt whose first
        block the stream does not hold).
    """

    #: A stream's serving state and recovery bookkeeping outlive its thread: a second run would
    #: start from them stale, so a closed subscriber is replaced, never restarted.
    restartable = False

    match: Callable[[Sequence[int]], StreamMatch]

    def __init__(self, stream: StreamConfig, limits: KvEventsConfig, context: zmq.Context,
                 gate: Optional[SnapshotGate] = None,
                 live_turns: Optional[threading.Lock] = None,
                 pending: Optional[BlockOverlay] = None, clock: Clock = MONOTONIC) -> None:
        self.stream = stream
        self.limits = limits
        self.stream_id = StreamId(stream.instance_name, stream.dp_rank)
        self.block_size = stream.block_size
        self.hash_seed = stream.hash_seed
        self._name = str(self.stream_id)
        super().__init__(f"kvsvc-stream-{self._name}")
        self._context = context
        self._clock = clock
        self._gate = gate
        self._live_turns = live_turns if live_turns is not None else threading.Lock()
        self._topic = stream.topic.encode("utf-8")
        self._serving = ServingState(self.stream_id, stream.block_size, stream.topic)
        self.pending = pending
        self._serving.pending = pending
        self.match = self._serving.match
        # The §7 rules (snapshot mode), or the §7h rules of a history-mode stream, whose live
        # batches also carry their payload digest (the catch-up anchor) and whose byte hashes
        # take the integer form (§2).
        self._history = stream.replay_mode is ReplayMode.HISTORY
        self._recovery: RecoveryRules
        if self._history:
            self._recovery = HistoryRecovery(stream, limits)
        else:
            self._recovery = SnapshotRecovery(stream, limits)
        # The rules' serving actions are carried out on the serving state (§6: each in one
        # lock hold); their attempt actions come back to _carry for the sockets.
        self._carrier = ActionCarrier(self._serving, self._recovery)

        # Owned by the stream thread from start() on.
        self._poller: Optional[zmq.Poller] = None
        self._live: Optional[LiveConnection] = None
        self._wake_pull: Optional[zmq.Socket] = None   # inproc PULL; close() pushes to it
        # Unique per subscriber, never id(self): a closed subscriber's inproc name is released
        # by ZMQ's reaper asynchronously, and a new object may reuse the old one's id at once.
        self._wake_endpoint = f"inproc://kvsvc-stream-wake-{uuid.uuid4().hex}"
        self._attempt: Optional[ReplayAttempt[Any]] = None
        self._attempt_id = 0
        self._waiting_for_turn = False

    # ------------------------------------------------------------------ public API

    def start(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Start the stream thread (daemon, named ``kvsvc-stream-<instance>/dp<rank>``).

        Returns once the thread has connected its sockets; the first snapshot request goes out
        at once (§6), as soon as the live ``SUB`` has connected.

        :param timeout_s: how long to wait for the thread to be running, seconds.
        :raises LifecycleError: already started, socket setup failed, or not running in time.
        """
        super().start(timeout_s)

    def close(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Stop the thread, which closes its sockets; idempotent, a no-op before start.

        :param timeout_s: join bound, seconds.
        :raises LifecycleError: the thread is still alive after ``timeout_s``.
        """
        super().close(timeout_s)

    def status(self) -> StreamStatus:
        """The stream's state, counts and counters (read under the stream lock)."""
        return self._serving.status()

    def counters(self) -> StreamCounters:
        """Copy of the stream's metrics counters (O(1): a few dict copies under the stream
        lock, never an index traversal)."""
        return self._serving.counters(self._clock.now(), self._recovery.buffered_bytes)

    @property
    def topic_mismatches(self) -> int:
        """Live messages dropped because their topic frame was not exactly the topic (§1)."""
        return self._serving.topic_mismatches

    @property
    def live_messages(self) -> int:
        """Live messages received with the exact topic (valid or not)."""
        return self._serving.live_messages

    @property
    def duplicates_dropped(self) -> int:
        """Batches with seq <= the swap watermark received after the swap (covered by it)."""
        return self._serving.duplicates_dropped

    @property
    def live_turns(self) -> threading.Lock:
        """The lock held while this stream's thread handles one turn of live messages."""
        return self._live_turns

    def debug_view(self) -> SubscriberView:
        """A racy copy of the internals (:class:`SubscriberView`) for tests and debugging."""
        live = self._live
        return SubscriberView(recovery=self._recovery.view(),
                              attempt_open=self._attempt is not None,
                              live_failures=live.failures if live is not None else 0,
                              waiting_for_live_turn=self._waiting_for_turn)

    # ------------------------------------------------------------------ thread

    def _setup(self) -> None:
        self._poller = zmq.Poller()
        self._wake_pull = self._context.socket(zmq.PULL)
        self._wake_pull.setsockopt(zmq.LINGER, 0)
        self._wake_pull.bind(self._wake_endpoint)
        self._poller.register(self._wake_pull, zmq.POLLIN)
        self._clock.add_waker(self._wake)
        self._live = LiveConnection(self._context, self.stream, self.limits, self._poller,
                                    self._name)
        self._live.open()
        self._carry(self._recovery.on_live_opened())

    def _loop(self) -> None:
        log.info("stream %s: subscribed to %s topic %r (replay %s)", self._name,
                 self.stream.endpoint, self.stream.topic, self.stream.replay_endpoint)
        try:
            self._carry(self._recovery.start(self._clock.now()))
            while not self.stopping:
                try:
                    self._turn()
                except zmq.ZMQError:
                    raise
                except Exception as exc:  # noqa: BLE001 - input must never kill the stream
                    # Only a bug in kvsvc gets here (input errors are StreamErrors).
                    log.exception("stream %s: internal error; recovering", self._name)
                    self._carry(self._recovery.on_internal_error(type(exc).__name__,
                                                                 self._clock.now()))
        except Exception:
            # A ZMQ failure: keep the stream visibly broken (BackgroundThread logs it).
            self._serving.crashed("internal error: stream thread crashed")
            raise

    def _teardown(self) -> None:
        self._clock.remove_waker(self._wake)
        if self._attempt is not None:
            self._attempt.close()
            self._attempt = None
        if self._live is not None:
            self._live.close()
        if self._wake_pull is not None:
            self._wake_pull.close(linger=0)
            self._wake_pull = None

    def _wake(self) -> None:
        """Interrupt the thread's poll (it may sleep up to ``POLL_INTERVAL_MS``) with one
        message from a PUSH created and closed here: ZMQ sockets are not shared between threads.
        inproc allows connecting before the thread has bound, and the message then waits."""
        try:
            push = self._context.socket(zmq.PUSH)
        except zmq.ZMQError as exc:  # context already terminated: nothing left to wake
            log.debug("stream %s: no wake-up sent: %s", self._name, exc)
            return
        try:
            push.connect(self._wake_endpoint)
            push.send(b"", flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # a full pipe already holds a wake-up
            log.debug("stream %s: no wake-up sent: %s", self._name, exc)
        finally:
            push.close(linger=100)

    def _turn(self) -> None:
        """One loop turn: feed the time, poll, handle what is readable, check the deadline."""
        recovery = self._recovery
        live = self._live
        assert live is not None and self._poller is not None
        now = self._clock.now()
        self._carry(recovery.tick(now))
        timeout_s = POLL_INTERVAL_MS / 1000.0
        if self._attempt is not None:
            timeout_s = min(timeout_s, self._attempt.deadline - now)
        wakeup = recovery.wakeup_at()
        if wakeup is not None:
            timeout_s = min(timeout_s, wakeup - now)
        if live.reopen_at is not None:
            timeout_s = min(timeout_s, live.reopen_at - now)
        ready = dict(self._poller.poll(max(0, int(timeout_s * 1000) + 1)))
        wake_pull = self._wake_pull
        if wake_pull is not None and wake_pull in ready:
            # close() (the loop checks the stop event next) or a clock that jumped (the next
            # turn reads it): the wake-ups are consumed so the next poll waits again.
            while True:
                try:
                    wake_pull.recv(flags=zmq.NOBLOCK)
                except zmq.Again:
                    return
        # Monitor first: a disconnect must be seen before data of a new connection.
        if live.monitor is not None and live.monitor in ready:
            self._on_monitor()
        if live.reopen_at is not None and self._clock.now() >= live.reopen_at:
            live.reopen()
            self._carry(recovery.on_live_opened())
        if live.sub is not None and live.sub in ready:
            self._waiting_for_turn = True
            with self._live_turns:
                self._waiting_for_turn = False
                recv = live.recv
                on_live = self._on_live
                for _ in range(LIVE_MESSAGES_PER_TURN):
                    frames = recv()
                    if frames is None:
                        break
                    on_live(frames)
        attempt = self._attempt
        if attempt is not None and attempt.socket in ready:
            try:
                result = attempt.receive()
            except StreamError as exc:
                self._carry(recovery.on_snapshot_failed(self._attempt_id, exc, self._clock.now()))
            else:
                if result is not None:
                    self._finish_attempt(attempt, result)
        elif attempt is not None:
            try:
                attempt.check_deadline(self._clock.now())
            except StreamError as exc:
                self._carry(recovery.on_snapshot_failed(self._attempt_id, exc, self._clock.now()))

    def _carry(self, actions: Sequence[Action], now: Optional[float] = None) -> None:
        """Carry out the machine's actions, in order: the serving ones on the serving state
        (:class:`~kvsvc.streams.carrier.ActionCarrier`), then the attempts opened or closed
        (an attempt opened, or one that cannot be opened, is reported back to it at once).

        :param now: monotonic seconds of the input (read here when not given).
        """
        if not actions:
            return
        for action in self._carrier.carry(actions, self._clock.now() if now is None else now):
            if type(action) is AbandonSnapshot:
                if action.attempt == self._attempt_id and self._attempt is not None:
                    self._attempt.close()  # unregisters it and returns its gate permit
                    self._attempt = None
            else:
                self._open_attempt(action)  # type: ignore[arg-type]

    def _open_attempt(self, request: "RequestSnapshot | RequestHistory") -> None:
        if self._attempt is not None:  # never left open by the machine; closed to be sure
            self._attempt.close()
            self._attempt = None
        self._attempt_id = request.attempt
        try:
            if type(request) is RequestHistory:
                sink = (self._history_sink(request.attempt) if request.anchor_digest is not None
                        else None)
                self._attempt = HistoryAttempt.open_history(
                    self._context, self.stream, self.limits, request.start_seq,
                    anchor_digest=request.anchor_digest, on_batch=sink, poller=self._poller,
                    gate=self._gate, urgent=request.urgent, clock=self._clock)
            else:
                self._attempt = SnapshotAttempt.open(self._context, self.stream, self.limits,
                                                     request.start_seq, poller=self._poller,
                                                     gate=self._gate, urgent=request.urgent,
                                                     clock=self._clock)
        except SnapshotError as exc:
            self._carry(self._recovery.on_snapshot_failed(request.attempt, exc,
                                                          self._clock.now()))
            return
        # Only now is the stream RECOVERING (and the request logged): a failed open leaves it
        # UNSYNCHRONIZED with the failure as its reason.
        self._carry(self._recovery.on_snapshot_opened(request.attempt, self._clock.now()))

    def _history_sink(self, attempt_id: int) -> Callable[[int, Sequence[Event], int, int], None]:
        """The catch-up batches of history attempt ``attempt_id`` go to the rules (§7h); what
        they return is carried out at once (it may close this very attempt)."""
        recovery = self._recovery
        assert isinstance(recovery, HistoryRecovery)

        def sink(seq: int, events: Sequence[Event], digest: int, wire_bytes: int) -> None:
            self._carry(recovery.on_history_batch(attempt_id, seq, events, digest, wire_bytes,
                                                  self._clock.now()))

        return sink

    def _finish_attempt(self, attempt: ReplayAttempt[Any],
                        result: "SnapshotResult | HistoryReply") -> None:
        """The end marker arrived: take in what already sits in the SUB queue first, so that
        fewer batches published before the snapshot arrive after the swap; then report it."""
        attempt_id = self._attempt_id
        self._drain()
        self._carry(self._recovery.on_snapshot_complete(attempt_id, result, attempt.requested_at,
                                                        self._clock.now()))

    def _drain(self) -> None:
        """Handle pending monitor events, then pending live messages (bounded)."""
        self._on_monitor()
        live = self._live
        assert live is not None
        for _ in range(DRAIN_LIMIT):
            frames = live.recv()
            if frames is None:
                return
            self._on_live(frames)

    def _on_monitor(self) -> None:
        live = self._live
        assert live is not None
        recovery = self._recovery
        while True:
            event = live.next_event()
            if event is None:
                return
            if event == HANDSHAKE_SUCCEEDED:
                now = self._clock.now()
                live.handshake(now)
                self._carry(recovery.on_live_up(now))
            elif event == DISCONNECTED:
                now = self._clock.now()
                reason = live.disconnected(now)
                self._carry(recovery.on_live_down(reason, now))
                if live.sub is None:
                    return  # closed until the delayed reopen: no more events to read

    def _on_live(self, frames: Sequence[memoryview]) -> None:
        """One live message (§1): topic, frames and payload checked here, the rest is the
        machine's (§6)."""
        if frames[0] != self._topic:
            # ZMQ subscriptions match prefixes; the topic must be equal exactly (§1). What
            # arrives is all the SUB can learn of the engine's topics (it is not subscribed to
            # others: no extra traffic on the hot path), and /ready lists them.
            topic = bytes(frames[0])
            if self._serving.topic_mismatch(topic):
                (log.warning if self._serving.live_messages == 0 else log.info)(
                    "stream %s: the engine sends topic %s, not the stream's topic %r: its "
                    "live messages are dropped (a topic must equal the engine's exactly, §1; "
                    "further ones counted in topic_mismatches, their topics listed in /ready)",
                    self._name, shown_topic(topic), self.stream.topic)
            return
        try:
            # (parse_live takes any bytes-like frames; memoryviews are read in place.)
            frame = parse_live(frames, self.limits.max_message_bytes)  # type: ignore[arg-type]
        except DecodeError as exc:
            self._serving.note_live(None)
            self._carry(self._recovery.on_live_error(DecodeErrorReason.FRAME, str(exc), None,
                                                     self._clock.now()))
            return
        seq = frame.seq
        history = self._history
        try:
            batch = decode_batch(frame.payload, self.stream.dp_rank, history)
        except DecodeError as exc:
            self._serving.note_live(None)
            self._carry(self._recovery.on_live_error(DecodeErrorReason.PAYLOAD,
                                                     f"seq {seq}: {exc}", seq, self._clock.now()))
            return
        # §7h anchor: the digest of every batch's payload bytes, as published (history only).
        now = self._clock.now()
        self._serving.note_live(now)
        # §7h anchor: the digest of every batch's payload bytes, as published (history only).
        actions = self._recovery.on_live_batch(
            seq, batch, frame.wire_bytes, now,
            xxh3_64_intdigest(frame.payload) if history else 0)
        if actions:
            self._carry(actions, now)
