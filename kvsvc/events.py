"""Decoded KV events (§2) as they cross from the decoder to the index, and the tier flags.

Hash values are already normalised (§2): integers as unsigned 64-bit, byte strings kept as
bytes. ``tier`` is the medium mapped to a tier flag: ``DEVICE``, ``HOST``, or ``OTHER_MEDIUM``
(0) for media that are not indexed (``storage``, ``disk``, ...; counted, not an error).

The event classes are ``slots`` dataclasses but not ``frozen``: a frozen dataclass sets each
field through ``object.__setattr__``, several times the cost of a plain one, and the decoder
builds two or three of these per live message. Treat them as read-only all the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

EngineHash = Union[int, bytes]

#: Tier flags (§5). A block's residency is ``DEVICE | HOST`` bits; 0 = not indexed medium.
OTHER_MEDIUM = 0
DEVICE = 1
HOST = 2

#: ``medium`` strings (lower-cased) to tier (§2); ``None`` (nil) means Device.
MEDIUM_TIERS = {
    "gpu": DEVICE,
    "device": DEVICE,
    "hbm": DEVICE,
    "npu": DEVICE,
    "cpu": HOST,
    "cpu_pinned": HOST,
    "host": HOST,
    "dram": HOST,
}


@dataclass(slots=True)
class BlockStored:
    """``BlockStored`` (§2, §5).

    :param block_hashes: engine hashes of the stored blocks, parent-most first.
    :param parent_block_hash: engine hash of the first block's parent, ``None`` for the root.
    :param token_ids: ``block_size * len(block_hashes)`` token ids, or empty for a tokenless
        replica event.
    :param block_size: tokens per block as sent (may be 0 in a tokenless event).
    :param tier: ``DEVICE``, ``HOST`` or ``OTHER_MEDIUM``.
    :param excluded: True when LoRA, extra keys or a non-full-attention spec make the blocks
        ineligible for the plain-text index (§3).
    :param packed_tokens: ``token_ids`` already validated and packed in the §4 byte form
        (4 bytes per id, little-endian), set by the decoder so that ingest converts each id
        once; ``None`` (events built by hand) lets the index validate and pack ``token_ids``.
        When set it must be exactly ``pack_tokens(token_ids)``; derived, so not compared.
    """

    block_hashes: Sequence[EngineHash]
    parent_block_hash: Optional[EngineHash]
    token_ids: Sequence[int]
    block_size: int
    tier: int
    excluded: bool = False
    packed_tokens: Optional[bytes] = field(default=None, compare=False)


@dataclass(slots=True)
class BlockRemoved:
    """``BlockRemoved`` (§2, §5): each hash loses ``tier`` only; removal never cascades."""

    block_hashes: Sequence[EngineHash]
    tier: int


@dataclass(slots=True)
class AllBlocksCleared:
    """``AllBlocksCleared`` (§2, §5).

    :param tier: ``None`` clears every tier (a complete state, §6); a tier flag clears only
        that tier's flags; ``OTHER_MEDIUM`` is a no-op.
    """

    tier: Optional[int] = None


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(slots=True)
class Batch:
    """One decoded MessagePack batch (§2).

    :param ts: engine timestamp, float seconds (informational).
    :param events: events, applied strictly in order.
    :param dp_rank: rank carried by the batch, ``None`` when absent (2-element form).
    """

    ts: float
    events: Sequence[Event]
    dp_rank: Optional[int]
