"""Decoding of one MessagePack batch (§2) into :class:`kvsvc.events.Batch`, with the §3
exclusion rule applied per event.

Accepted forms (§2):

- batch: array ``[ts, events, dp_rank]``, array ``[ts, events]`` (no rank: it belongs to the
  stream it arrived on), or map ``{"ts", "events", "data_parallel_rank"}``; a nil rank counts
  as absent;
- event: map with ``"type"`` (unknown keys ignored), or tagged array ``[type, field1, ...]``
  in the §2 field order with trailing fields optional (extra trailing fields ignored, like
  unknown map keys).

Required fields (in both forms): ``BlockStored`` needs ``block_hashes``, ``parent_block_hash``
(nil for a root; an absent parent is not taken for a root, which could forge a false prefix; D18),
``token_ids`` and ``block_size``; ``BlockRemoved`` needs ``block_hashes``; ``AllBlocksCleared``
needs nothing, and its ``medium`` restricts it to one tier (absent or nil: every tier).

Hash forms (§2): integers become unsigned 64-bit; byte strings stay bytes on snapshot-mode
streams and become ``int.from_bytes(h, "big") & (2**64 - 1)`` on history-mode streams
(``int_hashes``: vLLM's CPU offloading connector sends the raw bytes of a hash whose Device
events carry that integer). The option costs nothing on integer hashes (the common case).

Everything that is not exactly as specified raises :class:`~kvsvc.errors.DecodeError`, the
only error this module raises (``ormsgpack``'s own error is translated here, once).

Token ids are converted once, here (this is the ingest hot path): a compiled ``struct``
packs the list ``ormsgpack`` produced into the §4 byte form (32-bit little-endian; non-integers,
negatives and values of 2**32 or more fail the packing) and the top bit of every item's most
significant byte is checked with one ``isascii`` over every 4th byte (values of 2**31 or more):
:func:`kvsvc.index.keys.pack_tokens`. The event carries those bytes as ``packed_tokens`` (the
index hashes them as they are) and ``token_ids`` as a zero-copy ``memoryview`` of them in
format ``"I"`` (4 bytes per id however long the event waits in a recovery buffer). Known gap:
MessagePack booleans are Python ``bool``, a subclass of ``int``, and pass as 0/1 (no engine
sends booleans as token ids; checking every item's type would cost more than the packing
itself). Likewise ``ormsgpack.unpackb`` ignores bytes after the first complete object, so
trailing garbage after a valid live batch is not detected (a truncated payload is): finding
the end takes a second scan, ~13% of the live path's CPU. Snapshot messages are checked
(:func:`kvsvc.streams.split.check_single_object`).
"""

from __future__ import annotations

from array import array
from typing import Any, Sequence

import ormsgpack

from kvsvc.errors import DecodeError
from kvsvc.index.keys import ARRAY_IS_WIRE_FORM, pack_tokens
from kvsvc.events import (
    DEVICE,
    MEDIUM_TIERS,
    OTHER_MEDIUM,
    AllBlocksCleared,
    Batch,
    BlockRemoved,
    BlockStored,
    EngineHash,
    Event,
)

_U64_MASK = 0xFFFF_FFFF_FFFF_FFFF

#: Field order of the tagged-array form (§2), after the type tag.
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                  "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
#: ``kv_cache_spec_kind`` values of a plain-text attention group (§3).
_PLAIN_SPEC_KINDS = (None, "full_attention")
_CLEARED_FIELDS = ("medium",)
_FIELDS = {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS,
           "AllBlocksCleared": _CLEARED_FIELDS}


