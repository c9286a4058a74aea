"""The sliced decode of large snapshot reply payloads (kvsvc.streams.split.split_batch and
kvsvc.streams.snapshot_client.SnapshotAttempt.decode): event boundaries found by ``msgpack`` (skipping only), events still
parsed by ``ormsgpack``, and exactly the answer or error of a whole ``decode_batch``.

The invariant checked everywhere: for any payload, the sliced decode returns the events
``decode_batch`` returns, or raises ``DecodeError`` with the same text. Inputs: hand-made edge
cases (non-shortest encodings, truncations, trailing bytes, wrong rank, nesting at ormsgpack's
limit, invalid UTF-8, ext types) and hypothesis-generated valid batches, arbitrary values and
corruptions (derandomized under ``CI``).
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Optional
from unittest import mock

import msgpack
import ormsgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvsvc.streams.pacing as pacing_module
import kvsvc.streams.snapshot_client as snapshot_module
from kvsvc.config import StreamConfig, parse_kv_events_config
from kvsvc.errors import DecodeError, SnapshotError
from kvsvc.events import Event
from kvsvc.streams.decoder import decode_batch
from kvsvc.streams.frame import encode_reply
from kvsvc.streams.pacing import BUILD_TIMER_SLACK_NS, set_timer_slack
from kvsvc.streams.snapshot_client import SnapshotAttempt
from kvsvc.streams.split import check_single_object, split_batch, wrap_events
from tests.support.publisher import encode_batch, stored, to_array_event
from tests.support.strategies import msgpack_values, valid_events

B4 = 4
RANK = 0

FUZZ = settings(max_examples=200, deadline=None, derandomize=bool(os.environ.get("CI")),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _events(n: int) -> list[dict]:
    return [stored([i + 1], i or None, [(i + 1) * 100 + j for j in range(B4)], B4)
            for i in range(n)]


def _pack(obj: Any) -> bytes:
    return ormsgpack.packb(obj, option=ormsgpack.OPT_NON_STR_KEYS)


def _joined(groups: list[bytes]) -> list[Any]:
    """The events of ``split_batch``'s groups, in order."""
    return [raw for group in groups for raw in ormsgpack.unpackb(group)[0]]


def outcome(decode: Callable[[], list[Event]]) -> tuple[str, Any]:
    """("events", the events) or ("error", DecodeError text)."""
    try:
        return "events", decode()
    except DecodeError as exc:
        return "error", str(exc)


@pytest.fixture(scope="module")
def attempt_factory():
    """Builds SnapshotAttempts without sockets (only their decode is used here)."""
    ctx = zmq.Context()
    stream = StreamConfig(instance_name="split:1", dp_rank=RANK, block_size=B4,
                          endpoint="tcp://127.0.0.1:1", replay_endpoint="tcp://127.0.0.1:2")
    limits = parse_kv_events_config({"streams": []})
    yield lambda: SnapshotAttempt(stream, limits, 0, ctx, None, None)
    ctx.term()


def sliced(attempt_factory, payload: bytes, group_bytes: int = 1) -> tuple[str, Any]:
    """The outcome of an attempt's decode of ``payload``, split whatever its size."""
    with mock.patch.object(snapshot_module, "SPLIT_MIN_BYTES", 0), \
            mock.patch.object(snapshot_module, "SPLIT_GROUP_BYTES", group_bytes):
        return outcome(lambda: attempt_factory().decode(payload))


def whole(payload: bytes) -> list[Event]:
    """What a reply message decodes to unsplit: the whole-payload decode, and no byte after
    the batch (which ``ormsgpack`` alone would ignore)."""
    events = decode_batch(payload, RANK).events
    check_single_object(payload)
    return events


def assert_same_as_whole(attempt_factory, payload: bytes, group_bytes: int = 1) -> None:
    assert sliced(attempt_factory, payload, group_bytes) == outcome(lambda: whole(payload))


# -- split_batch on its own --------------------------------------------------------------------

@pytest.mark.parametrize("form", ["array3", "array2"])
@pytest.mark.parametrize("event_form", ["map", "array"])
@pytest.mark.parametrize("n", [0, 1, 17])
@pytest.mark.parametrize("group_bytes", [1, 100, 1 << 20])
def test_split_batch_gives_exactly_the_events_of_a_whole_unpack(form, event_form, n,
                                                                 group_bytes):
    payload = encode_batch(_events(n), RANK, form=form, event_form=event_form)
    calls = [0]

    def pace():
        calls[0] += 1

    groups = split_batch(payload, RANK, pace, group_bytes)
    assert groups is not None
    assert _joined(groups) == ormsgpack.unpackb(payload)[1]
    sizes = [len(ormsgpack.unpackb(g)[0]) for g in groups]
    assert sum(sizes) == n and 0 not in sizes
    if group_bytes == 1:  # every event fills a group: a pace after each
        assert sizes == [1] * n and calls[0] == n
    elif group_bytes == 1 << 20:  # one group, never full: no pace
        assert len(groups) == (1 if n else 0) and calls[0] == 0


