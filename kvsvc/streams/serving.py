"""The serving state of one stream: what request threads read (§6, §10), and its counters.

A :class:`ServingState` holds the serving index (only while ``SYNCHRONIZED``), the state, the
error reason, the last applied seq and the metrics counters, all under one lock. It is written
by the stream thread only (the actions of the recovery rules, :mod:`kvsvc.streams.actions`,
carried out by :meth:`ServingState.perform` and :meth:`ServingState.apply`) and read
by request threads (:meth:`ServingState.match`, :meth:`ServingState.status`,
:meth:`ServingState.counters`). Pure memory: no ZMQ, no thread, no clock.

Rules it keeps:

- Any change of the serving state happens under the lock in one hold, and an index that
  refuses a batch stops serving in the same hold, so a query never sees a partial batch, a
  stale index or a half-built one (§6); what follows (counting, recovering) is the rules'.
  A snapshot index is built privately and swapped
  in one assignment.
- A live message dropped for its topic (§1: equal exactly, while a ``SUB`` receives every topic
  that *starts* with its own) is counted, and the first :data:`OTHER_TOPICS_MAX` distinct
  topics are kept. While no message with the stream's own topic has arrived, the error in
  ``status()`` (``/ready``) names them: the engine publishes, just under another topic.
- :meth:`ServingState.match` has a lock-free fast path: ``_quick`` is a pair (resident keys,
  zero-hit answer) replaced in one assignment whenever the serving state changes; a prompt
  whose first key is not resident gets the shared zero-hit answer without the lock.
"""

from __future__ import annotations

import threading
from typing import Container, Optional, Sequence

from kvsvc.errors import StreamError
from kvsvc.index.changes import IndexChanges
from kvsvc.index.overlay import BlockOverlay
from kvsvc.index.tier_index import TierIndex
from kvsvc.streams.counters import (
    DECODE_ERROR_REASONS,
    EVENT_TYPES,
    NOT_INDEXED,
    RECOVERY_TRIGGERS,
    SNAPSHOT_OUTCOMES,
    DecodeErrorReason,
    RecoveryTrigger,
    SnapshotOutcome,
    StreamCounters,
    stats_tuple,
)
from kvsvc.streams.actions import (
    ApplyEvents,
    CountAttempt,
    CountDecodeError,
    CountDuplicate,
    CountRecovery,
    CountResyncDifference,
    HoldIndex,
    Invalidate,
    ResumeIndex,
    ServingAction,
    SetCompleteness,
    SetError,
    SetRecovering,
    SetUnsynchronized,
    SnapshotOk,
    SwapIndex,
)
from kvsvc.streams.state import (
    NOT_YET,
    Completeness,
    StreamId,
    StreamMatch,
    StreamState,
    StreamStatus,
)

__all__ = ["NOT_YET", "OTHER_TOPICS_MAX", "ServingState", "shown_topic"]

#: Distinct other topics kept per stream (a bound: an engine may publish many).
OTHER_TOPICS_MAX = 5
#: Longest topic shown, bytes (the rest is cut as ``...``).
TOPIC_SHOWN_BYTES = 64


def shown_topic(topic: bytes) -> str:
    """A topic frame for a log line or an error: quoted, non-UTF-8 bytes and control characters
    escaped (``'kv\\x00'``), cut after :data:`TOPIC_SHOWN_BYTES` bytes."""
    text = topic[:TOPIC_SHOWN_BYTES].decode("utf-8", "backslashreplace")
    # Control characters as Python writes them (\x00, \n): a log line stays one line.
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return f"'{text}'..." if len(topic) > TOPIC_SHOWN_BYTES else f"'{text}'"


#: Resident keys of a stream that serves no hits (the fast path's "nothing here").
_NO_KEYS: frozenset[int] = frozenset()
_ZERO_STATS = (0,) * len(NOT_INDEXED)