def decode_batch(payload: bytes, expected_rank: int, int_hashes: bool = False) -> Batch:
    """Decode one batch (§2) received on the stream of DP rank ``expected_rank``.

    :param payload: the MessagePack payload frame.
    :param expected_rank: the stream's configured DP rank; a batch carrying another rank is
        refused (one sequence can never serve two ranks).
    :param int_hashes: a history-mode stream (§2, §7h): byte-string hashes (block hashes,
        parents, removals) become ``int.from_bytes(h, "big") & (2**64 - 1)``, the integer form
        vLLM gives the same block on its Device events; False keeps bytes as bytes.
    :returns: the :class:`Batch`; events in order, hashes normalised, tiers mapped, §3
        exclusions flagged, ``BlockStored.packed_tokens`` set (module docstring).
    :raises DecodeError: invalid MessagePack, wrong shape or type anywhere, unknown event type,
        a missing required field, a token id outside ``[0, 2**31 - 1]``, or a rank mismatch.
    """
    try:
        obj = ormsgpack.unpackb(payload)
    except (ormsgpack.MsgpackDecodeError, ValueError, TypeError) as exc:
        raise DecodeError(f"payload is not valid MessagePack: {exc}") from exc

    kind = type(obj)
    if kind is list:
        if len(obj) == 3:
            ts, raw_events, rank = obj
        elif len(obj) == 2:
            (ts, raw_events), rank = obj, None
        else:
            raise DecodeError(f"batch array has {len(obj)} elements, expected 2 or 3")
    elif kind is dict:
        if "ts" not in obj or "events" not in obj:
            raise DecodeError("batch map needs keys 'ts' and 'events'")
        ts, raw_events, rank = obj["ts"], obj["events"], obj.get("data_parallel_rank")
    else:
        raise DecodeError(f"batch is {_typename(obj)}, expected an array or a map")

    if type(ts) is not float and type(ts) is not int:
        raise DecodeError(f"batch ts is {_typename(ts)}, expected a number")
    if type(raw_events) is not list:
        raise DecodeError(f"batch events is {_typename(raw_events)}, expected an array")
    if rank is not None:
        if type(rank) is not int:
            raise DecodeError(f"batch dp_rank is {_typename(rank)}, expected an integer")
        if rank != expected_rank:
            raise DecodeError(f"batch dp_rank {rank} does not match the stream's rank {expected_rank}")

    events: list[Event] = []
    for i, raw in enumerate(raw_events):
        try:
            events.append(decode_event(raw, int_hashes))
        except DecodeError as exc:
            raise DecodeError(f"event {i}: {exc}") from None
    return Batch(float(ts), events, rank)


def decode_event(raw: Any, int_hashes: bool = False) -> Event:
    """One already-unpacked event (§2), map or tagged-array form, as :func:`decode_batch`
    decodes each element of a batch's ``events`` (the snapshot client calls it on events it
    unpacked one at a time).

    :param raw: the event as ``ormsgpack.unpackb`` returns it.
    :param int_hashes: byte-string hashes to the integer form (§2 history-mode streams).
    :returns: the event dataclass (§3 exclusion flagged, ``packed_tokens`` set).
    :raises DecodeError: wrong shape or type, unknown type, missing field, bad token id.
    """
    kind = type(raw)
    if kind is dict:
        etype = raw.get("type")
        fields = raw
    elif kind is list:
        if not raw:
            raise DecodeError("event is an empty array")
        etype = raw[0]
        names = _FIELDS.get(etype) if type(etype) is str else None
        # zip() stops at the shorter side: absent trailing fields stay absent, extra ones
        # (fields of a newer engine) are ignored like unknown map keys.
        fields = dict(zip(names, raw[1:])) if names is not None else {}
    else:
        raise DecodeError(f"event is {_typename(raw)}, expected a map or an array")

    if etype == "BlockStored":
        return _block_stored(fields, int_hashes)
    if etype == "BlockRemoved":
        return _block_removed(fields, int_hashes)
    if etype == "AllBlocksCleared":
        medium = fields.get("medium")
        return AllBlocksCleared(None if medium is None else _tier(medium))
    if etype is None:
        raise DecodeError("event has no type")
    raise DecodeError(f"unknown event type {etype!r}")


def _block_stored(f: dict, int_hashes: bool) -> BlockStored:
    try:
        raw_hashes, parent = f["block_hashes"], f["parent_block_hash"]
        raw_tokens, block_size = f["token_ids"], f["block_size"]
    except KeyError as exc:
        raise DecodeError(f"BlockStored: missing field {exc.args[0]}") from None
    if type(block_size) is not int or block_size < 0:
        raise DecodeError(f"BlockStored: block_size is {_describe(block_size)}, "
                          f"expected a non-negative integer")
    get = f.get
    # Plain-text events (every optional field nil or absent, the spec kind plain) skip the
    # per-field type checks; anything else takes the full path below.
    if (get("lora_id") is None and get("lora_name") is None and get("extra_keys") is None
            and get("group_idx") is None and get("kv_cache_spec_kind") in _PLAIN_SPEC_KINDS):
        excluded = False
    else:
        excluded = _excluded(f)
    hashes = _hashes(raw_hashes, int_hashes)
    if parent is not None:
        parent = (parent & _U64_MASK if type(parent) is int
                  else _hash(parent, "parent_block_hash", int_hashes))
    packed = _packed_tokens(raw_tokens)
    return BlockStored(hashes, parent, _token_view(packed), block_size, _tier(get("medium")),
                       excluded, packed)


