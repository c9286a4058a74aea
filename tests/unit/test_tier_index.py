"""Per-stream tiered index (§3, §5) and the prefix walk (§10): one test per rule, exact numbers,
plus a hypothesis property test against a reference model of prefix tuples."""

from __future__ import annotations

from typing import Optional

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsvc.errors import CapacityExceeded, DecodeError, HashConflict, UnknownParent
from kvsvc.events import (
    DEVICE,
    HOST,
    OTHER_MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
)
from kvsvc.index.keys import prompt_keys
from kvsvc.index.tier_index import IndexStats, TierIndex

BS = 2
SEED = 1024

# Token blocks used throughout (BS tokens each).
A, B, C, D = [1, 2], [3, 4], [5, 6], [7, 8]


def keys(*blocks: list[int]) -> list[int]:
    """Content keys of a prompt made of ``blocks`` from the root."""
    return prompt_keys([t for b in blocks for t in b], BS, SEED)


def stored(hashes, parent, *blocks, tier=DEVICE, excluded=False, block_size=BS) -> BlockStored:
    return BlockStored(list(hashes), parent, [t for b in blocks for t in b], block_size, tier,
                       excluded)


def removed(hashes, tier=DEVICE) -> BlockRemoved:
    return BlockRemoved(list(hashes), tier)


def replica(hashes, tier) -> BlockStored:
    """Tokenless replica event (block_size 0 as some engines send)."""
    return BlockStored(list(hashes), None, [], 0, tier)


def new_index(max_entries: int = 1000) -> TierIndex:
    return TierIndex(BS, SEED, max_entries)


def counts(index: TierIndex) -> tuple[int, int, int]:
    return index.device_blocks, index.host_blocks, index.entries


# --------------------------------------------------------------------------- chaining


def test_chaining_and_parent_resolution():
    index = new_index()
    index.apply([stored([11, 12], None, A, B)])
    index.apply([stored([13], 12, C)])  # parent resolved through the engine map
    assert index.residency() == {k: DEVICE for k in keys(A, B, C)}
    assert index.match(keys(A, B, C)) == (3, 0)
    assert index.match(keys(A, B, C, D)) == (3, 0)
    # C after A (not after A, B) is a different content key: the walk stops there.
    assert index.match(keys(A, C)) == (1, 0)
    assert index.match(keys(B)) == (0, 0)
    assert index.match([]) == (0, 0)
    assert counts(index) == (3, 0, 3)


def test_bytes_engine_hashes_work_like_ints():
    index = new_index()
    index.apply([stored([b"h1", b"h2"], None, A, B), stored([b"h3"], b"h2", C)])
    assert index.match(keys(A, B, C)) == (3, 0)
    index.apply([removed([b"h2"])])
    assert index.match(keys(A, B, C)) == (1, 0)
    assert counts(index) == (2, 0, 2)


def test_match_stops_at_first_gap():
    index = new_index()
    index.apply([stored([1], None, A), stored([2, 3, 4], 1, B, C, D)])
    index.apply([removed([3])])
    assert index.match(keys(A, B, C, D)) == (2, 0)  # D is resident but behind the gap
    assert counts(index) == (3, 0, 3)


def test_device_host_split():
    index = new_index()
    index.apply([
        stored([1], None, A, tier=DEVICE),
        stored([2], 1, B, tier=HOST),
        stored([3], 2, C, tier=DEVICE),
        stored([3], 2, C, tier=HOST),
    ])
    # A device, B host only, C on both -> device.
    assert index.match(keys(A, B, C)) == (2, 1)
    assert index.match(keys(A, B)) == (1, 1)
    assert counts(index) == (2, 2, 3)


# --------------------------------------------------------------------------- tiers


def test_device_removal_leaves_host_replica():
    index = new_index()
    index.apply([stored([1], None, A, tier=DEVICE), stored([1], None, A, tier=HOST)])
    assert counts(index) == (1, 1, 1)
    assert index.match(keys(A)) == (1, 0)
    index.apply([removed([1], DEVICE)])
    assert counts(index) == (0, 1, 1)
    assert index.match(keys(A)) == (0, 1)
    index.apply([removed([1], HOST)])
    assert counts(index) == (0, 0, 0)
    assert index.match(keys(A)) == (0, 0)
    assert index.residency() == {}
    assert index.stats == IndexStats()


