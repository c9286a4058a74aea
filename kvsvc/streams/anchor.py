"""The continuity anchor of a history-mode stream (§7h) and the complete-state rule (§6).

Pure values, no I/O: the rules modules (:mod:`kvsvc.streams.recovery`,
:mod:`kvsvc.streams.history`) and the history reply checks (:mod:`kvsvc.streams.history_reply`)
share them, so each rule is written once.

- :func:`starts_cleared`: a batch whose first event is an untargeted ``AllBlocksCleared``
  carries a complete state by itself (§6; §7h: a subset becomes exact on it).
- :class:`Anchor`: ``L`` (the last applied seq, as ``expected = L + 1``), ``D`` (the XXH3-64
  digest of batch ``L``'s payload) and the digests of the last :data:`RECENT_DIGESTS` applied
  batches. :meth:`Anchor.judge` says once what a batch ``(seq, digest)`` is to the index that
  holds the anchor: :class:`Judgement` ``CONTIGUOUS``, ``DUPLICATE``, ``RESTARTED`` or ``GAP``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from kvsvc.events import AllBlocksCleared, Event

#: Digests of the last applied batches kept (seq -> digest) to tell a duplicate from a
#: restarted engine's batch with the same seq (D9 in docs/decisions.md).
RECENT_DIGESTS = 1024


def starts_cleared(events: Sequence[Event]) -> bool:
    """The batch starts with an untargeted ``AllBlocksCleared``: a complete state by itself
    (§6: an unsynchronized stream may synchronize from it; §7h: a subset becomes exact). Only an
    untargeted clear: a clear of one tier does not describe the other (D15 in docs/decisions.md)."""
    return bool(events) and type(events[0]) is AllBlocksCleared and events[0].tier is None


class Judgement(enum.Enum):
    """What a batch ``(seq, digest)`` is to an index holding an :class:`Anchor` (§7h)."""

    #: ``seq == L + 1`` (or any seq while the next seq is unknown): apply it.
    CONTIGUOUS = "contiguous"
    #: An older seq whose payload digest is the one applied: drop it.
    DUPLICATE = "duplicate"
    #: An older seq with another payload: the engine restarted (its counter began again).
    RESTARTED = "restarted"
    #: ``seq > L + 1``: batches are missing.
    GAP = "gap"


@dataclass(slots=True)
class Anchor:
    """``L``/``D`` of an index and the digests of its last applied batches (§7h).

    :ivar expected: ``L + 1``, the next seq the index needs; ``None``: unknown (after an empty
        rebuild reply, or an empty live-only index: the first live batch decides, §7h).
    :ivar digest: ``D``, the digest of batch ``L``; ``None`` while unknown.
    :ivar recent: ``seq -> digest`` of the last :data:`RECENT_DIGESTS` applied batches.
    """

    expected: Optional[int] = None
    digest: Optional[int] = None
    recent: dict[int, int] = field(default_factory=dict)

    @classmethod
    def at(cls, sequence: Optional[int], digest: Optional[int],
           digests: Mapping[int, int]) -> "Anchor":
        """The anchor of an index holding every batch up to ``sequence`` (``None``: unknown)
        whose last payload digest is ``digest``; ``digests`` are the known digests of earlier
        batches (those within :data:`RECENT_DIGESTS` of ``sequence`` are kept)."""
        recent = {s: d for s, d in digests.items()
                  if sequence is None or s > sequence - RECENT_DIGESTS}
        if sequence is not None and digest is not None:
            recent[sequence] = digest
        return cls(None if sequence is None else sequence + 1, digest, recent)

    @property
    def last(self) -> Optional[tuple[int, int]]:
        """``(L, D)``; ``None`` while either is unknown."""
        if self.expected is None or self.digest is None:
            return None
        return self.expected - 1, self.digest

    def judge(self, seq: int, digest: int, *,
              unknown: Judgement = Judgement.RESTARTED) -> Judgement:
        """What batch ``seq`` with payload digest ``digest`` is to this index (one judgement
        for every place that asks, §7h).

        :param unknown: the answer for an older seq whose digest is no longer (or never was)
            known: ``RESTARTED`` for a live batch (no proof it is the batch applied: recover),
            ``DUPLICATE`` for a batch a replay reply already covers (the reply is the proof).
        """
        expected = self.expected
        if expected is None or seq == expected:
            return Judgement.CONTIGUOUS
        if seq > expected:
            return Judgement.GAP
        known = self.recent.get(seq)
        if known is None:
            return unknown
        return Judgement.DUPLICATE if known == digest else Judgement.RESTARTED

    def advance(self, seq: int, digest: int) -> None:
        """Batch ``seq`` (digest ``digest``) was applied: it is ``L`` now."""
        self.expected = seq + 1
        self.digest = digest
        recent = self.recent
        recent[seq] = digest
        recent.pop(seq - RECENT_DIGESTS, None)
