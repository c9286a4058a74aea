"""The subscriber of one stream: its thread, its sockets and the §6 recovery state machine.

One :class:`StreamSubscriber` per (instance, DP rank). Its thread owns a ``SUB`` (live batches,
§1), a monitor socket on that ``SUB`` (connect/disconnect events), an inproc ``PULL`` through
which :meth:`StreamSubscriber.close` wakes it and, during a snapshot, one ``DEALER`` per attempt
(§7, :mod:`kvsvc.streams.snapshot`), all in one ``zmq.Poller`` loop. The poll sleeps until the
next deadline (attempt timeout, retry, periodic resync; at most ``POLL_INTERVAL_MS``), so an
idle stream costs no CPU.
Request threads only call :meth:`StreamSubscriber.match` and :meth:`StreamSubscriber.status`,
which read under the stream lock and never touch ZMQ.

States (§6)::

    UNSYNCHRONIZED --attempt starts--> RECOVERING --snapshot + buffered tail--> SYNCHRONIZED
          ^    ^--------attempt fails, backoff----------'                            |
          '-------- seq error, decode/index error, disconnect (index discarded) -----'

    RECOVERING / UNSYNCHRONIZED --live batch starting with AllBlocksCleared--> SYNCHRONIZED

The serving index exists only while SYNCHRONIZED; any error discards it under the same lock
hold that saw it, so a query never sees a partial batch, a stale index or a half-built one.
Snapshot indexes are built privately and swapped in one assignment under the lock.

Snapshots are requested only while the live ``SUB`` is connected (its handshake reported by
the monitor since it was last (re)opened): a batch published before the subscription reaches
the engine is lost without a trace, so the snapshot must come after it (:meth:`_live_handshake`).

Sequence bookkeeping (all on the stream thread):

- ``_expected``: the next live seq the serving index needs; ``None`` after an empty snapshot
  (watermark unknown): the first live batch is then applied whatever its seq (§7).
- ``_max_seen``: the highest live seq this ``SUB`` connection has received (reset on
  disconnect and when a backward jump starts a new epoch). After a swap at watermark W, a
  batch with seq <= W that is above ``_max_seen`` was published before the snapshot but
  received after it: a duplicate already covered, dropped silently. Any other seq other than
  ``_expected`` (a repeat, a backward jump of a restarted engine, a gap) is a sequence error.

Buffer accounting during an attempt (§6): each batch costs its wire bytes plus
``BUFFER_EVENT_OVERHEAD`` bytes per event, ``BUFFER_HASH_OVERHEAD`` per block hash and
``BUFFER_TOKEN_OVERHEAD`` per token id (the decoded records kept until the swap).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Container, Optional, Sequence

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvsvc.config import KvEventsConfig, StreamConfig
from kvsvc.errors import (
    BufferOverflow,
    CapacityExceeded,
    DecodeError,
    HashConflict,
    LifecycleError,
    SnapshotError,
    SnapshotTimeout,
    StreamError,
    UnknownParent,
)
from kvsvc.events import AllBlocksCleared, Batch, BlockRemoved, BlockStored
from kvsvc.index.tier_index import IndexStats, TierIndex
from kvsvc.streams.decoder import decode_batch
from kvsvc.streams.frame import parse_live
from kvsvc.streams.snapshot import MAXMSGSIZE_HEADROOM, SnapshotAttempt, SnapshotGate, SnapshotResult
from kvsvc.streams.state import StreamId, StreamMatch, StreamState, StreamStatus

log = logging.getLogger(__name__)

#: Backoff of failed attempts (§6): 100 ms doubling to at most 5 s.
BACKOFF_INITIAL_S = 0.1
BACKOFF_MAX_S = 5.0
#: Longest poll wait when no deadline is nearer. close() wakes the poll through the thread's
#: wake-up socket, so this only bounds how long a lost wake-up could delay a stop.
POLL_INTERVAL_MS = 5_000
#: After a periodic resync shows live batches that never arrived (watermark above the applied
#: seq) while nothing at all arrived on the live channel since the previous swap, a live batch
#: must arrive within this many seconds (those batches may still be in flight), or the live
#: channel is taken for dead (README "Where the spec is silent").
LIVE_SILENCE_GRACE_S = 2.0
#: After a recovery from a snapshot with a watermark while nothing at all has arrived on the
#: live connection, the first resync comes this soon (seconds) instead of after
#: ``resync_interval_ms``: a dead live channel (a wrong topic) is then found within seconds,
#: not after a whole resync interval of a snapshot index going stale.
PROBE_RESYNC_S = 2.0

#: Reconnect interval of the live ``SUB`` (ms): the first retry after a refused connect,
#: doubling on each failure up to the max (libzmq's default is a constant 100 ms).
LIVE_RECONNECT_IVL_MS = 10
LIVE_RECONNECT_IVL_MAX_MS = 500
#: A live connection that ends sooner than this (seconds) after its handshake, or before one,
#: failed: the next reopen of the ``SUB`` waits, from ``LIVE_REOPEN_MIN_S`` doubling to
#: ``LIVE_REOPEN_MAX_S`` (a wrong endpoint, say the engine's ROUTER, would otherwise be
#: reconnected thousands of times a second: each reopened socket connects at once).
LIVE_STABLE_S = 1.0
LIVE_REOPEN_MIN_S = 0.01
LIVE_REOPEN_MAX_S = 5.0
#: After this many failed live connections in a row, the stream's error says so.
LIVE_FLAP_HINT = 3

#: Live messages handled per poll turn before looking at the other sockets again.
LIVE_MESSAGES_PER_TURN = 256
#: Bound on the messages drained from the ``SUB`` just before a snapshot completes.
DRAIN_LIMIT = 10_000
#: Buffer record overheads (bytes) added to a buffered batch's wire size (§6).
BUFFER_EVENT_OVERHEAD = 128
BUFFER_HASH_OVERHEAD = 40
BUFFER_TOKEN_OVERHEAD = 4

_NOT_YET = "not synchronized yet: waiting for the first snapshot"
#: Appended to the reason while a due snapshot waits for the live connection.
_LIVE_WAIT = "; the snapshot is requested once the live channel "
#: Resident keys of a stream that serves no hits (the fast path's "nothing here").
_NO_KEYS: frozenset[int] = frozenset()


#: Labels of the metrics counters (kvsvc.http.metrics); fixed sets, never free text.
DECODE_ERROR_REASONS = ("frame", "payload", "event", "unknown_parent", "hash_conflict",
                        "capacity")
RECOVERY_TRIGGERS = ("start", "disconnect", "decode_error", "index_error", "sequence_gap",
                     "sequence_backwards", "live_silent", "internal_error")
SNAPSHOT_OUTCOMES = ("ok", "timeout", "buffer_overflow", "error")
EVENT_TYPES = {BlockStored: "BlockStored", BlockRemoved: "BlockRemoved",
               AllBlocksCleared: "AllBlocksCleared"}


def error_reason(exc: StreamError) -> str:
    """The decode-error label (:data:`DECODE_ERROR_REASONS`) of an error applying an event to
    the index: ``event`` for a malformed event the index refused (block size, token count)."""
    if isinstance(exc, UnknownParent):
        return "unknown_parent"
    if isinstance(exc, HashConflict):
        return "hash_conflict"
    if isinstance(exc, CapacityExceeded):
        return "capacity"
    return "event"


def _trigger_of(reason: str) -> str:
    return "index_error" if reason in ("unknown_parent", "hash_conflict", "capacity") \
        else "decode_error"


@dataclass(frozen=True, slots=True)
class StreamCounters:
    """Monotonic counters and last-snapshot figures of one stream, for ``/metrics`` (a copy
    taken under the stream lock; all counts since the subscriber was built).

    :param events_applied: event type name -> live events applied to the serving index
        (a recovery's buffered tail and ``AllBlocksCleared`` baselines included; snapshot
        contents not).
    :param not_indexed: reason -> live events/hashes accepted without indexing (§2, §3, §5):
        ``other_medium`` (events), ``excluded``, ``unknown_tokenless``, ``unknown_removal``
        (block hashes).
    :param decode_errors: :data:`DECODE_ERROR_REASONS` -> errors (live messages and events).
    :param recoveries_started: :data:`RECOVERY_TRIGGERS` -> recoveries started (``start`` once
        per thread, the others on each loss of synchronization).
    :param snapshot_attempts: :data:`SNAPSHOT_OUTCOMES` -> snapshot attempts ended so.
    :param snapshot_seconds_sum: total duration of successful snapshots, seconds.
    :param last_snapshot_seconds: duration of the last successful snapshot (request to
        swap), seconds; ``None`` before the first.
    :param last_snapshot_bytes: wire bytes of the last successful snapshot reply.
    :param last_snapshot_messages: data messages of the last successful snapshot reply.
    :param buffered_bytes: live bytes (with record overhead) buffered by the attempt in flight.
    :param seconds_since_event: seconds since the last live batch decoded; ``None`` before one.
    :param topic_mismatches: live messages dropped for a topic not exactly equal (§1).
    :param duplicates_dropped: batches covered by a swapped-in snapshot, dropped (§6).
    """

    events_applied: dict[str, int]
    not_indexed: dict[str, int]
    decode_errors: dict[str, int]
    recoveries_started: dict[str, int]
    snapshot_attempts: dict[str, int]
    snapshot_seconds_sum: float
    last_snapshot_seconds: Optional[float]
    last_snapshot_bytes: int
    last_snapshot_messages: int
    buffered_bytes: int
    seconds_since_event: Optional[float]
    topic_mismatches: int
    duplicates_dropped: int


#: IndexStats field -> ``not_indexed`` label (orphan markers only come from snapshots).
_NOT_INDEXED = {"not_indexed_medium": "other_medium", "excluded_blocks": "excluded",
                "unknown_tokenless": "unknown_tokenless", "unknown_removals": "unknown_removal"}


def _stats_tuple(stats: IndexStats) -> tuple[int, ...]:
    return tuple(getattr(stats, name) for name in _NOT_INDEXED)


def _backoff_s(failures: int) -> float:
    """Delay before the retry after ``failures`` consecutive failed attempts (>= 1)."""
    return min(BACKOFF_INITIAL_S * (2 ** min(failures - 1, 16)), BACKOFF_MAX_S)


def _record_bytes(batch: Batch, wire_bytes: int) -> int:
    """Buffer cost of one decoded live batch: wire bytes plus decoded-record overhead."""
    cost = wire_bytes
    for ev in batch.events:
        cost += BUFFER_EVENT_OVERHEAD
        if type(ev) is BlockStored:
            cost += BUFFER_HASH_OVERHEAD * len(ev.block_hashes) + BUFFER_TOKEN_OVERHEAD * len(ev.token_ids)
        elif type(ev) is BlockRemoved:
            cost += BUFFER_HASH_OVERHEAD * len(ev.block_hashes)
    return cost


class StreamSubscriber:
    """Subscriber of one stream (§1, §6, §7): thread, sockets, index and state.

    :param stream: the stream's configuration (endpoints, topic, rank, block size, seed).
    :param limits: the §8 limits (message, buffer, capacity, timeouts).
    :param context: the ZMQ context; sockets are created on the stream thread.
    :param gate: bounds the snapshot attempts running at once across the streams sharing it
        (the directory's); ``None``: unbounded. A stream queued for a permit is recovering
        (or, for a resync, still serving) and sends its request when the permit comes.
    :param live_turns: a lock shared by the streams of one directory, held while a stream
        thread drains its live socket (one turn, at most ``LIVE_MESSAGES_PER_TURN``
        messages), so that stream threads do not hand the GIL to each other at every received
        frame (:mod:`kvsvc.directory`); ``None``: a lock of this stream's own.

    :ivar stream_id: the stream's (instance, DP rank).
    :ivar block_size: tokens per block; callers compute query keys with it.
    :ivar hash_seed: the §4 seed; callers compute query keys with it.
    """

    def __init__(self, stream: StreamConfig, limits: KvEventsConfig, context: zmq.Context,
                 gate: Optional[SnapshotGate] = None,
                 live_turns: Optional[threading.Lock] = None) -> None:
        self.stream = stream
        self.limits = limits
        self.stream_id = StreamId(stream.instance_name, stream.dp_rank)
        self.block_size = stream.block_size
        self.hash_seed = stream.hash_seed
        self._context = context
        self._gate = gate
        self._live_turns = live_turns if live_turns is not None else threading.Lock()
        self._topic = stream.topic.encode("utf-8")
        self._name = str(self.stream_id)
        self._instance = stream.instance_name
        self._rank = stream.dp_rank

        # Serving state, read by request threads: guarded by _lock.
        self._lock = threading.Lock()
        self._index: Optional[TierIndex] = None
        self._state = StreamState.UNSYNCHRONIZED
        self._error: Optional[str] = _NOT_YET
        self._sequence: Optional[int] = None
        self._synchronized_once = False
        self._recoveries = 0
        self._resync_differences = 0
        # The lock-free fast path of match(): (resident keys, zero-hit answer), replaced in one
        # assignment under _lock whenever the serving state changes (_publish_locked).
        self._quick: tuple[Container[int], StreamMatch] = (_NO_KEYS, self._zero_answer())

        # Thread control.
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._start_error: Optional[BaseException] = None

        # Counters written by the stream thread only (plain int reads are safe elsewhere).
        self._topic_mismatches = 0
        self._live_messages = 0
        self._duplicates_dropped = 0
        # Metrics counters (kvsvc.http.metrics): written by the stream thread, the dicts under
        # _lock (counters() copies them under it); plain ints, no prometheus objects here.
        self._events_applied = dict.fromkeys(EVENT_TYPES.values(), 0)
        self._decode_errors = dict.fromkeys(DECODE_ERROR_REASONS, 0)
        self._recoveries_started = dict.fromkeys(RECOVERY_TRIGGERS, 0)
        self._snapshot_attempts = dict.fromkeys(SNAPSHOT_OUTCOMES, 0)
        self._snapshot_seconds_sum = 0.0
        self._last_snapshot: Optional[tuple[float, int, int]] = None  # seconds, bytes, messages
        self._last_event_at: Optional[float] = None
        # Live not-indexed counts: those of retired serving indexes, plus the serving index's
        # stats minus what its snapshot had counted when it was swapped in (_stats_base).
        self._not_indexed_retired = [0] * len(_NOT_INDEXED)
        self._stats_base: tuple[int, ...] = (0,) * len(_NOT_INDEXED)

        # Owned by the stream thread from start() on.
        self._sub: Optional[zmq.Socket] = None
        self._monitor: Optional[zmq.Socket] = None
        self._wake: Optional[zmq.Socket] = None   # inproc PULL; close() pushes to it
        # Unique per subscriber, never id(self): a closed subscriber's inproc name is released
        # by ZMQ's reaper asynchronously, and a new object may reuse the old one's id at once.
        self._wake_endpoint = f"inproc://kvsvc-stream-wake-{uuid.uuid4().hex}"
        self._poller: Optional[zmq.Poller] = None
        self._reopen_at: Optional[float] = None   # replace the SUB at this monotonic time
        self._reopen_delay = 0.0                  # backoff of failed live connections, s
        self._live_failures = 0                   # failed live connections in a row
        # When the current SUB's handshake succeeded (None: not yet), so its subscription is
        # on its way to the engine: only then is a snapshot requested (see _live_handshake).
        self._live_up_at: Optional[float] = None
        self._live_wait_noted = False             # the error says a due attempt waits for it
        self._waiting_error_logged = False        # one warning per backoff wait
        self._synced = False                      # mirrors _state is SYNCHRONIZED
        self._expected: Optional[int] = None      # next live seq the serving index needs
        self._max_seen: Optional[int] = None      # highest live seq on this connection
        self._live_at_swap = 0                    # _live_messages when the index was swapped
        # (deadline, watermark, first seq not received, _live_messages when armed) of a
        # silent-channel check.
        self._silence_check: Optional[tuple[float, int, int, int]] = None
        self._awaiting_live = False               # silent channel: recover on the next batch
        self._attempt: Optional[SnapshotAttempt] = None
        self._buffer: list[tuple[int, Batch]] = []
        self._buffer_bytes = 0
        self._failures = 0
        self._next_attempt_at: Optional[float] = None

    # ------------------------------------------------------------------ public API

    def start(self, timeout_s: float = 5.0) -> None:
        """Start the stream thread (daemon, named ``kvsvc-stream-<instance>/dp<rank>``).

        Returns once the thread has connected its sockets and entered its loop; the first
        snapshot request goes out at once (§6), as soon as the live ``SUB`` has connected.

        :param timeout_s: how long to wait for the thread to be running, seconds.
        :raises LifecycleError: already started, socket setup failed, or not running in time.
        """
        if self._thread is not None:
            raise LifecycleError(f"stream {self._name}: already started")
        self._thread = threading.Thread(target=self._run, name=f"kvsvc-stream-{self._name}",
                                        daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            self.close(timeout_s)
            raise LifecycleError(f"stream {self._name}: thread not running after {timeout_s}s")
        if self._start_error is not None:
            self._thread.join(timeout_s)
            raise LifecycleError(
                f"stream {self._name}: socket setup failed: {self._start_error}") from self._start_error

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and close its sockets (in the thread's ``finally``); idempotent.

        :param timeout_s: join timeout, seconds; a thread still alive after it is logged.
        """
        self._stop.set()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return
        self._wake_thread()
        thread.join(timeout_s)
        if thread.is_alive():
            log.error("stream %s: thread did not stop within %.1fs", self._name, timeout_s)

    def _wake_thread(self) -> None:
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

    def match(self, keys: Sequence[int]) -> StreamMatch:
        """This stream's answer to a prefix query (§10).

        Hits are computed under the stream lock only, so they always come from one complete
        serving state (§6: never a stale or partial hit). Most streams of a query hold none of
        the prompt: for them a lock-free probe of the first key returns the stream's shared
        zero-hit answer (~0.2 us instead of ~2 us). That probe may run while the stream thread
        applies a batch, so it can answer 0 hits for a first block that is resident just before
        and after that batch, with the previous batch's ``sequence`` and block counts: a miss,
        never a hit, that was not there.

        :param keys: content keys of the prompt's full blocks, oldest first, computed with this
            stream's ``block_size`` and ``hash_seed`` (:func:`kvsvc.index.keys.prompt_keys`).
        :returns: hits in tokens (blocks * ``block_size``) when synchronized; otherwise zero
            hits, ``synchronized=False`` and the reason in ``error``. Treat it as read-only:
            zero-hit answers are shared between queries.
        """
        resident, zero = self._quick
        if not keys or keys[0] not in resident:
            return zero
        with self._lock:
            index = self._index
            if self._state is StreamState.SYNCHRONIZED and index is not None:
                device, host_only = index.match(keys)
                block_size = self.block_size
                return StreamMatch(self._instance, self._rank, True, self._sequence,
                                   device * block_size, host_only * block_size,
                                   index.device_blocks, index.host_blocks, None)
            return self._quick[1]

    def _zero_answer(self) -> StreamMatch:
        """The answer to a prompt whose first block the stream does not hold (caller holds
        ``_lock``, or the thread has not started)."""
        index = self._index
        if self._state is StreamState.SYNCHRONIZED and index is not None:
            return StreamMatch(self._instance, self._rank, True, self._sequence, 0, 0,
                               index.device_blocks, index.host_blocks, None)
        return StreamMatch(self._instance, self._rank, False, None, 0, 0, 0, 0, self._error)

    def _publish_locked(self) -> None:
        """Refresh match()'s fast path after a change of the serving state (index, state,
        error, sequence or counts); caller holds ``_lock``. One assignment, so a query reads
        either the old pair or the new one."""
        index = self._index
        resident = (index.live_flags if self._state is StreamState.SYNCHRONIZED
                    and index is not None else _NO_KEYS)
        self._quick = (resident, self._zero_answer())

    def status(self) -> StreamStatus:
        """The stream's state, counts and counters (read under the stream lock)."""
        with self._lock:
            index = self._index
            return StreamStatus(
                stream=self.stream_id, state=self._state, error=self._error,
                sequence=self._sequence,
                device_blocks=index.device_blocks if index is not None else 0,
                host_blocks=index.host_blocks if index is not None else 0,
                entries=index.entries if index is not None else 0,
                synchronized_once=self._synchronized_once, recoveries=self._recoveries,
                resync_differences=self._resync_differences)

    @property
    def topic_mismatches(self) -> int:
        """Live messages dropped because their topic frame was not exactly the topic (§1)."""
        return self._topic_mismatches

    @property
    def live_messages(self) -> int:
        """Live messages received with the exact topic (valid or not)."""
        return self._live_messages

    @property
    def duplicates_dropped(self) -> int:
        """Batches with seq <= the swap watermark received after the swap (covered by it)."""
        return self._duplicates_dropped

    def counters(self) -> StreamCounters:
        """Copy of the stream's metrics counters (O(1): a few dict copies under the stream
        lock, never an index traversal)."""
        now = time.monotonic()
        with self._lock:
            index = self._index
            not_indexed = list(self._not_indexed_retired)
            if index is not None:
                for i, (cur, base) in enumerate(zip(_stats_tuple(index.stats), self._stats_base)):
                    not_indexed[i] += cur - base
            last = self._last_snapshot
            last_event = self._last_event_at
            return StreamCounters(
                events_applied=dict(self._events_applied),
                not_indexed=dict(zip(_NOT_INDEXED.values(), not_indexed)),
                decode_errors=dict(self._decode_errors),
                recoveries_started=dict(self._recoveries_started),
                snapshot_attempts=dict(self._snapshot_attempts),
                snapshot_seconds_sum=self._snapshot_seconds_sum,
                last_snapshot_seconds=last[0] if last is not None else None,
                last_snapshot_bytes=last[1] if last is not None else 0,
                last_snapshot_messages=last[2] if last is not None else 0,
                buffered_bytes=self._buffer_bytes,
                seconds_since_event=now - last_event if last_event is not None else None,
                topic_mismatches=self._topic_mismatches,
                duplicates_dropped=self._duplicates_dropped)

    def _count_locked(self, counts: dict[str, int], label: str) -> None:
        """``counts[label] += 1`` under ``_lock`` (the dicts are copied under it)."""
        with self._lock:
            counts[label] += 1

    def _count_events_locked(self, events: Sequence[object]) -> None:
        """Add ``events`` to the applied-by-type counts; caller holds ``_lock``."""
        applied = self._events_applied
        for ev in events:
            applied[EVENT_TYPES[type(ev)]] += 1

    def _retire_stats_locked(self) -> None:
        """Fold the serving index's live not-indexed counts into the retired totals before it
        is replaced or discarded; caller holds ``_lock``."""
        index = self._index
        if index is None:
            return
        for i, (cur, base) in enumerate(zip(_stats_tuple(index.stats), self._stats_base)):
            self._not_indexed_retired[i] += cur - base

    # ------------------------------------------------------------------ thread

    def _run(self) -> None:
        try:
            try:
                self._open_sockets()
            except zmq.ZMQError as exc:
                self._start_error = exc
                return
            finally:
                self._ready.set()
            log.info("stream %s: subscribed to %s topic %r (replay %s)", self._name,
                     self.stream.endpoint, self.stream.topic, self.stream.replay_endpoint)
            self._next_attempt_at = time.monotonic()  # §6: snapshot at once
            self._count_locked(self._recoveries_started, "start")
            while not self._stop.is_set():
                try:
                    self._turn()
                except zmq.ZMQError:
                    raise
                except Exception as exc:  # noqa: BLE001 - input must never kill the stream
                    # Only a bug in kvsvc gets here (input errors are StreamErrors). Discard the
                    # index, as for any stream error, and recover after a backoff instead of
                    # leaving the stream dead for the life of the process.
                    log.exception("stream %s: internal error; recovering", self._name)
                    self._abandon_attempt()
                    self._invalidate(f"internal error: {type(exc).__name__}", "internal_error")
                    self._failures += 1
                    self._next_attempt_at = time.monotonic() + _backoff_s(self._failures)
        except Exception:  # pragma: no cover - ZMQ failure; keep the stream visibly broken
            log.exception("stream %s: thread crashed", self._name)
            with self._lock:
                self._index = None
                self._state = StreamState.UNSYNCHRONIZED
                self._error = "internal error: stream thread crashed"
                self._publish_locked()
        finally:
            self._close_sockets()

    def _open_sockets(self) -> None:
        self._poller = zmq.Poller()
        self._wake = self._context.socket(zmq.PULL)
        self._wake.setsockopt(zmq.LINGER, 0)
        self._wake.bind(self._wake_endpoint)
        self._poller.register(self._wake, zmq.POLLIN)
        self._open_live()

    def _open_live(self) -> None:
        """Create, connect and register the ``SUB`` and its monitor (stream thread only)."""
        sub = self._context.socket(zmq.SUB)
        self._sub = sub
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, self.limits.max_message_bytes + MAXMSGSIZE_HEADROOM)
        # Recovery waits for this connection (_live_handshake), so retry a refused connect
        # soon (an engine re-binding its port), backing off for an engine that is down.
        sub.setsockopt(zmq.RECONNECT_IVL, LIVE_RECONNECT_IVL_MS)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, LIVE_RECONNECT_IVL_MAX_MS)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        self._monitor = sub.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self._live_up_at = None
        self._live_wait_noted = False
        sub.connect(self.stream.endpoint)
        self._poller.register(sub, zmq.POLLIN)  # type: ignore[union-attr]
        self._poller.register(self._monitor, zmq.POLLIN)  # type: ignore[union-attr]

    def _close_live(self) -> None:
        """Unregister and close the ``SUB`` and its monitor (stream thread only)."""
        if self._sub is None:
            return
        if self._poller is not None:
            for sock in (self._sub, self._monitor):
                if sock is not None:
                    try:
                        self._poller.unregister(sock)
                    except KeyError:
                        pass
        if self._monitor is not None:
            try:
                self._sub.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor.close(linger=0)
        self._sub.close(linger=0)
        self._sub = None
        self._monitor = None

    def _reopen_live(self) -> None:
        """Replace the ``SUB`` after a disconnect. libzmq does not reconnect a connection it
        dropped itself (a message over ``MAXMSGSIZE`` is such a protocol error), which would
        leave the stream synchronized by snapshot but deaf to every later live batch."""
        self._reopen_at = None
        self._close_live()
        self._open_live()
        # Once per failure streak at info: a flapping endpoint must not flood the log.
        (log.info if self._live_failures <= 1 else log.debug)(
            "stream %s: live socket reopened to %s", self._name, self.stream.endpoint)

    def _close_sockets(self) -> None:
        if self._attempt is not None:
            self._attempt.close()
            self._attempt = None
        self._close_live()
        if self._wake is not None:
            self._wake.close(linger=0)
            self._wake = None

    def _turn(self) -> None:
        """One loop turn: start a due attempt, poll, handle what is readable, check deadlines."""
        now = time.monotonic()
        if self._attempt is None and self._next_attempt_at is not None and now >= self._next_attempt_at:
            if self._live_up:
                self._begin_attempt()
            elif not self._live_wait_noted:
                self._note_live_wait()
        timeout_s = POLL_INTERVAL_MS / 1000.0
        if self._attempt is not None:
            timeout_s = min(timeout_s, self._attempt.deadline - now)
        elif self._next_attempt_at is not None and (self._live_up or not self._live_wait_noted):
            # (Once a due attempt is noted as waiting, the handshake event ends the poll.)
            timeout_s = min(timeout_s, self._next_attempt_at - now)
        if self._reopen_at is not None:
            timeout_s = min(timeout_s, self._reopen_at - now)
        if self._silence_check is not None:
            timeout_s = min(timeout_s, self._silence_check[0] - now)
        ready = dict(self._poller.poll(max(0, int(timeout_s * 1000) + 1)))
        if self._wake in ready:
            return  # close(): the loop checks the stop event next
        # Monitor first: a disconnect must be seen before data of a new connection.
        if self._monitor in ready:
            self._on_monitor()
        if self._reopen_at is not None and time.monotonic() >= self._reopen_at:
            self._reopen_live()
        if self._sub in ready:
            with self._live_turns:
                for _ in range(LIVE_MESSAGES_PER_TURN):
                    frames = self._recv_live()
                    if frames is None:
                        break
                    self._on_live(frames)
        attempt = self._attempt
        if attempt is not None and attempt.socket in ready:
            try:
                result = attempt.receive()
            except StreamError as exc:
                self._attempt_failed(exc)
            else:
                if result is not None:
                    self._finish_attempt(attempt, result)
        elif attempt is not None:
            try:
                attempt.check_deadline(time.monotonic())
            except StreamError as exc:
                self._attempt_failed(exc)
        if self._silence_check is not None:
            self._check_silence()

    def _check_silence(self) -> None:
        """End a silent-channel check: passed once any live message arrived since the swap;
        failed at its deadline, which unsynchronizes the stream until a live batch arrives
        (a dead live channel, e.g. a topic the engine does not publish, would otherwise keep
        a snapshot's index serving while the engine moves on: stale hits)."""
        deadline, watermark, first_missing, live_then = self._silence_check  # type: ignore[misc]
        # Counted from when the check was armed, not from the last swap: a later resync's
        # swap must not hide a batch that arrived in between.
        if self._live_messages != live_then or not self._synced:
            self._silence_check = None
            return
        if time.monotonic() < deadline:
            return
        self._silence_check = None
        self._abandon_attempt()
        self._awaiting_live = True
        self._next_attempt_at = None  # no snapshot until the live channel shows life
        self._invalidate(
            f"live channel silent: the engine published up to seq {watermark} (resync "
            f"watermark) but no live batch arrived since seq {first_missing}; check the "
            f"stream's endpoint and topic {self.stream.topic!r}", "live_silent")

    # ------------------------------------------------------------------ monitor

    def _on_monitor(self) -> None:
        if self._monitor is None:
            return  # the SUB is closed until its delayed reopen
        while True:
            try:
                event = recv_monitor_message(self._monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._live_handshake()
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                # A new connection may be a restarted engine counting from 0 again.
                self._max_seen = None
                # (_live_disconnected ends the connection's up time before the error acts.)
                self._stream_error(self._live_disconnected(), "disconnect")
                if self._sub is None:
                    return  # closed until the delayed reopen: no more events to read

    @property
    def _live_up(self) -> bool:
        """The current ``SUB`` has completed its handshake (and not disconnected since)."""
        return self._live_up_at is not None

    def _live_disconnected(self) -> str:
        """Schedule the ``SUB``'s replacement after a disconnect and return the reason. A
        connection that lasted :data:`LIVE_STABLE_S` is replaced at once; after one that did
        not, the socket is closed now and reopened after a doubling delay."""
        now = time.monotonic()
        stable = self._live_up_at is not None and now - self._live_up_at >= LIVE_STABLE_S
        self._live_up_at = None
        if stable:
            self._live_failures, self._reopen_delay = 0, 0.0
            self._reopen_at = now
            return "disconnected"
        self._live_failures += 1
        self._reopen_delay = min(max(self._reopen_delay * 2, LIVE_REOPEN_MIN_S),
                                 LIVE_REOPEN_MAX_S)
        self._reopen_at = now + self._reopen_delay
        self._close_live()
        if self._live_failures < LIVE_FLAP_HINT:
            return "disconnected"
        if self._live_failures == LIVE_FLAP_HINT:
            log.warning("stream %s: %d live connections in a row to %s ended within %.0f s; "
                        "reconnecting with backoff up to %.0f s", self._name,
                        self._live_failures, self.stream.endpoint, LIVE_STABLE_S,
                        LIVE_REOPEN_MAX_S)
        return (f"disconnected: {self._live_failures} live connections in a row ended within "
                f"{LIVE_STABLE_S:g} s (is {self.stream.endpoint} the engine's PUB event "
                f"socket?)")

    def _live_handshake(self) -> None:
        """The ``SUB``'s ZMTP handshake succeeded: snapshots may be requested from now on.

        A ``PUB`` drops every batch published before a subscriber's subscription reaches it,
        without a trace on either side. A snapshot taken before that moment can be followed by
        batches this stream never receives; a gap in ``seq`` shows that, unless the engine's
        counter restarted meanwhile and its new numbers run into the expected one (the soak
        found it: an engine back from a kill answered the snapshot before this ``SUB``
        reconnected, its first batch was lost, its publisher restarted, and the new seq 0 was
        applied as the expected one on an index without the lost blocks). So every snapshot is
        requested after the handshake: the subscription then leaves on this connection before
        the request's ``DEALER`` has even connected (README "Where the spec is silent", §6, §7).
        """
        # Make the socket attach the new pipe now, which writes the subscription to it, rather
        # than at its next use.
        self._sub.getsockopt(zmq.EVENTS)  # type: ignore[union-attr]
        self._live_up_at = time.monotonic()
        if not self._synced and self._attempt is None and self._next_attempt_at is not None:
            # A new connection may be a new engine: the backoff its predecessor's failed
            # snapshots earned must not delay asking it. An endpoint that keeps dropping
            # connections gets them at the pace of its reopens, which back off themselves
            # (_live_disconnected: up to LIVE_REOPEN_MAX_S apart).
            self._failures = 0
            self._next_attempt_at = min(self._next_attempt_at,
                                        time.monotonic() + BACKOFF_INITIAL_S)
        if self._live_wait_noted:
            self._live_wait_noted = False
            with self._lock:
                # The wait is over: the reason is the cause alone again.
                if not self._synced and self._error is not None:
                    self._error = self._error.partition(_LIVE_WAIT)[0]
                    self._publish_locked()
        log.info("stream %s: connected to %s", self._name, self.stream.endpoint)

    def _note_live_wait(self) -> None:
        """An attempt is due but the live channel is not connected: say so in ``error``."""
        self._live_wait_noted = True
        with self._lock:
            # (Never synchronized here: a disconnect unsynchronizes first.)
            cause = self._error or _NOT_YET
            self._error = (f"{cause}{_LIVE_WAIT}{self.stream.endpoint} is connected")
            self._publish_locked()

    # ------------------------------------------------------------------ live batches

    def _recv_live(self) -> Optional[list[memoryview]]:
        """One live message without blocking: its frames as ``memoryview``s of the received
        ZMQ frames, or ``None`` when none is pending.

        ``recv_multipart`` asks the socket for ``RCVMORE`` after every frame and copies each
        one: 3.1 us per message against 1.9 us here, where the ``more`` flag comes with the
        frame and the payload is decoded in place. The whole message is received before any
        of it is judged, so a message with a wrong frame count never desynchronises the next.
        """
        if self._sub is None:
            return None  # closed until its delayed reopen
        recv = self._sub.recv
        try:
            frame = recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        frames = [frame.buffer]
        while frame.more:
            # ZMQ delivers a multipart message atomically: the rest is already here.
            frame = recv(zmq.NOBLOCK, copy=False)
            frames.append(frame.buffer)
        return frames

    def _on_live(self, frames: Sequence[memoryview]) -> None:
        """One live message (§1, §6)."""
        if frames[0] != self._topic:
            # ZMQ subscriptions match prefixes; the topic must be equal exactly (§1).
            self._topic_mismatches += 1
            return
        self._live_messages += 1
        if self._awaiting_live:
            self._awaiting_live = False
            log.info("stream %s: live channel alive again; recovering", self._name)
            self._restart_recovery()
        try:
            frame = parse_live(frames, self.limits.max_message_bytes)
        except DecodeError as exc:
            self._count_locked(self._decode_errors, "frame")
            self._stream_error(str(exc), "decode_error")
            return
        seq = frame.seq
        prev_max = self._max_seen
        self._max_seen = seq if prev_max is None or seq > prev_max else prev_max
        try:
            batch = decode_batch(frame.payload, self.stream.dp_rank)
        except DecodeError as exc:
            self._count_locked(self._decode_errors, "payload")
            self._stream_error(f"seq {seq}: {exc}", "decode_error")
            return
        self._last_event_at = time.monotonic()
        if self._synced:
            self._on_live_synchronized(seq, batch, frame.wire_bytes, prev_max)
        else:
            self._on_live_unsynchronized(seq, batch, frame.wire_bytes, prev_max)

    def _on_live_synchronized(self, seq: int, batch: Batch, wire_bytes: int,
                              prev_max: Optional[int]) -> None:
        expected = self._expected
        if expected is None or seq == expected:
            failure: Optional[StreamError] = None
            with self._lock:
                try:
                    self._index.apply(batch.events)  # type: ignore[union-attr]
                except StreamError as exc:
                    failure = exc
                    self._decode_errors[error_reason(exc)] += 1
                    self._invalidate_locked(f"seq {seq}: {exc}")
                else:
                    self._sequence = seq
                    self._count_events_locked(batch.events)
                    self._publish_locked()
            if failure is not None:
                self._log_unsynchronized(f"seq {seq}: {failure}",
                                         _trigger_of(error_reason(failure)))
                self._restart_recovery()
                return
            self._expected = seq + 1
            if self._attempt is not None:
                # Background resync: the new index needs this batch too.
                self._buffer_batch(seq, batch, wire_bytes)
            return
        if seq < expected and prev_max is not None and seq > prev_max:
            # Published before the snapshot we swapped in at watermark >= seq, received after
            # it: already covered. Never a repeat (seq is above anything seen on this
            # connection), so it cannot hide an engine restart. With nothing seen on this
            # connection yet (prev_max None) an old seq may just as well be a publisher that
            # restarted its counter after the snapshot: that case recovers (one extra snapshot
            # at worst), because dropping it could keep a stale index synchronized.
            self._duplicates_dropped += 1
            log.debug("stream %s: dropped seq %d covered by the snapshot (next %d)",
                      self._name, seq, expected)
            return
        if seq > expected:
            reason = f"sequence gap: expected seq {expected}, got {seq}"
            trigger = "sequence_gap"
        else:
            trigger = "sequence_backwards"
            reason = f"sequence went backwards: expected seq {expected}, got {seq}"
            # A backward jump starts a new epoch (restarted engine): later batches of it must
            # not be judged against the old engine's numbers.
            self._max_seen = seq
        self._invalidate(reason, trigger)
        self._restart_recovery()
        # The new attempt's snapshot is requested after this batch: buffer it like any other.
        self._on_live_unsynchronized(seq, batch, wire_bytes, None)

    def _on_live_unsynchronized(self, seq: int, batch: Batch, wire_bytes: int,
                                prev_max: Optional[int]) -> None:
        events = batch.events
        if events and type(events[0]) is AllBlocksCleared and events[0].tier is None:
            self._baseline_from_cleared(seq, batch)
            return
        if prev_max is not None and seq <= prev_max:
            # A repeat or a restarted engine while recovering: the snapshot in flight may be the
            # old engine's. Start over in the new epoch.
            self._max_seen = seq
            self._stream_error(f"sequence went backwards during recovery: got seq {seq} "
                               f"after {prev_max}", "sequence_backwards")
            return
        if self._attempt is None:
            # Backoff: nothing to buffer into; the next snapshot is taken after this batch.
            return
        self._buffer_batch(seq, batch, wire_bytes)

    def _buffer_batch(self, seq: int, batch: Batch, wire_bytes: int) -> None:
        self._buffer_bytes += _record_bytes(batch, wire_bytes)
        if self._buffer_bytes > self.limits.max_buffered_bytes:
            self._attempt_failed(BufferOverflow(
                f"buffer overflow: live batches buffered during the snapshot exceed "
                f"max_buffered_bytes={self.limits.max_buffered_bytes}"))
            return
        self._buffer.append((seq, batch))

    def _baseline_from_cleared(self, seq: int, batch: Batch) -> None:
        """§6: a batch starting with an untargeted ``AllBlocksCleared`` is a complete state."""
        index = self._new_index()
        try:
            index.apply(batch.events)
        except StreamError as exc:
            reason = error_reason(exc)
            self._count_locked(self._decode_errors, reason)
            self._stream_error(f"seq {seq}: {exc}", _trigger_of(reason))
            return
        self._abandon_attempt()
        self._max_seen = seq
        # Every event of this batch is live: none of its not-indexed counts is a snapshot's.
        self._swap(index, expected=seq + 1, sequence=seq, resync=False,
                   how=f"AllBlocksCleared batch seq {seq}", live_events=batch.events,
                   stats_base=(0,) * len(_NOT_INDEXED))

    # ------------------------------------------------------------------ errors

    def _stream_error(self, reason: str, trigger: str) -> None:
        """An error of the stream: invalidate and recover when synchronized, else fail the
        attempt in flight (or record the reason while waiting to retry).

        :param reason: the error text (``/ready``, logs).
        :param trigger: the :data:`RECOVERY_TRIGGERS` label counted when this ends
            synchronization.
        """
        if self._synced:
            self._invalidate(reason, trigger)
            self._restart_recovery()
        elif self._attempt is not None:
            self._attempt_failed(StreamError(reason))
        else:
            with self._lock:
                self._error = reason
                self._publish_locked()
            # The state does not change while a retry waits: log the first error only, so a
            # burst of garbage cannot flood the log (the latest reason is still in `error`).
            if not self._waiting_error_logged:
                self._waiting_error_logged = True
                log.warning("stream %s: %s (retry already scheduled; further errors until then "
                            "are logged at debug level)", self._name, reason)
            else:
                log.debug("stream %s: %s (retry already scheduled)", self._name, reason)

    def _invalidate_locked(self, reason: str) -> None:
        """Discard the serving index and forget its sequence; caller holds ``_lock``."""
        self._retire_stats_locked()
        self._index = None
        self._state = StreamState.UNSYNCHRONIZED
        self._error = reason
        self._sequence = None
        self._synced = False
        self._expected = None
        self._publish_locked()

    def _invalidate(self, reason: str, trigger: str) -> None:
        with self._lock:
            self._invalidate_locked(reason)
        self._log_unsynchronized(reason, trigger)

    def _log_unsynchronized(self, reason: str, trigger: str) -> None:
        """The one log line (and recovery count) of a loss of synchronization."""
        self._count_locked(self._recoveries_started, trigger)
        log.warning("stream %s: unsynchronized: %s", self._name, reason)

    # ------------------------------------------------------------------ attempts

    def _new_index(self) -> TierIndex:
        return TierIndex(self.block_size, self.hash_seed, self.limits.max_blocks_per_stream)

    def _restart_recovery(self) -> None:
        """Abandon any attempt (a resync too) and request a recovery snapshot now (§6), or as
        soon as the live channel is connected (:meth:`_live_handshake`)."""
        self._abandon_attempt()
        self._next_attempt_at = time.monotonic()
        if self._live_up:
            self._begin_attempt()

    def _abandon_attempt(self) -> None:
        if self._attempt is not None:
            self._attempt.close()  # unregisters it and returns its gate permit
            self._attempt = None
        self._buffer = []
        self._buffer_bytes = 0

    def _begin_attempt(self) -> None:
        self._waiting_error_logged = False
        resync = self._synced
        start_seq = self._expected if resync and self._expected is not None else 0
        self._buffer = []
        self._buffer_bytes = 0
        try:
            self._attempt = SnapshotAttempt.open(self._context, self.stream, self.limits,
                                                 start_seq, poller=self._poller, gate=self._gate,
                                                 urgent=not resync)
        except SnapshotError as exc:
            self._attempt_failed(exc)
            return
        self._next_attempt_at = None
        if resync:
            # Periodic and uneventful (every resync_interval_ms per stream): not a state change.
            log.debug("stream %s: resync snapshot requested (start_seq %d)", self._name, start_seq)
        else:
            with self._lock:
                self._state = StreamState.RECOVERING
                self._publish_locked()
            log.info("stream %s: recovering: snapshot requested (start_seq %d)", self._name, start_seq)

    def _attempt_failed(self, exc: StreamError) -> None:
        """A failed attempt (§6): close it, keep the reason, retry after the backoff. A failed
        resync leaves the stream synchronized and serving."""
        self._abandon_attempt()
        outcome = ("timeout" if isinstance(exc, SnapshotTimeout) else
                   "buffer_overflow" if isinstance(exc, BufferOverflow) else "error")
        self._count_locked(self._snapshot_attempts, outcome)
        self._failures += 1
        delay = _backoff_s(self._failures)
        self._next_attempt_at = time.monotonic() + delay
        if self._synced:
            log.warning("stream %s: resync failed: %s; retry in %.1fs", self._name, exc, delay)
            return
        with self._lock:
            self._state = StreamState.UNSYNCHRONIZED
            self._error = str(exc)
            self._publish_locked()
        log.warning("stream %s: unsynchronized: %s; retry in %.1fs", self._name, exc, delay)

    def _finish_attempt(self, attempt: SnapshotAttempt, result: SnapshotResult) -> None:
        """The end marker arrived: merge the buffered tail and swap (§6, §7)."""
        # Take in what already sits in the SUB queue first, so that fewer batches published
        # before the snapshot arrive after the swap.
        self._drain()
        if self._attempt is not attempt:
            return  # a drained message ended this attempt (error, AllBlocksCleared baseline)
        resync = self._synced
        index = result.index
        # Not-indexed counts of the snapshot itself are not live ones; a recovery's buffered
        # tail is (it never reached a serving index), a resync's tail was counted when applied.
        stats_base = _stats_tuple(index.stats)
        tail: list[Batch] = []
        if result.empty:
            # §7: empty state, unknown watermark: the first live batch becomes the baseline.
            expected: Optional[int] = None
            sequence: Optional[int] = None
            how = "empty snapshot, baseline is the next live batch"
        else:
            wm = result.watermark
            expected = 0 if wm is None else wm + 1
            sequence = wm
            try:
                for seq, batch in self._buffer:
                    if seq < expected:
                        continue  # covered by the snapshot
                    if seq != expected:
                        raise SnapshotError(f"gap after watermark {_wm(wm)}: expected seq "
                                            f"{expected}, got {seq}")
                    index.apply(batch.events)
                    tail.append(batch)
                    expected = seq + 1
                    sequence = seq
            except StreamError as exc:
                self._attempt_failed(exc if isinstance(exc, SnapshotError)
                                     else SnapshotError(f"seq {seq} after snapshot: {exc}"))
                return
            if resync and self._expected is not None and expected < self._expected:
                # A consistent engine cannot do this: its counter restarted (a new process or
                # publisher) without a live batch telling us. The serving index describes the
                # old counter's state, so it must go, not just this attempt.
                reason = (f"snapshot watermark {_wm(wm)} is behind applied seq "
                          f"{self._expected - 1}: the engine's sequence restarted")
                self._abandon_attempt()
                self._invalidate(reason, "sequence_backwards")
                self._restart_recovery()
                return
            how = f"snapshot watermark {_wm(wm)}, {result.messages} messages, tail to seq {_wm(sequence)}"
        silent = (resync and not result.empty and result.watermark is not None
                  and self._expected is not None and result.watermark >= self._expected
                  and self._live_messages == self._live_at_swap)
        first_missing = self._expected
        if resync:
            stats_base = _stats_tuple(index.stats)
            tail = []
        started = attempt.requested_at
        duration = time.monotonic() - started if started is not None else 0.0
        with self._lock:
            self._snapshot_attempts["ok"] += 1
            self._snapshot_seconds_sum += duration
            self._last_snapshot = (duration, result.wire_bytes, result.messages)
        self._abandon_attempt()
        self._swap(index, expected=expected, sequence=sequence, resync=resync, how=how,
                   live_events=[ev for b in tail for ev in b.events], stats_base=stats_base)
        if silent and self._silence_check is None:
            # The engine published batches up to the watermark and not one reached us since
            # the last swap: in flight still, or a dead live channel. The index is exact now;
            # a live message must show up within the grace period. (A check already running
            # keeps its earlier deadline and count.)
            self._silence_check = (time.monotonic() + LIVE_SILENCE_GRACE_S,
                                   result.watermark, first_missing,  # type: ignore[assignment]
                                   self._live_messages)

    def _drain(self) -> None:
        """Handle pending monitor events, then pending live messages (bounded)."""
        self._on_monitor()
        for _ in range(DRAIN_LIMIT):
            frames = self._recv_live()
            if frames is None:
                return
            self._on_live(frames)

    def _swap(self, index: TierIndex, *, expected: Optional[int], sequence: Optional[int],
              resync: bool, how: str, live_events: Sequence[object] = (),
              stats_base: tuple[int, ...] = ()) -> None:
        """Make ``index`` the serving one, atomically (§6).

        :param live_events: live events ``index`` holds that no serving index counted yet
            (a recovery's buffered tail, an ``AllBlocksCleared`` baseline batch).
        :param stats_base: ``index.stats`` counts (as :func:`_stats_tuple`) not due to live
            events, subtracted from the live not-indexed counts.
        """
        difference = 0
        if resync and self._index is not None:
            # Only this thread writes the serving index, so reading it unlocked is safe.
            difference = index.difference(self._index)
        with self._lock:
            self._retire_stats_locked()
            self._stats_base = stats_base or (0,) * len(_NOT_INDEXED)
            self._count_events_locked(live_events)
            self._index = index
            self._state = StreamState.SYNCHRONIZED
            self._error = None
            self._sequence = sequence
            self._synchronized_once = True
            if resync:
                self._resync_differences += difference
            else:
                self._recoveries += 1
            self._publish_locked()
        self._synced = True
        self._expected = expected
        self._live_at_swap = self._live_messages
        self._failures = 0
        interval_s = self.limits.resync_interval_ms / 1000.0
        if not resync and sequence is not None and self._max_seen is None:
            interval_s = min(interval_s, PROBE_RESYNC_S)  # see PROBE_RESYNC_S
        self._next_attempt_at = time.monotonic() + interval_s
        if not resync:
            log.info("stream %s: synchronized (%s): %d device, %d host blocks", self._name, how,
                     index.device_blocks, index.host_blocks)
        elif difference:
            log.warning("stream %s: resync found %d differing blocks (lost events); index "
                        "replaced (%s)", self._name, difference, how)
        else:
            log.debug("stream %s: resync matched (%s)", self._name, how)


def _wm(value: Optional[int]) -> str:
    return "none" if value is None else str(value)
