"""The baidu_std codec and kvsvc's xLLM messages (§13) against frames captured from real brpc
1.12.1 (``tests/data/brpc/``, a copy of ``../shared/data/brpc/``): every field of each captured
request parses; the replies kvsvc builds are the captured replies, field by field and byte
for byte. Then the codec's own rules: split input, compression, attachments, the 64 MiB
bound, what it refuses."""

from __future__ import annotations

import gzip
import json
import struct
import zlib
from pathlib import Path

import pytest
from google.protobuf import json_format
from google.protobuf.unknown_fields import UnknownFieldSet

from kvsvc.errors import RpcMessageError, RpcProtocolError
from kvsvc.rpc import codec, messages
from kvsvc.rpc.codec import BadCall, Connection, Request, Response, Role

DATA = Path(__file__).resolve().parent.parent / "data" / "brpc"
SERVICE = "xllm_service.proto.XllmRpcService"


def frames(name: str, direction: str) -> bytes:
    return bytes.fromhex("".join((DATA / f"{name}.{direction}.hex").read_text().split()))


def decoded(name: str) -> dict:
    return json.loads((DATA / f"{name}.decoded.json").read_text())


def split_frames(data: bytes) -> list[tuple[int, int, bytes, bytes]]:
    """(body_size, meta_size, meta, rest) of each frame, parsed by hand (not by the codec)."""
    out = []
    while data:
        magic, body, meta = struct.unpack(">4sII", data[:12])
        assert magic == b"PRPC"
        out.append((body, meta, data[12:12 + meta], data[12 + meta:12 + body]))
        data = data[12 + body:]
    return out


def as_dict(msg) -> dict:
    return json_format.MessageToDict(msg, preserving_proto_field_name=True)


REQUEST_TYPES = {"Heartbeat": messages.HeartbeatRequest,
                 "Generations": messages.DisaggStreamGenerations,
                 "GetInstanceInfo": messages.InstanceID,
                 "GetStaticDecodeList": messages.InstanceID}
RESPONSE_TYPES = {"Heartbeat": messages.Status, "Generations": messages.StatusSet,
                  "GetInstanceInfo": messages.InstanceMetaInfo,
                  "GetStaticDecodeList": messages.InstanceIDs}
CAPTURES = ["heartbeat", "generations", "get_instance_info", "get_static_decode_list"]


@pytest.mark.parametrize("name", CAPTURES)
def test_captured_requests_parse_field_by_field(name):
    doc = decoded(name)["request"]
    raw = frames(name, "request")
    events = Connection(Role.SERVER).receive_data(raw)
    assert len(events) == len(doc) == len(split_frames(raw))
    for event, want, (body, meta_size, _, _) in zip(events, doc, split_frames(raw)):
        assert isinstance(event, Request)
        assert (body, meta_size) == (want["header"]["body_size"], want["header"]["meta_size"])
        assert event.correlation_id == int(want["meta"]["correlation_id"])
        assert event.service == want["meta"]["request"]["service_name"] == SERVICE
        assert event.method == want["meta"]["request"]["method_name"]
        assert event.compress_type == want["meta"]["compress_type"] == codec.COMPRESS_NONE
        assert event.attachment == b"" and event.timeout_ms is None and event.log_id == 0
        msg = messages.parse(REQUEST_TYPES[event.method], event.message)
        assert as_dict(msg) == want["message"]
        # Nothing the engine sent is unknown to kvsvc's schema.
        assert len(UnknownFieldSet(msg)) == 0


def test_captured_heartbeat_fields():
    (event,) = Connection(Role.SERVER).receive_data(frames("heartbeat", "request"))
    hb = messages.parse(messages.HeartbeatRequest, event.message)
    assert hb.name == "127.0.0.1:18000"
    assert hb.load_metrics.waiting_requests_num == 3
    assert hb.load_metrics.gpu_cache_usage_perc == pytest.approx(0.42, abs=1e-6)
    assert hb.latency_metrics.recent_max_ttft == 120
    assert hb.latency_metrics.recent_max_tbt == 0
    assert hb.incarnation_id == "KkXAnaHw24GezSqYoxAtkM"
    assert not hb.HasField("cache_event")


