"""The recovery rules of one stream (§6, §7, §7h) as state machines without sockets ("sans-IO").

Two rule sets implement :class:`RecoveryRules`; the stream thread picks one by the stream's
``replay_mode`` (§8):

- :class:`SnapshotRecovery` (this module), ``snapshot`` mode (§6, §7, xLLM): the replay
  endpoint answers with the engine's current residency at a watermark; every loss of
  synchronization discards the index and takes a new snapshot.
- :class:`~kvsvc.streams.history.HistoryRecovery`, ``history`` mode (§7h, vLLM and SGLang):
  the replay endpoint answers with the batches still in the engine's buffer. The stream keeps
  an anchor (last applied seq ``L`` and its payload digest ``D``); a gap, a disconnect and the
  periodic resync *catch up* from ``L`` (proven by ``D``) while the index is kept, and only a
  start, a restart or an unproven catch-up *rebuilds* from seq 0, into an ``exact`` or a
  ``subset`` index; without any replay answer the stream serves a live-only subset. Both
  subclass :class:`AttemptRules` (the attempt plumbing: action queue, attempt
  announce/abandon, live up/down bookkeeping, failure backoff, silent-channel judgement). It
  shares :class:`RecoveryTimers` (§6 backoff, resync interval) and :func:`record_bytes`
  (buffer accounting); its requests are :class:`RequestHistory`.

:class:`SnapshotRecovery` is fed what happened on the stream's thread and answers what to do
next. It holds no socket, starts no thread and never reads the clock: every input carries
``now`` (monotonic seconds). Inputs:

=============================================  ==============================================
``start(now)``                                 the thread runs: a snapshot is due at once (§6)
``on_live_batch(seq, batch, wire_bytes, now)`` a decoded live batch (§1, §2) with the exact topic
``on_live_error(reason, text, seq, now)``      a live message with the exact topic that failed
                                               frame parsing (§1) or payload decoding (§2)
``on_live_opened()``                           the live ``SUB`` was (re)created: not connected
``on_live_up(now)``                            its handshake succeeded (the subscription is out)
``on_live_down(reason, now)``                  its monitor reported a disconnect
``on_snapshot_opened(id, now)``                attempt ``id`` was opened (its request is out)
``on_snapshot_complete(id, result, ...)``      the end marker of attempt ``id`` arrived (§7)
``on_snapshot_failed(id, exc, now)``           attempt ``id`` failed (timeout, malformed, ...)
``on_internal_error(name, now)``               a bug-class exception escaped a turn
``on_apply_failed(action, error, now)``        the index refused an ``ApplyEvents`` it asked for
``tick(now)``                                  time passed (call at each loop turn)
=============================================  ==============================================

Each returns a tuple of actions (:mod:`kvsvc.streams.actions`) for the owner to carry out, in
order: the serving side effects (apply a batch, swap in an index, invalidate with a reason,
count a recovery with its trigger label, ...) and log lines, which the stream thread carries
out on its :class:`~kvsvc.streams.serving.ServingState`
(:class:`~kvsvc.streams.carrier.ActionCarrier`), and the attempt actions
:class:`RequestSnapshot` (open attempt ``id`` with ``start_seq``; ``urgent`` for a recovery,
not for a periodic resync; the owner reports ``on_snapshot_opened`` once the attempt is open,
or ``on_snapshot_failed`` when it cannot be opened) and :class:`AbandonSnapshot` (close attempt
``id``). One in-order live batch costs one :class:`~kvsvc.streams.actions.ApplyEvents`; if the
index refuses it, the rules hear of it through ``on_apply_failed``. The rules never read the
serving state: what they need of it they recorded when they asked for it.
:meth:`SnapshotRecovery.wakeup_at` says when the next :meth:`~SnapshotRecovery.tick` is due.

States (§6)::

    UNSYNCHRONIZED --attempt opened--> RECOVERING --snapshot + buffered tail--> SYNCHRONIZED
          ^    ^--------attempt fails, backoff----------'                            |
          '-------- seq error, decode/index error, disconnect (index discarded) -----'

    RECOVERING / UNSYNCHRONIZED --live batch starting with AllBlocksCleared--> SYNCHRONIZED

Rules (each one fixes a failure the soak test found; the decisions D1-D5 of docs/decisions.md):

- Snapshots are requested only while the live ``SUB`` is connected (``on_live_up`` since the
  last ``on_live_opened``/``on_live_down``): a ``PUB`` drops every batch published before a
  subscription reaches it without a trace, so a snapshot taken before that moment can be
  followed by batches this stream never receives; with a restarted counter the gap is
  invisible. A due attempt waiting for the connection says so in ``error`` (D2).
- ``expected``: the next live seq the serving index needs; ``None`` after an empty snapshot
  (watermark unknown): the first live batch is then applied whatever its seq (§7, D5).
- ``max_seen``: the highest live seq this ``SUB`` connection has received (forgotten on a
  disconnect and when a backward jump starts a new epoch). After a swap at watermark W, a
  batch with seq <= W that is above ``max_seen`` was published before the snapshot but
  received after it: a duplicate already covered, dropped silently. With nothing seen on the
  connection, an old seq may be a publisher whose counter restarted after the snapshot: that
  recovers. Any other seq than ``expected`` (a repeat, a backward jump, a gap) is a sequence
  error (D4).
- Buffer accounting during an attempt (§6): each batch costs its wire bytes plus
  :data:`BUFFER_EVENT_OVERHEAD` per event, :data:`BUFFER_HASH_OVERHEAD` per block hash and
  :data:`BUFFER_TOKEN_OVERHEAD` per token id; above ``max_buffered_bytes`` the attempt fails
  (``buffer overflow``).
- Failed attempts retry after :data:`BACKOFF_INITIAL_S` doubling to :data:`BACKOFF_MAX_S`; a
  new live connection resets that backoff (it may be a new engine).
- A synchronized stream resyncs every ``resync_interval_ms`` (a failed resync keeps serving);
  after a recovery from a snapshot with a watermark while nothing has arrived on the live
  connection, the first resync comes after :data:`PROBE_RESYNC_S`.
- A resync whose watermark is behind the applied seq means the engine's counter restarted
  unseen: the serving index goes, not just the attempt (D4).
- Silent channel: a resync showing batches that never arrived (watermark >= expected) while
  no live message arrived since the previous swap arms a check; no live message within
  :data:`LIVE_SILENCE_GRACE_S` unsynchronizes the stream, and no snapshot is requested until a
  live message arrives (then it recovers) (D1).

The history rule set (§7h) has its own meaning of a reply and of the tail merge, its own
duplicate rule (by digest, not by ``max_seen``) and one more input, ``on_history_batch``;
see :mod:`kvsvc.streams.history`.

Not thread-safe: owned by the stream thread; :meth:`SnapshotRecovery.view` is a racy copy for
tests and debugging.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from logging import DEBUG, INFO, WARNING
from typing import Generic, Optional, Protocol, Sequence, TypeVar, Union

from kvsvc.config import KvEventsConfig, StreamConfig
from kvsvc.errors import BufferOverflow, SnapshotError, SnapshotTimeout, StreamError
from kvsvc.events import Batch, BlockRemoved, BlockStored
from kvsvc.index.tier_index import TierIndex
from kvsvc.streams.anchor import starts_cleared
from kvsvc.streams.counters import (
    NOT_INDEXED,
    DecodeErrorReason,
    RecoveryTrigger,
    SnapshotOutcome,
    error_reason,
    stats_tuple,
    trigger_of,
)
from kvsvc.streams.actions import (
    COUNT_DUPLICATE,
    NO_ACTIONS,
    SET_RECOVERING,
    AbandonSnapshot,
    Action,
    ApplyEvents,
    CountAttempt,
    CountDecodeError,
    CountRecovery,
    Invalidate,
    Log,
    RequestHistory,
    RequestSnapshot,
    SetError,
    SetUnsynchronized,
    SnapshotOk,
    SwapIndex,
)
from kvsvc.streams.state import NOT_YET, HistoryReply, SnapshotResult, StreamId

__all__ = ["NO_ACTIONS", "AbandonSnapshot", "Action", "RequestHistory", "RequestSnapshot"]

log = logging.getLogger(__name__)

#: Backoff of failed attempts (§6): 100 ms doubling to at most 5 s.
BACKOFF_INITIAL_S = 0.1
BACKOFF_MAX_S = 5.0
#: After a periodic resync shows live batches that never arrived (watermark above the applied
#: seq) while nothing at all arrived on the live channel since the previous swap, a live batch
#: must arrive within this many seconds (those batches may still be in flight), or the live
#: channel is taken for dead (D1 in docs/decisions.md).
LIVE_SILENCE_GRACE_S = 2.0
#: After a recovery from a snapshot with a watermark while nothing at all has arrived on the
#: live connection, the first resync comes this soon (seconds) instead of after
#: ``resync_interval_ms``: a dead live channel (a wrong topic) is then found within seconds,
#: not after a whole resync interval of a snapshot index going stale (D1).
PROBE_RESYNC_S = 2.0
#: Buffer record overheads (bytes) added to a buffered batch's wire size (§6).
BUFFER_EVENT_OVERHEAD = 128
BUFFER_HASH_OVERHEAD = 40
BUFFER_TOKEN_OVERHEAD = 4

#: Appended to the reason while a due snapshot waits for the live connection.
LIVE_WAIT = "; the snapshot is requested once the live channel "


class Mode(enum.Enum):
    """Where a stream's recovery stands: one value per legal state, instead of flags (§6, §7h;
    snapshot mode uses ``REBUILDING``, ``SERVING`` and ``SILENT``). The history rules' table of
    what each input does in each mode is :data:`kvsvc.streams.history.MODE_TABLE`."""

    #: No index: a rebuild (snapshot mode: a snapshot) is due, waits for its backoff, or runs.
    REBUILDING = "rebuilding"
    #: §7h: an index is kept, not served, while a catch-up from its anchor proves and fills it.
    HELD = "held"
    #: The index serves (``synchronized``).
    SERVING = "serving"
    #: §7h: no replay answered and no index: the next live batch starts a live-only subset.
    LIVE_ONLY_WAITING = "live-only waiting"
    #: §7h: a subset built from live batches alone serves; the rebuild is retried meanwhile.
    LIVE_ONLY = "live-only"
    #: The live channel went silent while the engine published: nothing is requested until a
    #: live message arrives (history mode keeps the index, unserved).
    SILENT = "silent"


#: The modes that serve hits.
SERVES = frozenset({Mode.SERVING, Mode.LIVE_ONLY})
_SERVING, _SILENT = Mode.SERVING, Mode.SILENT  # (the live path's two checks, as locals)


class Link(enum.Enum):
    """The live ``SUB``'s connection as the rules know it (§6: replies only while it is up)."""

    #: Not connected (created, or disconnected).
    DOWN = "down"
    #: Not connected, and ``error`` says that a due attempt waits for it.
    DOWN_NOTED = "down, noted"
    #: The handshake succeeded: the subscription is out.
    UP = "up"