def test_group_array_headers_of_every_width():
    """16+ events in a group take an array16 header (the 65,536+ form is arithmetic only)."""
    payload = encode_batch(_events(40), RANK)
    groups = split_batch(payload, RANK, lambda: None, 1 << 20)
    assert groups is not None and groups[0][:2] == b"\x91\xdc"
    assert _joined(groups) == ormsgpack.unpackb(payload)[1]
    assert wrap_events(memoryview(b""), 0x10000)[:6] == b"\x91\xdd\x00\x01\x00\x00"


@pytest.mark.parametrize("payload", [
    b"\x93\xca\x3f\xc0\x00\x00\x90\x00",                                  # float32 ts
    b"\x93\xcb" + b"\x00" * 8 + b"\x91\xcf" + b"\x00" * 7 + b"\x05\x00",  # uint64-encoded 5
    b"\x93\xcb" + b"\x00" * 8 + b"\xdd\x00\x00\x00\x01\x01\xd0\x00",      # array32, int8 rank
    b"\x92\xd3" + b"\x00" * 8 + b"\xdc\x00\x02\x01\xd9\x01a",             # int64 ts, str8
    b"\x92\x01\x91\xc4\x01z",                                             # bin8 event
])
def test_non_shortest_encodings_split_exactly(payload, attempt_factory):
    """msgpack skips any valid encoding: the old re-pack check declined these."""
    groups = split_batch(payload, RANK, lambda: None, 1)
    assert groups is not None
    assert _joined(groups) == ormsgpack.unpackb(payload)[1]
    assert_same_as_whole(attempt_factory, payload)


@pytest.mark.parametrize("payload", [
    encode_batch(_events(2), RANK, form="map"),                           # map form: whole
    _pack([1.5, [], 1]),                                                  # another rank
    _pack([1.5, [], "0"]),                                                # rank not an int
    _pack([1.5, [], -1]),                                                 # negative rank
    _pack(["ts", [], 0]),                                                 # ts not a number
    _pack([None, [], 0]),                                                 # ts nil
    _pack([1.5, {}, 0]),                                                  # events a map
    _pack([1.5, [], 0]) + b"\x00",                                        # trailing bytes
    encode_batch(_events(3), RANK) + b"\xc1",                             # trailing garbage
    _pack([1.5, [1, 2], 0])[:-2],                                         # truncated
    encode_batch(_events(3), RANK)[:-1],                                  # truncated rank
    encode_batch(_events(3), RANK)[:40],                                  # truncated event
    b"\x93\xcb" + b"\x00" * 8 + b"\xdc\x00\x03\x01",                      # count beyond the end
    b"\x93\xcb" + b"\x00" * 8 + b"\x91\xc1\x00",                          # reserved byte 0xc1
    b"\x93\xcb" + b"\x00" * 8 + b"\x91\xdb\xff\xff\xff\xff",              # str32 beyond the end
    b"\x94\x01\x90\x00\x00",                                              # 4-element batch
    b"\x91\x01",                                                          # 1-element batch
    b"\xc1",
    b"",
])
def test_split_batch_declines_what_is_not_a_plain_batch(payload, attempt_factory):
    assert split_batch(payload, RANK, lambda: None) is None
    assert_same_as_whole(attempt_factory, payload)


def _nested(depth: int) -> bytes:
    """An event map whose unknown key holds ``depth`` nested arrays."""
    return b"\x82\xa4type\xb0AllBlocksCleared\xa1x" + b"\x91" * depth + b"\xc0"


@pytest.mark.parametrize("depth", [1, 1016, 1018, 1019, 1020, 1021, 1022, 1023, 1030])
def test_nesting_at_ormsgpack_s_limit_is_judged_as_in_the_whole_payload(depth, attempt_factory):
    """A group wraps its events in two arrays, as the batch does: ormsgpack's recursion limit
    falls on the same event (an event alone would be accepted two levels deeper)."""
    payload = b"\x93\x01\x91" + _nested(depth) + b"\x00"
    assert_same_as_whole(attempt_factory, payload)


@pytest.mark.parametrize("payload", [
    b"\x92\x01\x92\xa1a\xa2\xff\xfe",                                     # invalid UTF-8
    b"\x92\x01\x91\xd4\x01\x00",                                          # ext type
    b"\x92\x01\x91\x81\x01\x02",                                          # non-str map key
    encode_batch(_events(3) + [{"type": "BlockStored", "block_hashes": [9]}], RANK),
    encode_batch(_events(2) + [{"type": "Nope"}] + _events(2), RANK),
    encode_batch([{"type": "Nope"}], 5),                                  # bad event and rank
])
def test_what_only_ormsgpack_or_the_decoder_refuses_fails_with_the_whole_error(
        payload, attempt_factory):
    assert_same_as_whole(attempt_factory, payload)
    assert sliced(attempt_factory, payload)[0] == "error"


# -- hypothesis --------------------------------------------------------------------------------

