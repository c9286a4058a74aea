"""Batch and event decoding (§2) and the §3 exclusion flags."""

from __future__ import annotations

from array import array

import ormsgpack
import pytest

from kvsvc.errors import DecodeError
from kvsvc.events import DEVICE, HOST, OTHER_MEDIUM, AllBlocksCleared, BlockRemoved, BlockStored
from kvsvc.streams.decoder import decode_batch
from tests.support.publisher import cleared, encode_batch, removed, stored, to_array_event

TOKENS = list(range(100, 108))


def one(ev, *, event_form="map", form="array3", rank=0):
    batch = decode_batch(encode_batch([ev], rank, form=form, event_form=event_form), 0)
    assert len(batch.events) == 1
    return batch.events[0]


@pytest.mark.parametrize("event_form", ["map", "array"])
def test_block_stored_both_encodings(event_form):
    ev = one(stored([1, -1, b"\x01\x02"], 7, TOKENS * 3, 8, medium="CPU"), event_form=event_form)
    assert ev == BlockStored(block_hashes=[1, 2**64 - 1, b"\x01\x02"], parent_block_hash=7,
                             token_ids=array("I", TOKENS * 3), block_size=8, tier=HOST,
                             excluded=False)
    # Converted once: the index hashes packed_tokens as they are (§4 byte form), token_ids is a
    # zero-copy view of them.
    assert ev.packed_tokens == array("I", TOKENS * 3).tobytes()
    assert type(ev.token_ids) is memoryview and list(ev.token_ids) == TOKENS * 3


@pytest.mark.parametrize("event_form", ["map", "array"])
def test_removed_and_cleared_both_encodings(event_form):
    assert one(removed([-2], "gpu"), event_form=event_form) == BlockRemoved([2**64 - 2], DEVICE)
    assert one(removed([5]), event_form=event_form) == BlockRemoved([5], DEVICE)
    assert one(cleared(), event_form=event_form) == AllBlocksCleared(None)
    assert one(cleared("dram"), event_form=event_form) == AllBlocksCleared(HOST)
    assert one(cleared("disk"), event_form=event_form) == AllBlocksCleared(OTHER_MEDIUM)


def test_array_form_trailing_fields_optional_and_extra_ignored():
    assert one(["BlockStored", [1], None, TOKENS, 8]) == BlockStored(
        [1], None, array("I", TOKENS), 8, DEVICE, False)
    assert one(["BlockRemoved", [1]]) == BlockRemoved([1], DEVICE)
    assert one(["AllBlocksCleared"]) == AllBlocksCleared(None)
    long_form = ["BlockStored", [1], None, TOKENS, 8, None, "cpu", None, None, 0,
                 "full_attention", "future-field"]
    assert one(long_form) == BlockStored([1], None, array("I", TOKENS), 8, HOST, False)


def test_batch_forms_and_ranks():
    events = [stored([1], None, TOKENS, 8), removed([1])]
    for form in ("array3", "array2", "map"):
        batch = decode_batch(encode_batch(events, 3, form=form), 3)
        assert len(batch.events) == 2 and batch.ts == 1.0
        assert batch.dp_rank == (None if form == "array2" else 3)
    # A nil rank belongs to the stream it arrived on; an integer ts is accepted as a number.
    assert decode_batch(ormsgpack.packb([5, [], None]), 2).dp_rank is None
    assert decode_batch(ormsgpack.packb({"ts": 1.5, "events": [], "extra": 1}), 2).ts == 1.5
    with pytest.raises(DecodeError, match="dp_rank 1 does not match the stream's rank 0"):
        decode_batch(encode_batch([], 1), 0)
    with pytest.raises(DecodeError, match="dp_rank 1 does not match"):
        decode_batch(encode_batch([], 1, form="map"), 0)


def test_medium_mapping():
    for medium, tier in [(None, DEVICE), ("GPU", DEVICE), ("device", DEVICE), ("hbm", DEVICE),
                         ("npu", DEVICE), ("cpu", HOST), ("cpu_pinned", HOST), ("Host", HOST),
                         ("dram", HOST), ("storage", OTHER_MEDIUM), ("disk", OTHER_MEDIUM)]:
        assert one(stored([1], None, TOKENS, 8, medium=medium)).tier == tier, medium


@pytest.mark.parametrize("extra, excluded", [
    ({}, False),
    ({"lora_id": 3}, True),
    ({"lora_name": "adapter"}, True),
    ({"extra_keys": [None, None]}, False),
    ({"extra_keys": [None, ["mm-hash"]]}, True),
    ({"kv_cache_spec_kind": "full_attention"}, False),
    ({"kv_cache_spec_kind": None}, False),
    ({"kv_cache_spec_kind": "sliding_window"}, True),
    ({"group_idx": 1}, False),
])
def test_exclusion(extra, excluded):
    assert one(stored([1], None, TOKENS, 8, **extra)).excluded is excluded
    assert one(to_array_event(stored([1], None, TOKENS, 8, **extra))).excluded is excluded


def test_token_range_edges():
    assert list(one(stored([1], None, [0, 2**31 - 1], 2)).token_ids) == [0, 2**31 - 1]
    assert list(one(stored([], None, [], 0)).token_ids) == []


def bad(payload_obj):
    return ormsgpack.packb(payload_obj)