def test_tokenless_replica_known_and_unknown():
    index = new_index()
    index.apply([stored([1, 2], None, A, B)])
    index.apply([replica([1, 99], HOST)])
    assert index.stats.unknown_tokenless == 1
    assert counts(index) == (2, 1, 2)
    index.apply([removed([1], DEVICE)])
    assert index.match(keys(A, B)) == (1, 1)  # A host only, B device
    # The unknown hash was ignored, not remembered: it is still unknown to a removal.
    index.apply([removed([99], HOST)])
    assert index.stats.unknown_removals == 1
    assert counts(index) == (1, 1, 2)


def test_repeated_store_and_removal_are_idempotent():
    index = new_index()
    ev = stored([1, 2], None, A, B)
    index.apply([ev, ev, ev])
    index.apply([replica([1], DEVICE)])
    assert counts(index) == (2, 0, 2)
    index.apply([removed([2]), removed([2])])
    assert counts(index) == (1, 0, 1)
    assert index.stats.unknown_removals == 1  # the second removal found nothing
    assert index.match(keys(A, B)) == (1, 0)


def test_removal_never_cascades():
    index = new_index()
    index.apply([stored([1, 2, 3], None, A, B, C)])
    index.apply([removed([1])])
    assert index.residency() == {k: DEVICE for k in keys(A, B, C)[1:]}
    assert index.match(keys(A, B, C)) == (0, 0)
    assert counts(index) == (2, 0, 2)
    # The surviving child still resolves as a parent.
    index.apply([stored([4], 3, D)])
    assert index.residency()[keys(A, B, C, D)[3]] == DEVICE


def test_unknown_removals_are_counted_noops():
    index = new_index()
    index.apply([stored([1], None, A)])
    index.apply([removed([7, 8]), removed([9], HOST)])
    assert index.stats.unknown_removals == 3
    assert counts(index) == (1, 0, 1)
    # Removing a Host flag the block never had changes nothing.
    index.apply([removed([1], HOST)])
    assert counts(index) == (1, 0, 1)
    assert index.stats.unknown_removals == 3


def test_other_medium_is_skipped_and_counted():
    index = new_index()
    # Even a malformed shape (block size 256) is fine: other media are never indexed.
    index.apply([
        stored([1], None, A + A, tier=OTHER_MEDIUM, block_size=4),
        removed([1], OTHER_MEDIUM),
        AllBlocksCleared(OTHER_MEDIUM),
    ])
    assert index.stats.not_indexed_medium == 3
    assert index.stats.unknown_removals == 0
    assert counts(index) == (0, 0, 0)
    index.apply([stored([1], None, A)])
    index.apply([AllBlocksCleared(OTHER_MEDIUM), removed([1], OTHER_MEDIUM)])
    assert counts(index) == (1, 0, 1)
    assert index.stats.not_indexed_medium == 5


# --------------------------------------------------------------------------- excluded / orphan


def test_excluded_blocks_and_their_children():
    # The decoder folds LoRA, extra_keys and non-full-attention kv_cache_spec_kind into
    # ``excluded`` (§3); the index sees only the flag.
    index = new_index()
    index.apply([stored([1], None, A)])
    index.apply([stored([21, 22], 1, B, C, excluded=True)])
    index.apply([stored([23], 22, D)])        # child of EXCLUDED -> excluded, no error (live)
    index.apply([stored([24], 23, A)])        # grandchild too
    assert index.stats.excluded_blocks == 4
    assert counts(index) == (1, 0, 5)
    assert index.residency() == {keys(A)[0]: DEVICE}
    assert index.match(keys(A, B, C, D)) == (1, 0)
    assert index.match(keys(D)) == (0, 0)
    # A hybrid model's non-full-attention group may use another block size: never an error.
    index.apply([stored([30], None, [1, 2, 3, 4], excluded=True, block_size=4)])
    index.apply([stored([31], None, [9], excluded=True, block_size=BS)])
    assert index.stats.excluded_blocks == 6
    assert counts(index) == (1, 0, 7)