class ServingState:
    """Serving index, state and counters of one stream (see the module docstring).

    :param stream_id: the stream's (instance, DP rank), copied into every answer.
    :param block_size: tokens per block: hits are reported in tokens (blocks * block_size).
    :param topic: the stream's configured topic, named in the wrong-topic hint.

    :ivar live_messages: live messages received with the exact topic (valid or not); written
        by the stream thread only (a plain int read is safe anywhere).
    :ivar topic_mismatches: live messages dropped for a topic not exactly equal (§1).
    :ivar other_topics: the first :data:`OTHER_TOPICS_MAX` distinct topics of those messages,
        as :func:`shown_topic` (replaced in one assignment: read anywhere).
    :ivar duplicates_dropped: batches covered by a swapped-in snapshot, dropped (§6).
    :ivar last_event_at: monotonic time of the last live batch decoded; ``None`` before one.
    """

    def __init__(self, stream_id: StreamId, block_size: int, topic: str = "") -> None:
        self.stream_id = stream_id
        self._topic = topic
        self._instance = stream_id.instance_name
        self._rank = stream_id.dp_rank
        self._block_size = block_size
        self._lock = threading.Lock()
        self._index: Optional[TierIndex] = None
        self._state = StreamState.UNSYNCHRONIZED
        self._error: Optional[str] = NOT_YET
        self._sequence: Optional[int] = None
        self._completeness = Completeness.EXACT
        self._synchronized_once = False
        self._recoveries = 0
        self._resync_differences = 0
        self._quick: tuple[Container[int], StreamMatch] = (_NO_KEYS, self._zero_answer())
        # Plain ints written by the stream thread only.
        self.live_messages = 0
        self.topic_mismatches = 0
        self.other_topics: tuple[str, ...] = ()
        self._other_topic_frames: frozenset[bytes] = frozenset()
        self.duplicates_dropped = 0
        self.last_event_at: Optional[float] = None
        # Metrics dicts: written by the stream thread under _lock, copied under it.
        self._events_applied = dict.fromkeys(EVENT_TYPES.values(), 0)
        self._decode_errors = dict.fromkeys(DECODE_ERROR_REASONS, 0)
        self._recoveries_started = dict.fromkeys(RECOVERY_TRIGGERS, 0)
        self._snapshot_attempts = dict.fromkeys(SNAPSHOT_OUTCOMES, 0)
        self._snapshot_seconds_sum = 0.0
        self._last_snapshot: Optional[tuple[float, int, int]] = None  # seconds, bytes, messages
        # Live not-indexed counts: those of retired serving indexes, plus the serving index's
        # stats minus what its snapshot had counted when it was swapped in (_stats_base).
        self._not_indexed_retired = [0] * len(NOT_INDEXED)
        self._stats_base: tuple[int, ...] = _ZERO_STATS
        # §16: the stream's pending blocks (set once by the directory before the thread
        # starts), settled by every live batch applied; the collector is reused per batch.
        self.pending: Optional[BlockOverlay] = None
        self._changes = IndexChanges()

    # ------------------------------------------------------------------ request threads

    def match(self, keys: Sequence[int]) -> StreamMatch:
        """This stream's answer to a prefix query (§10).

        Hits are computed under the lock only, so they always come from one complete serving
        state (§6: never a stale or partial hit). Most streams of a query hold none of the
        prompt: for them a lock-free probe of the first key returns the shared zero-hit
        answer. That probe may run while the stream thread applies a batch, so it can answer 0
        hits for a first block that is resident just before and after that batch, with the
        previous batch's ``sequence`` and block counts: a miss, never a hit, that was not there.

        :param keys: content keys of the prompt's full blocks, oldest first, computed with the
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
                block_size = self._block_size
                return StreamMatch(self._instance, self._rank, True, self._sequence,
                                   device * block_size, host_only * block_size,
                                   index.device_blocks, index.host_blocks, None,
                                   self._completeness)
            return self._quick[1]

    def status(self) -> StreamStatus:
        """The stream's state and counts (read under the lock). While live messages arrived
        only under other topics, ``error`` says which (:meth:`topic_hint`), even on a
        synchronized stream: its index is then a snapshot that no live batch updates."""
        with self._lock:
            index = self._index
            error = self._error
            hint = self.topic_hint()
            if hint is not None:
                error = f"{error}; {hint}" if error else hint
            return StreamStatus(
                stream=self.stream_id, state=self._state, error=error,
                sequence=self._sequence,
                device_blocks=index.device_blocks if index is not None else 0,
                host_blocks=index.host_blocks if index is not None else 0,
                entries=index.entries if index is not None else 0,
                synchronized_once=self._synchronized_once, recoveries=self._recoveries,
                resync_differences=self._resync_differences,
                completeness=(self._completeness if self._state is StreamState.SYNCHRONIZED
                              else None))

    def counters(self, now: float, buffered_bytes: int) -> StreamCounters:
        """Copy of the metrics counters (O(1): a few dict copies under the lock).

        :param now: monotonic seconds, for ``seconds_since_event``.
        :param buffered_bytes: the recovery's current buffer accounting (§6).
        """
        with self._lock:
            index = self._index
            not_indexed = list(self._not_indexed_retired)
            if index is not None:
                for i, (cur, base) in enumerate(zip(stats_tuple(index.stats), self._stats_base)):
                    not_indexed[i] += cur - base
            last = self._last_snapshot
            last_event = self.last_event_at
            return StreamCounters(
                events_applied=dict(self._events_applied),
                not_indexed=dict(zip(NOT_INDEXED.values(), not_indexed)),
                decode_errors=dict(self._decode_errors),
                recoveries_started=dict(self._recoveries_started),
                snapshot_attempts=dict(self._snapshot_attempts),
                snapshot_seconds_sum=self._snapshot_seconds_sum,
                last_snapshot_seconds=last[0] if last is not None else None,
                last_snapshot_bytes=last[1] if last is not None else 0,
                last_snapshot_messages=last[2] if last is not None else 0,
                buffered_bytes=buffered_bytes,
                seconds_since_event=now - last_event if last_event is not None else None,
                topic_mismatches=self.topic_mismatches,
                duplicates_dropped=self.duplicates_dropped)

    def topic_hint(self) -> Optional[str]:
        """``None``, or, while no live message had the stream's topic and some had another:
        which topics the engine sends (``"no live message with topic 'kv' arrived; the engine
        sends topic 'kv-events' (dropped: a topic must equal the engine's exactly, §1)"``)."""
        others = self.other_topics
        if not others or self.live_messages:
            return None
        more = "" if len(others) < OTHER_TOPICS_MAX else ", ..."
        return (f"no live message with topic {self._topic!r} arrived; the engine sends "
                f"topic{'s' if len(others) > 1 else ''} {', '.join(others)}{more} (dropped: a "
                "topic must equal the engine's exactly, §1)")

    # ------------------------------------------------------------------ stream thread

    def topic_mismatch(self, topic: bytes) -> bool:
        """Count a live message dropped for its topic frame (§1) and keep the topic if it is
        one of the first :data:`OTHER_TOPICS_MAX` distinct ones (stream thread only).

        :param topic: the message's topic frame.
        :returns: True for the stream's first such message (the caller logs it once).
        """
        self.topic_mismatches += 1
        frames = self._other_topic_frames
        if len(frames) < OTHER_TOPICS_MAX and topic not in frames:
            self._other_topic_frames = frames | {topic}
            self.other_topics = (*self.other_topics, shown_topic(topic))
        return self.topic_mismatches == 1

    @property
    def index(self) -> Optional[TierIndex]:
        """The serving index (stream thread only: it is the only writer)."""
        return self._index

    @property
    def error(self) -> Optional[str]:
        """The current error reason (stream thread only: it is the only writer)."""
        return self._error

    def note_live(self, now: Optional[float]) -> None:
        """A live message with the exact topic arrived (``now``: it decoded, monotonic s;
        ``None``: it failed framing or decoding)."""
        self.live_messages += 1
        if now is not None:
            self.last_event_at = now

    def apply(self, action: ApplyEvents) -> Optional[StreamError]:
        """Apply one batch to the stream's index (§5, §6) under the lock: a live batch, or in
        history mode (§7h) a catch-up's replayed one, to an index served or kept while the
        stream recovers (only ``SYNCHRONIZED`` serves hits).

        :returns: ``None`` when applied (``sequence`` is then ``action.seq``); the index's error
            otherwise. A batch is never served half applied: an index that refuses one stops
            serving in the same lock hold (discarded, ``UNSYNCHRONIZED``, reason ``"seq <seq>:
            <error>"``); the rules' ``on_apply_failed`` says what follows.
        """
        events = action.events
        pending = self.pending
        # Collected whenever the stream has a pending set (§16), even while it is empty: a
        # dispatch may add the very blocks this batch stores while it is applied.
        changes = self._changes if pending is not None else None
        with self._lock:
            try:
                if changes is None:
                    self._index.apply(events, snapshot=action.orphans)  # type: ignore[union-attr, arg-type]
                else:
                    self._index.apply(events, snapshot=action.orphans,  # type: ignore[union-attr, arg-type]
                                      changes=changes)
            except StreamError as exc:
                self._invalidate_locked(f"seq {action.seq}: {exc}")
                return exc
            self._sequence = action.seq
            self._count_events_locked(events)
            self._publish_locked()
        if changes is not None:
            # After the index holds them, so a query sees each block exact or pending.
            pending.settle(changes)  # type: ignore[union-attr]
            changes.reset()
        return None

    def perform(self, action: ServingAction) -> None:
        """Carry out one serving action of the rules (:mod:`kvsvc.streams.actions`) other than
        :class:`~kvsvc.streams.actions.ApplyEvents` (:meth:`apply`), in one lock hold."""
        _PERFORM[type(action)](self, action)

    def invalidate(self, reason: str) -> None:
        """Discard the serving index and its sequence; state ``UNSYNCHRONIZED`` with ``reason``."""
        with self._lock:
            self._invalidate_locked(reason)

    def swap(self, index: TierIndex, *, sequence: Optional[int], resync: bool, difference: int,
             live_events: Sequence[object], stats_base: tuple[int, ...],
             completeness: Completeness = Completeness.EXACT) -> None:
        """Make ``index`` the serving one in one lock hold; state ``SYNCHRONIZED`` (§6).

        :param sequence: the last applied seq it holds (``None``: unknown).
        :param resync: a periodic resync (counts ``difference``) rather than a recovery
            (counts a recovery).
        :param difference: blocks that differ from the index it replaces (resync only).
        :param live_events: live events ``index`` holds that no serving index counted yet
            (a recovery's buffered tail, an ``AllBlocksCleared`` baseline batch).
        :param stats_base: ``index.stats`` counts (as :func:`~kvsvc.streams.counters.stats_tuple`)
            not due to live events, subtracted from the live not-indexed counts; ``()``: none.
        :param completeness: what ``index`` holds (§7h); snapshot mode: always exact.
        """
        with self._lock:
            self._retire_stats_locked()
            self._completeness = completeness
            self._stats_base = stats_base or _ZERO_STATS
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

    def hold(self, index: TierIndex, *, sequence: Optional[int], stats_base: tuple[int, ...],
             completeness: Completeness, reason: str) -> None:
        """Keep ``index`` as the stream's index without serving it (state ``RECOVERING`` with
        ``reason``), in one lock hold: §7h, a rebuild whose reply had a hole is complete up to
        ``sequence`` and catches up from there (:meth:`resume` serves it then).

        :param stats_base: as :meth:`swap`.
        """
        with self._lock:
            self._retire_stats_locked()
            self._completeness = completeness
            self._stats_base = stats_base or _ZERO_STATS
            self._index = index
            self._state = StreamState.RECOVERING
            self._error = reason
            self._sequence = sequence
            self._publish_locked()

    def resume(self, sequence: Optional[int]) -> None:
        """The index kept while the stream recovered is complete again (§7h: a catch-up was
        applied): state ``SYNCHRONIZED`` with it, in one lock hold; counts a recovery.

        :param sequence: the last applied seq it holds.
        """
        with self._lock:
            self._state = StreamState.SYNCHRONIZED
            self._error = None
            self._sequence = sequence
            self._synchronized_once = True
            self._recoveries += 1
            self._publish_locked()

    def count_resync_difference(self, difference: int) -> None:
        """Add ``difference`` to the resync differences (§7h: batches a periodic catch-up found
        that never arrived live, counted in batches)."""
        with self._lock:
            self._resync_differences += difference

    def set_completeness(self, completeness: Completeness) -> None:
        """Change what the serving index is said to hold (§7h: a subset becomes exact on an
        untargeted ``AllBlocksCleared``), in one lock hold with the answers it shapes."""
        with self._lock:
            self._completeness = completeness
            self._publish_locked()

    def set_recovering(self) -> None:
        """State ``RECOVERING`` (a recovery snapshot was requested); the error stays."""
        with self._lock:
            self._state = StreamState.RECOVERING
            self._publish_locked()

    def set_unsynchronized(self, error: str) -> None:
        """State ``UNSYNCHRONIZED`` with ``error`` (a failed recovery attempt)."""
        with self._lock:
            self._state = StreamState.UNSYNCHRONIZED
            self._error = error
            self._publish_locked()

    def set_error(self, error: Optional[str]) -> None:
        """Replace the error reason only (the state does not change)."""
        with self._lock:
            self._error = error
            self._publish_locked()

    def crashed(self, error: str) -> None:
        """The stream thread ended on a failure: no index, ``UNSYNCHRONIZED`` with ``error``."""
        with self._lock:
            self._index = None
            self._state = StreamState.UNSYNCHRONIZED
            self._error = error
            self._publish_locked()

    def count_decode_error(self, reason: DecodeErrorReason) -> None:
        """One more decode error labelled ``reason``."""
        with self._lock:
            self._decode_errors[reason] += 1

    def count_recovery(self, trigger: RecoveryTrigger) -> None:
        """One more recovery started by ``trigger``."""
        with self._lock:
            self._recoveries_started[trigger] += 1

    def count_attempt(self, outcome: SnapshotOutcome) -> None:
        """One more snapshot attempt ended with ``outcome`` (a failure; see :meth:`snapshot_ok`)."""
        with self._lock:
            self._snapshot_attempts[outcome] += 1

    def snapshot_ok(self, seconds: float, wire_bytes: int, messages: int) -> None:
        """One more successful snapshot: its duration (request to swap), bytes and messages."""
        with self._lock:
            self._snapshot_attempts[SnapshotOutcome.OK] += 1
            self._snapshot_seconds_sum += seconds
            self._last_snapshot = (seconds, wire_bytes, messages)

    # ------------------------------------------------------------------ internals

    def _invalidate_locked(self, reason: str) -> None:
        self._retire_stats_locked()
        self._index = None
        self._state = StreamState.UNSYNCHRONIZED
        self._error = reason
        self._sequence = None
        self._publish_locked()

    def _zero_answer(self) -> StreamMatch:
        """The answer to a prompt whose first block the stream does not hold (caller holds
        the lock, or nothing runs yet)."""
        index = self._index
        if self._state is StreamState.SYNCHRONIZED and index is not None:
            return StreamMatch(self._instance, self._rank, True, self._sequence, 0, 0,
                               index.device_blocks, index.host_blocks, None,
                               self._completeness)
        return StreamMatch(self._instance, self._rank, False, None, 0, 0, 0, 0, self._error)

    def _publish_locked(self) -> None:
        """Refresh match()'s fast path after a change of the serving state (index, state,
        error, sequence or counts); caller holds the lock. One assignment, so a query reads
        either the old pair or the new one."""
        index = self._index
        resident = (index.live_flags if self._state is StreamState.SYNCHRONIZED
                    and index is not None else _NO_KEYS)
        self._quick = (resident, self._zero_answer())

    def _count_events_locked(self, events: Sequence[object]) -> None:
        applied = self._events_applied
        for ev in events:
            applied[EVENT_TYPES[type(ev)]] += 1

    def _retire_stats_locked(self) -> None:
        """Fold the serving index's live not-indexed counts into the retired totals before it
        is replaced or discarded."""
        index = self._index
        if index is None:
            return
        for i, (cur, base) in enumerate(zip(stats_tuple(index.stats), self._stats_base)):
            self._not_indexed_retired[i] += cur - base


def _swap(serving: ServingState, a: SwapIndex) -> None:
    serving.swap(a.index, sequence=a.sequence, resync=a.resync, difference=a.difference,
                 live_events=a.live_events, stats_base=a.stats_base, completeness=a.completeness)


def _hold(serving: ServingState, a: HoldIndex) -> None:
    serving.hold(a.index, sequence=a.sequence, stats_base=a.stats_base,
                 completeness=a.completeness, reason=a.reason)


def _count_duplicate(serving: ServingState, a: CountDuplicate) -> None:
    serving.duplicates_dropped += 1


#: action type -> how :meth:`ServingState.perform` carries it out.
_PERFORM: dict = {
    SwapIndex: _swap,
    HoldIndex: _hold,
    ResumeIndex: lambda s, a: s.resume(a.sequence),
    Invalidate: lambda s, a: s.invalidate(a.reason),
    SetRecovering: lambda s, a: s.set_recovering(),
    SetUnsynchronized: lambda s, a: s.set_unsynchronized(a.error),
    SetError: lambda s, a: s.set_error(a.error),
    SetCompleteness: lambda s, a: s.set_completeness(a.completeness),
    CountRecovery: lambda s, a: s.count_recovery(a.trigger),
    CountAttempt: lambda s, a: s.count_attempt(a.outcome),
    CountDecodeError: lambda s, a: s.count_decode_error(a.reason),
    CountResyncDifference: lambda s, a: s.count_resync_difference(a.difference),
    CountDuplicate: _count_duplicate,
    SnapshotOk: lambda s, a: s.snapshot_ok(a.seconds, a.wire_bytes, a.messages),
}
