"""Wire forms of the simulated engine's flavors: the same cache changes encoded the way xLLM,
vLLM or SGLang publish them (§2), plus the replay behaviour each flavor has (§7 or §7h).

Pure functions, no sockets: :class:`~kvsvc.testbed.sim.engine.SimEngine` calls
:func:`encode_batch` with the xLLM-form event maps of
:class:`~kvsvc.testbed.sim.block_manager.BlockManager` and publishes the bytes.

Flavors (written from the protocol, §2 and §7h; nothing copied from the engines):

- ``xllm``: batch ``[ts, events, dp_rank]``, event maps with every §2 field, medium
  ``"gpu"``/``"cpu"``, u64 integer hashes; replay answers a snapshot (§7).
- ``vllm``: batch map ``{"ts", "events", "data_parallel_rank"}``; event maps
  ``{"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
  "medium", "lora_name"}`` (fields left at their default are omitted, as a struct encoder
  with ``omit_defaults`` does), ``BlockRemoved`` ``{"type", "block_hashes", "medium"}``,
  ``AllBlocksCleared`` ``{"type"}``; medium ``"GPU"``/``"CPU"``. A block's vLLM hash is a
  byte string (:func:`vllm_raw_hash`, 16 bytes); Device events carry its integer form
  ``int.from_bytes(raw, "big") & (2**64 - 1)`` (vLLM's default
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), the CPU offloading tier's events carry the raw
  bytes of the same hash with ``parent_block_hash`` nil (§2, the reason for §7h's hash
  normalisation). With ``vllm_array`` the older tagged-array form is sent instead:
  ``[ts, [[type, field1, ...], ...], dp_rank]``. Replay answers history (§7h).
- ``sglang``: batch ``[ts, events, attn_dp_rank]`` with tagged-array events
  ``["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium]``,
  ``["BlockRemoved", hashes, medium]``, ``["AllBlocksCleared"]``; hashes signed 64-bit
  integers (§2 normalises them with ``& (2**64 - 1)``); medium ``"GPU"``/``"CPU"``. Replay
  answers history (§7h).

The simulated engine's own block id (:func:`~kvsvc.testbed.sim.block_manager.chain_hash`, u64)
is always the integer form, so ground truth (``SimEngine.resident``) is keyed the same for every
flavor.
"""

from __future__ import annotations

import enum
from typing import Any, Optional, Sequence

import ormsgpack
import xxhash

_U64 = 0xFFFF_FFFF_FFFF_FFFF


class Flavor(str, enum.Enum):
    """Which engine the simulated engine speaks like (``kvsvc sim --flavor``)."""

    XLLM = "xllm"
    VLLM = "vllm"
    SGLANG = "sglang"

    @property
    def history(self) -> bool:
        """True when its replay endpoint answers history (§7h), False for a snapshot (§7)."""
        return self is not Flavor.XLLM

    @property
    def backend_type(self) -> str:
        """The registry's ``backend_type`` of such an instance (§9)."""
        return self.value


def vllm_raw_hash(h: int) -> bytes:
    """The raw (bytes) vLLM block hash of the simulated block ``h`` (u64): 16 bytes whose last
    8 are ``h`` big-endian, so that ``int.from_bytes(raw, "big") & (2**64 - 1) == h`` (the
    integer form vLLM's Device events carry, §2). The first 8 bytes are derived from ``h``
    (XXH3-64 of it) only so that the bytes look like a digest."""
    hb = h.to_bytes(8, "big")
    return xxhash.xxh3_64_digest(hb) + hb


def int_form(raw: bytes) -> int:
    """§2's integer form of a byte-string hash: ``int.from_bytes(raw, "big") & (2**64 - 1)``."""
    return int.from_bytes(raw, "big") & _U64


def _signed64(h: int) -> int:
    return h - (1 << 64) if h >= 1 << 63 else h


def _is_cpu(medium: Optional[str]) -> bool:
    return (medium or "").lower() == "cpu"


def _vllm_event_map(e: dict) -> dict:
    kind = e["type"]
    if kind == "AllBlocksCleared":
        return {"type": kind}
    cpu = _is_cpu(e.get("medium"))
    medium = "CPU" if cpu else "GPU"
    hashes: list[Any] = [vllm_raw_hash(h) if cpu else h for h in e["block_hashes"]]
    if kind == "BlockRemoved":
        return {"type": kind, "block_hashes": hashes, "medium": medium}
    parent = None if cpu else e["parent_block_hash"]
    return {"type": kind, "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": list(e["token_ids"]), "block_size": e["block_size"], "lora_id": None,
            "medium": medium, "lora_name": None}


def _tagged(e: dict, signed: bool) -> list:
    kind = e["type"]
    if kind == "AllBlocksCleared":
        return [kind]
    cpu = _is_cpu(e.get("medium"))
    medium = "CPU" if cpu else "GPU"
    if signed:
        hashes: list[Any] = [_signed64(h) for h in e["block_hashes"]]
        parent = e.get("parent_block_hash")
        parent = None if parent is None else _signed64(parent)
    else:  # vLLM's older array form: same hash rule as its map form
        hashes = [vllm_raw_hash(h) if cpu else h for h in e["block_hashes"]]
        parent = None if cpu else e.get("parent_block_hash")
    if kind == "BlockRemoved":
        return [kind, hashes, medium]
    return [kind, hashes, parent, list(e["token_ids"]), e["block_size"], None, medium]


def encode_events(flavor: Flavor, events: Sequence[dict], vllm_array: bool = False) -> list:
    """The flavor's event objects (before MessagePack) of xLLM-form event maps.

    :param events: maps as :mod:`kvsvc.testbed.sim.block_manager` builds them (``type``,
        ``block_hashes`` u64 ints, ``parent_block_hash``, ``token_ids``, ``block_size``,
        ``medium`` ``"gpu"``/``"cpu"``) or ``{"type": "AllBlocksCleared"}``.
    :returns: list of maps (xLLM, vLLM map form) or tagged arrays (vLLM array form, SGLang).
    """
    if flavor is Flavor.XLLM:
        return list(events)
    if flavor is Flavor.VLLM:
        if vllm_array:
            return [_tagged(e, signed=False) for e in events]
        return [_vllm_event_map(e) for e in events]
    return [_tagged(e, signed=True) for e in events]


def encode_batch(flavor: Flavor, ts: float, events: Sequence[dict], dp_rank: int,
                 vllm_array: bool = False) -> bytes:
    """One published payload (§2) of ``events`` in the flavor's batch form.

    :param ts: float seconds.
    :param events: xLLM-form event maps (see :func:`encode_events`).
    :param dp_rank: the publishing rank.
    :param vllm_array: vLLM only: the older tagged-array form ``[ts, events, rank]``.
    :returns: MessagePack bytes.
    """
    ev = encode_events(flavor, events, vllm_array)
    if flavor is Flavor.VLLM and not vllm_array:
        return ormsgpack.packb({"ts": float(ts), "events": ev, "data_parallel_rank": dp_rank})
    return ormsgpack.packb([float(ts), ev, dp_rank])
