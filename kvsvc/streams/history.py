"""The history-mode recovery rules of one stream (§7h, vLLM and SGLang) without sockets.

:class:`HistoryRecovery` is the second implementation of
:class:`~kvsvc.streams.recovery.RecoveryRules` (the first, :class:`~kvsvc.streams.recovery.
SnapshotRecovery`, is §6/§7). It shares the attempt plumbing of
:class:`~kvsvc.streams.recovery.AttemptRules` (action queue, attempt announce/abandon, live
up/down bookkeeping, §6 backoff through :class:`~kvsvc.streams.recovery.RecoveryTimers`) and
returns actions (:mod:`kvsvc.streams.actions`) that the stream thread carries out on the
serving state. It holds no socket, starts no thread, never reads the clock and never reads the
serving state back.

Inputs beyond the snapshot rules' ones: ``on_live_batch`` takes the payload's XXH3-64 digest
(``digest=``), and ``on_history_batch(attempt, seq, events, digest, wire_bytes, now)`` is each
batch of a catch-up after its anchor, as it arrives. Replies end with
``on_snapshot_complete(attempt, reply, ...)`` with a :class:`~kvsvc.streams.state.CatchUpReply`
or a :class:`~kvsvc.streams.state.RebuildReply`. Requests are
:class:`~kvsvc.streams.actions.RequestHistory` (a catch-up from ``L`` with the anchor digest,
or a rebuild from 0).

One state machine: the stream is in one :class:`~kvsvc.streams.recovery.Mode` (``REBUILDING``,
``HELD``, ``SERVING``, ``LIVE_ONLY_WAITING``, ``LIVE_ONLY``, ``SILENT``), and :data:`MODE_TABLE`
maps each (mode, :class:`Input`) to its handler; :func:`render_mode_table` writes that table as
markdown (docs/recovery.md, checked by a unit test). The rules of each cell (§7h;
docs/recovery.md, and the decisions D6-D14 of docs/decisions.md):

- **Anchor** (:class:`~kvsvc.streams.anchor.Anchor`): the working index's ``L`` and ``D`` and
  the digests of its last batches judge each batch once: contiguous (applied), duplicate
  (dropped), restarted (the engine restarted: discard, rebuild, ``sequence_backwards``), gap
  (D9).
- **Gap or disconnect while serving**: the index is kept (``HELD``, 0 hits) and catches up
  from ``L`` once the live ``SUB`` is connected; a kept index takes no live batch before the
  catch-up proved the anchor (an engine that restarted may have reached exactly the expected
  seq, D11): live batches are buffered and merged at the end
  (:func:`~kvsvc.streams.history_reply.merge_catch_up`). A reply with a hole (``truncated``)
  keeps what it applied and asks again from there (D7); one that proves no continuity discards
  the index and rebuilds (``history_mismatch``). Every ``resync_interval_ms`` a serving stream
  catches up the same way while it serves; batches live never brought are counted as a resync
  difference (in batches, D14), and if no live message at all arrived meanwhile a
  silent-channel check runs (``SILENT`` when it fails, D13).
- **Rebuild** from 0 into a private index, merged with the buffered live batches
  (:func:`~kvsvc.streams.history_reply.merge_rebuild`) and swapped in: ``exact`` from seq 0,
  ``subset`` (orphans for unknown parents) from ``F > 0``, empty: the first live batch decides.
  A subset's deltas apply with the orphan rule too (D6); it becomes exact on a batch starting with
  an untargeted ``AllBlocksCleared`` (:func:`~kvsvc.streams.anchor.starts_cleared`), which also
  synchronizes a stream that serves nothing.
- **No replay answer** (a rebuild unanswered within ``replay_timeout_ms``): a live-only subset
  serves, from the first live batch received (or empty at once when none was), while the
  rebuild is retried with the §6 backoff. A gap, a disconnect or a refused batch discards it;
  the next live batch starts a new one (D10).
- **Bad input** (a malformed reply, seqs not contiguous, a message over the limit, a stall past
  the per-message timeout, a buffer overflow): the attempt fails, is retried with the backoff;
  a serving stream keeps serving. A live message that fails decoding discards the index: the
  batch is lost to it and its replayed copy would fail alike (D12).

Not thread-safe: owned by the stream thread; :meth:`HistoryRecovery.view` is a racy copy.
"""

from __future__ import annotations

import enum
import logging
from logging import DEBUG, INFO, WARNING
from typing import Callable, Optional, Sequence, Union

