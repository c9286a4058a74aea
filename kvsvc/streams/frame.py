"""ZMQ multipart framing of the live channel (§1) and the snapshot channel (§7).

Parsing turns a received multipart message (a list of ``bytes`` frames) into a frozen
dataclass or raises :class:`~kvsvc.errors.DecodeError` with a reason that becomes the
stream's ``error``. Encoding helpers build the same frames for publishers (the test
publisher and the simulated engine), so both sides share one definition of the wire.

Live message (§1)::

    [topic, seq (8 bytes, big-endian u64), payload]

Snapshot request (§7), DEALER -> ROUTER::

    [b"", start_seq (8 bytes, big-endian u64)]

Snapshot reply (§7), ROUTER -> DEALER (the DEALER sees these frames; the ROUTER side
prepends the peer identity)::

    [b"", watermark (8 bytes), payload]            data message
    [b"", topic, watermark (8 bytes), payload]     data message, 4-frame form
    [b"", 0xFFFFFFFFFFFFFFFF, b""]                 end marker

Size limits count every frame of a message (§8 ``max_message_bytes``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Optional, Sequence

from kvsvc.errors import DecodeError

#: Watermark value meaning "no live batch published yet" in a data message, and the
#: watermark frame of the end marker (§7).
NO_WATERMARK = 0xFFFFFFFFFFFFFFFF

_U64 = struct.Struct(">Q")

#: The end marker as the DEALER receives it (and the ROUTER sends it after the identity).
END_MARKER: tuple[bytes, bytes, bytes] = (b"", _U64.pack(NO_WATERMARK), b"")


@dataclass(slots=True)
class LiveFrame:
    """One well-formed live message (§1). Not ``frozen`` (one per live message, and a frozen
    dataclass costs several times more to build); treat it as read-only.

    :param topic: the topic frame, exactly as received (may be empty).
    :param seq: the publisher's sequence number, unsigned 64-bit.
    :param payload: the MessagePack batch, undecoded (§2): the payload frame as given, bytes
        or a ``memoryview`` of the received ZMQ frame (not copied).
    :param wire_bytes: total size of all frames in bytes (counted against buffer limits, §6).
    """

    topic: bytes
    seq: int
    payload: bytes
    wire_bytes: int


@dataclass(frozen=True, slots=True)
class ReplyFrame:
    """One snapshot reply message (§7).

    :param watermark: seq of the last live batch included in the snapshot; ``None`` when the
        engine sent ``NO_WATERMARK`` with a payload (no live batch published yet) and for the
        end marker (which carries no watermark of its own).
    :param payload: the MessagePack batch (§2); ``b""`` for the end marker.
    :param is_end: True for the end marker.
    :param wire_bytes: total size of all frames in bytes.
    """

    watermark: Optional[int]
    payload: bytes
    is_end: bool
    wire_bytes: int


def _total_size(frames: Sequence[bytes]) -> int:
    return sum(map(len, frames))


def parse_live(frames: Sequence[bytes], max_message_bytes: int) -> LiveFrame:
    """Parse one live message (§1).

    :param frames: the multipart message, one bytes-like object (``bytes``, ``memoryview``)
        per frame.
    :param max_message_bytes: limit on the total size of all frames (§8).
    :returns: the parsed :class:`LiveFrame`.
    :raises DecodeError: not exactly 3 frames, a ``seq`` frame not 8 bytes long, or a total
        size over ``max_message_bytes``.
    """
    if len(frames) != 3:
        raise DecodeError(f"live message has {len(frames)} frames, expected 3 (topic, seq, payload)")
    topic, seq_frame, payload = frames
    size = len(topic) + len(seq_frame) + len(payload)
    if size > max_message_bytes:
        raise DecodeError(
            f"message exceeds max_message_bytes ({size} > {max_message_bytes} bytes)")
    if len(seq_frame) != 8:
        raise DecodeError(f"seq frame is {len(seq_frame)} bytes, expected 8")
    return LiveFrame(bytes(topic), _U64.unpack(seq_frame)[0], payload, size)


def parse_reply(frames: Sequence[bytes], max_message_bytes: int) -> ReplyFrame:
    """Parse one snapshot reply message as received by the DEALER (§7).

    The end marker is ``[b"", NO_WATERMARK, b""]``; for robustness its 4-frame variant
    ``[b"", topic, NO_WATERMARK, b""]`` is accepted too. A data message must carry a
    non-empty payload (an empty payload is not a batch). The 4-frame topic is not checked:
    the reply socket belongs to one stream.

    :param frames: the multipart message, one ``bytes`` per frame.
    :param max_message_bytes: limit on the total size of all frames (§8).
    :raises DecodeError: wrong frame count, non-empty delimiter, watermark frame not 8 bytes,
        an empty payload with a real watermark, or a total size over ``max_message_bytes``.
    """
    n = len(frames)
    if n == 3:
        delimiter, wm_frame, payload = frames
    elif n == 4:
        delimiter, _topic, wm_frame, payload = frames
    else:
        raise DecodeError(f"snapshot reply has {n} frames, expected 3 or 4")
    size = _total_size(frames)
    if size > max_message_bytes:
        raise DecodeError(
            f"snapshot reply message exceeds max_message_bytes ({size} > {max_message_bytes} bytes)")
    if len(delimiter) != 0:
        raise DecodeError("snapshot reply does not start with an empty delimiter frame")
    if len(wm_frame) != 8:
        raise DecodeError(f"snapshot watermark frame is {len(wm_frame)} bytes, expected 8")
    watermark = _U64.unpack(wm_frame)[0]
    if len(payload) == 0:
        if watermark != NO_WATERMARK:
            raise DecodeError("snapshot reply data message has an empty payload")
        return ReplyFrame(watermark=None, payload=b"", is_end=True, wire_bytes=size)
    return ReplyFrame(watermark=None if watermark == NO_WATERMARK else watermark,
                      payload=bytes(payload), is_end=False, wire_bytes=size)


def parse_snapshot_request(frames: Sequence[bytes]) -> int:
    """Parse a snapshot request as received by a ROUTER after its identity frame (§7).

    :param frames: ``[b"", start_seq]`` (identity already removed).
    :returns: ``start_seq``.
    :raises DecodeError: not 2 frames, non-empty delimiter, or ``start_seq`` not 8 bytes.
    """
    if len(frames) != 2 or len(frames[0]) != 0 or len(frames[1]) != 8:
        raise DecodeError("snapshot request must be [b'', start_seq (8 bytes)]")
    return _U64.unpack(frames[1])[0]


def _u64(value: int, what: str) -> bytes:
    if not 0 <= value <= NO_WATERMARK:
        raise ValueError(f"{what} {value} is not an unsigned 64-bit integer")
    return _U64.pack(value)


def encode_live(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """Frames of one live message (§1).

    :param topic: topic bytes (may be empty).
    :param seq: sequence number, ``0 <= seq < 2**64``.
    :param payload: the MessagePack batch.
    :raises ValueError: ``seq`` out of range.
    """
    return [topic, _u64(seq, "seq"), payload]


def encode_snapshot_request(start_seq: int) -> list[bytes]:
    """Frames of a snapshot request as sent by the DEALER (§7): ``[b"", start_seq]``.

    :raises ValueError: ``start_seq`` out of range.
    """
    return [b"", _u64(start_seq, "start_seq")]


def encode_reply(watermark: Optional[int], payload: bytes) -> list[bytes]:
    """Frames of one snapshot data message (§7), without the ROUTER identity frame.

    :param watermark: seq of the last live batch the snapshot includes, or ``None`` when no
        live batch has been published yet (sent as ``NO_WATERMARK``).
    :param payload: a non-empty MessagePack batch.
    :raises ValueError: ``watermark`` out of range or empty ``payload``.
    """
    if not payload:
        raise ValueError("a snapshot data message needs a non-empty payload")
    wm = NO_WATERMARK if watermark is None else watermark
    return [b"", _u64(wm, "watermark"), payload]
