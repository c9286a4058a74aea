"""Stream identity, state, per-stream query answers (§6, §10) and the snapshot result (§7):
the values shared by the stream modules, the directory and the HTTP layer."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Union

from kvsvc.index.tier_index import TierIndex


#: ``error`` of a stream that has not been synchronized yet.
NOT_YET = "not synchronized yet: waiting for the first replay (snapshot or history)"


class StreamState(str, enum.Enum):
    """§6 states. ``UNSYNCHRONIZED`` carries an error reason; only ``SYNCHRONIZED`` serves hits."""

    UNSYNCHRONIZED = "unsynchronized"
    RECOVERING = "recovering"
    SYNCHRONIZED = "synchronized"


class Completeness(enum.StrEnum):
    """What a synchronized stream's index holds (§7h, §10, §14): ``exact`` (the engine's whole
    residency), ``subset`` (history was lost: every block in it is resident, some resident
    blocks may be missing), or ``approximate`` (no events: what this replica routed there,
    :mod:`kvsvc.index.overlay`). Snapshot-mode streams are always exact when synchronized."""

    EXACT = "exact"
    SUBSET = "subset"
    APPROXIMATE = "approximate"


@dataclass(frozen=True, slots=True, order=True)
class StreamId:
    """One (instance, DP rank) KV-event channel."""

    instance_name: str
    dp_rank: int

    def __str__(self) -> str:
        return f"{self.instance_name}/dp{self.dp_rank}"


@dataclass(slots=True)
class StreamMatch:
    """One stream's answer to a prefix query (§10). Read-only by contract.

    Not ``frozen``: a frozen dataclass sets each field through ``object.__setattr__``, several
    times the cost of a plain one, and a query builds one per stream. Treat instances as
    immutable all the same: a stream hands the *same* zero-hit instance to every query until
    its state changes (:meth:`kvsvc.streams.serving.ServingState.match`).

    :param sequence: last applied live seq, ``None`` before the first one.
    :param device_hit_tokens: tokens of the contiguous reusable prefix found on Device.
    :param host_only_hit_tokens: tokens of the same prefix found only on Host.
    :param device_blocks: resident Device blocks of the stream (whole index).
    :param host_blocks: resident Host blocks (a block on both tiers counts in both).
    :param error: ``None`` or why the stream is not synchronized.
    :param completeness: ``exact``, ``subset`` (§7h) or ``approximate`` (§14) when
        synchronized, ``None`` otherwise.
    :param pending_hit_tokens: tokens of the blocks right after the reusable prefix that this
        replica routed to the stream and whose events have not arrived yet (§16, pending),
        apart from and never inside ``device_hit_tokens``; 0 for approximate streams.
    """

    instance_name: str
    dp_rank: int
    synchronized: bool
    sequence: Optional[int]
    device_hit_tokens: int
    host_only_hit_tokens: int
    device_blocks: int
    host_blocks: int
    error: Optional[str]
    completeness: Optional[Completeness] = None
    pending_hit_tokens: int = 0

    @property
    def reusable_prefix_tokens(self) -> int:
        """``device_hit_tokens + host_only_hit_tokens`` (§10)."""
        return self.device_hit_tokens + self.host_only_hit_tokens

    def to_json(self) -> dict:
        """The §10 JSON object of this match."""
        return {
            "instance_name": self.instance_name,
            "dp_rank": self.dp_rank,
            "synchronized": self.synchronized,
            "sequence": self.sequence,
            "device_hit_tokens": self.device_hit_tokens,
            "host_only_hit_tokens": self.host_only_hit_tokens,
            "reusable_prefix_tokens": self.reusable_prefix_tokens,
            "device_blocks": self.device_blocks,
            "host_blocks": self.host_blocks,
            "error": self.error,
            "completeness": self.completeness,
            "pending_hit_tokens": self.pending_hit_tokens,
        }


@dataclass(frozen=True, slots=True)
class StreamStatus:
    """A stream's state for ``/ready``, logs and (later) metrics, read under the stream lock.

    :param synchronized_once: True once the stream has been synchronized at least once.
    :param recoveries: completed recoveries (snapshot swaps and AllBlocksCleared baselines).
    :param resync_differences: blocks that differed at periodic resyncs (silently lost events).
    :param completeness: ``exact``/``subset`` while synchronized, else ``None`` (§7h).
    """

    stream: StreamId
    state: StreamState
    error: Optional[str]
    sequence: Optional[int]
    device_blocks: int
    host_blocks: int
    entries: int
    synchronized_once: bool
    recoveries: int
    resync_differences: int
    completeness: Optional[Completeness] = None


@dataclass(frozen=True, slots=True)
class SnapshotResult:
    """A complete snapshot reply (§7), from the snapshot client to the recovery rules.

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


@dataclass(frozen=True, slots=True)
class CatchUpReply:
    """How a catch-up's history reply (§7h, from ``start_seq = L``) ended, from the history
    client to the history rules. Its batches after the anchor were handed over one by one as
    they arrived (:meth:`~kvsvc.streams.history.HistoryRecovery.on_history_batch`).

    :param continuous: the first message had seq ``L`` and the anchor digest ``D``; ``False``
        ends the reply at its first message (or an empty reply), with ``reason``.
    :param messages: data messages received.
    :param wire_bytes: total bytes of all reply messages, end marker included.
    :param reason: why it was not continuous, or where it was truncated (``None`` otherwise).
    :param truncated: the reply skipped a seq (an engine's ``ROUTER`` drops messages silently
        at its send high-water mark): what was handed over is complete, the rest was not read.
    """

    continuous: bool
    messages: int
    wire_bytes: int
    reason: Optional[str] = None
    truncated: bool = False


@dataclass(frozen=True, slots=True)
class RebuildReply:
    """A rebuild's history reply (§7h, from ``start_seq = 0``), from the history client to the
    history rules.

    :param index: the private index built from the reply (not yet serving).
    :param first_seq: seq of the first data message; ``None`` for an empty reply.
    :param last_seq: seq of the last data message; ``None`` for an empty reply.
    :param last_digest: XXH3-64 of the last data message's payload; ``None`` for an empty reply.
    :param exact: the index is the engine's whole residency (the reply started at seq 0, or at
        a batch starting with an untargeted ``AllBlocksCleared``, and no block became an orphan
        after that); False: a subset.
    :param digests: ``seq -> payload digest`` of the last replayed batches (at most
        ``history_reply.DIGESTS_KEPT``), to check buffered live batches the reply covers.
    :param messages: data messages received.
    :param wire_bytes: total bytes of all reply messages, end marker included.
    :param reason: where the reply was truncated (``None`` otherwise).
    :param truncated: the reply skipped a seq after ``last_seq``: the index is complete up to
        ``last_seq`` and the rules catch up from there.
    """

    index: TierIndex
    first_seq: Optional[int]
    last_seq: Optional[int]
    last_digest: Optional[int]
    exact: bool
    digests: dict[int, int]
    messages: int
    wire_bytes: int
    reason: Optional[str] = None
    truncated: bool = False


#: What a history attempt ends with (§7h).
HistoryReply = Union[CatchUpReply, RebuildReply]