def test_captured_generations_fields():
    events = Connection(Role.SERVER).receive_data(frames("generations", "request"))
    gens = [messages.parse(messages.DisaggStreamGenerations, e.message).gens for e in events]
    assert [[g.service_req_id for g in call] for call in gens] == [["svc-1", "svc-2"]] * 3
    assert [g.req_id for g in gens[0]] == ["engine-svc-1", "engine-svc-2"]
    first, second, last = (call[0] for call in gens)
    assert first.finished_on_prefill_instance and not first.finished
    assert [(o.index, o.text, list(o.token_ids)) for o in first.outputs] == [(0, "tok0 ", [1000])]
    assert [(o.text, list(o.token_ids)) for o in second.outputs] == [("tok1 ", [1001])]
    assert not second.finished_on_prefill_instance and not second.HasField("gen_status")
    assert last.finished and last.HasField("gen_status") and last.gen_status.status_code == 0
    assert [(o.text, o.finish_reason) for o in last.outputs] == [("", "stop")]
    assert (last.usage.num_prompt_tokens, last.usage.num_generated_tokens,
            last.usage.num_total_tokens, last.usage.num_cached_tokens) == (8, 2, 10, 0)


def build_reply(name: str, request: Request) -> bytes:
    """What kvsvc's server answers to the captured request (the captured server's state)."""
    if request.method == "Heartbeat":
        reply = messages.Status(ok=True)
    elif request.method == "Generations":
        gens = messages.parse(messages.DisaggStreamGenerations, request.message).gens
        reply = messages.StatusSet()
        for _ in gens:
            reply.all_status.add(ok=True)
    elif request.method == "GetInstanceInfo":
        reply = messages.InstanceMetaInfo(name="127.0.0.1:18000", rpc_address="127.0.0.1:18000",
                                          type=0, dp_size=1)
    else:
        reply = messages.InstanceIDs()
    return Connection(Role.SERVER).send_response(request.correlation_id,
                                                 messages.serialize(reply))


@pytest.mark.parametrize("name", CAPTURES)
def test_built_replies_are_the_captured_replies(name):
    requests = Connection(Role.SERVER).receive_data(frames(name, "request"))
    built = b"".join(build_reply(name, r) for r in requests)
    captured = frames(name, "response")
    want = decoded(name)["response"]
    got = Connection(Role.CLIENT).receive_data(built)
    assert len(got) == len(want) == len(requests)
    for event, w, req, (body, meta_size, _, _) in zip(got, want, requests, split_frames(built)):
        assert isinstance(event, Response) and event.ok
        assert (body, meta_size) == (w["header"]["body_size"], w["header"]["meta_size"])
        assert event.correlation_id == req.correlation_id == int(w["meta"]["correlation_id"])
        assert event.error_code == w["meta"]["response"]["error_code"] == 0
        assert event.compress_type == w["meta"]["compress_type"]
        msg = messages.parse(RESPONSE_TYPES[req.method], event.message)
        assert as_dict(msg) == w["message"]
    # brpc's serialization and kvsvc's agree to the byte.
    assert built == captured


def test_generations_reply_has_one_status_per_entry():
    for request in Connection(Role.SERVER).receive_data(frames("generations", "request")):
        (resp,) = Connection(Role.CLIENT).receive_data(build_reply("generations", request))
        n = len(messages.parse(messages.DisaggStreamGenerations, request.message).gens)
        assert len(messages.parse(messages.StatusSet, resp.message).all_status) == n == 2


def test_input_split_at_every_byte():
    raw = frames("generations", "request")
    whole = Connection(Role.SERVER).receive_data(raw)
    conn = Connection(Role.SERVER)
    got = []
    for i in range(len(raw)):
        got += conn.receive_data(raw[i:i + 1])
    assert got == whole and conn.buffered == 0
    assert conn.receive_data(b"") == []


def test_client_ids_and_request_round_trip():
    client, server = Connection(Role.CLIENT), Connection(Role.SERVER)
    req = messages.ChatRequest(model="m", service_request_id="svc-9", token_ids=[1, 2, 3],
                               source_xservice_addr="10.0.0.1:8889", stream=True)
    req.routing.prefill_name = "10.0.0.2:9000"
    cid1, f1 = client.send_request("xllm.proto.XllmAPIService", "ChatCompletions",
                                   messages.serialize(req), timeout_ms=500)
    cid2, f2 = client.send_request("xllm.proto.XllmAPIService", "Completions", b"",
                                   attachment=b"att")
    assert (cid1, cid2) == (1, 2)
    e1, e2 = server.receive_data(f1 + f2)
    assert (e1.correlation_id, e1.method, e1.timeout_ms) == (1, "ChatCompletions", 500)
    got = messages.parse(messages.ChatRequest, e1.message)
    assert (got.service_request_id, list(got.token_ids), got.routing.prefill_name,
            got.source_xservice_addr, got.stream) == ("svc-9", [1, 2, 3], "10.0.0.2:9000",
                                                      "10.0.0.1:8889", True)
    assert (e2.method, e2.message, e2.attachment) == ("Completions", b"", b"att")
    # The answers, out of order, each to its id.
    r2, r1 = client.receive_data(server.send_response(2, b"x", attachment=b"yz")
                                 + server.send_response(1, error_code=codec.ENOMETHOD,
                                                        error_text="Fail to find method"))
    assert (r2.correlation_id, r2.message, r2.attachment, r2.ok) == (2, b"x", b"yz", True)
    assert (r1.correlation_id, r1.error_code, r1.error_text, r1.message) == (
        1, codec.ENOMETHOD, "Fail to find method", b"")


