"""Framing of live and snapshot messages (§1, §7)."""

from __future__ import annotations

import pytest

from kvsvc.errors import DecodeError
from kvsvc.streams.frame import (
    END_MARKER,
    NO_WATERMARK,
    LiveFrame,
    ReplyFrame,
    encode_live,
    encode_reply,
    encode_snapshot_request,
    parse_live,
    parse_reply,
    parse_snapshot_request,
)

LIMIT = 1024


def test_live_roundtrip():
    frames = encode_live(b"kv", 258, b"\x93\x01")
    assert frames == [b"kv", b"\x00\x00\x00\x00\x00\x00\x01\x02", b"\x93\x01"]
    assert parse_live(frames, LIMIT) == LiveFrame(topic=b"kv", seq=258, payload=b"\x93\x01",
                                                  wire_bytes=12)


def test_live_max_seq_and_empty_topic():
    frame = parse_live(encode_live(b"", NO_WATERMARK, b"x"), LIMIT)
    assert (frame.topic, frame.seq, frame.wire_bytes) == (b"", 2**64 - 1, 9)


@pytest.mark.parametrize("frames, reason", [
    ([b"", b"\x00" * 8], "2 frames"),
    ([b"", b"\x00" * 8, b"x", b"y"], "4 frames"),
    ([b""], "1 frames"),
    ([b"", b"\x00" * 7, b"x"], "seq frame is 7 bytes"),
    ([b"", b"\x00" * 9, b"x"], "seq frame is 9 bytes"),
])
def test_live_malformed(frames, reason):
    with pytest.raises(DecodeError, match=reason):
        parse_live(frames, LIMIT)


def test_live_size_limit_counts_all_frames():
    # 2 + 8 + 1014 = 1024 bytes: exactly at the limit is fine, one more byte is not.
    assert parse_live([b"kv", b"\x00" * 8, b"p" * 1014], LIMIT).wire_bytes == 1024
    with pytest.raises(DecodeError, match=r"message exceeds max_message_bytes \(1025 > 1024"):
        parse_live([b"kv", b"\x00" * 8, b"p" * 1015], LIMIT)


def test_encode_live_rejects_bad_seq():
    with pytest.raises(ValueError):
        encode_live(b"", -1, b"x")
    with pytest.raises(ValueError):
        encode_live(b"", 2**64, b"x")


def test_snapshot_request_roundtrip():
    frames = encode_snapshot_request(7)
    assert frames == [b"", b"\x00" * 7 + b"\x07"]
    assert parse_snapshot_request(frames) == 7
    with pytest.raises(DecodeError):
        parse_snapshot_request([b"x", b"\x00" * 8])
    with pytest.raises(DecodeError):
        parse_snapshot_request([b"", b"\x00" * 4])


def test_reply_data_end_and_four_frames():
    assert parse_reply(encode_reply(41, b"\x92"), LIMIT) == ReplyFrame(
        watermark=41, payload=b"\x92", is_end=False, wire_bytes=9)
    # No live batch yet: NO_WATERMARK with a payload.
    assert parse_reply(encode_reply(None, b"\x92"), LIMIT).watermark is None
    assert parse_reply(list(END_MARKER), LIMIT) == ReplyFrame(
        watermark=None, payload=b"", is_end=True, wire_bytes=8)
    four = [b"", b"kv", (5).to_bytes(8, "big"), b"\x92"]
    assert parse_reply(four, LIMIT) == ReplyFrame(watermark=5, payload=b"\x92", is_end=False,
                                                  wire_bytes=11)


@pytest.mark.parametrize("frames, reason", [
    ([b"", b"\x00" * 8], "2 frames"),
    ([b"x", b"\x00" * 8, b"p"], "empty delimiter"),
    ([b"", b"\x00" * 4, b"p"], "watermark frame is 4 bytes"),
    ([b"", b"\x00" * 8, b""], "empty payload"),
])
def test_reply_malformed(frames, reason):
    with pytest.raises(DecodeError, match=reason):
        parse_reply(frames, LIMIT)


def test_reply_size_limit():
    with pytest.raises(DecodeError, match="exceeds max_message_bytes"):
        parse_reply([b"", b"\x00" * 8, b"p" * 1017], LIMIT)


def test_encode_reply_rejects_empty_payload():
    with pytest.raises(ValueError):
        encode_reply(3, b"")
