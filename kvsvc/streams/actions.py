"""What the recovery rules ask the stream thread to do (§6, §7, §7h): actions as values.

The rules (:mod:`kvsvc.streams.recovery`, :mod:`kvsvc.streams.history`) take inputs and
return a tuple of these, in order; they never call the serving state or the sockets
themselves. The stream thread (:mod:`kvsvc.streams.subscriber`, through
:class:`~kvsvc.streams.carrier.ActionCarrier`) carries them out:

- **serving actions** change the :class:`~kvsvc.streams.serving.ServingState` (each in one
  lock hold): :class:`ApplyEvents`, :class:`SwapIndex`, :class:`HoldIndex`,
  :class:`ResumeIndex`, :class:`Invalidate`, :class:`SetRecovering`,
  :class:`SetUnsynchronized`, :class:`SetError`, :class:`SetCompleteness`, and the counters
  :class:`CountRecovery`, :class:`CountAttempt`, :class:`CountDecodeError`,
  :class:`CountResyncDifference`, :class:`CountDuplicate`, :class:`SnapshotOk`;
- :class:`Log`: one log line (the rules' logger, level and %-style arguments);
- **attempt actions** open or close a replay attempt: :class:`RequestSnapshot`,
  :class:`RequestHistory`, :class:`AbandonSnapshot`.

An :class:`ApplyEvents` the index refuses (§5 error) stops that index from serving in the same
lock hold (a batch is never served half applied); the actions after it in the tuple are
dropped and the rules are told with ``on_apply_failed``, whose actions are carried instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

from kvsvc.index.tier_index import TierIndex
from kvsvc.streams.counters import DecodeErrorReason, RecoveryTrigger, SnapshotOutcome
from kvsvc.streams.state import Completeness

# ---------------------------------------------------------------------------- attempts


@dataclass(frozen=True, slots=True)
class RequestSnapshot:
    """Open snapshot attempt ``attempt`` (§7) asking from ``start_seq``; report that it is
    open with ``on_snapshot_opened`` (or that it could not be opened with
    ``on_snapshot_failed``), then its end with ``on_snapshot_complete`` / ``on_snapshot_failed``.

    :param attempt: the attempt's id (increasing per machine).
    :param start_seq: last applied seq + 1 for a resync, else 0 (§7).
    :param urgent: a recovery (the stream serves nothing meanwhile); False: a periodic resync.
    """

    attempt: int
    start_seq: int
    urgent: bool


@dataclass(frozen=True, slots=True)
class AbandonSnapshot:
    """Close attempt ``attempt`` (its socket and gate permit); a late reply is dropped."""

    attempt: int


@dataclass(frozen=True, slots=True)
class RequestHistory:
    """Open history attempt ``attempt`` (§7h) from ``start_seq``; report it open with
    ``on_snapshot_opened`` (or ``on_snapshot_failed``), its catch-up batches with
    ``on_history_batch``, its end with ``on_snapshot_complete`` / ``on_snapshot_failed``.

    :param attempt: the attempt's id (increasing per machine).
    :param start_seq: ``L`` for a catch-up, 0 for a rebuild.
    :param urgent: the stream serves nothing meanwhile (False: a periodic catch-up, or a rebuild
        retry while a live-only subset serves).
    :param anchor_digest: ``D`` for a catch-up; ``None``: a rebuild.
    """

    attempt: int
    start_seq: int
    urgent: bool
    anchor_digest: Optional[int]

    @property
    def catch_up(self) -> bool:
        """A catch-up (else a rebuild from 0)."""
        return self.anchor_digest is not None


# ---------------------------------------------------------------------------- serving state


@dataclass(slots=True)
class ApplyEvents:
    """Apply live batch ``seq`` (or a catch-up's replayed one, §7h) to the stream's index
    (serving, or kept while it catches up), under the lock.

    Not ``frozen`` (treat it as read-only all the same): one is made per live batch, and a
    frozen dataclass sets each field through ``object.__setattr__``, three times the cost.

    :param orphans: the index is a subset (§7h): an unknown parent makes an orphan (§5 snapshot
        rule) instead of an error.
    """

    seq: int
    events: Sequence[object]
    orphans: bool = False


@dataclass(frozen=True, slots=True)
class SwapIndex:
    """Make ``index`` the serving one in one lock hold; state ``SYNCHRONIZED`` (§6).

    :param sequence: the last applied seq it holds (``None``: unknown).
    :param resync: a periodic resync (counts ``difference``) rather than a recovery.
    :param difference: blocks that differ from the index it replaces (resync only).
    :param live_events: live events ``index`` holds that no serving index counted yet.
    :param stats_base: ``index.stats`` counts not due to live events (``()``: none).
    :param completeness: what ``index`` holds (§7h); snapshot mode: always exact.
    """

    index: TierIndex
    sequence: Optional[int]
    resync: bool
    difference: int
    live_events: Sequence[object]
    stats_base: tuple[int, ...]
    completeness: Completeness = Completeness.EXACT


@dataclass(frozen=True, slots=True)
class HoldIndex:
    """Keep ``index`` without serving it (state ``RECOVERING`` with ``reason``, §7h: a rebuild
    complete up to ``sequence`` that catches up from there)."""

    index: TierIndex
    sequence: Optional[int]
    stats_base: tuple[int, ...]
    completeness: Completeness
    reason: str


@dataclass(frozen=True, slots=True)
class ResumeIndex:
    """The kept index is complete again: state ``SYNCHRONIZED`` at ``sequence``; counts a
    recovery (§7h)."""

    sequence: Optional[int]


@dataclass(frozen=True, slots=True)
class Invalidate:
    """Discard the serving index and its sequence; ``UNSYNCHRONIZED`` with ``reason`` (§6)."""

    reason: str


@dataclass(frozen=True, slots=True)
class SetRecovering:
    """State ``RECOVERING`` (a recovery attempt was requested); the error stays."""


@dataclass(frozen=True, slots=True)
class SetUnsynchronized:
    """State ``UNSYNCHRONIZED`` with ``error`` (the index, if any, is kept unserved)."""

    error: str


@dataclass(frozen=True, slots=True)
class SetError:
    """Replace the error reason only."""

    error: Optional[str]


@dataclass(frozen=True, slots=True)
class SetCompleteness:
    """What the serving index holds (§7h: a subset becomes exact on an untargeted
    ``AllBlocksCleared``)."""

    completeness: Completeness


@dataclass(frozen=True, slots=True)
class CountRecovery:
    """One more recovery started by ``trigger``."""

    trigger: RecoveryTrigger


@dataclass(frozen=True, slots=True)
class CountAttempt:
    """One more replay attempt ended with ``outcome`` (a failure; see :class:`SnapshotOk`)."""

    outcome: SnapshotOutcome


@dataclass(frozen=True, slots=True)
class CountDecodeError:
    """One more decode error labelled ``reason``."""

    reason: DecodeErrorReason


@dataclass(frozen=True, slots=True)
class CountResyncDifference:
    """Add ``difference`` to the resync differences (§7h: in batches)."""

    difference: int


@dataclass(frozen=True, slots=True)
class CountDuplicate:
    """One more live batch dropped as covered by what the index holds."""


@dataclass(frozen=True, slots=True)
class SnapshotOk:
    """One more successful replay: its duration (request to end, seconds), bytes, messages."""

    seconds: float
    wire_bytes: int
    messages: int


@dataclass(frozen=True, slots=True)
class Log:
    """One log line: ``logging.getLogger(logger).log(level, msg, *args)``."""

    logger: str
    level: int
    msg: str
    args: tuple[object, ...]


#: What opens or closes an attempt (the subscriber's part).
AttemptAction = Union[RequestSnapshot, RequestHistory, AbandonSnapshot]
#: What changes the serving state.
ServingAction = Union[ApplyEvents, SwapIndex, HoldIndex, ResumeIndex, Invalidate, SetRecovering,
                      SetUnsynchronized, SetError, SetCompleteness, CountRecovery, CountAttempt,
                      CountDecodeError, CountResyncDifference, CountDuplicate, SnapshotOk]
#: Everything the rules return.
Action = Union[AttemptAction, ServingAction, Log]
#: What most inputs return: nothing to do.
NO_ACTIONS: tuple = ()
#: The one :class:`CountDuplicate` (it has no fields).
COUNT_DUPLICATE = CountDuplicate()
#: The one :class:`SetRecovering`.
SET_RECOVERING = SetRecovering()