def test_excluded_markers_keep_tier_flags_and_are_removed():
    index = new_index()
    index.apply([stored([21], None, A, excluded=True, tier=DEVICE)])
    index.apply([replica([21], HOST)])
    index.apply([removed([21], DEVICE)])
    assert counts(index) == (0, 0, 1)  # still on Host: the marker stays
    index.apply([stored([22], 21, B)])  # and its children are still excluded
    assert index.stats.excluded_blocks == 2
    assert counts(index) == (0, 0, 2)
    index.apply([removed([21, 22], HOST)])  # 22 is only on Device: it stays
    assert counts(index) == (0, 0, 1)
    index.apply([removed([22], DEVICE)])
    assert counts(index) == (0, 0, 0)
    assert index.stats.unknown_removals == 0
    # Gone for good: a child naming it now is an unknown parent.
    with pytest.raises(UnknownParent):
        index.apply([stored([23], 21, C)])


def test_snapshot_orphans_vs_live_unknown_parent():
    index = new_index()
    index.apply([
        stored([2, 3], 77, B, C),        # parent 77 unknown -> orphans
        stored([4], 3, D, tier=HOST),    # descendant of an orphan -> orphan
        stored([1], None, A),            # another prefix, unaffected
        stored([5], 1, B),
    ], snapshot=True)
    assert index.stats.orphan_blocks == 3
    assert counts(index) == (2, 0, 5)
    assert index.match(keys(A, B)) == (2, 0)
    assert index.match(keys(B, C, D)) == (0, 0)
    assert index.residency() == {k: DEVICE for k in keys(A, B)}
    # Live: a child of an orphan stays orphan (no error), an unknown parent raises.
    index.apply([stored([6], 4, A)])
    assert index.stats.orphan_blocks == 4
    assert counts(index) == (2, 0, 6)
    with pytest.raises(UnknownParent, match="0x58"):
        index.apply([stored([9], 0x58, A)])


def test_orphan_markers_removed_when_no_flag_left():
    index = new_index()
    index.apply([stored([2], 77, B)], snapshot=True)
    index.apply([replica([2], HOST)])
    index.apply([removed([2], DEVICE)])
    assert counts(index) == (0, 0, 1)
    index.apply([removed([2], HOST)])
    assert counts(index) == (0, 0, 0)


# --------------------------------------------------------------------------- clear


def test_all_blocks_cleared_drops_everything():
    index = new_index()
    index.apply([stored([1, 2], None, A, B), stored([1], None, A, tier=HOST),
                 stored([3], None, C, excluded=True)])
    assert counts(index) == (2, 1, 3)
    index.apply([AllBlocksCleared()])
    assert counts(index) == (0, 0, 0)
    assert index.residency() == {}
    assert index.match(keys(A, B)) == (0, 0)
    with pytest.raises(UnknownParent):
        index.apply([stored([4], 2, C)])


def test_all_blocks_cleared_one_tier():
    index = new_index()
    index.apply([
        stored([1], None, A, tier=DEVICE), stored([1], None, A, tier=HOST),  # both
        stored([2], 1, B, tier=DEVICE),                                     # Device only
        stored([3], None, C, tier=HOST),                                    # Host only
        stored([21], None, D, excluded=True, tier=DEVICE),
        stored([22], None, D, excluded=True, tier=HOST),
    ])
    assert counts(index) == (2, 2, 5)
    index.apply([AllBlocksCleared(DEVICE)])
    assert counts(index) == (0, 2, 3)  # A, C and marker 22 remain
    assert index.residency() == {keys(A)[0]: HOST, keys(C)[0]: HOST}
    assert index.match(keys(A, B)) == (0, 1)
    index.apply([removed([2], DEVICE)])
    assert index.stats.unknown_removals == 1  # B went with its engine-map entry
    index.apply([stored([4], 22, A)])  # marker 22 still resolves as EXCLUDED
    assert index.stats.excluded_blocks == 3
    index.apply([AllBlocksCleared(HOST)])
    assert counts(index) == (0, 0, 1)  # only the new Device marker 4 is left
    index.apply([stored([1], None, A, tier=DEVICE)])
    assert counts(index) == (1, 0, 2)
    assert index.match(keys(A)) == (1, 0)