@st.composite
def valid_batch_payloads(draw) -> bytes:
    events = draw(st.lists(valid_events, max_size=8))
    form = draw(st.sampled_from(["array3", "array2"]))
    event_form = draw(st.sampled_from(["map", "array"]))
    ts = draw(st.one_of(st.floats(allow_nan=False, width=32), st.integers(-(2**63), 2**64 - 1)))
    obj: list = [ts, events]
    if form == "array3":
        obj.append(draw(st.sampled_from([RANK, None])))
    if event_form == "array":
        obj[1] = [to_array_event(e) for e in events]
    # msgpack packs floats as float32 when asked and chooses its own int/str/bin widths:
    # both packers' output must split exactly.
    packer = draw(st.sampled_from(["ormsgpack", "msgpack", "msgpack32"]))
    if packer == "ormsgpack":
        return ormsgpack.packb(obj)
    return msgpack.packb(obj, use_single_float=packer == "msgpack32")


@FUZZ
@given(valid_batch_payloads(), st.sampled_from([1, 50, 400, 1 << 20]))
def test_valid_batches_split_into_exactly_the_whole_events(payload, group_bytes):
    groups = split_batch(payload, RANK, lambda: None, group_bytes)
    assert groups is not None
    assert _joined(groups) == ormsgpack.unpackb(payload)[1]


@FUZZ
@given(valid_batch_payloads(), st.sampled_from([1, 50, 1 << 20]))
def test_valid_batches_decode_as_a_whole(attempt_factory, payload, group_bytes):
    assert_same_as_whole(attempt_factory, payload, group_bytes)


@FUZZ
@given(st.one_of(msgpack_values.map(lambda v: [1.5, v, RANK]),
                 st.lists(msgpack_values, max_size=6).map(lambda v: [1.5, v]),
                 st.lists(msgpack_values, max_size=6).map(lambda v: [1.5, v, RANK])))
def test_arbitrary_values_decode_as_a_whole(attempt_factory, batch):
    assert_same_as_whole(attempt_factory, _pack(batch))


@FUZZ
@given(valid_batch_payloads(), st.data())
def test_truncations_and_corruptions_decode_as_a_whole(attempt_factory, payload, data):
    cut = data.draw(st.integers(min_value=0, max_value=len(payload)))
    assert_same_as_whole(attempt_factory, payload[:cut])
    pos = data.draw(st.integers(min_value=0, max_value=len(payload) - 1))
    byte = data.draw(st.integers(min_value=0, max_value=255))
    assert_same_as_whole(attempt_factory, payload[:pos] + bytes([byte]) + payload[pos + 1:])
    tail = data.draw(st.binary(min_size=1, max_size=4))
    assert_same_as_whole(attempt_factory, payload + tail)


# -- the building thread's timer slack ---------------------------------------------------------

def _in_thread(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on a fresh thread (timer slack is per thread) and return its result."""
    box: list = []
    thread = threading.Thread(target=lambda: box.append(fn()))
    thread.start()
    thread.join(30)
    assert not thread.is_alive() and len(box) == 1
    return box[0]


@pytest.mark.skipif(not pacing_module.sys.platform.startswith("linux"), reason="Linux prctl")
def test_set_timer_slack_returns_the_previous_value():
    def run() -> tuple[Optional[int], Optional[int], Optional[int]]:
        first = set_timer_slack(7777)
        second = set_timer_slack(1)
        third = set_timer_slack(first)  # type: ignore[arg-type]
        return first, second, third

    first, second, third = _in_thread(run)
    assert first is not None and first > 0
    assert (second, third) == (7777, 1)


@pytest.mark.skipif(not pacing_module.sys.platform.startswith("linux"), reason="Linux prctl")
def test_a_build_lowers_the_slack_and_sets_it_back(attempt_factory):
    """While a reply message is built the thread's slack is BUILD_TIMER_SLACK_NS (cheap GIL
    yields); afterwards it is what it was, also when the message fails."""
    payload = encode_batch(_events(50), RANK)

    def run() -> tuple[list[Optional[int]], Optional[int], Optional[int]]:
        set_timer_slack(7777)
        attempt = attempt_factory()
        during: list[Optional[int]] = []
        decode = attempt.decode

        def spy(p: bytes) -> list[Event]:
            slack = set_timer_slack(1)
            during.append(slack)
            set_timer_slack(slack)  # type: ignore[arg-type]
            return decode(p)

        attempt.decode = spy  # type: ignore[method-assign]
        attempt.feed(encode_reply(None, payload))
        after_ok = set_timer_slack(7777)
        with pytest.raises(SnapshotError):
            attempt.feed(encode_reply(None, b"\xc1"))
        after_error = set_timer_slack(7777)
        return during, after_ok, after_error

    during, after_ok, after_error = _in_thread(run)
    assert during == [BUILD_TIMER_SLACK_NS, BUILD_TIMER_SLACK_NS]
    assert (after_ok, after_error) == (7777, 7777)