@pytest.mark.parametrize("ctype", [codec.COMPRESS_GZIP, codec.COMPRESS_ZLIB])
def test_gzip_and_zlib_both_ways(ctype):
    payload = messages.serialize(messages.HeartbeatRequest(name="a:1", incarnation_id="x" * 300))
    frame = codec.encode_request(7, SERVICE, "Heartbeat", payload, compress_type=ctype,
                                 attachment=b"tail")
    (event,) = Connection(Role.SERVER).receive_data(frame)
    assert (event.message, event.compress_type, event.attachment) == (payload, ctype, b"tail")
    # On the wire the message is really compressed, the attachment is not.
    _, _, _, rest = split_frames(frame)[0]
    wire = rest[:-4]
    assert rest[-4:] == b"tail" and len(wire) < len(payload)
    assert (gzip.decompress(wire) if ctype == codec.COMPRESS_GZIP
            else zlib.decompress(wire)) == payload
    (resp,) = Connection(Role.CLIENT).receive_data(
        codec.encode_response(7, payload, compress_type=ctype))
    assert (resp.message, resp.compress_type) == (payload, ctype)


@pytest.mark.parametrize("ctype,name", [(codec.COMPRESS_SNAPPY, "snappy"),
                                        (codec.COMPRESS_LZ4, "lz4"), (9, "9")])
def test_unsupported_compression_is_refused_per_call(ctype, name):
    meta = messages.RpcMeta(correlation_id=5, compress_type=ctype)
    meta.request.service_name, meta.request.method_name = SERVICE, "Hello"
    frame = codec.encode_frame(messages.serialize(meta), b"\x01\x02")
    conn = Connection(Role.SERVER)
    (event,) = conn.receive_data(frame + codec.encode_request(6, SERVICE, "Hello", b""))[:1]
    assert isinstance(event, BadCall)
    assert (event.correlation_id, event.error_code, event.method) == (5, codec.EREQUEST, "Hello")
    assert f"CompressType={name}" in event.error_text and "not supported" in event.error_text
    with pytest.raises(ValueError, match="not supported"):
        codec.compress(b"x", ctype)


def test_corrupt_compressed_message_is_a_bad_call_not_a_broken_stream():
    meta = messages.RpcMeta(correlation_id=3, compress_type=codec.COMPRESS_GZIP)
    meta.request.service_name, meta.request.method_name = SERVICE, "Heartbeat"
    conn = Connection(Role.SERVER)
    bad, good = conn.receive_data(codec.encode_frame(messages.serialize(meta), b"not gzip")
                                  + codec.encode_request(4, SERVICE, "Hello", b""))
    assert isinstance(bad, BadCall) and bad.error_code == codec.EREQUEST
    assert "Fail to parse request message, CompressType=gzip" in bad.error_text
    assert isinstance(good, Request) and good.correlation_id == 4


def test_decompression_is_bounded():
    bomb = gzip.compress(b"\0" * (1 << 20))
    with pytest.raises(ValueError, match="over 1000 bytes"):
        codec.decompress(bomb, codec.COMPRESS_GZIP, limit=1000)
    with pytest.raises(ValueError, match="truncated"):
        codec.decompress(bomb[:-10], codec.COMPRESS_GZIP)
    with pytest.raises(ValueError, match="after"):
        codec.decompress(zlib.compress(b"a") + b"junk", codec.COMPRESS_ZLIB)


def test_body_over_64_mib_breaks_the_connection_at_the_header():
    conn = Connection(Role.SERVER)
    header = struct.pack(">4sII", b"PRPC", codec.MAX_BODY_SIZE + 1, 10)
    with pytest.raises(RpcProtocolError, match="body_size=67108865 is over the limit"):
        conn.receive_data(header)
    with pytest.raises(RpcProtocolError):  # stays broken
        conn.receive_data(codec.encode_request(1, SERVICE, "Hello", b""))
    # Exactly the limit is accepted (waits for the body).
    ok = Connection(Role.SERVER)
    assert ok.receive_data(struct.pack(">4sII", b"PRPC", codec.MAX_BODY_SIZE, 10)) == []


