"""A MessagePack scanner that cuts a batch payload (§2) into small groups of events, and the
"one object per payload" check of snapshot messages.

``ormsgpack.unpackb`` of one large payload holds the GIL for the whole C call. The snapshot
client (:mod:`kvsvc.streams.snapshot_client`) instead unpacks a large reply payload group by
group (:func:`split_batch`), yielding the GIL in between; ``ormsgpack`` stays the parser and the
answer (events or error text) is exactly that of a whole-payload decode.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import msgpack
import ormsgpack

from kvsvc.errors import DecodeError

#: :func:`split_batch` cuts a batch's events into groups of at least this many bytes (one
#: event more at most): one ``ormsgpack.unpackb`` of a group takes ~0.1 ms.
SPLIT_GROUP_BYTES = 16 * 1024
#: What ``msgpack`` raises for a payload it cannot skip through: ``FormatError``,
#: ``StackError`` and its length limits are ``ValueError``; ``OutOfData`` (truncated) is not.
_SCAN_ERRORS = (ValueError, msgpack.UnpackException)


def split_batch(payload: bytes, expected_rank: int, pace: Callable[[], None],
                group_bytes: int = SPLIT_GROUP_BYTES) -> Optional[list[bytes]]:
    """The events of a batch ``[ts, events(, dp_rank)]`` (§2) cut into groups, each a small
    MessagePack payload ``[[event, ...]]`` that ``ormsgpack.unpackb`` decodes in ~0.1 ms, so
    that no single call holds the GIL for the whole payload (one 1 MiB reply message takes
    5-9 ms).

    ``ormsgpack`` does not say where an object ends, so the boundaries come from a
    ``msgpack.Unpacker`` that only skips (C code, ~0.7 us per event, no objects built);
    ``ormsgpack`` stays the parser. Each group's events sit inside two arrays, as in the batch,
    so ``ormsgpack``'s nesting limit applies to them exactly as to the whole payload. MessagePack
    lengths are self-describing, so both libraries end every object at the same byte.

    :param payload: the batch payload.
    :param expected_rank: the stream's DP rank; a batch carrying another gives ``None``.
    :param pace: called after each group (the caller's GIL yield).
    :param group_bytes: a group ends at the first event boundary this many bytes or more
        after its start (so a group holds at least one event).
    :returns: the groups, in order: ``ormsgpack.unpackb(group)[0]`` are the events a
        whole-payload ``unpackb`` holds at that place. ``None`` when the payload is not such
        an array, is malformed where ``msgpack`` looks (headers, lengths, truncation, nesting),
        has bytes after it, or has a ``ts`` or rank that :func:`decode_batch` would refuse: the
        caller then decodes it whole (same answer or error as before, just not sliced). A group
        can still fail in ``ormsgpack`` (say, invalid UTF-8, which ``msgpack`` does not check
        when skipping); the caller then decodes whole too.
    """
    size = len(payload)
    if size < 2 or payload[0] not in (0x92, 0x93):
        return None
    view = memoryview(payload)
    scan = _scanner(payload)
    groups: list[bytes] = []
    try:
        scan.read_array_header()
        ts = _scalar(scan, view)
        if type(ts) is not float and type(ts) is not int:
            return None
        count = scan.read_array_header()
        start = scan.tell()
        in_group = 0
        for _ in range(count):
            scan.skip()
            in_group += 1
            end = scan.tell()
            if end - start >= group_bytes:
                groups.append(wrap_events(view[start:end], in_group))
                start, in_group = end, 0
                pace()
        if in_group:
            groups.append(wrap_events(view[start:scan.tell()], in_group))
        if payload[0] == 0x93:
            rank = _scalar(scan, view)
            if rank is not None and (type(rank) is not int or rank != expected_rank):
                return None
    except _SCAN_ERRORS:  # ormsgpack's MsgpackDecodeError is a ValueError too
        return None
    return groups if scan.tell() == size else None


def check_single_object(payload: bytes) -> None:
    """Refuse bytes after the first MessagePack object of ``payload`` (§2: a payload is one
    batch). ``ormsgpack.unpackb`` decodes the first object and ignores the rest, so a snapshot
    message holding a batch plus anything (a second batch with removals, say) would otherwise
    be taken for that batch alone. Costs a ``msgpack`` skip (~0.6 us per kB): paid on snapshot
    messages, not on live ones (D19 in docs/decisions.md).

    :param payload: a payload ``ormsgpack`` decoded without error.
    :raises DecodeError: naming how many bytes follow the batch.
    """
    scan = _scanner(payload)
    try:
        scan.skip()
    except _SCAN_ERRORS:
        # Beyond msgpack's own limits (nesting) where ormsgpack decoded it: nothing to say.
        return
    extra = len(payload) - scan.tell()
    if extra:
        raise DecodeError(f"payload has {extra} byte{'' if extra == 1 else 's'} after its "
                          f"batch (a payload is one batch, §2)")


def _scanner(payload: bytes) -> msgpack.Unpacker:
    """A ``msgpack.Unpacker`` fed with ``payload``, for skipping through it. Every
    ``max_*_len`` limit defaults from ``max_buffer_size``: no valid object of this payload can
    exceed them."""
    scan = msgpack.Unpacker(max_buffer_size=max(len(payload), 1))
    scan.feed(payload)
    return scan


def _scalar(scan: msgpack.Unpacker, view: memoryview) -> Any:
    """The next object of ``scan`` (skipped there), decoded by ``ormsgpack``.

    :raises ValueError: either library refuses it (or ``msgpack.OutOfData``: truncated).
    """
    start = scan.tell()
    scan.skip()
    return ormsgpack.unpackb(view[start:scan.tell()])


def wrap_events(events: memoryview, count: int) -> bytes:
    """``[[events...]]``: ``count`` encoded events (their MessagePack bytes, back to back)
    wrapped in two array headers (fixarray, array16 or array32 for the inner one)."""
    if count < 16:
        head = bytes((0x91, 0x90 | count))
    elif count < 0x10000:
        head = b"\x91\xdc" + count.to_bytes(2, "big")
    else:
        head = b"\x91\xdd" + count.to_bytes(4, "big")
    return head + events

