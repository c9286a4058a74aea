"""The history-mode recovery rules of one stream (§7h, vLLM and SGLang) without sockets.

:class:`HistoryRecovery` is the second implementation of
:class:`~kvsvc.streams.recovery.RecoveryRules` (the first, :class:`~kvsvc.streams.recovery.
SnapshotRecovery`, is §6/§7). It shares the attempt plumbing of
:class:`~kvsvc.streams.recovery.AttemptRules` (its base class: action queue, attempt
announce/abandon, live up/down bookkeeping, §6 backoff through
:class:`~kvsvc.streams.recovery.RecoveryTimers`), the buffer accounting
(:func:`~kvsvc.streams.recovery.record_bytes`) and the actions it returns
(:mod:`kvsvc.streams.actions`: the stream thread carries them out on the serving state). Like
it, it holds no socket, starts no thread, never reads the clock and never reads the serving
state back.

Inputs beyond the snapshot rules' ones: ``on_live_batch`` takes the payload's XXH3-64 digest
(``digest=``), and ``on_history_batch(attempt, seq, events, digest, wire_bytes, now)`` is each
batch of a catch-up after its anchor, as it arrives. Replies end with
``on_snapshot_complete(attempt, reply, ...)`` with a
:class:`~kvsvc.streams.state.CatchUpReply` or a :class:`~kvsvc.streams.state.RebuildReply`. Requests are :class:`RequestHistory`
(a catch-up from ``L`` with the anchor digest, or a rebuild from 0).

The rules (§7h; docs/recovery.md, and the decisions D6-D14 of docs/decisions.md):

- **Anchor.** The working index (serving, or kept while the stream recovers) has ``expected``
  (next seq it needs, ``L + 1``) and ``digest`` (``D``, of batch ``L``); the digests of the last
  :data:`~kvsvc.streams.anchor.RECENT_DIGESTS` applied batches tell a duplicate (same seq, same digest) from an
  engine that restarted (same seq, another payload) (D9).
- **Live batch, synchronized.** ``seq == expected``: applied (the hot path: one apply, one
  dict store). A duplicate: dropped. An older seq that is not a duplicate: the engine restarted
  (``sequence_backwards``): discard, rebuild. ``seq > expected``: a gap: the stream is
  ``recovering`` (0 hits) with its index kept, and catches up from ``L``.
- **Disconnect.** Index kept, ``recovering``; the catch-up is requested once the live ``SUB``
  is connected again (§6: replies are asked for only while it is), never a rebuild.
- **Catch-up** from ``start_seq = L``: proven by the first message (seq ``L``, digest ``D``);
  its later batches are applied as they arrive, exactly like live deltas (unknown parent: an
  error, on an exact index). A kept index takes no live batch before the proof (an engine that
  restarted may have reached exactly the expected seq): live batches are buffered, and at the
  end marker those after the last replayed seq follow contiguously (the others are duplicates,
  checked by digest) and the stream serves again (D11). A periodic catch-up's stream keeps applying
  live batches as they come (whichever copy comes first; the other is a duplicate). A reply
  with a hole (``truncated``: a ``ROUTER`` dropped messages) keeps what it applied and asks
  again from there (D7). Not proven
  (another first seq, another digest, an empty reply): discard, rebuild
  (``history_mismatch``). Every ``resync_interval_ms`` a synchronized stream catches up the
  same way while it serves; batches it applies that never arrived live are counted as a resync
  difference (in batches, D14).
- **Rebuild** from 0 into a private index (built by the history client), swapped in at the end
  marker, then the buffered live batches: those the reply covers are dropped (a different
  digest fails the attempt), the rest must follow contiguously. Reply from 0: ``exact``; from
  ``F > 0``: ``subset`` (orphans for unknown parents); empty: empty index, the first live batch
  decides (seq 0 exact, else subset).
- **Subset index.** Its live deltas (and catch-ups) apply with the orphan rule too: a block
  stored under a parent from before ``F`` is an orphan, not an error (a subset never knows all
  parents; D6). It becomes exact on a batch starting with an untargeted ``AllBlocksCleared``, or
  on a rebuild from 0.
- **No replay answer** (a rebuild with no reply message at all within ``replay_timeout_ms``):
  the stream serves a live-only subset and retries the rebuild with the §6 backoff, which
  replaces it when it succeeds. Live batches received during the unanswered rebuild start it
  (the first received is its first; exact if its seq is 0). None received (an idle engine): it
  is synchronized at once with an EMPTY live-only index, ``subset``, expected seq unknown (an
  empty index holds no block, so it is a valid subset: 0 hits, never a false one; and the
  stream is ready, §10), and its first live batch decides as after an empty reply. A gap in a
  live-only stream discards it and starts a new one at that batch; so do a disconnect
  (nothing proves continuity without a replay) and a refused batch, at the next live batch
  (the rebuild retry goes on; batches kept for it from before a refused one are dropped)
  (D10).
- **Unsynchronized**: a live batch starting with an untargeted ``AllBlocksCleared`` is a
  complete state (§6): exact from it.
- **Bad input** (a malformed reply, seqs not contiguous, a message over the limit, a stall past
  the per-message timeout, a buffer overflow): the attempt fails with the reason, is retried
  with the backoff; a periodic catch-up's stream keeps serving, a recovering one serves nothing.

Not thread-safe: owned by the stream thread; :meth:`HistoryRecovery.view` is a racy copy.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from logging import DEBUG, INFO, WARNING
from typing import Optional, Sequence, Union

from kvsvc.config import KvEventsConfig, StreamConfig
from kvsvc.errors import (
    ReplayUnanswered,
    SnapshotError,
    StreamError,
)
from kvsvc.events import Batch, Event
from kvsvc.index.tier_index import TierIndex
from kvsvc.streams.counters import (
    NOT_INDEXED,
    RecoveryTrigger,
    error_reason,
    stats_tuple,
    trigger_of,
)
from kvsvc.streams.recovery import (
    LIVE_SILENCE_GRACE_S,
    NO_ACTIONS,
    Action,
    AttemptRules,
    RequestHistory,
    RecoveryView,
    record_bytes,
)
from kvsvc.streams.anchor import Anchor, Judgement, starts_cleared
from kvsvc.streams.actions import (
    COUNT_DUPLICATE,
    SET_RECOVERING,
    ApplyEvents,
    CountDecodeError,
    CountRecovery,
    CountResyncDifference,
    HoldIndex,
    ResumeIndex,
    SetCompleteness,
    SnapshotOk,
    SwapIndex,
)
from kvsvc.streams.state import (
    CatchUpReply,
    Completeness,
    HistoryReply,
    RebuildReply,
    SnapshotResult,
)

log = logging.getLogger(__name__)

EXACT, SUBSET = Completeness.EXACT, Completeness.SUBSET
CONTIGUOUS, DUPLICATE, RESTARTED, GAP = (Judgement.CONTIGUOUS, Judgement.DUPLICATE,
                                         Judgement.RESTARTED, Judgement.GAP)


HistoryAction = Action


class HistoryRecovery(AttemptRules[RequestHistory, tuple[int, Batch, int], tuple[float, int]]):
    """The §7h recovery rules of one history-mode stream (see the module docstring).

    :param stream: the stream's configuration (name and endpoint appear in reasons).
    :param limits: ``max_buffered_bytes``, ``resync_interval_ms``, ``max_blocks_per_stream``.
    """

    def __init__(self, stream: StreamConfig, limits: KvEventsConfig) -> None:
        self._anchor = Anchor()       # L + 1, D and recent digests of the working index
        super().__init__(stream, limits)
        # (first seq, stream served before) of a catch-up's buffered tail just asked for.
        self._tail: Optional[tuple[int, bool]] = None
        self._held = False            # the serving state holds the working index
        self._completeness = EXACT
        self._live_only = False       # no replay answered: the index is built from live only
        self._live_only_wait = False  # ... and the next live batch starts it
        self._request: Optional[RequestHistory] = None   # of the attempt in flight
        self._caught_up = 0           # batches a periodic catch-up applied before live did
        # (self._buffer holds (seq, batch, digest).)
        self._live_at_check = 0       # live_messages at the last swap or catch-up end
        # (self._silence is (deadline, live_messages).)

    # ------------------------------------------------------------------ read-only state

    @property
    def _expected(self) -> Optional[int]:
        """The next seq the working index needs (its anchor's ``L + 1``)."""
        return self._anchor.expected

    @_expected.setter
    def _expected(self, value: Optional[int]) -> None:
        self._anchor.expected = value

    @property
    def completeness(self) -> Completeness:
        """What the working index holds (meaningful while one is held)."""
        return self._completeness

    @property
    def anchor(self) -> Optional[tuple[int, int]]:
        """``(L, D)`` of the working index, ``None`` without one."""
        return self._anchor.last if self._held else None

    @property
    def held(self) -> bool:
        """An index is kept (serving, or recovering by catch-up)."""
        return self._held

    @property
    def live_only(self) -> bool:
        """No replay answered: the index is (or will be) built from live batches alone."""
        return self._live_only

    def view(self) -> RecoveryView:
        """A copy of the bookkeeping (racy off the stream thread: tests, debugging)."""
        return self._view(max_seen=None, buffered_seqs=tuple(seq for seq, _, _ in self._buffer),
                          silence_check=None, awaiting_live=self._live_only_wait)

    def wakeup_at(self) -> Optional[float]:
        """Monotonic seconds when :meth:`tick` is next due; ``None``: nothing scheduled."""
        silence = self._silence
        return self._wakeup(held_back=self._awaiting_live,
                            deadline=None if silence is None else silence[0])

    # ------------------------------------------------------------------ inputs

    def tick(self, now: float) -> tuple[HistoryAction, ...]:
        """Time passed: end a silent-channel check whose deadline passed, start a due attempt
        (or note that it waits for the live channel)."""
        if self._silence is not None:
            self._check_silence(now)
        # (A silent channel asks nothing until a live message; a serving stream notes no wait.)
        self._start_due(now, held_back=self._awaiting_live, may_note=not self._synced)
        return self._take()

    def on_live_batch(self, seq: int, batch: Batch, wire_bytes: int, now: float,
                      digest: int = 0) -> tuple[HistoryAction, ...]:
        """A live batch with the exact topic, framed (§1) and decoded (§2, byte hashes to
        integers); ``digest`` is the XXH3-64 of its payload (§7h anchor). See the module
        docstring for what each case does.

        :param wire_bytes: the message's wire size (buffer accounting).
        """
        self._live_messages += 1
        if self._awaiting_live:
            self._live_alive_again(now)
        if self._synced:
            expected = self._expected
            if expected is None or seq == expected:
                self._apply_serving(seq, batch, digest, wire_bytes, now)
                return self._take()
            if seq < expected:
                self._older(seq, batch, digest, wire_bytes, now)
            else:
                self._gap(seq, batch, digest, wire_bytes, now)
            return self._take()
        self._live_unsynchronized(seq, batch, digest, wire_bytes, now)
        return self._take()

    def on_history_batch(self, attempt: int, seq: int, events: Sequence[Event], digest: int,
                         wire_bytes: int, now: float) -> tuple[HistoryAction, ...]:
        """A catch-up's batch after its proven anchor (§7h), as it arrives: applied to the
        working index like a live delta unless live already brought it (then its digest must
        match). A stale attempt id is ignored."""
        if attempt != self._attempt or not self._held:
            return self._take()
        judged = self._anchor.judge(seq, digest, unknown=DUPLICATE)
        if judged is DUPLICATE:
            return self._take()
        if judged is RESTARTED:
            self._discard_and_rebuild(
                f"catch-up seq {seq} differs from the live batch applied: the engine "
                "restarted", RecoveryTrigger.HISTORY_MISMATCH, now)
            return self._take()
        if judged is GAP:
            self._attempt_failed(SnapshotError(f"history reply seq {seq} skips seq "
                                               f"{self._expected}"), now)
            return self._take()
        self._apply_held(seq, Batch(0.0, events, None), digest)
        if self._synced:
            self._caught_up += 1
        return self._take()

    def on_live_down(self, reason: str, now: float) -> tuple[HistoryAction, ...]:
        """The live ``SUB`` disconnected (§6): batches may be missed. A synchronized stream
        keeps its index, serves nothing (``recovering``) and catches up once connected again
        (a live-only one is discarded: a new one starts at the next live batch)."""
        self._live_up = False
        self._abandon_attempt()
        if self._synced and self._live_only:
            # No replay to prove anything after it (the engine may have restarted): a new
            # live-only index starts at the next live batch (exact if that one is seq 0).
            self._invalidate(f"{reason}; a new live-only subset starts at the next live batch",
                             RecoveryTrigger.DISCONNECT)
            self._live_only_wait = True
        elif self._synced:
            self._synced = False
            self._out.append(SET_RECOVERING)
            how = (f"catching up from seq {self._expected - 1 if self._expected else 0} "
                   "once reconnected")
            self._set_error(f"{reason}; {how}")
            self._log_unsynchronized(f"{reason}; {how}", RecoveryTrigger.DISCONNECT,
                                     recovering=True)
        else:
            self._set_unsynchronized(reason)
        if not self._live_only or self._timers.next_attempt_at is None:
            # (A live-only stream keeps its rebuild retry schedule, or retries once connected.)
            self._timers.next_attempt_at = now
        return self._take()

    def on_snapshot_complete(self, attempt: int, reply: Union[SnapshotResult, HistoryReply],
                             requested_at: Optional[float], now: float) -> tuple[HistoryAction, ...]:
        """The end of attempt ``attempt``'s reply (or a catch-up's first message that proved
        no continuity): finish the catch-up or swap in the rebuilt index (§7h). A stale id is
        ignored."""
        if attempt != self._attempt:
            return self._take()
        duration = now - requested_at if requested_at is not None else 0.0
        if isinstance(reply, CatchUpReply):
            self._catch_up_done(reply, duration, now)
        else:
            assert isinstance(reply, RebuildReply)
            self._rebuild_done(reply, duration, now)
        return self._take()

    def on_internal_error(self, error_name: str, now: float) -> tuple[HistoryAction, ...]:
        """A bug in kvsvc escaped a turn: discard the index and rebuild after a backoff."""
        self._abandon_attempt()
        self._invalidate(f"internal error: {error_name}", RecoveryTrigger.INTERNAL_ERROR)
        self._live_only_wait = self._live_only
        self._timers.failed(now)
        return self._take()

    # ------------------------------------------------------------------ live batches

    def _apply_serving(self, seq: int, batch: Batch, digest: int, wire_bytes: int,
                       now: float) -> None:
        """The hot path: the next live batch on a serving index."""
        if self._expected is None:
            # After an empty rebuild reply the first live batch decides (§7h).
            self._expected = seq
            self._set_completeness(EXACT if seq == 0 else SUBSET,
                                   f"first live batch after an empty reply has seq {seq}")
        self._apply_held(seq, batch, digest)
        request = self._request
        if request is not None and not request.catch_up:
            # A rebuild retry in flight (live-only stream): its index needs this batch too.
            self._buffer_batch(seq, batch, digest, wire_bytes, now)

    def _apply_held(self, seq: int, batch: Batch, digest: int) -> None:
        """Apply batch ``seq == expected`` to the working index (serving or kept) and move the
        anchor; should the index refuse it, :meth:`on_apply_failed` follows."""
        subset = self._completeness is SUBSET
        events = batch.events
        self._tail = None
        self._out.append(ApplyEvents(seq, events, subset))
        self._anchor.advance(seq, digest)
        if subset and starts_cleared(events):
            self._set_completeness(EXACT, f"seq {seq} starts with AllBlocksCleared")

    def on_apply_failed(self, seq: int, error: StreamError, now: float) -> tuple[HistoryAction, ...]:
        """The working index refused batch ``seq`` (§5; the serving state discarded it): the
        index is gone and a rebuild starts; a live-only stream starts again from the next live
        batch (the rebuild retry in flight goes on)."""
        reason, label = self._refused(seq, error)
        tail = self._tail
        if tail is not None and seq >= tail[0]:
            # Refused in a catch-up's buffered tail: the stream had not served again yet.
            self._synced = tail[1]
        live_only = self._live_only
        self._lost(reason, trigger_of(label))
        if live_only:
            # A rebuild retry in flight goes on, but the batches it kept came before this
            # one (which may have removed their blocks): none may start a live-only index.
            self._buffer = []
            self._buffer_bytes = 0
            self._live_only_wait = True
        else:
            self._restart_recovery(now)
        return self._take()

    def _older(self, seq: int, batch: Batch, digest: int, wire_bytes: int, now: float) -> None:
        """A live seq below the expected one on a serving index."""
        if self._anchor.judge(seq, digest) is DUPLICATE:
            # Applied already (a catch-up brought it first, or a repeat of the same batch).
            self._out.append(COUNT_DUPLICATE)
            return
        self._discard_and_rebuild(f"sequence went backwards: expected seq {self._expected}, "
                                  f"got {seq} (the engine restarted)",
                                  RecoveryTrigger.SEQUENCE_BACKWARDS, now)
        self._buffer_new(seq, batch, digest, wire_bytes, now)

    def _gap(self, seq: int, batch: Batch, digest: int, wire_bytes: int, now: float) -> None:
        """A live seq above the expected one on a serving index (§7h: catch up)."""
        reason = f"sequence gap: expected seq {self._expected}, got {seq}"
        if self._live_only:
            # §7h: a live-only stream cannot catch up: a new one starts at this batch.
            self._discard_live_only(seq, batch, digest, wire_bytes, reason, now)
            return
        self._synced = False
        self._out.append(SET_RECOVERING)
        self._set_error(f"{reason}; catching up from seq {self._expected - 1}")  # type: ignore[operator]
        self._log_unsynchronized(f"{reason}; catching up", RecoveryTrigger.SEQUENCE_GAP,
                                 recovering=True)
        request = self._request
        if request is None or not request.catch_up:
            self._restart_recovery(now)
        else:
            # The periodic catch-up in flight fills the gap (or its end asks again).
            self._promote(request)
        self._buffer_batch(seq, batch, digest, wire_bytes, now)

    def _live_unsynchronized(self, seq: int, batch: Batch, digest: int, wire_bytes: int,
                             now: float) -> None:
        """A live batch while the stream does not serve."""
        if starts_cleared(batch.events):
            self._baseline_from_cleared(seq, batch, digest, now)
            return
        if self._live_only_wait:
            self._start_live_only(seq, batch, digest, wire_bytes, now)
            return
        if self._held:
            # A kept index takes no live batch before its catch-up proved the anchor: after a
            # disconnect the engine may have restarted and published up to exactly the
            # expected seq, and only the anchor's digest tells (the batch is buffered for the
            # catch-up, or dropped without one: the reply covers it).
            expected = self._expected
            if expected is not None and seq < expected:
                if self._anchor.judge(seq, digest) is DUPLICATE:
                    self._out.append(COUNT_DUPLICATE)
                    return
                self._discard_and_rebuild(
                    f"sequence went backwards: expected seq {expected}, got {seq} (the "
                    "engine restarted)", RecoveryTrigger.SEQUENCE_BACKWARDS, now)
        self._buffer_new(seq, batch, digest, wire_bytes, now)

    def _buffer_new(self, seq: int, batch: Batch, digest: int, wire_bytes: int,
                    now: float) -> None:
        """Buffer a live batch into the attempt in flight; a seq not above the last buffered
        one means a restart. Without an attempt and without an index (a rebuild is due, or
        waits for its backoff) the batch is kept too, within ``max_buffered_bytes``: the next
        rebuild's reply covers it (deduplicated), and if no reply ever comes the live-only
        subset starts from the first batch received (§7h), not from a later one."""
        buffer = self._buffer
        if self._attempt is None:
            if self._held:
                return  # the catch-up's reply covers it
            cost = record_bytes(batch, wire_bytes)
            if buffer and seq <= buffer[-1][0] or self._buffer_bytes + cost > self._max_buffered:
                buffer.clear()
                self._buffer_bytes = 0
            buffer.append((seq, batch, digest))
            self._buffer_bytes += cost
            return
        if buffer and seq <= buffer[-1][0]:
            last = buffer[-1][0]
            self._discard_and_rebuild(f"sequence went backwards during recovery: got seq {seq} "
                                      f"after {last}", RecoveryTrigger.SEQUENCE_BACKWARDS, now)
            if self._attempt is None:
                return
        self._buffer_batch(seq, batch, digest, wire_bytes, now)

    def _buffer_batch(self, seq: int, batch: Batch, digest: int, wire_bytes: int,
                      now: float) -> None:
        self._buffer_item((seq, batch, digest), batch, wire_bytes, "the history reply", now)

    def _baseline_from_cleared(self, seq: int, batch: Batch, digest: int, now: float) -> None:
        """§6: a batch starting with an untargeted ``AllBlocksCleared`` is a complete state."""
        index = self._cleared_index(seq, batch, now)
        if index is None:
            return
        self._abandon_attempt()
        self._live_only_wait = False
        self._install(index, seq, digest, {}, EXACT, live_events=batch.events,
                      stats_base=_ZERO_STATS, how=f"AllBlocksCleared batch seq {seq}", now=now)

    def _start_live_only(self, seq: int, batch: Batch, digest: int, wire_bytes: int,
                         now: float) -> None:
        """No replay answered (§7h): a live-only index from this batch on (exact at seq 0)."""
        index = self._new_index()
        completeness = EXACT if seq == 0 else SUBSET
        try:
            index.apply(batch.events, snapshot=completeness is SUBSET)
        except StreamError as exc:
            self._out.append(CountDecodeError(error_reason(exc)))
            self._set_error(f"seq {seq}: {exc}")
            return
        self._live_only_wait = False
        self._install(index, seq, digest, {}, completeness, live_events=batch.events,
                      stats_base=_ZERO_STATS,
                      how=f"live-only subset from seq {seq} (no replay answer)", keep_attempt=True)
        request = self._request
        if request is not None and not request.catch_up:
            self._buffer_batch(seq, batch, digest, wire_bytes, now)

    def _discard_live_only(self, seq: int, batch: Batch, digest: int, wire_bytes: int,
                           reason: str, now: float) -> None:
        """§7h: a gap in a live-only stream discards it; a new one starts at this batch."""
        self._invalidate(f"{reason} in a live-only stream", RecoveryTrigger.SEQUENCE_GAP)
        self._live_only_wait = True
        self._start_live_only(seq, batch, digest, wire_bytes, now)

    def _live_only_from(self, buffered: list[tuple[int, Batch, int]], now: float) -> None:
        """No replay answer: the live-only subset starts from the first batch received (§7h),
        so the batches buffered during the unanswered rebuild are not lost."""
        for seq, batch, digest in buffered:
            self.on_live_batch_replayed(seq, batch, digest, now)

    def on_live_batch_replayed(self, seq: int, batch: Batch, digest: int, now: float) -> None:
        """A buffered live batch handed over again (after an unanswered rebuild): as
        :meth:`on_live_batch` without counting it a second time."""
        if self._synced:
            expected = self._expected
            if expected is None or seq == expected:
                self._apply_serving(seq, batch, digest, 0, now)
            elif seq > expected:
                self._gap(seq, batch, digest, 0, now)
            return
        self._live_unsynchronized(seq, batch, digest, 0, now)

    # ------------------------------------------------------------------ replies

    def _catch_up_done(self, reply: CatchUpReply, duration: float, now: float) -> None:
        request = self._request
        assert request is not None
        self._out.append(SnapshotOk(duration, reply.wire_bytes, reply.messages))
        if not reply.continuous:
            self._discard_and_rebuild(f"catch-up from seq {request.start_seq} failed: "
                                      f"{reply.reason}; rebuilding",
                                      RecoveryTrigger.HISTORY_MISMATCH, now)
            return
        periodic = self._synced
        caught_up = self._caught_up
        buffered = self._buffer
        self._abandon_attempt()
        if reply.truncated:
            # The engine dropped part of its reply: what arrived is applied; ask for the rest.
            self._log(log, INFO, "stream %s: %s; catching up again from seq %d", self._name,
                      reply.reason, self._expected - 1)  # type: ignore[operator]
            self._caught_up = caught_up
            self._begin_attempt()
            return
        # The buffered live batches (after a gap) follow the replayed ones.
        for seq, batch, digest in buffered:
            judged = self._anchor.judge(seq, digest, unknown=DUPLICATE)
            if judged is DUPLICATE:
                continue
            if judged is RESTARTED:
                self._discard_and_rebuild(
                    f"live seq {seq} differs from the batch replayed: the engine restarted",
                    RecoveryTrigger.HISTORY_MISMATCH, now)
                return
            if judged is GAP:
                # Published after the reply and lost on the way: ask again from here.
                self._log(log, INFO, "stream %s: catch-up ended at seq %d, buffered live seq "
                          "%d: catching up again", self._name,
                          self._expected - 1, seq)  # type: ignore[operator]
                self._begin_attempt()
                return
            tail = self._tail
            self._apply_held(seq, batch, digest)
            self._tail = (seq, periodic) if tail is None else tail
        self._timers.synchronized(now, probe=False)
        live_messages = self._live_messages
        silent = live_messages == self._live_at_check
        self._live_at_check = live_messages
        if periodic:
            if caught_up:
                self._out.append(CountResyncDifference(caught_up))
                self._log(log, WARNING, "stream %s: periodic catch-up found %d batches that "
                          "never arrived live (lost events); applied", self._name, caught_up)
                if silent and self._silence is None:
                    # Not one live message since the last check while the engine published:
                    # in flight still, or a dead live channel (D13 in docs/decisions.md);
                    # a live message must arrive within the grace period.
                    self._silence = (now + LIVE_SILENCE_GRACE_S, live_messages)
            else:
                self._log(log, DEBUG, "stream %s: periodic catch-up matched (seq %d)",
                          self._name, request.start_seq)
            return
        self._resume(f"catch-up from seq {request.start_seq}, {reply.messages} messages")

    def _rebuild_done(self, reply: RebuildReply, duration: float, now: float) -> None:
        index = reply.index
        stats_base = stats_tuple(index.stats)
        if reply.truncated and reply.last_seq is not None and reply.last_digest is not None:
            # Complete up to the hole: keep it (not served) and catch up from its last seq;
            # the catch-up's reply covers the buffered live batches.
            self._out.append(SnapshotOk(duration, reply.wire_bytes, reply.messages))
            self._live_only = self._live_only_wait = False
            self._hold(index, reply.last_seq, reply.last_digest, dict(reply.digests),
                       EXACT if reply.exact else SUBSET, stats_base,
                       f"{reply.reason}; catching up from seq {reply.last_seq}")
            return
        merged = merge_rebuild(reply, self._buffer)
        if isinstance(merged, SnapshotError):
            self._attempt_failed(merged, now)
            return
        self._out.append(SnapshotOk(duration, reply.wire_bytes, reply.messages))
        self._live_only = self._live_only_wait = False
        self._install(index, merged.sequence, merged.digest, merged.digests,
                      merged.completeness, live_events=merged.tail, stats_base=stats_base,
                      how=merged.how, now=now)

    # ------------------------------------------------------------------ state changes

    def _install(self, index: TierIndex, sequence: Optional[int], digest: Optional[int],
                 digests: dict[int, int], completeness: Completeness, *,
                 live_events: Sequence[object], stats_base: tuple[int, ...], how: str,
                 keep_attempt: bool = False, now: Optional[float] = None) -> None:
        """Make ``index`` the serving one (§6 atomic swap) with its anchor; ``now`` given: the
        next periodic catch-up after ``resync_interval_ms`` (a live-only start keeps the rebuild
        retry schedule and the attempt in flight, ``keep_attempt``)."""
        replacing = self._synced
        if not keep_attempt:
            self._abandon_attempt()
        self._out.append(SwapIndex(index, sequence, False, 0, live_events, stats_base,
                                   completeness))
        self._index = index
        self._error = None
        self._tail = None
        self._synced = self._held = True
        self._completeness = completeness
        self._anchor = Anchor.at(sequence, digest, digests)
        if now is not None:
            self._timers.synchronized(now, probe=False)
        self._live_at_check = self._live_messages
        self._log(log, INFO, "stream %s: synchronized%s (%s, %s): %d device, %d host blocks",
                  self._name, " again" if replacing else "", how, completeness.value,
                  index.device_blocks, index.host_blocks)

    def _hold(self, index: TierIndex, sequence: int, digest: int, digests: dict[int, int],
              completeness: Completeness, stats_base: tuple[int, ...], reason: str) -> None:
        """Keep a rebuilt index complete up to ``sequence`` without serving it and catch up."""
        was_synced = self._synced
        self._abandon_attempt()
        self._out.append(HoldIndex(index, sequence, stats_base, completeness, reason))
        self._index = index
        self._error = reason
        self._tail = None
        if was_synced:
            # (A live-only subset was serving: it stops, the rebuilt index takes over.)
            self._out.append(CountRecovery(RecoveryTrigger.SEQUENCE_GAP))
        self._synced = False
        self._held = True
        self._completeness = completeness
        self._anchor = Anchor.at(sequence, digest, digests)
        self._log(log, INFO, "stream %s: rebuilt to seq %d: %s", self._name, sequence, reason)
        self._begin_attempt()

    def _resume(self, how: str) -> None:
        """The kept index is complete again: serve it."""
        self._synced = True
        self._live_at_check = self._live_messages
        self._out.append(ResumeIndex(None if self._expected is None else self._expected - 1))
        self._error = None
        self._out.append(SetCompleteness(self._completeness))
        # (Counted when the line is written: after the catch-up's batches were applied.)
        self._log(log, INFO, "stream %s: synchronized (%s, %s): %s device, %s host blocks",
                  self._name, how, self._completeness.value, _Blocks(self._index, "device_blocks"),
                  _Blocks(self._index, "host_blocks"))

    def _check_silence(self, now: float) -> None:
        """End a silent-channel check: passed once a live message arrived since it was armed;
        failed at its deadline: the index is kept but serves nothing, and nothing is asked for
        until a live message arrives (a dead live channel, say a topic the engine does not
        publish, would otherwise leave removals unseen between catch-ups: stale hits)."""
        assert self._silence is not None
        deadline, count = self._silence
        if not self._silence_failed(count, deadline, now):
            return
        self._synced = False
        reason = (f"live channel silent: the engine published batches up to seq "
                  f"{self._expected - 1 if self._expected else 0} (found by a catch-up) but no "
                  f"live batch arrived; check the stream's endpoint and topic "
                  f"{self._stream.topic!r}")
        self._set_unsynchronized(reason)
        self._log_unsynchronized(reason, RecoveryTrigger.LIVE_SILENT)

    def _live_alive_again(self, now: float) -> None:
        """A live message after a silent channel: catch up (the kept index) now."""
        self._awaiting_live = False
        self._log(log, INFO, "stream %s: live channel alive again; catching up", self._name)
        self._timers.next_attempt_at = now

    def _set_completeness(self, completeness: Completeness, why: str) -> None:
        if completeness is self._completeness:
            return
        self._completeness = completeness
        self._out.append(SetCompleteness(completeness))
        self._log(log, INFO, "stream %s: index is %s now (%s)", self._name, completeness.value,
                  why)

    def _stream_error(self, reason: str, trigger: RecoveryTrigger, now: float) -> None:
        """An error of the stream: discard the index and rebuild (a live-only stream: start
        again from the next live batch), or fail the attempt in flight. A live message that
        failed decoding comes here too (``on_live_error``): the batch is lost to the index and
        its replayed copy would fail alike (D12 in docs/decisions.md)."""
        if self._held:
            live_only = self._live_only
            self._abandon_attempt()
            self._invalidate(reason, trigger)
            if live_only:
                self._live_only_wait = True
                if self._timers.next_attempt_at is None:
                    # The rebuild retry in flight was abandoned: ask again (§6 schedule kept
                    # otherwise), or the replay endpoint would never be tried again.
                    self._timers.next_attempt_at = now
            else:
                self._restart_recovery(now)
        else:
            self._fail_or_note(reason, now)

    def _discard_and_rebuild(self, reason: str, trigger: RecoveryTrigger, now: float) -> None:
        """Discard the working index (served or kept) and rebuild from 0 now (§7h)."""
        self._abandon_attempt()
        self._invalidate(reason, trigger)
        self._live_only = self._live_only_wait = False
        self._restart_recovery(now)

    def _invalidate(self, reason: str, trigger: RecoveryTrigger) -> None:
        """Discard the working index and its anchor; one log line and one recovery count per
        loss of synchronization (a kept index just logs)."""
        self._discard(reason)
        self._lost(reason, trigger)

    def _lost(self, reason: str, trigger: RecoveryTrigger) -> None:
        """Forget the index (the serving state discarded it already). Counts ``trigger`` when
        an index goes (a kept one too: its catch-up becomes a rebuild)."""
        was_synced, was_held = self._synced, self._held
        self._synced = self._held = False
        self._tail = None
        self._anchor = Anchor()
        self._completeness = EXACT
        if was_synced:
            self._log_unsynchronized(reason, trigger)
        elif was_held:
            self._out.append(CountRecovery(trigger))
            self._log(log, WARNING, "stream %s: index discarded: %s", self._name, reason)

    # ------------------------------------------------------------------ attempts

    def _promote(self, request: RequestHistory) -> None:
        """A periodic attempt in flight is now the stream's recovery."""
        self._request = RequestHistory(request.attempt, request.start_seq, True,
                                       request.anchor_digest)

    def _abandon_attempt(self) -> None:
        super()._abandon_attempt()
        self._request = None
        self._caught_up = 0

    def _begin_attempt(self, now: Optional[float] = None) -> None:
        """Request a catch-up from ``L`` when an index with an anchor is kept (not live-only),
        else a rebuild from 0."""
        self._waiting_error_logged = False
        anchor = self.anchor if not self._live_only else None
        if anchor is not None or self._held:
            # (A rebuild keeps what arrived before its request: its reply covers it.)
            self._buffer = []
            self._buffer_bytes = 0
        self._caught_up = 0
        self._attempt_ids += 1
        self._attempt = self._attempt_ids
        if anchor is not None:
            request = RequestHistory(self._attempt, anchor[0], not self._synced, anchor[1])
        else:
            request = RequestHistory(self._attempt, 0, not self._synced, None)
        self._request = request
        self._out.append(request)
        self._opening = request
        self._timers.next_attempt_at = None

    def _announce(self, request: RequestHistory) -> None:
        what = (f"catch-up requested (start_seq {request.start_seq})" if request.catch_up
                else "rebuild requested (start_seq 0)")
        if not request.urgent or self._synced:
            self._log(log, DEBUG, "stream %s: periodic %s", self._name, what)
            return
        self._out.append(SET_RECOVERING)
        self._log(log, INFO, "stream %s: recovering: %s", self._name, what)

    def _attempt_failed(self, exc: StreamError, now: float) -> None:
        """A failed attempt (§6, §7h): close it, keep the reason, retry after the backoff. A
        periodic one leaves the stream serving; a rebuild without any answer
        (:class:`~kvsvc.errors.ReplayUnanswered`) makes the stream serve a live-only subset
        from the first live batch received (§7h)."""
        request = self._request
        buffered = self._buffer
        delay = self._fail_attempt(exc, now)
        unanswered = (isinstance(exc, ReplayUnanswered) and request is not None
                      and not request.catch_up)
        if self._synced:
            # Once per failure streak at warning: a live-only stream retries for good.
            self._log(
                log, WARNING if self._timers.failures == 1 else DEBUG,
                "stream %s: %s failed: %s; still serving; retry in %.1fs", self._name,
                "rebuild retry" if request is not None and not request.catch_up
                else "periodic catch-up", exc, delay)
            return
        reason = str(exc)
        if unanswered and not self._held and not buffered:
            # Nothing received either (an idle engine without a replay endpoint): serve an
            # empty live-only subset now, so that the stream is ready (§10) without waiting
            # for the engine's first batch; that batch decides as after an empty reply.
            self._start_empty_live_only(reason, delay)
            return
        if unanswered and not self._held:
            self._live_only = self._live_only_wait = True
            reason = f"{reason}; serving a live-only subset from the next live batch"
        self._set_unsynchronized(reason)
        self._log(log, WARNING, "stream %s: unsynchronized: %s; retry in %.1fs", self._name,
                  reason, delay)
        if unanswered and buffered and not self._held:
            self._live_only_from(buffered, now)

    def _start_empty_live_only(self, reason: str, delay: float) -> None:
        """No replay answer and no live batch received (§7h "No replay answer"; D10 in
        docs/decisions.md): serve an EMPTY live-only index, ``subset``, with the expected seq
        unknown. It holds no block, so it is a valid subset of any residency (0 hits, never a
        false one). The first live batch then decides as after an empty rebuild reply: seq 0
        ``exact``, any other seq ``subset`` with the orphan rule. The rebuild keeps its §6
        backoff retry schedule (``delay`` seconds, already set); a later successful rebuild
        replaces this index."""
        self._live_only = True
        self._live_only_wait = False
        self._install(self._new_index(), None, None, {}, SUBSET, live_events=(),
                      stats_base=_ZERO_STATS,
                      how=f"{reason}: live-only subset, empty until the first live batch; "
                          f"rebuild retry in {delay:.1f}s", keep_attempt=True)


_ZERO_STATS = (0,) * len(NOT_INDEXED)


@dataclass(frozen=True, slots=True)
class RebuildMerge:
    """A rebuild reply merged with the live batches buffered meanwhile (:func:`merge_rebuild`).

    :param sequence: the last seq the index holds (``None``: unknown, after an empty reply with
        nothing buffered: the first live batch decides).
    :param digest: its payload digest (``D``).
    :param digests: ``seq -> digest`` of the reply's and the tail's last batches.
    :param completeness: what the index holds (§7h).
    :param tail: the events of the buffered batches applied (live events never counted yet).
    :param how: what was merged (for the log line).
    """

    sequence: Optional[int]
    digest: Optional[int]
    digests: dict[int, int]
    completeness: Completeness
    tail: list[Event]
    how: str


def merge_rebuild(reply: RebuildReply,
                  buffered: Sequence[tuple[int, Batch, int]]) -> Union[RebuildMerge, SnapshotError]:
    """Merge a rebuild reply (§7h) with the live batches ``(seq, batch, digest)`` buffered
    during it, applying the tail to the reply's private index (never a serving one).

    - Buffered batches the reply covers are dropped when their digest is the replayed one's
      (or unknown); another digest means the engine restarted: the attempt fails.
    - The rest must follow the reply's last seq contiguously (else the attempt fails: ``gap
      after the history reply``) and are applied with the orphan rule on a subset.
    - An empty reply: the first buffered batch decides (seq 0 exact, any other seq subset).
    - A subset becomes exact on a batch starting with an untargeted ``AllBlocksCleared``.

    :returns: the :class:`RebuildMerge`, or the :class:`~kvsvc.errors.SnapshotError` the attempt
        fails with (the index is then unusable).
    """
    index = reply.index
    anchor = Anchor.at(reply.last_seq, reply.last_digest, reply.digests)
    if reply.first_seq is None:
        completeness = EXACT
        how = "empty history reply"
    else:
        completeness = EXACT if reply.exact else SUBSET
        how = f"history reply seq {reply.first_seq}..{reply.last_seq}, {reply.messages} messages"
    digests = dict(reply.digests)
    tail: list[Event] = []
    for seq, batch, digest in buffered:
        if anchor.expected is None:
            # Empty reply: the first live batch decides (§7h).
            completeness = EXACT if seq == 0 else SUBSET
        judged = anchor.judge(seq, digest, unknown=DUPLICATE)
        if judged is DUPLICATE:
            continue
        if judged is RESTARTED:
            return SnapshotError(f"live seq {seq} differs from the batch replayed (the engine "
                                 "restarted)")
        if judged is GAP:
            return SnapshotError(f"gap after the history reply: expected seq {anchor.expected}, "
                                 f"got {seq}")
        try:
            index.apply(batch.events, snapshot=completeness is SUBSET)
        except StreamError as exc:
            return SnapshotError(f"seq {seq} after the history reply: {exc}")
        if completeness is SUBSET and starts_cleared(batch.events):
            completeness = EXACT
        tail.extend(batch.events)
        anchor.advance(seq, digest)
        digests[seq] = digest
    sequence = None if anchor.expected is None else anchor.expected - 1
    return RebuildMerge(sequence, anchor.digest, digests, completeness, tail, how)


class _Blocks:
    """A log argument: ``index``'s block count ``attr`` (``device_blocks``, ``host_blocks``)
    read when the line is written, after the batches asked for before it were applied."""

    __slots__ = ("_index", "_attr")

    def __init__(self, index: Optional[TierIndex], attr: str) -> None:
        self._index = index
        self._attr = attr

    def __str__(self) -> str:
        return str(getattr(self._index, self._attr) if self._index is not None else 0)