@dataclass(frozen=True, slots=True)
class SilenceCheck:
    """A running silent-channel check.

    :param deadline: monotonic seconds by which a live message must have arrived.
    :param watermark: the resync watermark that showed batches never received.
    :param first_missing: the first seq not received (the expected seq then).
    :param live_messages: live messages counted when the check was armed.
    """

    deadline: float
    watermark: int
    first_missing: int
    live_messages: int


@dataclass(frozen=True, slots=True)
class RecoveryView:
    """Read-only copy of a machine's bookkeeping (tests, debugging; see the module docstring).

    :param synchronized: the serving index is valid.
    :param expected: next live seq the serving index needs (``None``: any, or unsynchronized).
    :param max_seen: highest live seq seen on the current connection.
    :param live_up: the live connection's handshake succeeded.
    :param attempt: id of the attempt in flight, ``None`` when there is none.
    :param next_attempt_at: when the next attempt is due (monotonic s); ``None``: none scheduled.
    :param failures: consecutive failed attempts (the backoff exponent).
    :param buffered_bytes: buffer accounting of the attempt in flight.
    :param buffered_seqs: seqs of the batches buffered, in arrival order.
    :param silence_check: the running silent-channel check, if any.
    :param awaiting_live: a silent channel was found: recover on the next live message.
    :param live_messages: live messages with the exact topic so far.
    """

    synchronized: bool
    expected: Optional[int]
    max_seen: Optional[int]
    live_up: bool
    attempt: Optional[int]
    next_attempt_at: Optional[float]
    failures: int
    buffered_bytes: int
    buffered_seqs: tuple[int, ...]
    silence_check: Optional[SilenceCheck]
    awaiting_live: bool
    live_messages: int


def backoff_s(failures: int) -> float:
    """Delay (seconds) before the retry after ``failures`` consecutive failed attempts (>= 1):
    :data:`BACKOFF_INITIAL_S` doubling per failure, at most :data:`BACKOFF_MAX_S` (§6)."""
    return min(BACKOFF_INITIAL_S * (2 ** min(failures - 1, 16)), BACKOFF_MAX_S)