@pytest.mark.parametrize("data,match", [
    (b"GET / HTTP/1.1\r\n\r\n", "not baidu_std"),
    (b"PRPX", "not baidu_std"),
    (b"PR\x00", "not baidu_std"),
    (struct.pack(">4sII", b"PRPC", 4, 5) + b"abcd", "meta_size=5 is bigger than body_size=4"),
    (struct.pack(">4sII", b"PRPC", 3, 3) + b"\xff\xff\xff", "Fail to parse RpcMeta"),
])
def test_broken_streams(data, match):
    with pytest.raises(RpcProtocolError, match=match):
        Connection(Role.SERVER).receive_data(data)


def test_meta_without_required_request_fields_breaks_the_stream():
    meta = messages.RpcMeta(correlation_id=1)
    meta.request.service_name = SERVICE   # method_name (required) missing
    with pytest.raises(RpcProtocolError, match="Fail to parse RpcMeta"):
        Connection(Role.SERVER).receive_data(
            codec.encode_frame(meta.SerializePartialToString(), b""))


def test_direction_is_checked():
    with pytest.raises(RpcProtocolError, match="sent to a client"):
        Connection(Role.CLIENT).receive_data(codec.encode_request(1, SERVICE, "Hello", b""))
    with pytest.raises(RpcProtocolError, match="without a request meta"):
        Connection(Role.SERVER).receive_data(codec.encode_response(1, b""))
    with pytest.raises(RpcProtocolError):
        Connection(Role.SERVER).send_request(SERVICE, "Hello", b"")
    with pytest.raises(RpcProtocolError):
        Connection(Role.CLIENT).send_response(1)


def test_end_of_stream_inside_a_frame_and_data_after_it():
    frame = codec.encode_request(1, SERVICE, "Hello", b"")
    conn = Connection(Role.SERVER)
    assert conn.receive_data(frame[:-1]) == []
    with pytest.raises(RpcProtocolError, match="closed inside a frame"):
        conn.receive_data(b"")
    closed = Connection(Role.SERVER)
    assert closed.receive_data(b"") == []
    with pytest.raises(RpcProtocolError, match="after end of stream"):
        closed.receive_data(frame)


def test_attachment_size_over_the_payload_and_unimplemented_features_are_bad_calls():
    def frame(cid, **meta_fields):
        meta = messages.RpcMeta(correlation_id=cid, **meta_fields)
        meta.request.service_name, meta.request.method_name = SERVICE, "Hello"
        return meta

    too_big = frame(1, attachment_size=10)
    streamed = frame(2)
    streamed.stream_settings.stream_id = 77
    chunked = frame(3)
    chunked.chunk_info.stream_id, chunked.chunk_info.chunk_id = 1, 1
    authed = frame(4, authentication_data=b"secret")
    authed.user_fields["k"] = "v"
    raw = b"".join(codec.encode_frame(messages.serialize(m), b"abc")
                   for m in (too_big, streamed, chunked, authed))
    e1, e2, e3, e4 = Connection(Role.SERVER).receive_data(raw)
    assert isinstance(e1, BadCall) and "attachment_size=10 is larger than request_size=3" \
        in e1.error_text
    assert isinstance(e2, BadCall) and "streaming RPC" in e2.error_text
    assert isinstance(e3, BadCall) and "chunk" in e3.error_text
    assert all(e.error_code == codec.EREQUEST for e in (e1, e2, e3))
    # Credentials are ignored (no authenticator, §13), user fields are kept.
    assert isinstance(e4, Request) and e4.message == b"abc" and e4.user_fields == {"k": "v"}


def test_error_reply_carries_no_message_and_a_bad_response_is_a_bad_call():
    frame = codec.encode_response(9, b"ignored", error_code=codec.EINTERNAL, error_text="boom",
                                  compress_type=codec.COMPRESS_GZIP)
    (resp,) = Connection(Role.CLIENT).receive_data(frame)
    assert (resp.error_code, resp.error_text, resp.message, resp.compress_type) == (
        codec.EINTERNAL, "boom", b"", codec.COMPRESS_NONE)
    meta = messages.RpcMeta(correlation_id=10, compress_type=codec.COMPRESS_ZLIB)
    meta.response.error_code = 0
    (bad,) = Connection(Role.CLIENT).receive_data(
        codec.encode_frame(messages.serialize(meta), b"xx"))
    assert isinstance(bad, BadCall) and bad.error_code == codec.ERESPONSE


