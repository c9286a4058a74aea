"""What one applied batch changed in a stream's index, for the stream's pending blocks (§16).

Apart from :mod:`kvsvc.index.overlay` (which takes locks) so that the index, and the recovery
rules that build indexes, stay free of threading.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from kvsvc.events import DEVICE


@dataclass(slots=True)
class IndexChanges:
    """What one applied batch changed in a stream's index, for the pending overlay (§16):
    collected by :meth:`kvsvc.index.tier_index.TierIndex.apply` when it is given one.

    :ivar keys: content keys stored or removed by the batch (in event order, repeats allowed).
    :ivar cleared: the batch cleared Device (an ``AllBlocksCleared`` without medium or of
        Device): every pending block is covered.
    """

    keys: list[int] = field(default_factory=list)
    cleared: bool = False

    def reset(self) -> None:
        """Empty again, for the next batch (one collector per stream, reused)."""
        self.keys.clear()
        self.cleared = False

    def note_cleared(self, tier: Optional[int]) -> None:
        """An ``AllBlocksCleared`` of ``tier`` (``None``: every tier) was applied."""
        if tier is None or tier == DEVICE:
            self.cleared = True
