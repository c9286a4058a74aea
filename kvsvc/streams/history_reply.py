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
"""

from __future__ import annotations

from typing import Optional, Union

from kvsvc.errors import SnapshotError
from kvsvc.index.tier_index import TierIndex
from kvsvc.streams.state import CatchUpReply, RebuildReply

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