from kvsvc.config import KvEventsConfig, StreamConfig
from kvsvc.errors import ReplayUnanswered, SnapshotError, StreamError
from kvsvc.events import Batch, Event
from kvsvc.index.tier_index import TierIndex
from kvsvc.streams.actions import (
    COUNT_DUPLICATE,
    SET_RECOVERING,
    Action,
    ApplyEvents,
    CountDecodeError,
    CountRecovery,
    CountResyncDifference,
    HoldIndex,
    RequestHistory,
    ResumeIndex,
    SetCompleteness,
    SnapshotOk,
    SwapIndex,
)
from kvsvc.streams.anchor import RECENT_DIGESTS, Anchor, Judgement, starts_cleared
from kvsvc.streams.counters import (
    NOT_INDEXED,
    RecoveryTrigger,
    error_reason,
    stats_tuple,
    trigger_of,
)
from kvsvc.streams.history_reply import Buffered, merge_catch_up, merge_rebuild
from kvsvc.streams.recovery import (
    LIVE_SILENCE_GRACE_S,
    SERVES,
    AttemptRules,
    Link,
    Mode,
    RecoveryView,
    record_bytes,
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
DUPLICATE = Judgement.DUPLICATE
REBUILDING, HELD, SERVING = Mode.REBUILDING, Mode.HELD, Mode.SERVING
LIVE_ONLY_WAITING, LIVE_ONLY, SILENT = Mode.LIVE_ONLY_WAITING, Mode.LIVE_ONLY, Mode.SILENT
#: The modes that keep an index (served or not).
HOLDS = frozenset({SERVING, LIVE_ONLY, HELD, SILENT})
#: The modes of a stream without any replay answer.
LIVE_ONLY_MODES = frozenset({LIVE_ONLY, LIVE_ONLY_WAITING})
_ZERO_STATS = (0,) * len(NOT_INDEXED)


class Input(enum.Enum):
    """The inputs whose rule depends on the mode (columns of :data:`MODE_TABLE`)."""

    LIVE_BATCH = "live batch"
    DISCONNECT = "disconnect"
    BAD_INPUT = "bad live message"
    REFUSED = "refused batch"
    REPLAY_FAILED = "replay failed"
    TIMER = "timer"


class HistoryIndex(AttemptRules[RequestHistory, Buffered, tuple[float, int]]):
    """The working index of a history-mode stream and the state changes around it (§7h): its
    mode, anchor and completeness, installing, holding, resuming and losing it, and the
    requests for it. The rules of each input are :class:`HistoryRecovery`'s.

    :param stream: the stream's configuration (name and endpoint appear in reasons).
    :param limits: ``max_buffered_bytes``, ``resync_interval_ms``, ``max_blocks_per_stream``.
    """

    def __init__(self, stream: StreamConfig, limits: KvEventsConfig) -> None:
        self._anchor = Anchor()       # L + 1, D and recent digests of the working index
        super().__init__(stream, limits)
        self._completeness = EXACT
        self._request: Optional[RequestHistory] = None   # of the attempt in flight
        self._caught_up = 0           # batches a periodic catch-up applied before live did
        self._live_at_check = 0       # live messages at the last swap or catch-up end
        # The ApplyEvents a catch-up's buffered tail asked for, and the mode before it.
        self._tail: Optional[tuple[list[ApplyEvents], Mode]] = None
        # Buffered batches handed over again (no replay answer): each ApplyEvents asked for
        # with the batches after it, so a refused one does not lose those (they go on).
        self._replayed: list[tuple[ApplyEvents, list[Buffered]]] = []
        # (self._buffer holds (seq, batch, digest); self._silence is (deadline, live count).)

    @property
    def _expected(self) -> Optional[int]:  # the base class's name for the anchor's L + 1
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
        return self._anchor.last if self._mode in HOLDS else None

    @property
    def held(self) -> bool:
        """An index is kept (serving, or recovering by catch-up)."""
        return self._mode in HOLDS

    @property
    def live_only(self) -> bool:
        """No replay answered: the index is (or will be) built from live batches alone."""
        return self._mode in LIVE_ONLY_MODES

    def view(self) -> RecoveryView:
        """A copy of the bookkeeping (racy off the stream thread: tests, debugging)."""
        return self._view(max_seen=None, buffered_seqs=tuple(seq for seq, _, _ in self._buffer),
                          silence_check=None, awaiting_live=self._mode is LIVE_ONLY_WAITING)

    def wakeup_at(self) -> Optional[float]:
        """Monotonic seconds when :meth:`tick` is next due; ``None``: nothing scheduled."""
        silence = self._silence
        return self._wakeup(held_back=self._mode is SILENT,
                            deadline=None if silence is None else silence[0])

    # ------------------------------------------------------------------ the working index

    def _apply_held(self, seq: int, batch: Batch, digest: int) -> ApplyEvents:
        """Apply batch ``seq`` (contiguous) to the working index and move the anchor; should
        the index refuse it, ``on_apply_failed`` follows. :returns: the action asked for."""
        subset = self._completeness is SUBSET
        events = batch.events
        self._tail = None
        action = ApplyEvents(seq, events, subset)
        self._out.append(action)
        self._anchor.advance(seq, digest)
        if subset and starts_cleared(events):
            self._set_completeness(EXACT, f"seq {seq} starts with AllBlocksCleared")
        return action

    def _install(self, index: TierIndex, sequence: Optional[int], digest: Optional[int],
                 digests: dict[int, int], completeness: Completeness, mode: Mode, *,
                 live_events: Sequence[object], stats_base: tuple[int, ...], how: str,
                 keep_attempt: bool = False, now: Optional[float] = None) -> None:
        """Make ``index`` the serving one (§6 atomic swap) with its anchor, in ``mode``
        (``SERVING`` or ``LIVE_ONLY``); ``now`` given: the next periodic catch-up after
        ``resync_interval_ms`` (a live-only start keeps the rebuild retry schedule and the
        attempt in flight, ``keep_attempt``)."""
        replacing = self._mode in SERVES
        if not keep_attempt:
            self._abandon_attempt()
        self._out.append(SwapIndex(index, sequence, False, 0, live_events, stats_base,
                                   completeness))
        self._index = index
        self._error = None
        self._tail = None
        self._mode = mode
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
        """Keep a rebuilt index complete up to ``sequence`` without serving it and catch up
        (``HELD``)."""
        was_synced = self._mode in SERVES
        self._abandon_attempt()
        self._out.append(HoldIndex(index, sequence, stats_base, completeness, reason))
        self._index = index
        self._error = reason
        self._tail = None
        if was_synced:
            # (A live-only subset was serving: it stops, the rebuilt index takes over.)
            self._out.append(CountRecovery(RecoveryTrigger.SEQUENCE_GAP))
        self._mode = HELD
        self._completeness = completeness
        self._anchor = Anchor.at(sequence, digest, digests)
        self._log(log, INFO, "stream %s: rebuilt to seq %d: %s", self._name, sequence, reason)
        self._begin_attempt()

    def _resume(self, how: str) -> None:
        """The kept index is complete again: serve it (``SERVING``)."""
        self._mode = SERVING
        self._live_at_check = self._live_messages
        self._out.append(ResumeIndex(None if self._expected is None else self._expected - 1))
        self._error = None
        self._out.append(SetCompleteness(self._completeness))
        # (Counted when the line is written: after the catch-up's batches were applied.)
        self._log(log, INFO, "stream %s: synchronized (%s, %s): %s device, %s host blocks",
                  self._name, how, self._completeness.value, _Blocks(self._index, "device_blocks"),
                  _Blocks(self._index, "host_blocks"))

    def _set_completeness(self, completeness: Completeness, why: str) -> None:
        if completeness is self._completeness:
            return
        self._completeness = completeness
        self._out.append(SetCompleteness(completeness))
        self._log(log, INFO, "stream %s: index is %s now (%s)", self._name, completeness.value,
                  why)

    def _discard_and_rebuild(self, reason: str, trigger: RecoveryTrigger, now: float) -> None:
        """Discard the working index (served or kept) and rebuild from 0 now (§7h)."""
        self._abandon_attempt()
        self._invalidate(reason, trigger)
        self._mode = REBUILDING
        self._restart_recovery(now)

    def _invalidate(self, reason: str, trigger: RecoveryTrigger) -> None:
        """Discard the working index and its anchor (the serving state too)."""
        self._discard(reason)
        self._lost(reason, trigger)

    def _lost(self, reason: str, trigger: RecoveryTrigger) -> None:
        """Forget the index (the serving state discarded it already): ``REBUILDING``, or
        ``LIVE_ONLY_WAITING`` for a live-only stream. Counts ``trigger`` when an index goes
        (a kept one too: its catch-up becomes a rebuild); one log line."""
        was = self._mode
        self._mode = LIVE_ONLY_WAITING if was in LIVE_ONLY_MODES else REBUILDING
        self._tail = None
        self._anchor = Anchor()
        self._completeness = EXACT
        if was in SERVES:
            self._log_unsynchronized(reason, trigger)
        elif was in HOLDS:
            self._out.append(CountRecovery(trigger))
            self._log(log, WARNING, "stream %s: index discarded: %s", self._name, reason)

    def _baseline_from_cleared(self, seq: int, batch: Batch, digest: int, now: float) -> None:
        """§6: a batch starting with an untargeted ``AllBlocksCleared`` is a complete state:
        ``SERVING`` (``LIVE_ONLY`` for a live-only stream), exact."""
        index = self._cleared_index(seq, batch, now)
        if index is None:
            return
        self._abandon_attempt()
        mode = LIVE_ONLY if self._mode in LIVE_ONLY_MODES else SERVING
        self._install(index, seq, digest, {}, EXACT, mode, live_events=batch.events,
                      stats_base=_ZERO_STATS, how=f"AllBlocksCleared batch seq {seq}", now=now)

    def _start_live_only(self, seq: int, batch: Batch, digest: int, wire_bytes: int,
                         now: float) -> None:
        """No replay answered (§7h): a live-only index from this batch on (exact at seq 0);
        a batch that does not apply leaves the stream waiting for the next one."""
        index = self._new_index()
        completeness = EXACT if seq == 0 else SUBSET
        try:
            index.apply(batch.events, snapshot=completeness is SUBSET)
        except StreamError as exc:
            self._out.append(CountDecodeError(error_reason(exc)))
            self._set_error(f"seq {seq}: {exc}")
            return
        self._install(index, seq, digest, {}, completeness, LIVE_ONLY, live_events=batch.events,
                      stats_base=_ZERO_STATS,
                      how=f"live-only subset from seq {seq} (no replay answer)", keep_attempt=True)
        self._keep_for_rebuild(seq, batch, digest, wire_bytes, now)

    def _start_empty_live_only(self, reason: str, delay: float) -> None:
        """No replay answer and no live batch received (§7h "No replay answer"; D10 in
        docs/decisions.md): serve an EMPTY live-only index, ``subset``, with the expected seq
        unknown. It holds no block, so it is a valid subset of any residency (0 hits, never a
        false one). The first live batch then decides as after an empty rebuild reply. The
        rebuild keeps its §6 backoff retry schedule (``delay`` seconds, already set)."""
        self._install(self._new_index(), None, None, {}, SUBSET, LIVE_ONLY, live_events=(),
                      stats_base=_ZERO_STATS,
                      how=f"{reason}: live-only subset, empty until the first live batch; "
                          f"rebuild retry in {delay:.1f}s", keep_attempt=True)

    def _check_silence(self, now: float) -> None:
        """End a silent-channel check: passed once a live message arrived since it was armed;
        failed at its deadline: ``SILENT``, the index kept but serving nothing, and nothing is
        asked for until a live message arrives (a dead live channel, say a topic the engine
        does not publish, would otherwise leave removals unseen between catch-ups)."""
        assert self._silence is not None
        deadline, count = self._silence
        if not self._silence_failed(count, deadline, now):
            return
        self._mode = SILENT
        reason = (f"live channel silent: the engine published batches up to seq "
                  f"{self._expected - 1 if self._expected else 0} (found by a catch-up) but no "
                  f"live batch arrived; check the stream's endpoint and topic "
                  f"{self._stream.topic!r}")
        self._set_unsynchronized(reason)
        self._log_unsynchronized(reason, RecoveryTrigger.LIVE_SILENT)

    def _live_alive_again(self, now: float) -> None:
        """A live message after a silent channel: catch up (the kept index) now (``HELD``)."""
        self._mode = HELD
        self._log(log, INFO, "stream %s: live channel alive again; catching up", self._name)
        self._timers.next_attempt_at = now

    def _catch_up_done(self, reply: CatchUpReply, duration: float, now: float) -> None:
        """Finish a catch-up (§7h): the buffered tail follows, then the stream serves again
        (a periodic one counts what live never brought)."""
        request = self._request
        assert request is not None
        self._out.append(SnapshotOk(duration, reply.wire_bytes, reply.messages))
        if not reply.continuous:
            self._discard_and_rebuild(f"catch-up from seq {request.start_seq} failed: "
                                      f"{reply.reason}; rebuilding",
                                      RecoveryTrigger.HISTORY_MISMATCH, now)
            return
        before = self._mode
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
        merged = merge_catch_up(self._anchor, buffered)
        for seq, batch, digest in merged.apply:
            asked = [] if self._tail is None else self._tail[0]
            asked.append(self._apply_held(seq, batch, digest))
            self._tail = (asked, before)
        if merged.restarted is not None:
            self._discard_and_rebuild(f"live seq {merged.restarted} differs from the batch "
                                      "replayed: the engine restarted",
                                      RecoveryTrigger.HISTORY_MISMATCH, now)
            return
        if merged.gap is not None:
            # Published after the reply and lost on the way: ask again from here.
            self._log(log, INFO, "stream %s: catch-up ended at seq %d, buffered live seq %d: "
                      "catching up again", self._name,
                      self._expected - 1, merged.gap)  # type: ignore[operator]
            self._begin_attempt()
            return
        self._timers.synchronized(now, probe=False)
        live_messages = self._live_messages
        silent = live_messages == self._live_at_check
        self._live_at_check = live_messages
        if before in SERVES:
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
        """Swap in a rebuild (§7h) merged with the buffered tail (→ SERVING), or keep one
        truncated by a hole and catch up from its last seq (→ HELD)."""
        index = reply.index
        stats_base = stats_tuple(index.stats)
        if reply.truncated and reply.last_seq is not None and reply.last_digest is not None:
            # Complete up to the hole; the catch-up's reply covers the buffered live batches.
            self._out.append(SnapshotOk(duration, reply.wire_bytes, reply.messages))
            self._hold(index, reply.last_seq, reply.last_digest, dict(reply.digests),
                       EXACT if reply.exact else SUBSET, stats_base,
                       f"{reply.reason}; catching up from seq {reply.last_seq}")
            return
        merged = merge_rebuild(reply, self._buffer)
        if isinstance(merged, SnapshotError):
            self._attempt_failed(merged, now)
            return
        self._out.append(SnapshotOk(duration, reply.wire_bytes, reply.messages))
        self._install(index, merged.sequence, merged.digest, merged.digests,
                      merged.completeness, SERVING, live_events=merged.tail,
                      stats_base=stats_base, how=merged.how, now=now)

    # ------------------------------------------------------------------ buffering

    def _buffer_new(self, seq: int, batch: Batch, digest: int, wire_bytes: int,
                    now: float) -> None:
        """Buffer a live batch into the attempt in flight; a seq not above the last buffered
        one means a restart. Without an attempt and without an index (a rebuild is due, or
        waits for its backoff) the batch is kept too, within ``max_buffered_bytes``: the next
        rebuild's reply covers it (deduplicated), and if no reply ever comes the live-only
        subset starts from the first batch received (§7h), not from a later one."""
        buffer = self._buffer
        if self._attempt is None:
            if self._mode in HOLDS:
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

    def _keep_for_rebuild(self, seq: int, batch: Batch, digest: int, wire_bytes: int,
                          now: float) -> None:
        """A rebuild retry in flight (a live-only stream): its index needs this batch too."""
        request = self._request
        if request is not None and not request.catch_up:
            self._buffer_batch(seq, batch, digest, wire_bytes, now)

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
        self._waiting_errors = 0
        mode = self._mode
        anchor = self.anchor if mode not in LIVE_ONLY_MODES else None
        if anchor is not None or mode in HOLDS:
            # (A rebuild keeps what arrived before its request: its reply covers it.)
            self._buffer = []
            self._buffer_bytes = 0
        self._caught_up = 0
        self._attempt_ids += 1
        self._attempt = self._attempt_ids
        urgent = mode not in SERVES
        if anchor is not None:
            request = RequestHistory(self._attempt, anchor[0], urgent, anchor[1])
        else:
            request = RequestHistory(self._attempt, 0, urgent, None)
        self._request = request
        self._out.append(request)
        self._opening = request
        self._timers.next_attempt_at = None

    def _announce(self, request: RequestHistory) -> None:
        what = (f"catch-up requested (start_seq {request.start_seq})" if request.catch_up
                else "rebuild requested (start_seq 0)")
        if not request.urgent or self._mode in SERVES:
            self._log(log, DEBUG, "stream %s: periodic %s", self._name, what)
            return
        self._out.append(SET_RECOVERING)
        self._log(log, INFO, "stream %s: recovering: %s", self._name, what)


#: A handler of :data:`MODE_TABLE`: called with the rules and the input's arguments.
Handler = Callable[..., None]


class HistoryRecovery(HistoryIndex):
    """The §7h recovery rules of one history-mode stream (see the module docstring): each
    input runs the handler :data:`MODE_TABLE` gives for the current mode.

    :param stream: the stream's configuration (name and endpoint appear in reasons).
    :param limits: ``max_buffered_bytes``, ``resync_interval_ms``, ``max_blocks_per_stream``.
    """

    # ------------------------------------------------------------------ inputs

    def tick(self, now: float) -> tuple[Action, ...]:
        """Time passed: a silent-channel check past its deadline ends (→ ``SILENT``) or, once
        the stream no longer serves, is dropped; then :data:`MODE_TABLE`, ``timer``."""
        if self._silence is not None:
            self._check_silence(now)
        # What a refused batch of an earlier input would have been judged by: that input's
        # actions were carried long ago (the buffered batches go, the memory with them).
        self._replayed = []
        _TABLE[self._mode, Input.TIMER](self, now)
        return self._take()

    def on_live_batch(self, seq: int, batch: Batch, wire_bytes: int, now: float,
                      digest: int = 0) -> tuple[Action, ...]:
        """A live batch with the exact topic, framed (§1) and decoded (§2, byte hashes to
        integers); ``digest`` is the XXH3-64 of its payload (§7h anchor); what it does is the
        mode's (:data:`MODE_TABLE`, ``live batch``).

        :param wire_bytes: the message's wire size (buffer accounting).
        """
        self._live_messages += 1
        anchor = self._anchor
        if (self._mode is SERVING and seq == anchor.expected and self._completeness is EXACT
                and not self._out and (self._request is None or self._request.catch_up)):
            # The hot path, the SERVING cell's contiguous case on an exact index with no
            # rebuild in flight, inline: one action, the anchor moved (as Anchor.advance).
            self._tail = None
            anchor.expected = seq + 1
            anchor.digest = digest
            recent = anchor.recent
            recent[seq] = digest
            recent.pop(seq - RECENT_DIGESTS, None)
            return (ApplyEvents(seq, batch.events, False),)
        _TABLE[self._mode, Input.LIVE_BATCH](self, seq, batch, digest, wire_bytes, now)
        return self._take()

    def on_history_batch(self, attempt: int, seq: int, events: Sequence[Event], digest: int,
                         wire_bytes: int, now: float) -> tuple[Action, ...]:
        """A catch-up's batch after its proven anchor (§7h), as it arrives: applied to the
        working index like a live delta unless live already brought it (then its digest must
        match). A stale attempt id is ignored."""
        if attempt != self._attempt or self._mode not in HOLDS:
            return self._take()
        judged = self._anchor.judge(seq, digest, unknown=DUPLICATE)
        if judged is Judgement.RESTARTED:
            self._discard_and_rebuild(f"catch-up seq {seq} differs from the live batch applied: "
                                      "the engine restarted", RecoveryTrigger.HISTORY_MISMATCH,
                                      now)
        elif judged is Judgement.GAP:
            self._attempt_failed(SnapshotError(f"history reply seq {seq} skips seq "
                                               f"{self._expected}"), now)
        elif judged is Judgement.CONTIGUOUS:
            self._apply_held(seq, Batch(0.0, events, None), digest)
            if self._mode in SERVES:
                self._caught_up += 1
        return self._take()

    def on_live_down(self, reason: str, now: float) -> tuple[Action, ...]:
        """The live ``SUB`` disconnected (§6): batches may be missed (:data:`MODE_TABLE`,
        ``disconnect``); the next attempt is due once connected again."""
        self._link = Link.DOWN
        self._abandon_attempt()
        _TABLE[self._mode, Input.DISCONNECT](self, reason, now)
        if self._mode not in LIVE_ONLY_MODES or self._timers.next_attempt_at is None:
            # (A live-only stream keeps its rebuild retry schedule, or retries once connected.)
            self._timers.next_attempt_at = now
        return self._take()

    def on_snapshot_complete(self, attempt: int, reply: Union[SnapshotResult, HistoryReply],
                             requested_at: Optional[float], now: float) -> tuple[Action, ...]:
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

    def on_internal_error(self, error_name: str, now: float) -> tuple[Action, ...]:
        """A bug in kvsvc escaped a turn: discard the index and rebuild after a backoff (a
        live-only stream: start again from the next live batch)."""
        self._abandon_attempt()
        self._invalidate(f"internal error: {error_name}", RecoveryTrigger.INTERNAL_ERROR)
        self._timers.failed(now)
        return self._take()

    def on_apply_failed(self, action: ApplyEvents, error: StreamError,
                        now: float) -> tuple[Action, ...]:
        """The working index refused batch ``action.seq`` (§5; the serving state discarded
        it) (:data:`MODE_TABLE`, ``refused batch``)."""
        reason, label = self._refused(action.seq, error)
        tail = self._tail
        if tail is not None and any(a is action for a in tail[0]):
            # Refused in a catch-up's buffered tail: the stream had not served again yet.
            self._mode = tail[1]
        rest = next((after for a, after in self._replayed if a is action), None)
        self._tail = None
        self._replayed = []
        _TABLE[self._mode, Input.REFUSED](self, reason, trigger_of(label), now)
        if rest:
            # (As each buffered batch was handed over on its own: the next ones go on.)
            self._replay_buffered(rest, now)
        return self._take()

    def _stream_error(self, reason: str, trigger: RecoveryTrigger, now: float) -> None:
        """An error of the stream (a live message that failed decoding, a complete-state batch
        that does not apply) (:data:`MODE_TABLE`, ``bad live message``)."""
        _TABLE[self._mode, Input.BAD_INPUT](self, reason, trigger, now)

    def _attempt_failed(self, exc: StreamError, now: float) -> None:
        """A failed attempt (§6, §7h): closed, the reason kept, retried after the backoff
        (:data:`MODE_TABLE`, ``replay failed``)."""
        request = self._request
        buffered = self._buffer
        delay = self._fail_attempt(exc, now)
        _TABLE[self._mode, Input.REPLAY_FAILED](self, exc, request, buffered, delay, now)

    # ------------------------------------------------------------------ live batch

    def _live_serving(self, seq: int, batch: Batch, digest: int, wire_bytes: int,
                      now: float) -> None:
        """applied if contiguous; duplicate dropped; restarted: rebuild (→ REBUILDING); gap:
        catch up from L (→ HELD)"""
        if not self._contiguous(seq, batch, digest, wire_bytes, now):
            reason = f"sequence gap: expected seq {self._expected}, got {seq}"
            self._mode = HELD
            self._out.append(SET_RECOVERING)
            last = self._expected - 1  # type: ignore[operator]
            self._set_error(f"{reason}; catching up from seq {last}")
            self._log_unsynchronized(f"{reason}; catching up", RecoveryTrigger.SEQUENCE_GAP,
                                     recovering=True)
            request = self._request
            if request is None or not request.catch_up:
                self._restart_recovery(now)
            else:
                # The periodic catch-up in flight fills the gap (or its end asks again).
                self._promote(request)
            self._buffer_batch(seq, batch, digest, wire_bytes, now)

    def _live_live_only(self, seq: int, batch: Batch, digest: int, wire_bytes: int,
                        now: float) -> None:
        """as serving (also kept for the rebuild retry); gap: a new live-only subset from it"""
        if not self._contiguous(seq, batch, digest, wire_bytes, now):
            # §7h: a live-only stream cannot catch up: a new one starts at this batch.
            self._invalidate(f"sequence gap: expected seq {self._expected}, got {seq} in a "
                             "live-only stream", RecoveryTrigger.SEQUENCE_GAP)
            self._start_live_only(seq, batch, digest, wire_bytes, now)

    def _contiguous(self, seq: int, batch: Batch, digest: int, wire_bytes: int,
                    now: float) -> bool:
        """A serving index's live batch: applied when contiguous (the first after an empty
        reply decides exactness, §7h), dropped when a duplicate, a rebuild when the engine
        restarted. :returns: False for a gap (the caller's rule)."""
        expected = self._expected
        if expected is None or seq == expected:
            if expected is None:
                # After an empty rebuild reply the first live batch decides (§7h).
                self._expected = seq
                self._set_completeness(EXACT if seq == 0 else SUBSET,
                                       f"first live batch after an empty reply has seq {seq}")
            self._apply_held(seq, batch, digest)
            self._keep_for_rebuild(seq, batch, digest, wire_bytes, now)
            return True
        if seq > expected:
            return False
        if self._anchor.judge(seq, digest) is DUPLICATE:
            # Applied already (a catch-up brought it first, or a repeat of the same batch).
            self._out.append(COUNT_DUPLICATE)
            return True
        self._discard_and_rebuild(f"sequence went backwards: expected seq {expected}, got {seq} "
                                  "(the engine restarted)", RecoveryTrigger.SEQUENCE_BACKWARDS, now)
        self._buffer_new(seq, batch, digest, wire_bytes, now)
        return True

    def _live_held(self, seq: int, batch: Batch, digest: int, wire_bytes: int,
                   now: float) -> None:
        """complete state (→ SERVING); restarted: rebuild (→ REBUILDING); duplicate dropped;
        else buffered for the catch-up, never applied before its proof"""
        if starts_cleared(batch.events):
            self._baseline_from_cleared(seq, batch, digest, now)
            return
        # After a disconnect the engine may have restarted and published up to exactly the
        # expected seq: only the catch-up's anchor digest tells.
        expected = self._expected
        if expected is not None and seq < expected:
            if self._anchor.judge(seq, digest) is DUPLICATE:
                self._out.append(COUNT_DUPLICATE)
                return
            self._discard_and_rebuild(f"sequence went backwards: expected seq {expected}, got "
                                      f"{seq} (the engine restarted)",
                                      RecoveryTrigger.SEQUENCE_BACKWARDS, now)
        self._buffer_new(seq, batch, digest, wire_bytes, now)

    def _live_silent(self, seq: int, batch: Batch, digest: int, wire_bytes: int,
                     now: float) -> None:
        """the channel is alive: catch up now (→ HELD), then as held"""
        self._live_alive_again(now)
        self._live_held(seq, batch, digest, wire_bytes, now)

    def _live_rebuilding(self, seq: int, batch: Batch, digest: int, wire_bytes: int,
                         now: float) -> None:
        """complete state (→ SERVING); else buffered for the rebuild"""
        if starts_cleared(batch.events):
            self._baseline_from_cleared(seq, batch, digest, now)
        else:
            self._buffer_new(seq, batch, digest, wire_bytes, now)

    def _live_waiting(self, seq: int, batch: Batch, digest: int, wire_bytes: int,
                      now: float) -> None:
        """complete state, or a live-only subset from it (→ LIVE_ONLY)"""
        if starts_cleared(batch.events):
            self._baseline_from_cleared(seq, batch, digest, now)
        else:
            self._start_live_only(seq, batch, digest, wire_bytes, now)

    def _replay_buffered(self, buffered: list[Buffered], now: float) -> None:
        """No replay answer: the live-only subset starts from the first batch received (§7h),
        so the batches buffered during the unanswered rebuild are handed over again (as live
        batches, not counted a second time)."""
        self._replayed = []
        out = self._out
        for i, (seq, batch, digest) in enumerate(buffered):
            if self._mode in SERVES and self._expected is not None and seq < self._expected:
                continue  # (as before: an older seq of a buffer in order cannot happen)
            mark = len(out)
            _TABLE[self._mode, Input.LIVE_BATCH](self, seq, batch, digest, 0, now)
            self._replayed += [(a, buffered[i + 1:]) for a in out[mark:]
                               if type(a) is ApplyEvents]

    # ------------------------------------------------------------------ disconnect

    def _down_serving(self, reason: str, now: float) -> None:
        """index kept, 0 hits; catch up once reconnected (→ HELD)"""
        self._mode = HELD
        self._out.append(SET_RECOVERING)
        last = self._expected - 1 if self._expected else 0
        how = f"catching up from seq {last} once reconnected"
        self._set_error(f"{reason}; {how}")
        self._log_unsynchronized(f"{reason}; {how}", RecoveryTrigger.DISCONNECT, recovering=True)

    def _down_live_only(self, reason: str, now: float) -> None:
        """discarded: a new subset starts at the next live batch (→ LIVE_ONLY_WAITING)"""
        # No replay proves anything after it (the engine may have restarted).
        self._invalidate(f"{reason}; a new live-only subset starts at the next live batch",
                         RecoveryTrigger.DISCONNECT)

    def _down_idle(self, reason: str, now: float) -> None:
        """unsynchronized with the reason"""
        self._set_unsynchronized(reason)

    # ------------------------------------------------------------------ errors

    def _error_held(self, reason: str, trigger: RecoveryTrigger, now: float) -> None:
        """discard the index, rebuild (→ REBUILDING)"""
        self._abandon_attempt()
        self._invalidate(reason, trigger)
        self._restart_recovery(now)

    def _error_live_only(self, reason: str, trigger: RecoveryTrigger, now: float) -> None:
        """discard; the next live batch starts a new subset (→ LIVE_ONLY_WAITING)"""
        self._abandon_attempt()
        self._invalidate(reason, trigger)
        if self._timers.next_attempt_at is None:
            # The rebuild retry in flight was abandoned: ask again (§6 schedule kept
            # otherwise), or the replay endpoint would never be tried again.
            self._timers.next_attempt_at = now

    def _error_idle(self, reason: str, trigger: RecoveryTrigger, now: float) -> None:
        """fails the attempt in flight, or is the reason while a retry waits"""
        self._fail_or_note(reason, now)

    def _refused_held(self, reason: str, trigger: RecoveryTrigger, now: float) -> None:
        """index gone, rebuild (→ REBUILDING)"""
        self._lost(reason, trigger)
        self._restart_recovery(now)

    def _refused_live_only(self, reason: str, trigger: RecoveryTrigger, now: float) -> None:
        """index gone; the next live batch starts a new subset (→ LIVE_ONLY_WAITING)"""
        self._lost(reason, trigger)
        # The rebuild retry in flight goes on, but the batches it kept came before this one
        # (which may have removed their blocks): none may start a live-only index.
        self._buffer = []
        self._buffer_bytes = 0

    # ------------------------------------------------------------------ replay failed

    def _failed_serving(self, exc: StreamError, request: Optional[RequestHistory],
                        buffered: list[Buffered], delay: float, now: float) -> None:
        """still serving; retried after the backoff"""
        # Once per failure streak at warning: a live-only stream retries for good.
        self._log(log, WARNING if self._timers.failures == 1 else DEBUG,
                  "stream %s: %s failed: %s; still serving; retry in %.1fs", self._name,
                  "rebuild retry" if request is not None and not request.catch_up
                  else "periodic catch-up", exc, delay)

    def _failed_held(self, exc: StreamError, request: Optional[RequestHistory],
                     buffered: list[Buffered], delay: float, now: float) -> None:
        """unsynchronized with the reason (index kept); retried after the backoff"""
        self._set_unsynchronized(str(exc))
        self._log(log, WARNING, "stream %s: unsynchronized: %s; retry in %.1fs", self._name,
                  exc, delay)

    def _failed_rebuilding(self, exc: StreamError, request: Optional[RequestHistory],
                           buffered: list[Buffered], delay: float, now: float) -> None:
        """no answer at all: a live-only subset from the batches received, or empty when none
        (→ LIVE_ONLY); else unsynchronized with the reason; retried after the backoff"""
        reason = str(exc)
        if not (isinstance(exc, ReplayUnanswered) and request is not None
                and not request.catch_up):
            self._failed_held(exc, request, buffered, delay, now)
            return
        if not buffered:
            # Nothing received either (an idle engine without a replay endpoint): serve an
            # empty live-only subset now, so that the stream is ready (§10) without waiting
            # for the engine's first batch; that batch decides as after an empty reply.
            self._start_empty_live_only(reason, delay)
            return
        self._mode = LIVE_ONLY_WAITING
        reason = f"{reason}; serving a live-only subset from the next live batch"
        self._set_unsynchronized(reason)
        self._log(log, WARNING, "stream %s: unsynchronized: %s; retry in %.1fs", self._name,
                  reason, delay)
        self._replay_buffered(buffered, now)

    # ------------------------------------------------------------------ timer

    def _tick_serving(self, now: float) -> None:
        """the periodic catch-up (live-only: the rebuild retry) when due"""
        self._start_due(now, held_back=False, may_note=False)

    def _tick_recovering(self, now: float) -> None:
        """the due attempt, once the live channel is up (the error says it waits)"""
        self._start_due(now, held_back=False, may_note=True)

    def _tick_silent(self, now: float) -> None:
        """nothing: no request until a live message arrives"""


_R = HistoryRecovery
#: Each mode's handlers, in the order of :class:`Input`.
_ROWS: dict[Mode, tuple[Handler, ...]] = {
    REBUILDING: (_R._live_rebuilding, _R._down_idle, _R._error_idle, _R._refused_held,
                 _R._failed_rebuilding, _R._tick_recovering),
    HELD: (_R._live_held, _R._down_idle, _R._error_held, _R._refused_held, _R._failed_held,
           _R._tick_recovering),
    SERVING: (_R._live_serving, _R._down_serving, _R._error_held, _R._refused_held,
              _R._failed_serving, _R._tick_serving),
    LIVE_ONLY_WAITING: (_R._live_waiting, _R._down_idle, _R._error_idle, _R._refused_live_only,
                        _R._failed_rebuilding, _R._tick_recovering),
    LIVE_ONLY: (_R._live_live_only, _R._down_live_only, _R._error_live_only,
                _R._refused_live_only, _R._failed_serving, _R._tick_serving),
    SILENT: (_R._live_silent, _R._down_idle, _R._error_held, _R._refused_held, _R._failed_held,
             _R._tick_silent),
}
#: (mode, input) -> what the input does in that mode (rows: modes; see :func:`render_mode_table`).
MODE_TABLE: dict[tuple[Mode, Input], Handler] = {
    (mode, each): handler for mode, row in _ROWS.items()
    for each, handler in zip(Input, row, strict=True)}
_TABLE = MODE_TABLE


def render_mode_table() -> str:
    """:data:`MODE_TABLE` as a markdown table: a row per mode (with its meaning,
    :data:`MODE_MEANINGS`), a column per input, each cell the rule of its handler (its
    docstring, one line)."""
    head = "| mode | " + " | ".join(i.value for i in Input) + " |"
    lines = [head, "|" + "---|" * (len(Input) + 1)]
    for mode in Mode:
        cells = [" ".join((MODE_TABLE[mode, i].__doc__ or "").split()) for i in Input]
        lines.append(f"| **{mode.name}**: {MODE_MEANINGS[mode]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


#: What each mode means (the first column of the rendered table).
MODE_MEANINGS = {
    REBUILDING: "no index; a rebuild from seq 0 is due, waits for its backoff, or runs",
    HELD: "an index kept unserved (0 hits) while a catch-up from its anchor proves and fills it",
    SERVING: "the index serves (exact or subset); a catch-up every resync_interval_ms",
    LIVE_ONLY_WAITING: "no replay answer, no index: the next live batch starts a live-only subset",
    LIVE_ONLY: "a subset built from live batches alone serves; the rebuild is retried",
    SILENT: "the live channel went silent: index kept unserved, nothing asked until a live message",
}


class _Blocks:
    """A log argument: ``index``'s block count ``attr`` (``device_blocks``, ``host_blocks``)
    read when the line is written, after the batches asked for before it were applied."""

    __slots__ = ("_index", "_attr")

    def __init__(self, index: Optional[TierIndex], attr: str) -> None:
        self._index = index
        self._attr = attr

    def __str__(self) -> str:
        return str(getattr(self._index, self._attr) if self._index is not None else 0)