# --------------------------------------------------------------------------- errors


def test_block_size_mismatch_is_decode_error():
    index = new_index()
    with pytest.raises(DecodeError, match="block_size 4 != configured block_size 2"):
        index.apply([stored([1], None, [1, 2, 3, 4], block_size=4)])


def test_token_count_mismatch_is_decode_error():
    index = new_index()
    with pytest.raises(DecodeError, match="3 token ids for 2 blocks of 2"):
        index.apply([stored([1, 2], None, [1, 2, 3])])
    with pytest.raises(DecodeError, match="2 token ids for 2 blocks of 2"):
        index.apply([stored([1, 2], None, [1, 2])])


def test_token_out_of_range_is_decode_error():
    index = new_index()
    with pytest.raises(DecodeError, match=r"token_ids\[1\]"):
        index.apply([stored([1], None, [5, 2**31])])


def test_hash_conflict_different_content():
    index = new_index()
    index.apply([stored([1], None, A)])
    with pytest.raises(HashConflict, match="0x1 already maps"):
        index.apply([stored([1], None, B)])
    index = new_index()
    with pytest.raises(HashConflict):  # same hash twice in one event with different content
        index.apply([stored([5, 5], None, A, B)])


def test_hash_conflict_marker_vs_key():
    index = new_index()
    index.apply([stored([1], None, A, excluded=True)])
    with pytest.raises(HashConflict, match="EXCLUDED"):
        index.apply([stored([1], None, A)])
    index = new_index()
    index.apply([stored([1], None, A)])
    with pytest.raises(HashConflict, match="maps to a content key"):
        index.apply([stored([1], None, A, excluded=True)])
    index = new_index()
    index.apply([stored([2], 9, A)], snapshot=True)
    with pytest.raises(HashConflict, match="ORPHAN"):
        index.apply([stored([2], None, A)])


def test_capacity_exactly_at_and_one_over():
    index = new_index(max_entries=3)
    index.apply([stored([1, 2], None, A, B), stored([21], None, C, excluded=True)])
    assert index.entries == 3
    # Re-storing and replicas of known hashes add no entry.
    index.apply([stored([1, 2], None, A, B, tier=HOST), replica([21], HOST), replica([9], HOST)])
    assert counts(index) == (2, 2, 3)
    with pytest.raises(CapacityExceeded, match="index capacity exceeded"):
        index.apply([stored([3], 2, C)])
    index = new_index(max_entries=3)
    index.apply([stored([1, 2], None, A, B)])
    with pytest.raises(CapacityExceeded):
        index.apply([stored([22], 2, C, excluded=True), stored([23], 22, D)])


def test_capacity_frees_on_removal():
    index = new_index(max_entries=2)
    index.apply([stored([1, 2], None, A, B)])
    index.apply([removed([2]), stored([3], 1, C)])
    assert counts(index) == (2, 0, 2)
    assert index.match(keys(A, C)) == (2, 0)


def test_constructor_rejects_bad_sizes():
    with pytest.raises(ValueError, match="block_size"):
        TierIndex(0, SEED, 10)
    with pytest.raises(ValueError, match="max_entries"):
        TierIndex(BS, SEED, 0)


# --------------------------------------------------------------------------- aliases


def test_alias_removal_keeps_block_resident_through_other_hash():
    index = new_index()
    index.apply([stored([1], None, A), stored([2], None, A)])
    assert counts(index) == (1, 0, 2)
    index.apply([removed([1])])
    assert index.match(keys(A)) == (1, 0)
    assert counts(index) == (1, 0, 1)
    index.apply([stored([3], 2, B)])  # the surviving alias still resolves
    assert index.match(keys(A, B)) == (2, 0)
    index.apply([removed([2])])
    assert counts(index) == (1, 0, 1)
    assert index.match(keys(A, B)) == (0, 0)
    # No dangling mapping: both hashes are unknown now.
    index.apply([replica([1, 2], HOST)])
    assert index.stats.unknown_tokenless == 2


