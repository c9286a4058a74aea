"""The rules of one history reply (§7h): order, continuity, truncation and exactness, without
sockets. The history client (:mod:`kvsvc.streams.history_client`) only collects the reply's
messages and builds a rebuild's index; it asks these checks what each message means.

Per data message ``(seq, digest)``:

- seqs must be contiguous, ``prev + 1``: a repeat or a jump backwards is a malformed reply
  (:class:`~kvsvc.errors.SnapshotError`). A skipped seq ends the reply early as *truncated*:
  an engine's buffer is contiguous, but its ``ROUTER`` silently drops messages at its send
  high-water mark (libzmq's default, 1000) when it sends a long reply faster than its I/O
  thread writes it; what arrived before the hole is complete, and the recovery rules catch up
  from its last seq instead of starting over (D7 in docs/decisions.md).
- **Catch-up** (:class:`CatchUpCheck`, from ``start_seq = L`` with anchor digest ``D``): the
  first message must be seq ``L`` with digest ``D`` (:data:`PROVEN`); otherwise (another seq,
  another digest, an empty reply) the reply ends at once, not continuous. Each later message is
  a :data:`BATCH` for the recovery rules, applied like a live delta.
- **Rebuild** (:class:`RebuildCheck`, from 0): every message is built into the private index.
  The index is ``exact`` when the reply started at seq 0, or a batch starting with an untargeted
  ``AllBlocksCleared`` made it complete, and no block became an orphan after that point (D8); the
  digests of the last :data:`DIGESTS_KEPT` batches are kept to check the buffered live batches
  the reply covers.

At the end of a reply the live batches buffered meanwhile are merged by pure functions:
:func:`merge_rebuild` (into the rebuild's private index) and :func:`merge_catch_up` (which of
them follow a catch-up, judged by the kept index's :class:`~kvsvc.streams.anchor.Anchor`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

from kvsvc.errors import SnapshotError, StreamError
from kvsvc.events import Batch, Event
from kvsvc.index.tier_index import TierIndex
from kvsvc.streams.anchor import Anchor, Judgement, starts_cleared
from kvsvc.streams.state import CatchUpReply, Completeness, RebuildReply

EXACT, SUBSET = Completeness.EXACT, Completeness.SUBSET
DUPLICATE, RESTARTED, GAP = Judgement.DUPLICATE, Judgement.RESTARTED, Judgement.GAP
#: A live batch buffered during an attempt: (seq, batch, payload digest).
Buffered = tuple[int, Batch, int]

#: Digests of the last replayed batches a rebuild keeps (seq -> digest), to check buffered live
#: batches that the reply covers (they must be the same batches, §7h "deduplicate by seq").
DIGESTS_KEPT = 1024

#: :meth:`CatchUpCheck.message`: the anchor itself (seq ``L``, digest ``D``), already applied.
PROVEN = "proven"
#: :meth:`CatchUpCheck.message`: a batch after the anchor, for the recovery rules.
BATCH = "batch"


class ReplyOrder:
    """Contiguous seqs within one reply (see the module docstring).

    :ivar first_seq: seq of the first data message (``None`` before one).
    :ivar last_seq: seq of the last data message accepted (``None`` before one).
    :ivar last_digest: its payload digest.
    :ivar messages: data messages accepted.
    """

    def __init__(self) -> None:
        self.first_seq: Optional[int] = None
        self.last_seq: Optional[int] = None
        self.last_digest: Optional[int] = None
        self.messages = 0

    def accept(self, seq: Optional[int], digest: int) -> Optional[str]:
        """Take data message ``seq`` (``None``: the seq ``0xFFFFFFFFFFFFFFFF``).

        :returns: ``None`` when accepted; the truncation reason when it skips seqs (the
            message is then not accepted and the reply ends).
        :raises SnapshotError: the seq is ``0xFFFFFFFFFFFFFFFF``, a repeat or a jump backwards.
        """
        if seq is None:
            raise SnapshotError("history reply: a data message has seq 0xFFFFFFFFFFFFFFFF")
        last = self.last_seq
        if last is not None and seq != last + 1:
            if seq > last + 1:
                return f"history reply skipped from seq {last} to {seq}"
            what = "repeated" if seq == last else "went backwards"
            raise SnapshotError(f"history reply seq {what}: seq {seq} after {last}")
        self.messages += 1
        if last is None:
            self.first_seq = seq
        self.last_seq = seq
        self.last_digest = digest
        return None


class CatchUpCheck(ReplyOrder):
    """The reply of a catch-up from ``start_seq = L`` proven by ``anchor_digest = D`` (§7h).

    :param start_seq: ``L``.
    :param anchor_digest: ``D``.
    """

    def __init__(self, start_seq: int, anchor_digest: int) -> None:
        super().__init__()
        self.start_seq = start_seq
        self.anchor_digest = anchor_digest

    def message(self, seq: Optional[int], digest: int,
                wire_bytes: int) -> Union[str, CatchUpReply]:
        """Data message ``seq`` with payload ``digest``; ``wire_bytes``: the reply's bytes so
        far, this message included.

        :returns: :data:`PROVEN` (the anchor), :data:`BATCH` (apply it), or the
            :class:`CatchUpReply` that ends the reply (not continuous, or truncated).
        :raises SnapshotError: as :meth:`ReplyOrder.accept`.
        """
        hole = self.accept(seq, digest)
        if hole is not None:
            return self.reply(wire_bytes, True, hole, truncated=True)
        if self.messages > 1:
            return BATCH
        if seq != self.start_seq:
            return self.reply(wire_bytes, False, f"reply starts at seq {seq}, not at the anchor "
                                                 f"seq {self.start_seq}")
        if digest != self.anchor_digest:
            return self.reply(wire_bytes, False, f"seq {seq} has another payload digest than "
                                                 "the batch applied (the engine restarted)")
        return PROVEN

    def end(self, wire_bytes: int) -> CatchUpReply:
        """The end marker arrived (``wire_bytes``: the whole reply's bytes)."""
        if self.messages == 0:
            return self.reply(wire_bytes, False, f"empty reply (no batch from seq "
                                                 f"{self.start_seq} on: the engine restarted or "
                                                 "its buffer rolled past it)")
        return self.reply(wire_bytes, True)

    def reply(self, wire_bytes: int, continuous: bool, reason: Optional[str] = None,
              truncated: bool = False) -> CatchUpReply:
        """The :class:`CatchUpReply` with what was received."""
        return CatchUpReply(continuous, self.messages, wire_bytes, reason, truncated)


class RebuildCheck(ReplyOrder):
    """The reply of a rebuild from seq 0 (§7h): order, exactness and the digests kept."""

    def __init__(self) -> None:
        super().__init__()
        self._exact = False
        self._orphans_at_exact = 0
        self.digests: dict[int, int] = {}

    def message(self, seq: Optional[int], digest: int) -> Optional[str]:
        """Data message ``seq`` with payload ``digest``, to be built into the index.

        :returns: ``None`` (build it), or the truncation reason (the reply ends before it).
        :raises SnapshotError: as :meth:`ReplyOrder.accept`.
        """
        hole = self.accept(seq, digest)
        if hole is not None:
            return hole
        assert seq is not None
        if self.messages == 1:
            self._exact = seq == 0
        digests = self.digests
        digests[seq] = digest
        digests.pop(seq - DIGESTS_KEPT, None)
        return None

    def cleared(self, orphans: int) -> None:
        """The message just accepted starts with an untargeted ``AllBlocksCleared``: everything
        before is gone, the index is the whole residency from here on (``orphans``: the
        index's orphan count before the batch)."""
        self._exact = True
        self._orphans_at_exact = orphans

    def reply(self, index: TierIndex, wire_bytes: int, reason: Optional[str] = None,
              truncated: bool = False) -> RebuildReply:
        """The :class:`RebuildReply` of what was built into ``index``."""
        exact = self._exact and index.stats.orphan_blocks == self._orphans_at_exact
        return RebuildReply(index, self.first_seq, self.last_seq, self.last_digest, exact,
                            self.digests, self.messages, wire_bytes, reason, truncated)


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
                  buffered: Sequence[Buffered]) -> Union[RebuildMerge, SnapshotError]:
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