def ev_with(**changes):
    ev = stored([1], None, TOKENS, 8)
    for key, value in changes.items():
        if value is KeyError:
            del ev[key]
        else:
            ev[key] = value
    return ev


@pytest.mark.parametrize("payload, reason", [
    (b"\xc1", "not valid MessagePack"),
    (b"\x93\x01", "not valid MessagePack"),
    (bad(5), "batch is int"),
    (bad([1.0]), "1 elements"),
    (bad([1.0, [], 0, 4]), "4 elements"),
    (bad({"ts": 1.0}), "needs keys 'ts' and 'events'"),
    (bad(["x", [], 0]), "ts is str"),
    (bad([None, [], 0]), "ts is nil"),
    (bad([1.0, {}, 0]), "events is dict"),
    (bad([1.0, [], "0"]), "dp_rank is str"),
    (bad([1.0, [], True]), "dp_rank is bool"),
    (bad([1.0, [5], 0]), "event 0: event is int"),
    (bad([1.0, [[]], 0]), "event is an empty array"),
    (bad([1.0, [{"block_hashes": [1]}], 0]), "event has no type"),
    (bad([1.0, [{"type": "BlockEvicted"}], 0]), "unknown event type 'BlockEvicted'"),
    (bad([1.0, [["Nope", 1]], 0]), "unknown event type 'Nope'"),
    (bad([1.0, [[7, 1]], 0]), "unknown event type 7"),
    (bad([1.0, [cleared(), ev_with(block_hashes=KeyError)], 0]),
     "event 1: BlockStored: missing field block_hashes"),
    (bad([1.0, [ev_with(parent_block_hash=KeyError)], 0]), "missing field parent_block_hash"),
    (bad([1.0, [ev_with(token_ids=KeyError)], 0]), "missing field token_ids"),
    (bad([1.0, [ev_with(block_size=KeyError)], 0]), "missing field block_size"),
    (bad([1.0, [["BlockStored", [1], None, TOKENS]], 0]), "missing field block_size"),
    (bad([1.0, [["BlockRemoved"]], 0]), "BlockRemoved: missing field block_hashes"),
    (bad([1.0, [ev_with(block_hashes=5)], 0]), "block_hashes is int"),
    (bad([1.0, [ev_with(block_hashes=[1.5])], 0]), "block hash is float"),
    (bad([1.0, [ev_with(block_hashes=[True])], 0]), "block hash is bool"),
    (bad([1.0, [ev_with(block_hashes=["ab"])], 0]), "block hash is str"),
    (bad([1.0, [ev_with(block_hashes=[None])], 0]), "block hash is nil"),
    (bad([1.0, [ev_with(parent_block_hash="p")], 0]), "parent_block_hash is str"),
    (bad([1.0, [ev_with(parent_block_hash=False)], 0]), "parent_block_hash is bool"),
    (bad([1.0, [ev_with(token_ids=None)], 0]), "token_ids is nil"),
    (bad([1.0, [ev_with(token_ids=[1, 2.0])], 0]), r"token_ids\[1\] is float 2.0, not an int"),
    (bad([1.0, [ev_with(token_ids=[1, "2"])], 0]), r"token_ids\[1\] is str '2', not an int"),
    (bad([1.0, [ev_with(token_ids=[1, -1])], 0]), r"token_ids\[1\] = -1 is out of range"),
    (bad([1.0, [ev_with(token_ids=[2**31])], 0]), r"token_ids\[0\] = 2147483648 is out of range"),
    (bad([1.0, [ev_with(token_ids=[3, 2**32 - 1])], 0]),
     r"token_ids\[1\] = 4294967295 is out of range"),
    (bad([1.0, [ev_with(token_ids=[2**32])], 0]), r"token_ids\[0\] = 4294967296 is out of range"),
    (bad([1.0, [ev_with(block_size="8")], 0]), "block_size is str"),
    (bad([1.0, [ev_with(block_size=-8)], 0]), "block_size is -8"),
    (bad([1.0, [ev_with(block_size=True)], 0]), "block_size is bool"),
    (bad([1.0, [ev_with(lora_id="x")], 0]), "lora_id is str"),
    (bad([1.0, [ev_with(lora_id=1.0)], 0]), "lora_id is float"),
    (bad([1.0, [ev_with(medium=1)], 0]), "medium is int"),
    (bad([1.0, [ev_with(lora_name=1)], 0]), "lora_name is int"),
    (bad([1.0, [ev_with(extra_keys="k")], 0]), "extra_keys is str"),
    (bad([1.0, [ev_with(group_idx="0")], 0]), "group_idx is str"),
    (bad([1.0, [ev_with(kv_cache_spec_kind=1)], 0]), "kv_cache_spec_kind is int"),
    (bad([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": b"cpu"}], 0]),
     "medium is bytes"),
    (bad([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "group_idx": 1.0}], 0]),
     "group_idx is float"),
    (bad([1.0, [{"type": "AllBlocksCleared", "medium": 3}], 0]), "medium is int"),
])
def test_decode_errors(payload, reason):
    with pytest.raises(DecodeError, match=reason):
        decode_batch(payload, 0)


def test_non_string_map_keys_are_a_decode_error():
    payload = ormsgpack.packb([1.0, [{1: 2}], 0], option=ormsgpack.OPT_NON_STR_KEYS)
    with pytest.raises(DecodeError, match="not valid MessagePack"):
        decode_batch(payload, 0)