def test_correlation_ids_are_int64():
    for cid in (0, 2**63 - 1, -1):
        (event,) = Connection(Role.SERVER).receive_data(
            codec.encode_request(cid, SERVICE, "Hello", b""))
        assert event.correlation_id == cid


def test_messages_parse_errors_are_translated():
    with pytest.raises(RpcMessageError, match="cannot parse xllm_service.proto.HeartbeatRequest"):
        messages.parse(messages.HeartbeatRequest, b"\x0a\x05ab")
    with pytest.raises(RpcMessageError):
        messages.parse(messages.StatusSet, b"\xff")


def test_schema_numbers_of_section_13():
    """The field numbers PROTOCOL.md §13 states (the rest are xLLM's, read from its files)."""
    def number(cls, path):
        desc = cls.DESCRIPTOR
        for part in path.split("."):
            f = desc.fields_by_name[part]
            desc = f.message_type
        return f.number

    chat, comp = messages.ChatRequest, messages.CompletionRequest
    assert [number(chat, n) for n in ("service_request_id", "token_ids", "routing",
                                      "source_xservice_addr")] == [25, 26, 27, 42]
    assert [number(comp, n) for n in ("service_request_id", "token_ids", "routing",
                                      "source_xservice_addr")] == [23, 24, 25, 38]
    assert [number(chat, n) for n in ("routing.prefill_name", "routing.decode_name")] == [1, 2]
    hb = messages.HeartbeatRequest
    assert [number(hb, n) for n in ("name", "cache_event", "load_metrics",
                                    "load_metrics.waiting_requests_num",
                                    "load_metrics.gpu_cache_usage_perc", "latency_metrics",
                                    "latency_metrics.recent_max_ttft",
                                    "latency_metrics.recent_max_tbt",
                                    "incarnation_id")] == [1, 2, 3, 1, 2, 4, 1, 2, 6]
    info = messages.InstanceMetaInfo
    assert [number(info, n) for n in ("name", "rpc_address", "type", "cluster_ids", "dp_size",
                                      "addrs", "ports", "incarnation_id", "register_ts_ms",
                                      "kv_split_size")] == [1, 2, 3, 4, 7, 8, 10, 11, 12, 13]
    gen = messages.DisaggStreamGeneration
    assert [number(gen, n) for n in ("req_id", "service_req_id", "gen_status",
                                     "gen_status.status_code", "gen_status.status_msg",
                                     "outputs", "outputs.index", "outputs.text",
                                     "outputs.token_ids", "outputs.finish_reason",
                                     "outputs.logprobs", "usage", "usage.num_prompt_tokens",
                                     "usage.num_generated_tokens", "usage.num_total_tokens",
                                     "usage.num_cached_tokens", "finished",
                                     "finished_on_prefill_instance")] == [
        1, 2, 3, 1, 2, 4, 1, 2, 3, 4, 5, 5, 1, 2, 3, 4, 6, 7]
    meta = messages.RpcMeta
    assert [number(meta, n) for n in ("request", "request.service_name", "request.method_name",
                                      "request.log_id", "request.timeout_ms", "response",
                                      "response.error_code", "response.error_text",
                                      "compress_type", "correlation_id", "attachment_size",
                                      "authentication_data")] == [
        1, 1, 2, 3, 8, 2, 1, 2, 3, 4, 5, 7]
    assert messages.StatusSet.DESCRIPTOR.fields_by_name["all_status"].number == 1
    assert messages.InstanceIDs.DESCRIPTOR.fields_by_name["names"].number == 1
    assert messages.StatusSet.DESCRIPTOR.full_name == "xllm.proto.StatusSet"
    assert messages.Status.DESCRIPTOR.full_name == "xllm_service.proto.Status"


def test_frames_before_a_break_are_delivered_then_the_stream_is_broken():
    good = codec.encode_request(1, SERVICE, "Hello", b"")
    bad = struct.pack(">4sII", b"PRPC", codec.MAX_BODY_SIZE + 1, 0)
    conn = Connection(Role.SERVER)
    (event,) = conn.receive_data(good + bad)
    assert event.correlation_id == 1
    assert conn.broken is not None and "over the limit" in conn.broken
    with pytest.raises(RpcProtocolError, match="over the limit"):
        conn.receive_data(b"")
    assert Connection(Role.SERVER).broken is None
