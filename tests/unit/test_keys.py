"""Content keys (§4) against independently computed XXH3-128 values."""

from __future__ import annotations

import pytest
import xxhash

from kvsvc.index.keys import chain_keys, key_to_bytes, pack_tokens, prompt_keys

SEED = 1024


def le32(*tokens: int) -> bytes:
    """Tokens as 32-bit little-endian, built by hand (not through the module under test)."""
    return b"".join(t.to_bytes(4, "little") for t in tokens)


def xxh(data: bytes, seed: int = SEED) -> int:
    return xxhash.xxh3_128_intdigest(data, seed=seed)


def test_pack_tokens_is_little_endian_u32():
    assert pack_tokens([0, 1, 258, 2**31 - 1]) == (
        b"\x00\x00\x00\x00" b"\x01\x00\x00\x00" b"\x02\x01\x00\x00" b"\xff\xff\xff\x7f")
    assert pack_tokens([]) == b""
    assert pack_tokens((7, 8)) == le32(7, 8)


def test_pack_tokens_accepts_bool_as_int():
    # Documented choice: bool is an int subclass and not rejected (too costly to detect).
    assert pack_tokens([True, False]) == le32(1, 0)


@pytest.mark.parametrize("bad, index, words", [
    ([1, -1], 1, "out of range"),
    ([2**31], 0, "out of range"),
    ([5, 6, 2**32 - 1], 2, "out of range"),
    ([2**40], 0, "out of range"),
    ([1, 2.0], 1, "float"),
    (["3"], 0, "str"),
    ([4, None], 1, "NoneType"),
])
def test_pack_tokens_rejects_with_position(bad, index, words):
    with pytest.raises(ValueError) as info:
        pack_tokens(bad)
    assert f"token_ids[{index}]" in str(info.value)
    assert words in str(info.value)


def test_chain_keys_three_blocks_match_direct_xxhash():
    b0, b1, b2 = (1, 2, 3), (4, 5, 6), (2**31 - 1, 0, 9)
    k0 = xxh(le32(*b0))
    k1 = xxh(k0.to_bytes(16, "little") + le32(*b1))
    k2 = xxh(k1.to_bytes(16, "little") + le32(*b2))
    assert chain_keys(le32(*b0, *b1, *b2), 3, SEED) == [k0, k1, k2]
    assert len({k0, k1, k2}) == 3


def test_chain_keys_known_answer():
    # Fixed vector (XXH3-128 of the 16 bytes of block [1, 2, 3, 4], seed 1024, computed once
    # with a direct xxhash call): guards against a library or byte-order change.
    expected = 0x5F969E759C68D8E82D5EA1377E03C6B0
    assert xxhash.xxh3_128_intdigest(b"\x01\0\0\0\x02\0\0\0\x03\0\0\0\x04\0\0\0",
                                     seed=1024) == expected
    assert chain_keys(le32(1, 2, 3, 4), 4, 1024) == [expected]
    assert key_to_bytes(expected) == xxhash.xxh3_128_digest(le32(1, 2, 3, 4), seed=1024)[::-1]


def test_chain_keys_from_parent_continues_the_chain():
    full = chain_keys(le32(1, 2, 3, 4, 5, 6), 2, SEED)
    assert len(full) == 3
    assert chain_keys(le32(3, 4, 5, 6), 2, SEED, parent_key=full[0]) == full[1:]
    assert chain_keys(le32(5, 6), 2, SEED, parent_key=full[1]) == full[2:]


def test_chain_keys_ignores_partial_block_and_accepts_memoryview():
    packed = le32(1, 2, 3, 4, 5)
    assert chain_keys(packed, 2, SEED) == chain_keys(le32(1, 2, 3, 4), 2, SEED)
    assert len(chain_keys(packed, 2, SEED)) == 2
    assert chain_keys(memoryview(packed), 2, SEED) == chain_keys(packed, 2, SEED)
    assert chain_keys(le32(1), 2, SEED) == []
    assert chain_keys(b"", 2, SEED) == []


def test_chain_keys_depends_on_seed():
    assert chain_keys(le32(1, 2), 2, 0) == [xxh(le32(1, 2), seed=0)]
    assert chain_keys(le32(1, 2), 2, 0) != chain_keys(le32(1, 2), 2, SEED)
    assert chain_keys(le32(1, 2), 2, 2**64 - 1) == [xxh(le32(1, 2), seed=2**64 - 1)]


def test_chain_keys_rejects_block_size_zero():
    with pytest.raises(ValueError, match="block_size"):
        chain_keys(le32(1, 2), 0, SEED)


def test_prompt_keys_full_blocks_only():
    k0 = xxh(le32(10, 11))
    k1 = xxh(k0.to_bytes(16, "little") + le32(12, 13))
    assert prompt_keys([10, 11, 12, 13, 14], 2, SEED) == [k0, k1]
    assert prompt_keys([10, 11, 12, 13], 2, SEED) == [k0, k1]
    assert prompt_keys([10], 2, SEED) == []
    assert prompt_keys([], 2, SEED) == []


def test_prompt_keys_validates_the_tail_too():
    with pytest.raises(ValueError, match=r"token_ids\[2\]"):
        prompt_keys([1, 2, -5], 2, SEED)
    with pytest.raises(ValueError, match="block_size"):
        prompt_keys([1, 2], 0, SEED)


def test_key_to_bytes():
    assert key_to_bytes(1) == b"\x01" + b"\x00" * 15
    assert key_to_bytes(2**128 - 1) == b"\xff" * 16
    assert key_to_bytes(0x0102) == b"\x02\x01" + b"\x00" * 14
    with pytest.raises(OverflowError):
        key_to_bytes(2**128)
