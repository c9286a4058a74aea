"""Content keys of blocks (§4).

A content key identifies a block *and its whole prefix*::

    key(block_0) = XXH3_128(tokens_0, seed)
    key(block_i) = XXH3_128(key(block_{i-1}) as 16 bytes little-endian || tokens_i, seed)

where ``tokens_i`` are the block's token ids packed as 32-bit little-endian unsigned integers
and ``seed`` is the stream's ``hash_seed``. In memory a key is a Python ``int``, the unsigned
128-bit digest (equal to ``xxhash.xxh3_128_intdigest``); its byte form, used for chaining and for
cross-checks against an engine, is ``key.to_bytes(16, "little")`` (:func:`key_to_bytes`). This is
byte-for-byte the block key of xLLM's prefix cache (§4).

This module is on the hot path of ingest and query, so each step uses the cheapest form:

* token ids are packed by ``array("I").fromlist(ids)`` + ``tobytes()`` on little-endian hosts
  (``array`` uses the host's byte order; a compiled ``struct.Struct("<...I")`` stays for the
  others): it checks the range itself and builds no argument tuple;
* a block's hash input is ``prev + packed[i:j]`` (plain ``bytes`` concatenation);
* a digest is taken as ``xxh3_128_digest()[::-1]`` (the little-endian byte form, reused as the
  next block's prefix) and converted once with ``int.from_bytes``, which also yields the most
  compact ints (they are the index's keys, a million of them per large stream).

A ``memoryview`` input works too (``bytes + memoryview`` yields ``bytes``).
"""

from __future__ import annotations

import functools
import struct
import sys
from array import array
from typing import Optional, Sequence, Union

import xxhash

#: Largest valid token id (§4): ids are 32-bit little-endian but must fit in 31 bits.
MAX_TOKEN_ID = 2**31 - 1

#: Byte length of a content key in its wire/byte form.
KEY_BYTES = 16

#: True where an ``array("I")`` (and a ``memoryview`` cast to ``"I"``) holds token ids in the
#: §4 byte form: 4-byte little-endian items. The packing fast paths here, the decoder's token
#: view and the query endpoint's ids depend on it; elsewhere they take the ``struct`` path.
ARRAY_IS_WIRE_FORM = sys.byteorder == "little" and array("I").itemsize == 4


@functools.lru_cache(maxsize=256)
def _token_struct(n: int) -> struct.Struct:
    """Compiled ``<nI`` packer. A bounded, thread-safe memo of a pure function (not shared
    state): a compiled ``Struct.pack`` skips parsing the format on every call,
    and ingest sees the same few event sizes over and over."""
    return struct.Struct("<%dI" % n)


def _describe_bad_token(token_ids: Sequence[int]) -> str:
    """Slow path: name the first invalid token id (only called after packing failed)."""
    for i, t in enumerate(token_ids):
        if not isinstance(t, int):
            return f"token_ids[{i}] is {type(t).__name__} {t!r}, not an int"
        if not 0 <= t <= MAX_TOKEN_ID:
            return f"token_ids[{i}] = {t} is out of range [0, 2**31-1]"
    return "token_ids could not be packed as 32-bit integers"


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Pack token ids as 32-bit little-endian unsigned integers (§4).

    ``bool`` values are accepted as 0/1: ``bool`` is an ``int`` subclass and rejecting it would
    need a Python-level type check of every token, which costs more than the packing itself (D20).
    Callers that parse JSON (where ``true`` is not a number) must reject booleans themselves.

    :param token_ids: token ids, each an ``int`` in ``[0, 2**31 - 1]``; any length.
    :returns: ``4 * len(token_ids)`` bytes.
    :raises ValueError: naming the index and value of the first element that is not an ``int``
        or is out of range.
    """
    if not ARRAY_IS_WIRE_FORM:  # pragma: no cover - no mainstream host
        try:
            packed = _token_struct(len(token_ids)).pack(*token_ids)
        except (struct.error, TypeError, OverflowError) as exc:
            raise ValueError(_describe_bad_token(token_ids)) from exc
    elif type(token_ids) is array and token_ids.typecode == "I":
        packed = token_ids.tobytes()  # its buffer already is the §4 byte form
    else:
        tokens = array("I")
        try:
            # fromlist converts in one C loop without the argument tuple struct.pack(*ids)
            # needs (module docstring).
            tokens.fromlist(token_ids if type(token_ids) is list else list(token_ids))
        except (TypeError, OverflowError) as exc:
            raise ValueError(_describe_bad_token(token_ids)) from exc
        packed = tokens.tobytes()
    # "<I" accepts up to 2**32-1; an id >= 2**31 has the top bit of its last (most
    # significant) byte set, which ``isascii`` on every 4th byte finds at C speed.
    if not packed[3::4].isascii():
        raise ValueError(_describe_bad_token(token_ids))
    return packed


def chain_keys(packed: Union[bytes, memoryview], block_size: int, seed: int,
               parent_key: Optional[int] = None) -> list[int]:
    """Content keys of the full blocks of ``packed``, chained from ``parent_key`` (§4).

    :param packed: tokens as produced by :func:`pack_tokens` (4 bytes per token).
    :param block_size: tokens per block, >= 1.
    :param seed: XXH3 seed, the stream's ``hash_seed``, in ``[0, 2**64 - 1]``.
    :param parent_key: content key of the block preceding the first one, ``None`` for the root.
    :returns: ``len(packed) // (4 * block_size)`` keys, oldest first; a trailing partial block
        is ignored.
    :raises ValueError: if ``block_size < 1``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    step = 4 * block_size
    end = len(packed) // step * step
    digest = xxhash.xxh3_128_digest  # canonical form: big-endian
    from_bytes = int.from_bytes
    keys: list[int] = []
    append = keys.append
    prev = b"" if parent_key is None else parent_key.to_bytes(KEY_BYTES, "little")
    for i in range(0, end, step):
        prev = digest(prev + packed[i:i + step], seed)[::-1]
        append(from_bytes(prev, "little"))
    return keys


def prompt_keys(token_ids: Sequence[int], block_size: int, seed: int) -> list[int]:
    """Content keys of the full blocks of a prompt, from the root (§4, §10).

    :param token_ids: prompt token ids, each an ``int`` in ``[0, 2**31 - 1]``.
    :param block_size: tokens per block, >= 1.
    :param seed: XXH3 seed of the stream.
    :returns: ``len(token_ids) // block_size`` keys; trailing tokens of a partial block are
        not hashed (only full blocks count, §10) but are still validated.
    :raises ValueError: for an invalid token id anywhere in ``token_ids`` (see
        :func:`pack_tokens`) or ``block_size < 1``.
    """
    # Every token is validated, the partial tail included: a bad id anywhere in a prompt is bad
    # input, whether or not it would have been hashed.
    return chain_keys(pack_tokens(token_ids), block_size, seed)


def key_to_bytes(key: int) -> bytes:
    """The 16-byte little-endian form of a content key (§4).

    :param key: content key, an unsigned 128-bit ``int``.
    :raises OverflowError: if ``key`` is negative or does not fit in 128 bits.
    """
    return key.to_bytes(KEY_BYTES, "little")