def _excluded(f: dict) -> bool:
    """Type-check the optional fields of a ``BlockStored`` and apply §3: LoRA, multimodal/extra
    keys and non-full-attention groups are not plain-text prefixes (the index remembers their
    hashes as excluded). :raises DecodeError: an optional field of the wrong type."""
    lora_id = _optional(f, "lora_id", int)
    lora_name = _optional(f, "lora_name", str)
    extra_keys = _optional(f, "extra_keys", list)
    _optional(f, "group_idx", int)
    spec_kind = _optional(f, "kv_cache_spec_kind", str)
    return (lora_id is not None or lora_name is not None
            or (extra_keys is not None and any(k is not None for k in extra_keys))
            or (spec_kind is not None and spec_kind != "full_attention"))


def _block_removed(f: dict, int_hashes: bool) -> BlockRemoved:
    try:
        raw_hashes = f["block_hashes"]
    except KeyError:
        raise DecodeError("BlockRemoved: missing field block_hashes") from None
    if f.get("group_idx") is not None:
        _optional(f, "group_idx", int)
    return BlockRemoved(_hashes(raw_hashes, int_hashes), _tier(f.get("medium")))


def _optional(f: dict, name: str, kind: type) -> Any:
    """``f[name]`` when of exactly ``kind`` (``bool`` is not an ``int``), ``None`` if nil or
    absent. :raises DecodeError: any other type."""
    value = f.get(name)
    if value is not None and type(value) is not kind:
        raise DecodeError(f"{name} is {_typename(value)}, expected {kind.__name__} or nil")
    return value


def _hash(value: Any, what: str, int_hashes: bool = False) -> EngineHash:
    """§2 hash normalisation: integers to unsigned 64-bit; bytes kept, or with ``int_hashes``
    (history-mode streams) turned into vLLM's integer form of the same hash, its last 8 bytes
    big-endian. :raises DecodeError:"""
    kind = type(value)
    if kind is int:
        return value & _U64_MASK
    if kind is bytes:
        return int.from_bytes(value, "big") & _U64_MASK if int_hashes else value
    raise DecodeError(f"{what} is {_typename(value)}, expected an integer or bytes")


def _hashes(raw: Any, int_hashes: bool) -> list[EngineHash]:
    if type(raw) is not list:
        raise DecodeError(f"block_hashes is {_typename(raw)}, expected an array")
    # Inline fast path for the common all-int case; anything else goes through _hash.
    return [h & _U64_MASK if type(h) is int else _hash(h, "block hash", int_hashes) for h in raw]


def _packed_tokens(raw: Any) -> bytes:
    """``token_ids`` -> the §4 byte form, ids in ``[0, 2**31 - 1]``. :raises DecodeError:"""
    if type(raw) is not list:
        raise DecodeError(f"token_ids is {_typename(raw)}, expected an array")
    try:
        return pack_tokens(raw)
    except ValueError as exc:
        raise DecodeError(str(exc)) from None  # names the first bad id: "token_ids[i] ..."


def _token_view(packed: bytes) -> Sequence[int]:
    """The ids of ``packed`` as a read-only sequence of ints without copying them."""
    if ARRAY_IS_WIRE_FORM:
        return memoryview(packed).cast("I")
    view = array("I", packed)  # pragma: no cover - no mainstream host
    view.byteswap()
    return view


def _tier(medium: Any) -> int:
    """§2 medium -> tier flag; nil is Device, unknown strings are ``OTHER_MEDIUM``.
    :raises DecodeError: non-string non-nil medium."""
    if medium is None:
        return DEVICE
    if type(medium) is not str:
        raise DecodeError(f"medium is {_typename(medium)}, expected a string or nil")
    tier = MEDIUM_TIERS.get(medium)  # engines send lower case: skip lower() then
    return tier if tier is not None else MEDIUM_TIERS.get(medium.lower(), OTHER_MEDIUM)


def _typename(value: Any) -> str:
    return "nil" if value is None else type(value).__name__


def _describe(value: Any) -> str:
    return f"{value!r}" if type(value) is int else _typename(value)
