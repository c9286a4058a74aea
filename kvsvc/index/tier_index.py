"""The per-stream tiered prefix index (§5) and its prefix walk (§10).

One :class:`TierIndex` per stream. It has a single writer (the stream thread) and the caller
holds the stream lock around :meth:`TierIndex.apply` and :meth:`TierIndex.match`, so the index
itself takes no lock.

Representation (chosen for memory and ingest speed; no per-block Python object besides the
key ints themselves; ``bench/bench_index_micro.py`` and benchmark 5 measure it): two dict slots
and one content-key int per block, plus the engine-hash int the decoder created, which the
engine map keeps alive:

* ``_flags``: ``content key -> tier flags`` (``DEVICE | HOST``, never 0). Content keys are the
  128-bit ints of :mod:`kvsvc.index.keys`; flag values are small cached ints.
* ``_emap``: ``engine hash -> content key``. The value is the very ``int`` object used as the
  ``_flags`` key, so the mapping costs one dict slot and no second key object.
* ``_markers``: ``engine hash -> kind | flags`` for hashes that are not indexed: ``EXCLUDED``
  (§3: LoRA, extra keys, non-full-attention specs, and their children) and ``ORPHAN`` (snapshot
  blocks whose parent is unknown, and their children, §5). Markers keep tier flags like blocks,
  so a ``BlockRemoved`` deletes a marker once no flag is left; without that, markers of evicted
  blocks would leak until the stream hit its capacity (D16 in docs/decisions.md).
* ``_alias``: only for content keys reached from more than one engine hash (see below).

§5 lists a "parent key" per block; it is omitted. The content key already encodes the whole
prefix, so answers never need it, and dropping it saves a slot per block.

Aliases. Two engine hashes may carry the same content (same tokens and prefix) if an engine
hashes something kvsvc does not. Flags are per engine hash (what the engine reports) and a
content key's flags are the OR over its hashes, so removing one alias from a tier never clears a
block still resident through the other, and deleting one alias never leaves the other dangling
(D17).
To stay within the memory budget there is no reverse map ``key -> hashes``; instead an aliased
key has an entry ``_alias[key] = {hash: flags, ..., None: flags}`` where ``None`` stands for the
key's first engine hash (the single hash mapping to the key that is not listed). When only one
hash is left the entry is dropped and the key is plain again.

Prefix closure (for the query, §10). Two flags say whether residency is monotone along every
chain: ``_prefix_closed`` (every resident block's parent is resident) and ``_device_closed``
(every Device block's parent is on Device). While they hold, :meth:`TierIndex.match` bisects the
prompt's keys (~7 lookups for 128 blocks instead of up to 128). Stores keep them: a live block
needs a resident parent (else ``UnknownParent``) and a snapshot block without one becomes an
ORPHAN marker, never resident; only a Device block stored under a parent that is not on Device,
or a tokenless Device replica (parent unknown), clears ``_device_closed``. The index keeps no
parent links (they would cost a dict slot per block, over the §8 memory budget), so it cannot
tell a leaf from an inner block: any block leaving the index clears ``_prefix_closed`` and any
block leaving Device clears ``_device_closed``, until the index is rebuilt (snapshot, periodic
resync) or becomes empty. Under eviction the walk is therefore linear, as before; after each
resync it is logarithmic until the first eviction.

Capacity: :attr:`TierIndex.entries` is ``len(_emap) + len(_markers)``: every engine hash the
index remembers, so indexed blocks plus markers, an alias counting as one more entry (§8 counts
engine-map entries). It is checked after each event; the caller discards the index on any error.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from kvsvc.errors import CapacityExceeded, DecodeError, HashConflict, UnknownParent
from kvsvc.events import (
    DEVICE,
    HOST,
    OTHER_MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    Event,
)
from kvsvc.index.keys import chain_keys, pack_tokens
from kvsvc.index.changes import IndexChanges

log = logging.getLogger(__name__)

#: Both tier bits.
_TIERS = DEVICE | HOST
#: Marker kinds, stored in ``_markers`` values above the tier bits.
EXCLUDED = 4
ORPHAN = 8
_KIND_NAMES = {EXCLUDED: "EXCLUDED", ORPHAN: "ORPHAN"}


@dataclass(slots=True)
class IndexStats:
    """Counters of events and hashes the index accepted without indexing them (§2, §3, §5).

    :param not_indexed_medium: events whose tier is ``OTHER_MEDIUM`` (skipped).
    :param unknown_tokenless: hashes of tokenless replica events not in the engine map.
    :param excluded_blocks: block hashes recorded as EXCLUDED (excluded events and children of
        excluded parents), counted per stored event.
    :param orphan_blocks: block hashes recorded as ORPHAN in snapshot mode, per stored event.
    :param unknown_removals: ``BlockRemoved`` hashes the index did not know.
    """

    not_indexed_medium: int = 0
    unknown_tokenless: int = 0
    excluded_blocks: int = 0
    orphan_blocks: int = 0
    unknown_removals: int = 0


def _hash_repr(h: EngineHash) -> str:
    """Engine hash for error messages: hex for ints, hex bytes otherwise."""
    return f"{h:#x}" if isinstance(h, int) else f"bytes:{bytes(h).hex()}"


class TierIndex:
    """Per-stream index of resident blocks on the Device and Host tiers (§5).

    :param block_size: tokens per block; ``BlockStored`` events with tokens must carry it.
    :param hash_seed: XXH3 seed of the content keys (§4).
    :param max_entries: ``max_blocks_per_stream`` (§8): bound on :attr:`entries`.
    :raises ValueError: if ``block_size`` or ``max_entries`` is < 1.
    """

    __slots__ = ("block_size", "hash_seed", "max_entries", "stats", "_flags", "_emap",
                 "_markers", "_alias", "_n_device", "_n_host", "_prefix_closed",
                 "_device_closed", "_changes")

    def __init__(self, block_size: int, hash_seed: int, max_entries: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.max_entries = max_entries
        self.stats = IndexStats()
        self._flags: dict[int, int] = {}
        self._emap: dict[EngineHash, int] = {}
        self._markers: dict[EngineHash, int] = {}
        self._alias: dict[int, dict[Optional[EngineHash], int]] = {}
        self._n_device = 0
        self._n_host = 0
        # See "Prefix closure" in the module docstring: while True, match() bisects.
        self._prefix_closed = True
        self._device_closed = True
        # The collector of the apply() in progress (§16 pending overlay), None otherwise.
        self._changes: Optional[IndexChanges] = None

    # ------------------------------------------------------------------ read side

    @property
    def device_blocks(self) -> int:
        """Number of content keys resident on Device (markers not counted)."""
        return self._n_device

    @property
    def host_blocks(self) -> int:
        """Number of content keys resident on Host; a block on both tiers counts here too."""
        return self._n_host

    @property
    def entries(self) -> int:
        """Engine hashes remembered: indexed blocks (+ aliases) plus EXCLUDED/ORPHAN markers;
        the capacity count compared with ``max_entries``."""
        return len(self._emap) + len(self._markers)

    @property
    def live_flags(self) -> Mapping[int, int]:
        """The live ``content key -> tier flags`` dict itself (not a copy), for lock-free
        membership probes by query threads: a single ``key in live_flags`` is atomic under the
        GIL. Never iterate it from another thread. It is replaced (not just changed) by
        ``AllBlocksCleared``, so re-read it after every :meth:`apply`."""
        return self._flags

    def match(self, keys: Sequence[int]) -> tuple[int, int]:
        """Prefix walk (§10): the resident contiguous prefix of ``keys``.

        The answer is that of walking ``keys`` in order and stopping at the first key resident
        on neither tier. While the index is prefix-closed (module docstring) residency is
        monotone along the prompt's chain and the prefix is found by bisection, O(log n)
        lookups; otherwise the walk is linear.

        :param keys: content keys of a prompt's full blocks, oldest first (``prompt_keys``):
            each key's parent is the key before it.
        :returns: ``(device_blocks, host_only_blocks)`` of that prefix, in blocks (the caller
            multiplies by ``block_size``); a block on Device counts as device even if it is also
            on Host.
        """
        flags = self._flags
        if self._prefix_closed:
            lo, hi = 0, len(keys)
            while lo < hi:
                mid = (lo + hi) >> 1
                if keys[mid] in flags:
                    lo = mid + 1
                else:
                    hi = mid
            resident = lo
            if not self._n_host:
                return resident, 0  # no Host block at all: the whole prefix is on Device
            if self._device_closed:
                lo = 0
                while lo < hi:
                    mid = (lo + hi) >> 1
                    if flags[keys[mid]] & DEVICE:
                        lo = mid + 1
                    else:
                        hi = mid
                return lo, resident - lo
            host_only = list(map(flags.get, keys[:resident])).count(HOST)
            return resident - host_only, host_only
        get = flags.get
        device = host_only = 0
        for key in keys:
            key_flags = get(key)
            if not key_flags:
                break
            if key_flags & DEVICE:
                device += 1
            else:
                host_only += 1
        return device, host_only

    def residency(self) -> dict[int, int]:
        """A copy of ``content key -> tier flags`` (``DEVICE | HOST`` bits) of resident blocks."""
        return dict(self._flags)

    def difference(self, other: "TierIndex") -> int:
        """Number of content keys whose tier flags differ between ``self`` and ``other``,
        counting keys resident in only one of them (§6 periodic resync: silently lost events).
        """
        mine, theirs = self._flags, other._flags
        differ = sum(1 for key, flags in mine.items() if theirs.get(key) != flags)
        return differ + sum(1 for key in theirs if key not in mine)

    # ------------------------------------------------------------------ write side

    def apply(self, events: Sequence[Event], *, snapshot: bool = False,
              changes: Optional[IndexChanges] = None) -> None:
        """Apply the events of one batch, strictly in order (§5).

        :param events: decoded events (:mod:`kvsvc.events`).
        :param snapshot: True inside a snapshot (§7): a ``BlockStored`` whose parent is unknown
            makes its blocks ORPHAN markers instead of raising.
        :param changes: when given, collects the content keys the batch stored (tokenless
            Device replicas of known blocks included) or removed, and whether it cleared
            Device: what settles the stream's pending blocks (§16,
            :meth:`kvsvc.index.overlay.BlockOverlay.settle`). Markers are not collected.
        :raises DecodeError: a ``BlockStored`` with tokens whose ``block_size`` differs from the
            configured one, whose ``len(token_ids) != block_size * len(block_hashes)``, or with
            a token id outside ``[0, 2**31 - 1]``.
        :raises UnknownParent: live (``snapshot=False``) ``BlockStored`` whose parent hash is
            neither nil nor known.
        :raises HashConflict: an engine hash already mapped to a different content key, or to a
            marker where a real key is stored (or the reverse).
        :raises CapacityExceeded: :attr:`entries` would exceed ``max_entries``.

        After any of these the index content is undefined: the caller discards the index.
        """
        self._changes = changes
        try:
            self._apply(events, snapshot)
        finally:
            self._changes = None

    def _apply(self, events: Sequence[Event], snapshot: bool) -> None:
        for event in events:
            kind = type(event)
            # (`type(x) is C` is the fast dispatch; mypy narrows only isinstance.)
            if kind is BlockStored:
                self._stored(event, snapshot)  # type: ignore[arg-type]
            elif kind is BlockRemoved:
                self._removed(event)  # type: ignore[arg-type]
            elif kind is AllBlocksCleared:
                self._cleared(event.tier)
            else:
                raise DecodeError(f"not an index event: {kind.__name__}")
            if len(self._emap) + len(self._markers) > self.max_entries:
                raise CapacityExceeded()

    def _stored(self, event: BlockStored, snapshot: bool) -> None:
        """``BlockStored`` (§3, §5); see :meth:`apply` for the errors."""
        tier = event.tier
        if tier == OTHER_MEDIUM:
            # Checked first, before any validation: other media (storage connectors) may use
            # their own block sizes and are never indexed anyway (§2).
            self.stats.not_indexed_medium += 1
            return
        hashes = event.block_hashes
        if event.excluded:
            # §3: never keyed, so never validated either (hybrid models send non-full-attention
            # groups with their own block size); tokens or not, the hashes become EXCLUDED.
            self._mark(hashes, EXCLUDED, tier)
            return
        token_ids = event.token_ids
        if not token_ids:
            self._replica(hashes, tier)
            return
        block_size = self.block_size
        if event.block_size != block_size:
            raise DecodeError(f"BlockStored block_size {event.block_size} != configured "
                              f"block_size {block_size}")
        if len(token_ids) != block_size * len(hashes):
            raise DecodeError(f"BlockStored has {len(token_ids)} token ids for "
                              f"{len(hashes)} blocks of {block_size}")
        parent = event.parent_block_hash
        if parent is None:
            parent_key = None
        else:
            parent_key = self._emap.get(parent)
            if parent_key is None:
                marker = self._markers.get(parent)
                if marker is not None:
                    self._mark(hashes, marker & ~_TIERS, tier)
                elif snapshot:
                    self._mark(hashes, ORPHAN, tier)
                else:
                    raise UnknownParent(f"BlockStored parent {_hash_repr(parent)} is unknown")
                return
            if tier == DEVICE and not self._flags.get(parent_key, 0) & DEVICE:
                # A Device block under a Host-only parent: Device residency is no longer
                # monotone along chains. (Later blocks of the event have their predecessor,
                # stored on the same tier just before them, as parent.)
                self._device_closed = False
        packed = event.packed_tokens
        if packed is None:
            try:
                packed = pack_tokens(token_ids)
            except ValueError as exc:
                raise DecodeError(f"BlockStored {exc}") from exc
        keys = chain_keys(packed, block_size, self.hash_seed, parent_key)
        if self._changes is not None:
            self._changes.keys.extend(keys)

        flags_map, emap, markers = self._flags, self._emap, self._markers
        added = 0
        for h, key in zip(hashes, keys):
            old_key = emap.get(h)
            if old_key is None:
                if markers and h in markers:
                    raise HashConflict(f"engine hash {_hash_repr(h)} is "
                                       f"{_KIND_NAMES[markers[h] & ~_TIERS]}, "
                                       "now stored with a content key")
                old = flags_map.get(key)
                if old is None:
                    # The common case: a new block under a new hash (one int object shared by
                    # both maps).
                    flags_map[key] = tier
                    emap[h] = key
                    added += 1
                else:
                    self._add_alias(h, key, old, tier)
            elif old_key == key:
                self._set_flag(h, old_key, tier)
            else:
                raise HashConflict(f"engine hash {_hash_repr(h)} already maps to another "
                                   "content key")
        if tier == DEVICE:
            self._n_device += added
        else:
            self._n_host += added

    def _replica(self, hashes: Sequence[EngineHash], tier: int) -> None:
        """Tokenless ``BlockStored`` (§5): known hashes (blocks or markers) gain ``tier``."""
        emap, markers = self._emap, self._markers
        for h in hashes:
            key = emap.get(h)
            if key is not None:
                if tier == DEVICE and not self._flags[key] & DEVICE:
                    self._device_closed = False  # its parent's tiers are not known here
                if self._changes is not None:
                    self._changes.keys.append(key)
                self._set_flag(h, key, tier)
            elif h in markers:
                markers[h] |= tier
            else:
                self.stats.unknown_tokenless += 1

    def _mark(self, hashes: Sequence[EngineHash], kind: int, tier: int) -> None:
        """Record ``hashes`` as ``kind`` markers (EXCLUDED or ORPHAN) resident on ``tier``.

        A hash that already is a marker keeps its flags, gains ``tier`` and takes ``kind`` (both
        kinds mean "never a hit", so a change of kind is not worth a recovery).

        :raises HashConflict: a hash already mapped to a content key.
        """
        emap, markers = self._emap, self._markers
        for h in hashes:
            if h in emap:
                raise HashConflict(f"engine hash {_hash_repr(h)} maps to a content key, now "
                                   f"stored as {_KIND_NAMES[kind]}")
            markers[h] = kind | (markers.get(h, 0) & _TIERS) | tier
        if kind == EXCLUDED:
            self.stats.excluded_blocks += len(hashes)
        else:
            self.stats.orphan_blocks += len(hashes)

    def _count(self, old: int, new: int) -> None:
        """Adjust the resident counts for a content key going from ``old`` to ``new`` flags."""
        self._n_device += (new & DEVICE) - (old & DEVICE)
        self._n_host += ((new & HOST) - (old & HOST)) >> 1

    def _set_flag(self, h: EngineHash, key: int, tier: int) -> None:
        """Known hash ``h`` (mapped to ``key``) gains ``tier``; idempotent (presence flags)."""
        slots = self._alias.get(key)
        if slots is not None:
            slot = h if h in slots else None
            slots[slot] |= tier
        old = self._flags[key]
        new = old | tier
        if new != old:
            self._flags[key] = new
            self._count(old, new)

    def _add_alias(self, h: EngineHash, key: int, old: int, tier: int) -> None:
        """New hash ``h`` whose content ``key`` is already indexed under another hash."""
        slots = self._alias.get(key)
        if slots is None:
            # Before this, exactly one engine hash mapped to ``key``: it becomes the ``None``
            # slot and keeps the flags it alone contributed.
            self._alias[key] = {None: old, h: tier}
        else:
            slots[h] = tier
        self._emap[h] = key
        new = old | tier
        if new != old:
            self._flags[key] = new
            self._count(old, new)

    def _removed(self, event: BlockRemoved) -> None:
        """``BlockRemoved`` (§5): each known hash loses ``tier`` only; never cascades."""
        tier = event.tier
        if tier == OTHER_MEDIUM:
            self.stats.not_indexed_medium += 1
            return
        keep = _TIERS & ~tier
        flags_map, emap, markers, alias = self._flags, self._emap, self._markers, self._alias
        n_device, n_host = self._n_device, self._n_host
        resident_before = len(flags_map)
        changed = self._changes.keys if self._changes is not None else None
        for h in event.block_hashes:
            key = emap.get(h)
            if changed is not None and key is not None:
                changed.append(key)
            if key is None:
                marker = markers.get(h)
                if marker is None:
                    self.stats.unknown_removals += 1
                elif marker & keep:
                    markers[h] = marker & ~tier
                else:
                    del markers[h]
                continue
            old = flags_map[key]
            # Aliases are rare: skip the lookup while there is none.
            slots = alias.get(key) if alias else None
            if slots is None:
                new = old & keep
                if new:
                    flags_map[key] = new
                else:
                    del flags_map[key]
                    del emap[h]
            else:
                new = self._remove_alias_flag(h, key, slots, keep)
            # Counts kept in locals: one attribute write per event, not per block.
            n_device += (new & DEVICE) - (old & DEVICE)
            n_host += ((new & HOST) - (old & HOST)) >> 1
        if not flags_map:
            # Empty again: trivially prefix-closed.
            self._prefix_closed = self._device_closed = True
        else:
            # Without parent links the index cannot tell a leaf from an inner block, so any
            # block leaving a tier may have left a resident child behind it.
            if len(flags_map) < resident_before:
                self._prefix_closed = False
            if n_device < self._n_device:
                self._device_closed = False
        self._n_device, self._n_host = n_device, n_host

    def _remove_alias_flag(self, h: EngineHash, key: int,
                           slots: dict[Optional[EngineHash], int], keep: int) -> int:
        """``h`` of aliased ``key`` keeps only ``keep`` bits; returns the key's new flags."""
        slot = h if h in slots else None
        hash_flags = slots[slot] & keep
        if hash_flags:
            slots[slot] = hash_flags
        else:
            del slots[slot]
            del self._emap[h]
        new = 0
        for flags in slots.values():
            new |= flags
        if len(slots) <= 1:
            # One hash left (or none): it is the only one mapping to ``key`` now.
            del self._alias[key]
        if new:
            self._flags[key] = new
        else:
            del self._flags[key]
        return new

    def _cleared(self, tier: Optional[int]) -> None:
        """``AllBlocksCleared`` (§5): drop everything, or only ``tier``'s flags."""
        if self._changes is not None:
            self._changes.note_cleared(tier)
        if tier is None:
            self._flags = {}
            self._emap = {}
            self._markers = {}
            self._alias = {}
            self._n_device = self._n_host = 0
            self._prefix_closed = self._device_closed = True
            log.debug("index cleared: all tiers")
            return
        if tier == OTHER_MEDIUM:
            self.stats.not_indexed_medium += 1
            return
        keep = _TIERS & ~tier
        # Rebuilding is O(n) like an in-place sweep, but leaves compact dicts behind.
        old_alias = self._alias
        new_alias: dict[int, dict[Optional[EngineHash], int]] = {}
        for key, slots in old_alias.items():
            kept = {slot: f & keep for slot, f in slots.items() if f & keep}
            if len(kept) > 1:
                new_alias[key] = kept
        flags_map = {key: f & keep for key, f in self._flags.items() if f & keep}
        if old_alias:
            emap = {}
            for h, key in self._emap.items():
                alias_slots = old_alias.get(key)
                if alias_slots is None:
                    if key in flags_map:
                        emap[h] = key
                elif alias_slots[h if h in alias_slots else None] & keep:
                    emap[h] = key
        else:
            emap = {h: key for h, key in self._emap.items() if key in flags_map}
        self._markers = {h: m & ~tier for h, m in self._markers.items() if m & keep}
        if len(flags_map) < len(self._flags):
            self._prefix_closed = not flags_map
        if tier == DEVICE:
            self._device_closed = True  # no Device block is left
        self._flags, self._emap, self._alias = flags_map, emap, new_alias
        # Every block left now carries exactly the other tier's flag.
        if tier == DEVICE:
            self._n_device, self._n_host = 0, len(flags_map)
        else:
            self._n_device, self._n_host = len(flags_map), 0
        log.debug("index cleared tier %d: %d blocks left", tier, len(flags_map))
