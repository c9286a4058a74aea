"""The prefix cache of one simulated DP rank: a Device pool and an optional Host pool of
full blocks, with the events a real engine (vLLM / xLLM) would publish for every change.

No threads, no sockets, no locks: :class:`BlockManager` is driven by its owner
(:class:`kvsvc.testbed.sim.engine.SimEngine`), which serialises every call under the rank's lock.

Model (what the events describe, §2, §5):

- A block is ``block_size`` token ids. Its engine hash is :func:`chain_hash` of its parent's hash
  and its tokens, so equal prefixes always give equal hashes (published as a u64 int).
- **Device** holds at most ``device_blocks`` blocks and is prefix-closed: a block is evicted only
  when no child of it is on Device ("parents kept while children are cached"), least recently
  used first. Blocks of the request being executed are pinned (referenced) and never evicted.
- **Host** (``host_blocks > 0``) is fed by Device evictions (offload): the evicted block is first
  published as a tokenless ``BlockStored`` medium ``cpu`` (the service still knows its hash, §5
  replica form), then ``BlockRemoved`` medium ``gpu``, so it never leaves both tiers on the wire.
  Host evicts least recently used blocks that are also on Device or have no resident child.
- Every resident block's parent is resident on some tier, so a snapshot never holds an orphan
  and a prefix walk over the published state equals the ground truth (§10). If no Host room can
  be made, the Device-evicted block is dropped together with its Host-only descendants.
- Executing a request walks its full blocks: Device hits, then Host-only hits (loaded back to
  Device; the Host copy stays), then missing blocks (stored on Device). The loaded and stored
  blocks form one contiguous chain and are published as ONE ``BlockStored`` medium ``gpu`` with
  tokens, after the eviction events they caused. The trailing partial block is never stored. A
  request with more full blocks than the Device pool can take (everything else pinned) stores
  only the leading blocks that fit and stops at the first one that does not.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional, Sequence

import xxhash

from kvsvc.events import DEVICE, HOST

#: Every event map carries all §2 fields; these are the plain-text values (§3: indexed).
FULL_ATTENTION = "full_attention"


def chain_hash(parent: Optional[int], tokens: Sequence[int]) -> int:
    """Engine hash of one block: ``xxh3_64(parent as 8 bytes LE || tokens as u32 LE)``.

    The root block (``parent is None``) hashes its tokens alone. This is the simulated engine's
    own opaque id (§2 "engine hash"); kvsvc never uses it as a content key (§4).

    :param parent: the parent block's engine hash (u64) or ``None`` for the first block.
    :param tokens: the block's ``block_size`` token ids, each in ``[0, 2**32)``.
    :returns: unsigned 64-bit int.
    """
    data = struct.pack(f"<{len(tokens)}I", *tokens)
    if parent is not None:
        data = parent.to_bytes(8, "little") + data
    return xxhash.xxh3_64_intdigest(data)


def stored_event(hashes: list[int], parent: Optional[int], tokens: list[int], block_size: int,
                 medium: str) -> dict:
    """A ``BlockStored`` map in the xLLM form with all §2 fields (plain text, §3).

    :param hashes: engine hashes, parent-most first.
    :param parent: engine hash of the first block's parent, ``None`` for the root.
    :param tokens: ``block_size * len(hashes)`` token ids, or ``[]`` for a tokenless replica.
    :param medium: ``"gpu"`` or ``"cpu"``.
    """
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
        "extra_keys": None,
        "group_idx": None,
        "kv_cache_spec_kind": FULL_ATTENTION,
    }


def removed_event(hashes: list[int], medium: str) -> dict:
    """A ``BlockRemoved`` map in the xLLM form with all §2 fields."""
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, "group_idx": None}


@dataclass(slots=True, eq=False)
class _Block:
    hash: int
    parent: Optional[int]
    tokens: tuple[int, ...]
    on_device: bool = False
    on_host: bool = False
    device_children: int = 0
    # Resident children on any tier (the union tree), for closure and cascades.
    children: set[int] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class SnapshotBlock:
    """One resident block as a snapshot lists it (§7), parents before children.

    :param hash: engine hash (u64).
    :param parent: parent engine hash or ``None`` for a root.
    :param tokens: the block's ``block_size`` token ids.
    :param tiers: ``DEVICE | HOST`` bits.
    """

    hash: int
    parent: Optional[int]
    tokens: tuple[int, ...]
    tiers: int


@dataclass(frozen=True, slots=True)
class Execution:
    """What one request did to the cache (internal to the sim; the engine adds rank and seq).

    :param events: the §2 event maps to publish as one batch, in order (may be empty).
    :param device_hit_tokens: prefix tokens found on Device before execution.
    :param host_only_hit_tokens: prefix tokens found only on Host before execution.
    :param stored_blocks: new blocks stored on Device (Host loads not counted).
    :param loaded_blocks: Host-only blocks loaded back to Device.
    """

    events: list[dict]
    device_hit_tokens: int
    host_only_hit_tokens: int
    stored_blocks: int
    loaded_blocks: int


class BlockManager:
    """The two-tier prefix cache of one DP rank (see the module docstring for the model).

    :param block_size: tokens per block (>= 1).
    :param device_blocks: Device pool size in blocks (>= 1).
    :param host_blocks: Host pool size in blocks (0 disables the Host tier).
    :raises ValueError: a size out of range.
    """

    def __init__(self, block_size: int = 128, device_blocks: int = 4096, host_blocks: int = 0) -> None:
        if block_size < 1 or device_blocks < 1 or host_blocks < 0:
            raise ValueError(f"bad sizes: block_size={block_size} device_blocks={device_blocks} "
                             f"host_blocks={host_blocks}")
        self.block_size = block_size
        self.device_capacity = device_blocks
        self.host_capacity = host_blocks
        self._blocks: dict[int, _Block] = {}
        # Oldest first. Touch order puts parents after children, so old leaves come first.
        self._device_lru: OrderedDict[int, None] = OrderedDict()
        self._host_lru: OrderedDict[int, None] = OrderedDict()

    # ---- queries -------------------------------------------------------------------------

    @property
    def device_count(self) -> int:
        """Blocks resident on Device."""
        return len(self._device_lru)

    @property
    def host_count(self) -> int:
        """Blocks resident on Host (a block on both tiers counts here too)."""
        return len(self._host_lru)

    def _walk(self, token_ids: Sequence[int]) -> tuple[list[_Block], list[tuple[int, tuple[int, ...]]]]:
        """Split the full blocks of ``token_ids`` into the resident prefix and the rest
        (``(hash, tokens)`` of every full block after the prefix)."""
        bs = self.block_size
        prefix: list[_Block] = []
        rest: list[tuple[int, tuple[int, ...]]] = []
        parent: Optional[int] = None
        for i in range(len(token_ids) // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(parent, tokens)
            if not rest:
                b = self._blocks.get(h)
                if b is not None:
                    prefix.append(b)
                    parent = h
                    continue
            rest.append((h, tokens))
            parent = h
        return prefix, rest

    def true_prefix(self, token_ids: Sequence[int]) -> tuple[int, int]:
        """Ground truth of §10 for ``token_ids``: contiguous full blocks from the first one,
        stopping at the first block on neither tier; a block on Device counts as Device.

        :returns: ``(device_hit_tokens, host_only_hit_tokens)``, multiples of ``block_size``.
        """
        prefix, _ = self._walk(token_ids)
        dev = sum(1 for b in prefix if b.on_device)
        return dev * self.block_size, (len(prefix) - dev) * self.block_size

    def resident(self) -> dict[int, int]:
        """Every resident block: ``{engine hash: DEVICE | HOST bits}``."""
        return {h: (DEVICE if b.on_device else 0) | (HOST if b.on_host else 0)
                for h, b in self._blocks.items()}

    def snapshot(self) -> list[SnapshotBlock]:
        """The current residency, parents before children (depth-first from the roots)."""
        out: list[SnapshotBlock] = []
        stack = [b for b in self._blocks.values() if b.parent is None]
        stack.reverse()
        while stack:
            b = stack.pop()
            out.append(SnapshotBlock(b.hash, b.parent, b.tokens,
                                     (DEVICE if b.on_device else 0) | (HOST if b.on_host else 0)))
            stack.extend(self._blocks[c] for c in sorted(b.children, reverse=True))
        return out

    # ---- mutation ------------------------------------------------------------------------

    def clear(self) -> None:
        """Forget everything without events (a new engine process starts empty)."""
        self._blocks.clear()
        self._device_lru.clear()
        self._host_lru.clear()

    def execute(self, token_ids: Sequence[int]) -> Execution:
        """Run one request through the cache (see the module docstring).

        :param token_ids: the prompt; only its full blocks are cached.
        :returns: the hits seen before execution and the events of the change.
        """
        bs = self.block_size
        prefix, rest = self._walk(token_ids)
        events: list[dict] = []
        device_prefix = [b for b in prefix if b.on_device]
        # Device closure makes Device hits a leading run; the rest of the prefix is Host-only.
        host_only = prefix[len(device_prefix):]
        result_dev = len(device_prefix) * bs
        result_host = len(host_only) * bs
        pinned: set[int] = {b.hash for b in prefix}
        run: list[_Block] = []
        run_parent = device_prefix[-1].hash if device_prefix else None
        loaded = stored = 0
        for b in host_only:
            if not self._make_device_room(pinned, events):
                break
            self._put_device(b)
            run.append(b)
            loaded += 1
        else:
            for h, tokens in rest:
                if not self._make_device_room(pinned, events):
                    break
                parent = run[-1].hash if run else run_parent
                b = _Block(h, parent, tokens)
                self._blocks[h] = b
                if parent is not None:
                    self._blocks[parent].children.add(h)
                self._put_device(b)
                pinned.add(h)
                run.append(b)
                stored += 1
        if run:
            events.append(stored_event([b.hash for b in run], run_parent,
                                       [t for b in run for t in b.tokens], bs, "gpu"))
        # Touch leaf first so that parents end up more recent than their children.
        for b in reversed(device_prefix + run):
            self._device_lru.move_to_end(b.hash)
        for b in reversed(host_only):
            if b.on_host:
                self._host_lru.move_to_end(b.hash)
        return Execution(events, result_dev, result_host, stored, loaded)

    def _put_device(self, b: _Block) -> None:
        b.on_device = True
        self._device_lru[b.hash] = None
        if b.parent is not None:
            self._blocks[b.parent].device_children += 1

    def _make_device_room(self, pinned: set[int], events: list[dict]) -> bool:
        """Evict one Device block if the pool is full. False when nothing can be evicted."""
        if len(self._device_lru) < self.device_capacity:
            return True
        victim = None
        for h in self._device_lru:
            if h not in pinned and self._blocks[h].device_children == 0:
                victim = self._blocks[h]
                break
        if victim is None:
            return False
        del self._device_lru[victim.hash]
        victim.on_device = False
        if victim.parent is not None:
            self._blocks[victim.parent].device_children -= 1
        if victim.on_host:
            events.append(removed_event([victim.hash], "gpu"))
        elif self.host_capacity > 0 and self._make_host_room(pinned, events):
            # Replica first, removal second: on the wire the block never leaves both tiers.
            victim.on_host = True
            self._host_lru[victim.hash] = None
            events.append(stored_event([victim.hash], victim.parent, [], self.block_size, "cpu"))
            events.append(removed_event([victim.hash], "gpu"))
        else:
            events.append(removed_event([victim.hash], "gpu"))
            self._drop(victim, events)
        return True

    def _make_host_room(self, pinned: set[int], events: list[dict]) -> bool:
        """Evict one Host block if the Host pool is full. False when nothing can be evicted."""
        if len(self._host_lru) < self.host_capacity:
            return True
        for h in self._host_lru:
            b = self._blocks[h]
            if h not in pinned and (b.on_device or not b.children):
                del self._host_lru[h]
                b.on_host = False
                events.append(removed_event([h], "cpu"))
                if not b.on_device:
                    self._drop(b, events)
                return True
        return False

    def _drop(self, b: _Block, events: list[dict]) -> None:
        """Delete a block that is on no tier, and its resident descendants (Host-only by
        Device closure), publishing their removals: nothing resident is ever orphaned."""
        del self._blocks[b.hash]
        if b.parent is not None:
            self._blocks[b.parent].children.discard(b.hash)
        stack = list(b.children)
        while stack:
            d = self._blocks.pop(stack.pop())
            for tier_on, lru, medium in ((d.on_device, self._device_lru, "gpu"),
                                         (d.on_host, self._host_lru, "cpu")):
                if tier_on:
                    del lru[d.hash]
                    events.append(removed_event([d.hash], medium))
            stack.extend(d.children)

    def check_invariants(self) -> None:
        """Assert the model's invariants (tests and debugging).

        :raises AssertionError: a broken invariant, naming it.
        """
        assert len(self._device_lru) <= self.device_capacity, "device over capacity"
        assert len(self._host_lru) <= self.host_capacity, "host over capacity"
        for h, b in self._blocks.items():
            assert b.on_device or b.on_host, f"{h:#x} on no tier"
            assert b.on_device == (h in self._device_lru), f"{h:#x} device lru mismatch"
            assert b.on_host == (h in self._host_lru), f"{h:#x} host lru mismatch"
            if b.parent is not None:
                p = self._blocks.get(b.parent)
                assert p is not None, f"{h:#x} orphaned"
                assert h in p.children, f"{h:#x} missing from parent's children"
                if b.on_device:
                    assert p.on_device, f"{h:#x} on device without its parent"
            real_dc = sum(1 for c in b.children if self._blocks[c].on_device)
            assert real_dc == b.device_children, f"{h:#x} device_children {b.device_children} != {real_dc}"