@dataclass(frozen=True, slots=True)
class CatchUpMerge:
    """What follows a catch-up (:func:`merge_catch_up`).

    :param apply: the buffered batches to apply to the kept index, in order.
    :param restarted: a buffered seq whose digest differs from the batch the index holds (the
        engine restarted: discard, rebuild), checked after ``apply``; ``None``: none.
    :param gap: the first buffered seq after a hole (published after the reply and lost on the
        way: catch up again after ``apply``); ``None``: none.
    """

    apply: list[Buffered]
    restarted: Optional[int] = None
    gap: Optional[int] = None


def merge_catch_up(anchor: Anchor, buffered: Sequence[Buffered]) -> CatchUpMerge:
    """Which of the live batches ``(seq, batch, digest)`` buffered during a catch-up follow it
    (§7h), judged by the kept index's ``anchor`` (not changed: a copy moves on): those the
    reply covers are duplicates (by digest; unknown ones too) and dropped; the rest must follow
    contiguously. The first batch that differs from the one held (``restarted``) or comes after
    a hole (``gap``) ends the merge."""
    moving = Anchor(anchor.expected, anchor.digest, dict(anchor.recent))
    out: list[Buffered] = []
    for item in buffered:
        seq, _, digest = item
        judged = moving.judge(seq, digest, unknown=DUPLICATE)
        if judged is DUPLICATE:
            continue
        if judged is RESTARTED:
            return CatchUpMerge(out, restarted=seq)
        if judged is GAP:
            return CatchUpMerge(out, gap=seq)
        out.append(item)
        moving.advance(seq, digest)
    return CatchUpMerge(out)
