"""Hypothesis strategies of msgpack values and of valid §2 events, shared by the decoder and stream
fuzzers."""

from __future__ import annotations

from hypothesis import strategies as st

U64 = 0xFFFF_FFFF_FFFF_FFFF


#: Integers MessagePack can carry: int64 and uint64 ranges, biased to the edges.
ints = st.one_of(
    st.integers(min_value=-(2**63), max_value=U64),
    st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, U64,
                     -(2**31), -(2**63)]),
)


scalars = st.one_of(st.none(), st.booleans(), ints, st.floats(allow_nan=True),
                    st.text(max_size=20), st.binary(max_size=20),
                    st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "gpu",
                                     "cpu", "storage", "type", "events", "ts"]))


keys = st.one_of(st.text(max_size=12), ints, st.binary(max_size=8),
                 st.sampled_from(["type", "ts", "events", "data_parallel_rank", "block_hashes",
                                  "parent_block_hash", "token_ids", "block_size", "medium"]))


msgpack_values = st.recursive(
    scalars,
    lambda children: st.one_of(st.lists(children, max_size=6),
                               st.dictionaries(keys, children, max_size=5)),
    max_leaves=40)


hashes = st.one_of(st.integers(min_value=-(2**63), max_value=U64), st.binary(min_size=1, max_size=16))


media = st.sampled_from([None, "gpu", "GPU", "device", "hbm", "npu", "cpu", "CPU_PINNED", "host",
                         "dram", "storage", "disk", "external", ""])


BLOCK_SIZE = 4


token_ids_ok = st.integers(min_value=0, max_value=2**31 - 1)


@st.composite
def stored_events(draw) -> dict:
    n = draw(st.integers(min_value=0, max_value=4))
    tokenless = draw(st.booleans())
    ev = {"type": "BlockStored",
          "block_hashes": draw(st.lists(hashes, min_size=n, max_size=n)),
          "parent_block_hash": draw(st.one_of(st.none(), hashes)),
          "token_ids": [] if tokenless else draw(st.lists(token_ids_ok, min_size=n * BLOCK_SIZE,
                                                          max_size=n * BLOCK_SIZE)),
          "block_size": 0 if tokenless and draw(st.booleans()) else BLOCK_SIZE,
          "lora_id": draw(st.one_of(st.none(), st.integers(0, 10))),
          "medium": draw(media)}
    if draw(st.booleans()):
        ev["lora_name"] = draw(st.one_of(st.none(), st.text(max_size=5)))
        ev["extra_keys"] = draw(st.one_of(st.none(), st.lists(st.one_of(st.none(), st.integers(-5, 5)),
                                                              max_size=3)))
        ev["group_idx"] = draw(st.one_of(st.none(), st.integers(0, 3)))
        ev["kv_cache_spec_kind"] = draw(st.one_of(st.none(), st.sampled_from(
            ["full_attention", "sliding_window", "mamba"])))
    return ev


@st.composite
def removed_events(draw) -> dict:
    return {"type": "BlockRemoved", "block_hashes": draw(st.lists(hashes, max_size=4)),
            "medium": draw(media)}


@st.composite
def cleared_events(draw) -> dict:
    ev: dict = {"type": "AllBlocksCleared"}
    if draw(st.booleans()):
        ev["medium"] = draw(media)
    return ev


valid_events = st.one_of(stored_events(), removed_events(), cleared_events())