def record_bytes(batch: Batch, wire_bytes: int) -> int:
    """Buffer cost (bytes) of one decoded live batch: wire bytes plus decoded-record overhead
    (§6): :data:`BUFFER_EVENT_OVERHEAD` per event, :data:`BUFFER_HASH_OVERHEAD` per block hash,
    :data:`BUFFER_TOKEN_OVERHEAD` per token id."""
    cost = wire_bytes
    for ev in batch.events:
        cost += BUFFER_EVENT_OVERHEAD
        if type(ev) is BlockStored:
            cost += BUFFER_HASH_OVERHEAD * len(ev.block_hashes) + BUFFER_TOKEN_OVERHEAD * len(ev.token_ids)
        elif type(ev) is BlockRemoved:
            cost += BUFFER_HASH_OVERHEAD * len(ev.block_hashes)
    return cost


class RecoveryRules(Protocol):
    """What the stream thread drives: one rule set per replay mode (§7 snapshot; §7h history
    next). Every input is called on the stream thread only, takes ``now`` (monotonic seconds)
    where time matters and returns the actions to carry out in order (:data:`NO_ACTIONS` when
    there are none; the hot path, an in-order live batch, returns that very tuple). The
    serving side effects are actions too (:mod:`kvsvc.streams.actions`), carried out by the
    stream thread (:class:`~kvsvc.streams.carrier.ActionCarrier`). See
    :class:`SnapshotRecovery` for the snapshot-mode rules of each input.
    """

    @property
    def buffered_bytes(self) -> int:
        """Buffer accounting (bytes, §6) of the attempt in flight; 0 without one (metrics)."""

    @property
    def attempt(self) -> Optional[int]:
        """Id of the attempt in flight (requested, not yet ended or abandoned), else ``None``."""

    def view(self) -> "RecoveryView":
        """A copy of the bookkeeping; may be called off the stream thread (racy: tests, debug)."""

    def wakeup_at(self) -> Optional[float]:
        """Called before each poll: monotonic seconds when :meth:`tick` is next due, ``None``
        for nothing scheduled (the owner bounds its own waits: attempt deadline, reopen)."""

    def start(self, now: float) -> tuple[Action, ...]:
        """Called once when the thread runs, after :meth:`on_live_opened`: counts the ``start``
        recovery and makes a snapshot due; may return requests only once the live channel is up."""

    def tick(self, now: float) -> tuple[Action, ...]:
        """Called at every loop turn: runs the timers (due attempts, checks); may return
        requests and abandons."""

    def on_live_batch(self, seq: int, batch: Batch, wire_bytes: int,
                      now: float, digest: int = 0) -> tuple[Action, ...]:
        """Called per live message with the exact topic that framed (§1) and decoded (§2);
        ``wire_bytes`` is its size on the wire; ``digest`` the XXH3-64 of its payload (history
        mode's anchor, §7h; 0 and unused in snapshot mode); may return any actions."""

    def on_live_error(self, reason: DecodeErrorReason, text: str, seq: Optional[int],
                      now: float) -> tuple[Action, ...]:
        """Called per live message with the exact topic that failed framing (``seq`` ``None``)
        or decoding; ``text`` is the error for ``/ready``; may return any actions."""

    def on_live_opened(self) -> tuple[Action, ...]:
        """Called when the live ``SUB`` was (re)created, before it is connected; returns no
        request (nothing may be requested until :meth:`on_live_up`)."""

    def on_live_up(self, now: float) -> tuple[Action, ...]:
        """Called when the live ``SUB``'s handshake succeeded (its subscription is out); may
        make a snapshot due, which the next :meth:`tick` requests."""

    def on_live_down(self, reason: str, now: float) -> tuple[Action, ...]:
        """Called when the live ``SUB``'s monitor reported a disconnect, ``reason`` the error
        text; may return an abandon, never a request (the channel is down)."""

    def on_snapshot_opened(self, attempt: int, now: float) -> tuple[Action, ...]:
        """Called once the owner opened the attempt of a :class:`RequestSnapshot` (not called
        when opening raised: that is :meth:`on_snapshot_failed`); a stale id is ignored;
        returns :data:`NO_ACTIONS` in snapshot mode."""

    def on_snapshot_failed(self, attempt: int, exc: StreamError,
                           now: float) -> tuple[Action, ...]:
        """Called when attempt ``attempt`` could not be opened, timed out or got a malformed
        reply; a stale id is ignored; may return an abandon of it (a no-op for the owner when it
        never opened), never a request (the retry comes after the backoff, through :meth:`tick`)."""

    def on_snapshot_complete(self, attempt: int, reply: Union[SnapshotResult, HistoryReply],
                             requested_at: Optional[float], now: float) -> tuple[Action, ...]:
        """Called when attempt ``attempt``'s end marker arrived (a history catch-up: also when
        its first message proved no continuity; the result is a ``HistoryReply`` in history
        mode), after the owner drained the
        live messages already queued; ``requested_at`` is when its request was sent (monotonic
        s, ``None``: unknown); a stale id is ignored; may return abandons and a request."""

    def on_internal_error(self, error_name: str, now: float) -> tuple[Action, ...]:
        """Called when a bug-class exception (``error_name``, its class name) escaped a turn;
        may return an abandon; the recovery comes later through :meth:`tick`."""

    def on_apply_failed(self, action: ApplyEvents, error: StreamError,
                        now: float) -> tuple[Action, ...]:
        """Called when the index refused ``action`` (the very
        :class:`~kvsvc.streams.actions.ApplyEvents` object returned) with ``error`` (the
        serving state stopped serving it; the actions after it were dropped); may return any
        actions."""


class RecoveryTimers:
    """The schedule shared by every rule set: when the next attempt is due, the backoff of
    failed attempts, and the resync interval (§6). Pure arithmetic on ``now``.

    :param resync_interval_ms: the §8 periodic resync interval.
    :ivar next_attempt_at: monotonic seconds when an attempt is due; ``None``: none scheduled.
    :ivar failures: consecutive failed attempts.
    """

    def __init__(self, resync_interval_ms: int) -> None:
        self.resync_interval_s = resync_interval_ms / 1000.0
        self.next_attempt_at: Optional[float] = None
        self.failures = 0

    def failed(self, now: float) -> float:
        """One more failed attempt: the next one is due after the backoff; returns the delay."""
        self.failures += 1
        delay = backoff_s(self.failures)
        self.next_attempt_at = now + delay
        return delay

    def synchronized(self, now: float, probe: bool) -> None:
        """A swap: failures reset, the next resync due after the interval (at most
        :data:`PROBE_RESYNC_S` with ``probe``)."""
        self.failures = 0
        interval_s = self.resync_interval_s
        if probe:
            interval_s = min(interval_s, PROBE_RESYNC_S)
        self.next_attempt_at = now + interval_s

    def new_connection(self, now: float) -> None:
        """A new live connection may be a new engine: the backoff its predecessor's failed
        snapshots earned must not delay asking it (due within :data:`BACKOFF_INITIAL_S`)."""
        self.failures = 0
        if self.next_attempt_at is not None:
            self.next_attempt_at = min(self.next_attempt_at, now + BACKOFF_INITIAL_S)


