"""The label values of a stream's metrics, declared once, and the counters they label.

Every label set is fixed (never free text), so a Prometheus series exists for each value from
the start (:mod:`kvsvc.http.metrics` iterates the dicts of :class:`StreamCounters`). The values
are :class:`enum.StrEnum` members: each compares and hashes equal to its string, and
the ``*_REASONS`` / ``*_TRIGGERS`` / ``*_OUTCOMES`` tuples hold the plain strings used as keys.

- :class:`DecodeErrorReason` (``kvsvc_stream_decode_errors{reason}``): what was malformed in a
  live message (§1 framing, §2 payload, §2/§5 event) or what the index refused (§5).
- :class:`RecoveryTrigger` (``kvsvc_stream_recoveries{trigger}``): why a recovery started (§6).
- :class:`SnapshotOutcome` (``kvsvc_stream_snapshot_attempts{outcome}``): how an attempt ended
  (§6, §7).
- :data:`EVENT_TYPES` (``kvsvc_stream_events_applied{type}``): event class -> its §2 name.
- :data:`NOT_INDEXED` (``kvsvc_stream_*_not_indexed{reason}``): ``IndexStats`` field -> label.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

from kvsvc.errors import CapacityExceeded, HashConflict, StreamError, UnknownParent
from kvsvc.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvsvc.index.tier_index import IndexStats


class DecodeErrorReason(enum.StrEnum):
    """Why a live message, batch or event was refused."""

    FRAME = "frame"                    #: §1: frame count, seq frame, size limit
    PAYLOAD = "payload"                #: §2: the batch does not decode
    EVENT = "event"                    #: §5: the index refused an event (block size, tokens)
    UNKNOWN_PARENT = "unknown_parent"  #: §5: a live delta names an unknown parent
    HASH_CONFLICT = "hash_conflict"    #: §5: an engine hash already maps to another key
    CAPACITY = "capacity"              #: §5/§8: ``max_blocks_per_stream`` exceeded


class RecoveryTrigger(enum.StrEnum):
    """Why a recovery started (§6)."""

    START = "start"                            #: the first one of the stream thread
    DISCONNECT = "disconnect"                  #: the SUB's monitor reported a disconnect
    DECODE_ERROR = "decode_error"              #: a frame or payload error
    INDEX_ERROR = "index_error"                #: unknown parent, hash conflict, capacity
    SEQUENCE_GAP = "sequence_gap"              #: seq above the expected one
    SEQUENCE_BACKWARDS = "sequence_backwards"  #: a repeat, a backward jump, a restarted counter
    LIVE_SILENT = "live_silent"                #: the silent-channel check failed
    #: §7h: a catch-up could not prove continuity (the engine restarted or its buffer rolled
    #: past the anchor): the index is discarded and the stream rebuilds
    HISTORY_MISMATCH = "history_mismatch"
    INTERNAL_ERROR = "internal_error"          #: a bug in kvsvc (not an input error)


class SnapshotOutcome(enum.StrEnum):
    """How a snapshot attempt ended (§6, §7)."""

    OK = "ok"
    TIMEOUT = "timeout"
    BUFFER_OVERFLOW = "buffer_overflow"
    ERROR = "error"


#: Label values, in declaration order (the keys of :class:`StreamCounters`' dicts).
DECODE_ERROR_REASONS: tuple[str, ...] = tuple(r.value for r in DecodeErrorReason)
RECOVERY_TRIGGERS: tuple[str, ...] = tuple(t.value for t in RecoveryTrigger)
SNAPSHOT_OUTCOMES: tuple[str, ...] = tuple(o.value for o in SnapshotOutcome)
#: Event class -> its §2 ``type`` name (the ``type`` label of applied events).
EVENT_TYPES: dict[type, str] = {BlockStored: "BlockStored", BlockRemoved: "BlockRemoved",
                                AllBlocksCleared: "AllBlocksCleared"}
#: ``IndexStats`` field -> ``not_indexed`` label (orphan markers only come from snapshots).
NOT_INDEXED: dict[str, str] = {
    "not_indexed_medium": "other_medium", "excluded_blocks": "excluded",
    "unknown_tokenless": "unknown_tokenless", "unknown_removals": "unknown_removal"}

_INDEX_ERRORS = frozenset((DecodeErrorReason.UNKNOWN_PARENT, DecodeErrorReason.HASH_CONFLICT,
                           DecodeErrorReason.CAPACITY))


def error_reason(exc: StreamError) -> DecodeErrorReason:
    """The decode-error label of an error applying an event to the index (§5): ``event`` for a
    malformed event the index refused (block size, token count)."""
    if isinstance(exc, UnknownParent):
        return DecodeErrorReason.UNKNOWN_PARENT
    if isinstance(exc, HashConflict):
        return DecodeErrorReason.HASH_CONFLICT
    if isinstance(exc, CapacityExceeded):
        return DecodeErrorReason.CAPACITY
    return DecodeErrorReason.EVENT


def trigger_of(reason: DecodeErrorReason) -> RecoveryTrigger:
    """The recovery trigger of a decode-error label: ``index_error`` for what the index refused
    on its own rules (unknown parent, hash conflict, capacity), else ``decode_error``."""
    return RecoveryTrigger.INDEX_ERROR if reason in _INDEX_ERRORS else RecoveryTrigger.DECODE_ERROR


def stats_tuple(stats: IndexStats) -> tuple[int, ...]:
    """The not-indexed counts of ``stats``, in :data:`NOT_INDEXED` order."""
    return tuple(getattr(stats, name) for name in NOT_INDEXED)


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