def test_alias_flags_are_per_engine_hash():
    index = new_index()
    index.apply([stored([1], None, A, tier=DEVICE), stored([2], None, A, tier=HOST),
                 stored([3], None, A, tier=HOST)])
    assert counts(index) == (1, 1, 3)
    index.apply([removed([1], DEVICE)])  # the first hash (unlisted slot) goes
    assert index.match(keys(A)) == (0, 1)
    assert counts(index) == (0, 1, 2)
    index.apply([removed([2], HOST)])
    assert counts(index) == (0, 1, 1)
    index.apply([replica([3], DEVICE), removed([3], HOST)])
    assert index.match(keys(A)) == (1, 0)
    assert counts(index) == (1, 0, 1)
    index.apply([removed([3], DEVICE), replica([1, 2, 3], HOST)])
    assert counts(index) == (0, 0, 0)
    assert index.stats.unknown_tokenless == 3


def test_alias_survives_tier_clear_only_where_flagged():
    index = new_index()
    index.apply([stored([1], None, A, tier=DEVICE), stored([2], None, A, tier=HOST),
                 stored([3], 1, B, tier=DEVICE)])
    index.apply([AllBlocksCleared(DEVICE)])
    assert counts(index) == (0, 1, 1)
    assert index.match(keys(A, B)) == (0, 1)
    index.apply([replica([1], HOST)])  # hash 1 lost its only flag: gone from the engine map
    assert index.stats.unknown_tokenless == 1
    index.apply([removed([2], HOST)])
    assert counts(index) == (0, 0, 0)


# --------------------------------------------------------------------------- resync helpers


def test_residency_is_a_copy():
    index = new_index()
    index.apply([stored([1], None, A)])
    snapshot = index.residency()
    snapshot.clear()
    assert index.residency() == {keys(A)[0]: DEVICE}


def test_difference_counts_differing_keys():
    old, new = new_index(), new_index()
    old.apply([stored([1], None, A), stored([2], 1, B), stored([2], 1, B, tier=HOST)])
    new.apply([stored([1], None, A), stored([2], 1, B), stored([3], None, C, tier=HOST)])
    assert old.difference(new) == 2  # B's flags differ, C only in new
    assert new.difference(old) == 2
    assert old.difference(old) == 0
    assert old.difference(new_index()) == 2
    assert new_index().difference(new_index()) == 0


# --------------------------------------------------------------------------- property test

# Operations over a tiny alphabet so that prefixes, repeats and aliases are frequent.
_block = st.tuples(st.integers(0, 2), st.integers(0, 2))
_tier = st.sampled_from([DEVICE, HOST])
_ops = st.lists(st.one_of(
    st.tuples(st.just("store"), st.integers(0, 50), st.lists(_block, min_size=1, max_size=3),
              _tier, st.integers(0, 1)),
    st.tuples(st.just("remove"), st.integers(0, 50), _tier),
    st.tuples(st.just("replica"), st.integers(0, 50), _tier),
    st.tuples(st.just("clear"), st.sampled_from([None, DEVICE, HOST])),
), max_size=30)


class _Model:
    """Reference: each engine hash names a prefix tuple; flags per hash; a prefix is resident
    on a tier if any of its hashes is."""

    def __init__(self) -> None:
        self.ids: dict[tuple, int] = {}        # (prefix, salt) -> engine hash
        self.prefix_of: dict[int, tuple] = {}  # every hash ever issued -> its prefix
        self.flags: dict[int, int] = {}        # hashes currently known -> flags

    def hash_for(self, prefix: tuple, salt: int) -> int:
        # Same content + salt -> same hash (repeats); other salt -> an alias.
        if (prefix, salt) not in self.ids:
            self.ids[(prefix, salt)] = len(self.ids) + 1
            self.prefix_of[self.ids[(prefix, salt)]] = prefix
        return self.ids[(prefix, salt)]

    def resident(self) -> dict[tuple, int]:
        out: dict[tuple, int] = {}
        for h, f in self.flags.items():
            out[self.prefix_of[h]] = out.get(self.prefix_of[h], 0) | f
        return out

    def match(self, prefix: tuple) -> tuple[int, int]:
        resident = self.resident()
        device = host = 0
        for end in range(BS, len(prefix) + 1, BS):
            f = resident.get(prefix[:end], 0)
            if not f:
                break
            if f & DEVICE:
                device += 1
            else:
                host += 1
        return device, host