#: The request type (RequestSnapshot, RequestHistory) and buffered item type of a rule set.
_R = TypeVar("_R", RequestSnapshot, RequestHistory)
_B = TypeVar("_B")
_S = TypeVar("_S")


class AttemptRules(Generic[_R, _B, _S]):
    """The attempt plumbing both rule sets share (§6): the action queue, the attempt in
    flight and its announcement, the live connection's up/down bookkeeping (requests only
    while the live ``SUB`` is connected), the wait-for-live note in ``error``, and the §6
    backoff of failed attempts. The rules of a reply, of live batches and of losing
    synchronization stay in the subclasses (:class:`SnapshotRecovery` §6/§7,
    :class:`~kvsvc.streams.history.HistoryRecovery` §7h), which implement
    :meth:`_begin_attempt` and :meth:`_announce`.

    :param stream: the stream's configuration (name, topic and endpoint appear in reasons).
    :param limits: ``max_buffered_bytes``, ``resync_interval_ms``, ``max_blocks_per_stream``.
    """

    def __init__(self, stream: StreamConfig, limits: KvEventsConfig) -> None:
        self._stream = stream
        self._limits = limits
        self._name = str(StreamId(stream.instance_name, stream.dp_rank))
        # What the serving state was told (the rules' own record: never read back from it).
        self._error: Optional[str] = NOT_YET     # its error reason
        self._index: Optional[TierIndex] = None  # the index it holds (serving or kept)
        self._live_messages = 0                  # live messages with the exact topic
        self._max_buffered = limits.max_buffered_bytes
        self._timers = RecoveryTimers(limits.resync_interval_ms)
        self._out: list[Action] = []
        self._mode = Mode.REBUILDING
        self._expected: Optional[int] = None     # next live seq the working index needs
        self._link = Link.DOWN
        self._waiting_errors = 0                 # errors noted while a retry waits (1st: warning)
        self._attempt: Optional[int] = None      # id of the attempt in flight
        # The request of the attempt in flight while its owner has not reported it open yet.
        self._opening: Optional[_R] = None
        self._attempt_ids = 0
        self._buffer: list[_B] = []
        self._buffer_bytes = 0
        self._silence: Optional[_S] = None       # the running silent-channel check

    # ------------------------------------------------------------------ read-only state

    @property
    def buffered_bytes(self) -> int:
        """Buffer accounting (bytes) of the attempt in flight (§6)."""
        return self._buffer_bytes

    @property
    def synchronized(self) -> bool:
        """The serving index is valid."""
        return self._mode in SERVES

    @property
    def mode(self) -> Mode:
        """Where the recovery stands."""
        return self._mode

    @property
    def _synced(self) -> bool:
        return self._mode in SERVES

    @property
    def _awaiting_live(self) -> bool:
        return self._mode is Mode.SILENT

    @property
    def attempt(self) -> Optional[int]:
        """Id of the attempt in flight, ``None`` when there is none."""
        return self._attempt

    def _view(self, *, max_seen: Optional[int], buffered_seqs: tuple[int, ...],
              silence_check: Optional[SilenceCheck], awaiting_live: bool) -> RecoveryView:
        """The :class:`RecoveryView` of this machine with the rule set's own fields given."""
        return RecoveryView(
            synchronized=self._synced, expected=self._expected, max_seen=max_seen,
            live_up=self._link is Link.UP, attempt=self._attempt,
            next_attempt_at=self._timers.next_attempt_at, failures=self._timers.failures,
            buffered_bytes=self._buffer_bytes, buffered_seqs=buffered_seqs,
            silence_check=silence_check, awaiting_live=awaiting_live,
            live_messages=self._live_messages)

    def _wakeup(self, *, held_back: bool, deadline: Optional[float]) -> Optional[float]:
        """When :meth:`tick` is next due (monotonic s): the due attempt's time unless an
        attempt is in flight, ``held_back`` (the rule set asks nothing now) or the attempt is
        noted as waiting for the live channel (``on_live_up`` ends that wait); at the latest
        ``deadline`` (a silence check's). ``None``: nothing scheduled."""
        at: Optional[float] = None
        nxt = self._timers.next_attempt_at
        if (self._attempt is None and nxt is not None and not held_back
                and self._link is not Link.DOWN_NOTED):
            at = nxt
        if deadline is not None:
            at = deadline if at is None else min(at, deadline)
        return at

    def _start_due(self, now: float, *, held_back: bool, may_note: bool) -> None:
        """Start the attempt that is due at ``now`` (none in flight, not ``held_back``) when
        the live channel is up (§6: requests only while it is connected); else, once and if
        ``may_note``, say in ``error`` that it waits for the live channel."""
        nxt = self._timers.next_attempt_at
        if self._attempt is None and nxt is not None and now >= nxt and not held_back:
            if self._link is Link.UP:
                self._begin_attempt(now)
            elif self._link is Link.DOWN and may_note:
                self._note_live_wait()

    # ------------------------------------------------------------------ shared inputs

    def start(self, now: float) -> tuple[Action, ...]:
        """The stream thread runs: a recovery is due at once (§6; sent on the first
        :meth:`tick` with the live channel up). Counts the ``start`` recovery."""
        self._timers.next_attempt_at = now
        self._out.append(CountRecovery(RecoveryTrigger.START))
        return self._take()

    def on_live_opened(self) -> tuple[Action, ...]:
        """A new live ``SUB`` was created and is connecting: not up until its handshake."""
        self._link = Link.DOWN
        return self._take()

    def on_live_up(self, now: float) -> tuple[Action, ...]:
        """The live ``SUB``'s handshake succeeded: replies may be requested from now on
        (see the module docstring). A new connection may be a new engine, so the backoff of
        failed attempts is reset; an endpoint that keeps dropping connections gets requests at
        the pace of its reopens, which back off themselves (:mod:`kvsvc.streams.live`)."""
        noted = self._link is Link.DOWN_NOTED
        self._link = Link.UP
        if not self._synced and self._attempt is None and self._timers.next_attempt_at is not None:
            self._timers.new_connection(now)
        if noted:
            error = self._error
            # The wait is over: the reason is the cause alone again.
            if not self._synced and error is not None:
                self._set_error(error.partition(LIVE_WAIT)[0])
        return self._take()

    def on_snapshot_opened(self, attempt: int, now: float) -> tuple[Action, ...]:
        """The owner opened attempt ``attempt`` (its request is sent, or queued for a gate
        permit): a recovery's stream is ``RECOVERING`` from now on, with one info line (a
        periodic attempt: a debug line, no state change). An attempt whose opening failed never
        gets here (``on_snapshot_failed``). An attempt no longer in flight is ignored (its
        announcement was made when the input that requested it also ended it, see
        :meth:`_abandon_attempt`).

        :returns: :data:`NO_ACTIONS`.
        """
        request = self._opening
        if request is not None and request.attempt == attempt:
            self._opening = None
            self._announce(request)
        return self._take()

    def on_snapshot_failed(self, attempt: int, exc: StreamError, now: float) -> tuple[Action, ...]:
        """Attempt ``attempt`` failed (§6): it could not be opened, or ``SnapshotTimeout``
        (outcome ``timeout``), or any other ``StreamError`` (``error``). Retried after the
        backoff (the rule set's :meth:`_attempt_failed` says what else). An attempt no longer
        in flight is ignored."""
        if attempt == self._attempt:
            opening = self._opening
            if opening is not None and opening.attempt == attempt:
                self._opening = None  # never opened: nothing to announce
            self._attempt_failed(exc, now)
        return self._take()

    def on_live_error(self, reason: DecodeErrorReason, text: str, seq: Optional[int],
                      now: float) -> tuple[Action, ...]:
        """A live message with the exact topic that failed parsing (``frame``, §1) or decoding
        (``payload``, §2): counted, and a stream error (§6, §7h: the rule set's
        :meth:`_stream_error`, trigger ``decode_error``).

        :param text: the error's text (``/ready``): for a payload, ``"seq <seq>: <error>"``.
        :param seq: the message's seq when its frames parsed, else ``None``.
        """
        self._live_messages += 1
        if self._awaiting_live:
            self._live_alive_again(now)
        if seq is not None:
            self._note_seen(seq)
        self._out.append(CountDecodeError(reason))
        self._stream_error(text, RecoveryTrigger.DECODE_ERROR, now)
        return self._take()

    def _note_seen(self, seq: int) -> None:
        """A live message with ``seq`` arrived (its payload may not have decoded)."""

    def _silence_failed(self, live_messages: int, deadline: float, now: float) -> bool:
        """Judge the running silent-channel check (D1 in docs/decisions.md), armed
        when ``live_messages`` live messages had arrived, due at ``deadline`` (monotonic s):
        passed (ended, False) once any live message arrived since it was armed or the stream
        no longer serves; running (False) before ``deadline``; else failed (True): ended and
        the attempt abandoned; the rule set then says how the stream stops serving and enters
        ``SILENT`` (nothing is asked until a live message arrives)."""
        # Counted from when the check was armed, not from the last swap: a later resync's
        # swap must not hide a batch that arrived in between.
        if self._live_messages != live_messages or not self._synced:
            self._silence = None
            return False
        if now < deadline:
            return False
        self._silence = None
        self._abandon_attempt()
        return True

    def _live_alive_again(self, now: float) -> None:
        """A live message after a silent channel (the rule set's reaction)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ attempts

    def _begin_attempt(self, now: Optional[float] = None) -> None:
        """Request the next attempt (appends its request, sets ``_attempt``/``_opening``)."""
        raise NotImplementedError

    def _announce(self, request: _R) -> None:
        """The attempt of ``request`` is open: log it (and set ``RECOVERING`` when urgent)."""
        raise NotImplementedError

    def _attempt_failed(self, exc: StreamError, now: float) -> None:
        """A failed attempt (§6): the rule set's reaction; see :meth:`_fail_attempt`."""
        raise NotImplementedError

    def _new_index(self) -> TierIndex:
        return TierIndex(self._stream.block_size, self._stream.hash_seed,
                         self._limits.max_blocks_per_stream)

    def _take(self) -> tuple[Action, ...]:
        out = self._out
        if not out:
            return NO_ACTIONS
        self._out = []
        return tuple(out)

    def _restart_recovery(self, now: float) -> None:
        """Abandon any attempt (a periodic one too) and request a recovery now (§6), or as
        soon as the live channel is connected."""
        self._abandon_attempt()
        self._timers.next_attempt_at = now
        if self._link is Link.UP:
            self._begin_attempt(now)

    def _abandon_attempt(self) -> None:
        if self._opening is not None:
            # Requested by the very input that now ends it: the owner opens it only once this
            # input returns, but the request came before whatever ends it, so it is announced
            # now and the log reads in the order things happened.
            request = self._opening
            self._opening = None
            self._announce(request)
        if self._attempt is not None:
            self._out.append(AbandonSnapshot(self._attempt))
            self._attempt = None
        self._buffer = []
        self._buffer_bytes = 0

    def _fail_attempt(self, exc: StreamError, now: float) -> float:
        """Close the failed attempt, count its outcome (``timeout``, ``buffer_overflow``,
        ``error``) and schedule the retry after the §6 backoff; returns the delay (s)."""
        self._abandon_attempt()
        outcome = (SnapshotOutcome.TIMEOUT if isinstance(exc, SnapshotTimeout) else
                   SnapshotOutcome.BUFFER_OVERFLOW if isinstance(exc, BufferOverflow) else
                   SnapshotOutcome.ERROR)
        self._out.append(CountAttempt(outcome))
        return self._timers.failed(now)

    def _cleared_index(self, seq: int, batch: Batch, now: float) -> Optional[TierIndex]:
        """§6: a new index holding batch ``seq``, which starts with an untargeted
        ``AllBlocksCleared`` (a complete state); ``None`` when the batch does not apply (counted
        as a decode error and handled as a stream error)."""
        index = self._new_index()
        try:
            index.apply(batch.events)
        except StreamError as exc:
            reason = error_reason(exc)
            self._out.append(CountDecodeError(reason))
            self._stream_error(f"seq {seq}: {exc}", trigger_of(reason), now)
            return None
        return index

    def _stream_error(self, reason: str, trigger: RecoveryTrigger, now: float) -> None:
        """An error of the stream (the rule set's reaction)."""
        raise NotImplementedError

    def _buffer_item(self, item: _B, batch: Batch, wire_bytes: int, during: str,
                     now: float) -> None:
        """Buffer ``item`` (live ``batch`` of ``wire_bytes``) into the attempt in flight (§6
        accounting, :func:`record_bytes`); above ``max_buffered_bytes`` the attempt fails
        (``buffer overflow``, the text naming ``during``)."""
        self._buffer_bytes += record_bytes(batch, wire_bytes)
        if self._buffer_bytes > self._max_buffered:
            self._attempt_failed(BufferOverflow(
                f"buffer overflow: live batches buffered during {during} exceed "
                f"max_buffered_bytes={self._max_buffered}"), now)
            return
        self._buffer.append(item)

    def _fail_or_note(self, reason: str, now: float) -> None:
        """A stream error without an index to discard: it fails the attempt in flight, or,
        while a retry waits, it is the reason recorded (:meth:`_note_waiting_error`)."""
        if self._attempt is not None:
            self._attempt_failed(StreamError(reason), now)
        else:
            self._note_waiting_error(reason)

    def _note_waiting_error(self, reason: str) -> None:
        """An error while a retry waits: record the reason; the state does not change, so only
        the first error is logged at warning (a burst of garbage cannot flood the log; the
        latest reason is still in ``error``)."""
        self._set_error(reason)
        self._waiting_errors += 1
        if self._waiting_errors == 1:
            self._log(log, WARNING, "stream %s: %s (retry already scheduled; further errors "
                      "until then are logged at debug level)", self._name, reason)
        else:
            self._log(log, DEBUG, "stream %s: %s (retry already scheduled)", self._name, reason)

    def _log_unsynchronized(self, reason: str, trigger: RecoveryTrigger,
                            recovering: bool = False) -> None:
        """Count the recovery (``trigger``) and log the loss of synchronization once."""
        self._out.append(CountRecovery(trigger))
        self._log(log, WARNING, "stream %s: %s: %s", self._name,
                  "recovering" if recovering else "unsynchronized", reason)

    def _note_live_wait(self) -> None:
        """An attempt is due but the live channel is not connected: say so in ``error``."""
        self._link = Link.DOWN_NOTED
        cause = self._error or NOT_YET
        self._set_error(f"{cause}{LIVE_WAIT}{self._stream.endpoint} is connected")

    # ------------------------------------------------------------------ serving actions

    def _log(self, logger: logging.Logger, level: int, msg: str, *args: object) -> None:
        """Ask for one log line (a :class:`~kvsvc.streams.actions.Log`) when ``logger`` logs
        at ``level``."""
        if logger.isEnabledFor(level):
            self._out.append(Log(logger.name, level, msg, args))

    def _set_error(self, error: Optional[str]) -> None:
        """The serving state's error reason becomes ``error`` (the state stays)."""
        self._error = error
        self._out.append(SetError(error))

    def _set_unsynchronized(self, error: str) -> None:
        """The serving state becomes ``UNSYNCHRONIZED`` with ``error`` (an index is kept)."""
        self._error = error
        self._out.append(SetUnsynchronized(error))

    def _discard(self, reason: str) -> None:
        """The serving state discards its index: ``UNSYNCHRONIZED`` with ``reason``."""
        self._error = reason
        self._index = None
        self._out.append(Invalidate(reason))

    def _refused(self, seq: int, error: StreamError) -> tuple[str, DecodeErrorReason]:
        """An :class:`~kvsvc.streams.actions.ApplyEvents` of batch ``seq`` was refused: the
        serving state discarded the index (reason ``"seq <seq>: <error>"``); counts the
        decode-error label. :returns: the reason and the label."""
        reason = f"seq {seq}: {error}"
        label = error_reason(error)
        self._error = reason
        self._index = None
        self._out.append(CountDecodeError(label))
        return reason, label


