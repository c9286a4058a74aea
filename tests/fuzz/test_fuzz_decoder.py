"""Fuzzing the batch decoder (§2, §3) with hypothesis: whatever the payload, ``decode_batch``
returns a :class:`~kvsvc.events.Batch` or raises :class:`~kvsvc.errors.DecodeError`, nothing else.

Four input families, each with a modest example count (the whole file runs in a few seconds):

- arbitrary MessagePack values (random types, nesting, sizes, non-string map keys, integers at
  and beyond the 64-bit edges, binary and text) packed with ``ormsgpack``;
- arbitrary byte strings, and truncations / single-byte corruptions of valid batches;
- structurally valid batches (both batch forms, both event forms, negative / huge / bytes
  hashes) whose decoded values are checked exactly (hash normalisation, tiers, exclusion);
- valid batches with one field replaced by an arbitrary value (wrong field types).

Under ``CI`` the examples are derandomized (same inputs every run); locally hypothesis explores.
"""

from __future__ import annotations

import os
from array import array

import ormsgpack
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvsvc.errors import DecodeError
from kvsvc.events import DEVICE, HOST, OTHER_MEDIUM, AllBlocksCleared, Batch, BlockRemoved, BlockStored
from kvsvc.streams.decoder import decode_batch
from tests.support.publisher import encode_batch
from tests.support.strategies import U64, hashes, msgpack_values, stored_events, valid_events

RANK = 0