def _step(model: _Model, op: tuple) -> Optional[object]:
    """Update the model for ``op`` and return the event for the index (or None)."""
    kind = op[0]
    if kind == "store":
        _, choice, blocks, tier, salt = op
        known = sorted(model.flags)
        pick = choice % (len(known) + 1)
        parent = None if pick == 0 else known[pick - 1]
        prefix = () if parent is None else model.prefix_of[parent]
        hashes, tokens = [], []
        for block in blocks:
            prefix = prefix + block
            h = model.hash_for(prefix, salt)
            model.flags[h] = model.flags.get(h, 0) | tier
            hashes.append(h)
            tokens.extend(block)
        return BlockStored(hashes, parent, tokens, BS, tier)
    if kind in ("remove", "replica"):
        _, choice, tier = op
        issued = sorted(model.prefix_of)
        if not issued:
            return None
        h = issued[choice % len(issued)]
        if h in model.flags:
            if kind == "replica":
                model.flags[h] |= tier
            elif model.flags[h] & ~tier:
                model.flags[h] &= ~tier
            else:
                del model.flags[h]
        return BlockRemoved([h], tier) if kind == "remove" else BlockStored([h], None, [], 0,
                                                                             tier)
    tier = op[1]
    if tier is None:
        model.flags.clear()
    else:
        model.flags = {h: f & ~tier for h, f in model.flags.items() if f & ~tier}
    return AllBlocksCleared(tier)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_ops)
def test_matches_reference_model(ops):
    model = _Model()
    index = new_index()
    for op in ops:
        event = _step(model, op)
        if event is not None:
            index.apply([event])
        resident = model.resident()
        assert index.entries == len(model.flags)
        assert index.device_blocks == sum(1 for f in resident.values() if f & DEVICE)
        assert index.host_blocks == sum(1 for f in resident.values() if f & HOST)
        assert index.residency() == {keys(*[list(p[i:i + BS]) for i in range(0, len(p), BS)])[-1]: f
                                     for p, f in resident.items()}
        for prefix in set(model.prefix_of.values()):
            query = prefix + (9, 9)  # one never-stored block at the end
            blocks = [list(query[i:i + BS]) for i in range(0, len(query), BS)]
            assert index.match(keys(*blocks)) == model.match(query)


# --------------------------------------------------------------------------- prefix closure

def test_bisection_answers_equal_the_walk_on_a_closed_index():
    index = new_index()
    index.apply([stored([1, 2, 3], None, A, B, C), stored([4], 3, D, tier=HOST)])
    assert index.match(keys(A, B, C, D)) == (3, 1)
    assert index.match(keys(A, B, D)) == (2, 0)
    assert index.match(keys(B)) == (0, 0)
    assert index.match([]) == (0, 0)


def test_removing_an_inner_block_falls_back_to_the_linear_walk():
    index = new_index()
    index.apply([stored([1, 2, 3], None, A, B, C)])
    index.apply([removed([2])])  # not leaf-first: C stays resident under a missing parent
    assert index.match(keys(A, B, C)) == (1, 0)
    index.apply([removed([1, 3])])  # empty again
    index.apply([stored([5, 6], None, A, B)])
    assert index.match(keys(A, B, C)) == (2, 0)


def test_device_block_under_host_only_parent_is_counted_by_walk():
    index = new_index()
    index.apply([stored([1], None, A, tier=HOST), stored([2, 3], 1, B, C)])
    # Host-only A, then B and C on Device: the prefix is 1 host-only + 2 device blocks.
    assert index.match(keys(A, B, C)) == (2, 1)
    index.apply([replica([1], DEVICE), removed([2])])
    assert index.match(keys(A, B, C)) == (1, 0)