class SnapshotRecovery(AttemptRules[RequestSnapshot, tuple[int, Batch], SilenceCheck]):
    """The §6/§7 recovery rules of one snapshot-mode stream (see the module docstring).

    :param stream: the stream's configuration (name, topic and endpoint appear in reasons).
    :param limits: ``max_buffered_bytes``, ``resync_interval_ms``, ``max_blocks_per_stream``.
    """

    def __init__(self, stream: StreamConfig, limits: KvEventsConfig) -> None:
        super().__init__(stream, limits)
        self._max_seen: Optional[int] = None     # highest live seq on this connection
        self._live_at_swap = 0                   # live_messages when the index was swapped

    # ------------------------------------------------------------------ read-only state

    def view(self) -> RecoveryView:
        """A copy of the bookkeeping (racy when read off the stream thread: tests, debugging)."""
        return self._view(max_seen=self._max_seen,
                          buffered_seqs=tuple(seq for seq, _ in self._buffer),
                          silence_check=self._silence, awaiting_live=self._awaiting_live)

    def wakeup_at(self) -> Optional[float]:
        """Monotonic seconds when :meth:`tick` is next due (an attempt due, a silence check's
        deadline); ``None``: nothing scheduled (an attempt in flight has its own deadline)."""
        # (A silent channel's recovery waits for a live batch with nothing scheduled.)
        silence = self._silence
        return self._wakeup(held_back=False,
                            deadline=None if silence is None else silence.deadline)

    # ------------------------------------------------------------------ inputs

    def tick(self, now: float) -> tuple[Action, ...]:
        """Time passed: end a silence check whose deadline passed, start a due attempt (or note
        in ``error`` that it waits for the live channel)."""
        if self._silence is not None:
            self._check_silence(now)
        self._start_due(now, held_back=False, may_note=True)
        return self._take()

    def on_live_batch(self, seq: int, batch: Batch, wire_bytes: int,
                      now: float, digest: int = 0) -> tuple[Action, ...]:
        """A live batch with the exact topic, framed (§1) and decoded (§2); ``digest`` is
        not used in snapshot mode.

        Synchronized: applied when ``seq`` is the expected one (and buffered for a resync in
        flight), dropped when covered by the swapped-in snapshot, else a sequence error.
        Otherwise: an ``AllBlocksCleared`` batch becomes the baseline; else buffered into the
        attempt in flight (nothing to buffer into during a backoff).

        :param wire_bytes: the message's wire size (buffer accounting).
        """
        self._live_messages += 1
        mode = self._mode
        if mode is _SILENT:
            self._live_alive_again(now)
        prev_max = self._max_seen
        self._max_seen = seq if prev_max is None or seq > prev_max else prev_max
        if mode is _SERVING:
            expected = self._expected
            if expected is None or seq == expected:
                self._expected = seq + 1
                if self._attempt is None and not self._out:
                    return (ApplyEvents(seq, batch.events),)  # the hot path
                self._out.append(ApplyEvents(seq, batch.events))
                if self._attempt is not None:
                    # Background resync: the new index needs this batch too.
                    self._buffer_batch(seq, batch, wire_bytes, now)
                return self._take()
            self._on_unexpected_seq(seq, expected, batch, wire_bytes, prev_max, now)
        else:
            self._on_live_unsynchronized(seq, batch, wire_bytes, prev_max, now)
        return self._take()

    def on_apply_failed(self, action: ApplyEvents, error: StreamError,
                        now: float) -> tuple[Action, ...]:
        """The serving index refused live batch ``action.seq`` (§5: an unknown parent, a hash
        conflict, capacity): the serving state discarded it; counted, and a recovery starts
        (trigger from the error's label)."""
        reason, label = self._refused(action.seq, error)
        self._mode = Mode.REBUILDING
        self._expected = None
        self._log_unsynchronized(reason, trigger_of(label))
        self._restart_recovery(now)
        return self._take()

    def _note_seen(self, seq: int) -> None:
        """A live message that failed decoding still counts for ``max_seen``."""
        prev_max = self._max_seen
        self._max_seen = seq if prev_max is None or seq > prev_max else prev_max

    def on_live_down(self, reason: str, now: float) -> tuple[Action, ...]:
        """The live ``SUB``'s monitor reported a disconnect (§6): a stream error with trigger
        ``disconnect``; the next connection may be a restarted engine counting from 0 again.

        :param reason: the error text (``"disconnected"``, or with the flapping hint).
        """
        self._max_seen = None
        self._link = Link.DOWN
        self._stream_error(reason, RecoveryTrigger.DISCONNECT, now)
        return self._take()

    def on_snapshot_complete(self, attempt: int, reply: Union[SnapshotResult, HistoryReply],
                             requested_at: Optional[float], now: float) -> tuple[Action, ...]:
        """The end marker of attempt ``attempt`` arrived: merge the buffered tail and swap (§6,
        §7). The owner takes in the live messages already queued first (fewer batches published
        before the snapshot then arrive after the swap); an attempt those ended is ignored.

        - Empty reply: empty state, watermark unknown; the first live batch is the baseline.
        - Otherwise buffered batches with seq <= watermark are dropped, the rest must continue
          ``watermark + 1, ...`` contiguously (else the attempt fails: ``gap after watermark``)
          and are applied to the new index.
        - A resync whose merged seq is behind the applied one: the engine's counter restarted;
          the serving index is discarded and a recovery starts (``sequence_backwards``).

        :param requested_at: monotonic seconds when the request was sent (duration metric).
        """
        if attempt != self._attempt:
            return self._take()
        assert isinstance(reply, SnapshotResult)
        resync = self._synced
        index = reply.index
        # Not-indexed counts of the snapshot itself are not live ones; a recovery's buffered
        # tail is (it never reached a serving index), a resync's tail was counted when applied.
        stats_base = stats_tuple(index.stats)
        tail: list[Batch] = []
        if reply.empty:
            # §7: empty state, unknown watermark: the first live batch becomes the baseline.
            expected: Optional[int] = None
            sequence: Optional[int] = None
            how = "empty snapshot, baseline is the next live batch"
        else:
            wm = reply.watermark
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
                                     else SnapshotError(f"seq {seq} after snapshot: {exc}"), now)
                return self._take()
            if resync and self._expected is not None and expected < self._expected:
                # A consistent engine cannot do this: its counter restarted (a new process or
                # publisher) without a live batch telling us. The serving index describes the
                # old counter's state, so it must go, not just this attempt.
                reason = (f"snapshot watermark {_wm(wm)} is behind applied seq "
                          f"{self._expected - 1}: the engine's sequence restarted")
                self._abandon_attempt()
                self._invalidate(reason, RecoveryTrigger.SEQUENCE_BACKWARDS)
                self._restart_recovery(now)
                return self._take()
            how = f"snapshot watermark {_wm(wm)}, {reply.messages} messages, tail to seq {_wm(sequence)}"
        live_messages = self._live_messages
        silent = (resync and not reply.empty and reply.watermark is not None
                  and self._expected is not None and reply.watermark >= self._expected
                  and live_messages == self._live_at_swap)
        first_missing = self._expected
        if resync:
            stats_base = stats_tuple(index.stats)
            tail = []
        duration = now - requested_at if requested_at is not None else 0.0
        self._out.append(SnapshotOk(duration, reply.wire_bytes, reply.messages))
        self._abandon_attempt()
        self._swap(index, expected=expected, sequence=sequence, resync=resync, how=how,
                   live_events=[ev for b in tail for ev in b.events], stats_base=stats_base,
                   now=now)
        if silent and self._silence is None:
            # The engine published batches up to the watermark and not one reached us since
            # the last swap: in flight still, or a dead live channel. The index is exact now;
            # a live message must show up within the grace period. (A check already running
            # keeps its earlier deadline and count.)
            self._silence = SilenceCheck(now + LIVE_SILENCE_GRACE_S, reply.watermark,  # type: ignore[arg-type]
                                         first_missing, live_messages)  # type: ignore[arg-type]
        return self._take()

    def on_internal_error(self, error_name: str, now: float) -> tuple[Action, ...]:
        """A bug in kvsvc escaped a turn (input errors are ``StreamError``s): discard the index,
        as for any stream error, and recover after a backoff instead of leaving the stream dead
        for the life of the process (trigger ``internal_error``).

        :param error_name: the exception's class name (the reason says
            ``"internal error: <name>"``).
        """
        self._abandon_attempt()
        self._invalidate(f"internal error: {error_name}", RecoveryTrigger.INTERNAL_ERROR)
        self._timers.failed(now)
        return self._take()

    # ------------------------------------------------------------------ live batches

    def _live_alive_again(self, now: float) -> None:
        self._mode = Mode.REBUILDING
        self._log(log, INFO, "stream %s: live channel alive again; recovering", self._name)
        self._restart_recovery(now)

    def _on_unexpected_seq(self, seq: int, expected: int, batch: Batch, wire_bytes: int,
                           prev_max: Optional[int], now: float) -> None:
        if seq < expected and prev_max is not None and seq > prev_max:
            # Published before the snapshot we swapped in at watermark >= seq, received after
            # it: already covered. Never a repeat (seq is above anything seen on this
            # connection), so it cannot hide an engine restart. With nothing seen on this
            # connection yet (prev_max None) an old seq may just as well be a publisher that
            # restarted its counter after the snapshot: that case recovers (one extra snapshot
            # at worst), because dropping it could keep a stale index synchronized.
            self._out.append(COUNT_DUPLICATE)
            self._log(log, DEBUG, "stream %s: dropped seq %d covered by the snapshot (next %d)",
                      self._name, seq, expected)
            return
        if seq > expected:
            reason = f"sequence gap: expected seq {expected}, got {seq}"
            trigger = RecoveryTrigger.SEQUENCE_GAP
        else:
            trigger = RecoveryTrigger.SEQUENCE_BACKWARDS
            reason = f"sequence went backwards: expected seq {expected}, got {seq}"
            # A backward jump starts a new epoch (restarted engine): later batches of it must
            # not be judged against the old engine's numbers.
            self._max_seen = seq
        self._invalidate(reason, trigger)
        self._restart_recovery(now)
        # The new attempt's snapshot is requested after this batch: buffer it like any other.
        self._on_live_unsynchronized(seq, batch, wire_bytes, None, now)

    def _on_live_unsynchronized(self, seq: int, batch: Batch, wire_bytes: int,
                                prev_max: Optional[int], now: float) -> None:
        if starts_cleared(batch.events):
            self._baseline_from_cleared(seq, batch, now)
            return
        if prev_max is not None and seq <= prev_max:
            # A repeat or a restarted engine while recovering: the snapshot in flight may be the
            # old engine's. Start over in the new epoch.
            self._max_seen = seq
            self._stream_error(f"sequence went backwards during recovery: got seq {seq} "
                               f"after {prev_max}", RecoveryTrigger.SEQUENCE_BACKWARDS, now)
            return
        if self._attempt is None:
            # Backoff: nothing to buffer into; the next snapshot is taken after this batch.
            return
        self._buffer_batch(seq, batch, wire_bytes, now)

    def _buffer_batch(self, seq: int, batch: Batch, wire_bytes: int, now: float) -> None:
        self._buffer_item((seq, batch), batch, wire_bytes, "the snapshot", now)

    def _baseline_from_cleared(self, seq: int, batch: Batch, now: float) -> None:
        """§6: a batch starting with an untargeted ``AllBlocksCleared`` is a complete state."""
        index = self._cleared_index(seq, batch, now)
        if index is None:
            return
        self._abandon_attempt()
        self._max_seen = seq
        # Every event of this batch is live: none of its not-indexed counts is a snapshot's.
        self._swap(index, expected=seq + 1, sequence=seq, resync=False,
                   how=f"AllBlocksCleared batch seq {seq}", live_events=batch.events,
                   stats_base=(0,) * len(NOT_INDEXED), now=now)

    # ------------------------------------------------------------------ errors

    def _stream_error(self, reason: str, trigger: RecoveryTrigger, now: float) -> None:
        """An error of the stream: invalidate and recover when synchronized, else fail the
        attempt in flight (or record the reason while waiting to retry).

        :param reason: the error text (``/ready``, logs).
        :param trigger: counted when this ends synchronization.
        """
        if self._synced:
            self._invalidate(reason, trigger)
            self._restart_recovery(now)
        else:
            self._fail_or_note(reason, now)

    def _invalidate(self, reason: str, trigger: RecoveryTrigger) -> None:
        """Discard the serving index and forget its sequence; one log line and one recovery
        count (``trigger``) per loss of synchronization."""
        self._discard(reason)
        self._mode = Mode.REBUILDING
        self._expected = None
        self._log_unsynchronized(reason, trigger)

    def _check_silence(self, now: float) -> None:
        """End a silent-channel check: passed once any live message arrived since it was armed;
        failed at its deadline, which unsynchronizes the stream until a live message arrives
        (a dead live channel, e.g. a topic the engine does not publish, would otherwise keep
        a snapshot's index serving while the engine moves on: stale hits)."""
        check = self._silence
        assert check is not None
        if not self._silence_failed(check.live_messages, check.deadline, now):
            return
        self._timers.next_attempt_at = None  # no snapshot until the live channel shows life
        self._invalidate(
            f"live channel silent: the engine published up to seq {check.watermark} (resync "
            f"watermark) but no live batch arrived since seq {check.first_missing}; check the "
            f"stream's endpoint and topic {self._stream.topic!r}", RecoveryTrigger.LIVE_SILENT)
        self._mode = Mode.SILENT

    # ------------------------------------------------------------------ attempts

    def _begin_attempt(self, now: Optional[float] = None) -> None:
        """Request a snapshot: a resync from the expected seq when synchronized, else a
        recovery from 0 (§7)."""
        self._waiting_errors = 0
        resync = self._synced
        start_seq = self._expected if resync and self._expected is not None else 0
        self._buffer = []
        self._buffer_bytes = 0
        self._attempt_ids += 1
        self._attempt = self._attempt_ids
        request = RequestSnapshot(self._attempt, start_seq, not resync)
        self._out.append(request)
        self._opening = request  # announced once the owner reports it open
        self._timers.next_attempt_at = None

    def _announce(self, request: RequestSnapshot) -> None:
        """The attempt of ``request`` is open: a recovery sets ``RECOVERING`` (one info line);
        a resync only logs at debug level."""
        if not request.urgent:
            # Periodic and uneventful (every resync_interval_ms per stream): not a state change.
            self._log(log, DEBUG, "stream %s: resync snapshot requested (start_seq %d)",
                      self._name, request.start_seq)
        else:
            self._out.append(SET_RECOVERING)
            self._log(log, INFO, "stream %s: recovering: snapshot requested (start_seq %d)",
                      self._name, request.start_seq)

    def _attempt_failed(self, exc: StreamError, now: float) -> None:
        """A failed attempt (§6): close it, keep the reason, retry after the backoff. A failed
        resync leaves the stream synchronized and serving."""
        delay = self._fail_attempt(exc, now)
        if self._synced:
            self._log(log, WARNING, "stream %s: resync failed: %s; retry in %.1fs", self._name,
                      exc, delay)
            return
        self._set_unsynchronized(str(exc))
        self._log(log, WARNING, "stream %s: unsynchronized: %s; retry in %.1fs", self._name, exc,
                  delay)

    def _swap(self, index: TierIndex, *, expected: Optional[int], sequence: Optional[int],
              resync: bool, how: str, live_events: Sequence[object],
              stats_base: tuple[int, ...], now: float) -> None:
        """Make ``index`` the serving one, atomically (§6), and schedule the next resync."""
        difference = 0
        current = self._index
        if resync and current is not None:
            # The stream thread is the serving index's only writer and carries every action
            # before the next input, so this is the index as served.
            difference = index.difference(current)
        self._out.append(SwapIndex(index, sequence, resync, difference, live_events, stats_base))
        self._index = index
        self._error = None
        self._mode = Mode.SERVING
        self._expected = expected
        self._live_at_swap = self._live_messages
        self._timers.synchronized(
            now, probe=not resync and sequence is not None and self._max_seen is None)
        if not resync:
            self._log(log, INFO, "stream %s: synchronized (%s): %d device, %d host blocks",
                      self._name, how, index.device_blocks, index.host_blocks)
        elif difference:
            self._log(log, WARNING, "stream %s: resync found %d differing blocks (lost events); "
                      "index replaced (%s)", self._name, difference, how)
        else:
            self._log(log, DEBUG, "stream %s: resync matched (%s)", self._name, how)


def _wm(value: Optional[int]) -> str:
    return "none" if value is None else str(value)