FUZZ = settings(max_examples=300, deadline=None, derandomize=bool(os.environ.get("CI")),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# -- strategies --------------------------------------------------------------------------------


@st.composite
def valid_batches(draw) -> tuple[bytes, list[dict]]:
    events = draw(st.lists(valid_events, max_size=5))
    form = draw(st.sampled_from(["array3", "array2", "map"]))
    event_form = draw(st.sampled_from(["map", "array"]))
    rank = draw(st.sampled_from([RANK, None])) if form != "array2" else None
    return encode_batch(events, rank, form=form, event_form=event_form, ts=1.5), events


def _pack(value) -> bytes:
    return ormsgpack.packb(value, option=ormsgpack.OPT_NON_STR_KEYS)


# -- the invariant -----------------------------------------------------------------------------

def decode_or_error(payload: bytes) -> Batch | None:
    """The one allowed behaviour: a well-formed Batch, or DecodeError (then ``None``)."""
    try:
        batch = decode_batch(payload, RANK)
    except DecodeError as exc:
        assert str(exc), "a DecodeError must carry a reason (it becomes the stream's error)"
        return None
    assert type(batch) is Batch
    assert type(batch.ts) is float
    assert batch.dp_rank in (None, RANK)
    for ev in batch.events:
        assert type(ev) in (BlockStored, BlockRemoved, AllBlocksCleared)
        if type(ev) is AllBlocksCleared:
            assert ev.tier in (None, DEVICE, HOST, OTHER_MEDIUM)
            continue
        assert ev.tier in (DEVICE, HOST, OTHER_MEDIUM)
        for h in ev.block_hashes:
            assert (type(h) is int and 0 <= h <= U64) or type(h) is bytes
        if type(ev) is BlockStored:
            p = ev.parent_block_hash
            assert p is None or (type(p) is int and 0 <= p <= U64) or type(p) is bytes
            assert all(0 <= t <= 2**31 - 1 for t in ev.token_ids)
            assert ev.packed_tokens == array("I", ev.token_ids).tobytes()
            assert type(ev.block_size) is int and ev.block_size >= 0
    return batch


# -- tests -------------------------------------------------------------------------------------

@FUZZ
@given(msgpack_values)
def test_arbitrary_msgpack_values(value):
    decode_or_error(_pack(value))


@FUZZ
@given(st.binary(max_size=256))
def test_arbitrary_bytes(payload):
    decode_or_error(payload)


@FUZZ
@given(valid_batches(), st.data())
def test_truncations_and_corruptions_of_valid_batches(batch, data):
    payload, _ = batch
    cut = data.draw(st.integers(min_value=0, max_value=len(payload)))
    decode_or_error(payload[:cut])
    pos = data.draw(st.integers(min_value=0, max_value=len(payload) - 1))
    byte = data.draw(st.integers(min_value=0, max_value=255))
    decode_or_error(payload[:pos] + bytes([byte]) + payload[pos + 1:])


@FUZZ
@given(valid_batches())
def test_valid_batches_decode_exactly(batch):
    payload, events = batch
    decoded = decode_or_error(payload)
    assert decoded is not None, "a structurally valid batch was refused"
    assert decoded.ts == 1.5
    assert len(decoded.events) == len(events)
    for raw, ev in zip(events, decoded.events):
        medium = raw.get("medium")
        tier = DEVICE if medium is None else {
            "gpu": DEVICE, "device": DEVICE, "hbm": DEVICE, "npu": DEVICE, "cpu": HOST,
            "cpu_pinned": HOST, "host": HOST, "dram": HOST}.get(medium.lower(), OTHER_MEDIUM)
        if raw["type"] == "AllBlocksCleared":
            assert ev == AllBlocksCleared(None if "medium" not in raw or medium is None else tier)
            continue
        norm = [h & U64 if type(h) is int else h for h in raw["block_hashes"]]
        assert list(ev.block_hashes) == norm
        assert ev.tier == tier
        if raw["type"] == "BlockStored":
            p = raw["parent_block_hash"]
            assert ev.parent_block_hash == (p & U64 if type(p) is int else p)
            assert list(ev.token_ids) == raw["token_ids"]
            assert ev.excluded == (raw["lora_id"] is not None
                                   or raw.get("lora_name") is not None
                                   or any(k is not None for k in raw.get("extra_keys") or [])
                                   or raw.get("kv_cache_spec_kind") not in (None, "full_attention"))


STORED_FIELDS = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                 "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "type"]


@FUZZ
@given(stored_events(), st.sampled_from(STORED_FIELDS), msgpack_values)
def test_wrong_field_types(event, name, value):
    event = dict(event)
    event[name] = value
    try:
        payload = encode_batch([event], RANK)
    except (TypeError, ormsgpack.MsgpackEncodeError):
        assume(False)  # a value ormsgpack cannot pack with string keys: not a wire input
        return
    decode_or_error(payload)
    array_form = [event.get(f) for f in STORED_FIELDS[:-1]]
    decode_or_error(_pack([1.0, [["BlockStored", *array_form]], RANK]))


@FUZZ
@given(st.lists(st.one_of(hashes, st.integers(min_value=U64 + 1, max_value=2**70),
                          st.integers(min_value=-(2**70), max_value=-(2**63) - 1)), max_size=4))
def test_out_of_range_integers_never_escape(raw_hashes):
    """Integers outside int64/uint64 cannot be packed; the raw 0xcf/0xd3 edges can, and every
    value a real payload carries is normalised to unsigned 64-bit (§2)."""
    packable = [h for h in raw_hashes if type(h) is bytes or -(2**63) <= h <= U64]
    ev = {"type": "BlockRemoved", "block_hashes": packable, "medium": None}
    decoded = decode_or_error(encode_batch([ev], RANK))
    assert decoded is not None
    assert list(decoded.events[0].block_hashes) == [h & U64 if type(h) is int else h
                                                    for h in packable]


@pytest.mark.parametrize("payload", [
    b"\xcf" + b"\xff" * 8,                          # a bare u64 max
    b"\x93\xcb" + b"\x00" * 8 + b"\x91\xc1" + b"\x00",  # never-used byte 0xc1 inside events
    b"\x93\xcb" + b"\x00" * 8 + b"\xdd\xff\xff\xff\xff",  # array32 header promising 4 G items
    b"\xdf\xff\xff\xff\xff",                         # map32 header promising 4 G entries
    b"\xc6\xff\xff\xff\xff",                         # bin32 header promising 4 GiB
    b"\xd9\x05\xff\xfe\xfd\xfc\xfb",                # str8 with invalid UTF-8
    b"\xc7\x01\x05a",                               # ext type (no hook)
    b"",
])
def test_hostile_headers(payload):
    assert decode_or_error(payload) is None
