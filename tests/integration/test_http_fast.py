"""The query endpoint's fast path (§10): body read straight from ``wsgi.input``, token ids
handed to the directory as packed ``array("I")``, booleans found with one byte search. The
answers and errors must be exactly those of the plain path; a synchronized stream checks the
hits end to end, in process and under the real gunicorn worker."""

from __future__ import annotations

import io
import json
from array import array

import pytest

from kvsvc.errors import BadRequest
from kvsvc.http.auth import TOKEN_HEADER
from kvsvc.http.body import parse_query_tokens, parse_token_ids
from kvsvc.http.errors import status_of
from kvsvc.http.internal import QUERY_PATH
from kvsvc.index.keys import pack_tokens
from tests.support.publisher import ProtocolPublisher, stored
from tests.support.app import HEADERS, INSTANCE, one_stream_config, post, running_app
from tests.support.http_service import TOKEN, raw_request, real_service
from tests.support.util import free_ports, wait_for

BS = 4


@pytest.fixture
def synced_app(zmq_ctx):
    """A running app whose one stream (block size 4) holds tokens 1..8 on Device, synchronized."""
    event_port, replay_port = free_ports(2)
    pub = ProtocolPublisher(zmq_ctx, event_port, replay_port)
    pub.set_snapshot([stored([1, 2], None, list(range(1, 9)), BS, medium="gpu")], watermark=None)
    pub.start()
    try:
        with running_app(one_stream_config(event_port, replay_port, block_size=BS)) as app:
            client = app.test_client()
            wait_for(lambda: client.get("/ready?streams=synchronized").status_code == 200, timeout_s=10,
                     interval_s=0.02, what="stream synchronized")
            yield app
    finally:
        pub.close()


def hits(response) -> list[tuple[bool, int, int, int]]:
    return [(m["synchronized"], m["device_hit_tokens"], m["reusable_prefix_tokens"],
             m["device_blocks"]) for m in response.get_json()["matches"]]


# -- parse -------------------------------------------------------------------------------------

def test_parse_query_tokens_gives_the_packed_ids_as_an_array():
    ids = [0, 1, 150_000, 2**31 - 1]
    out = parse_query_tokens(json.dumps({"token_ids": ids}).encode(), 64)
    assert type(out) is array and out.typecode == "I"
    assert list(out) == ids
    assert out.tobytes() == pack_tokens(ids)
    assert parse_token_ids(json.dumps({"token_ids": ids}).encode(), 64) == ids


def test_parse_query_tokens_of_an_empty_list_is_empty():
    assert list(parse_query_tokens(b'{"token_ids": []}', 64)) == []


@pytest.mark.parametrize("body", [
    b'{"token_ids": [true]}',
    b'{"token_ids": [1, false]}',
    b'{"token_ids": [0, 1, true], "model": "null"}',
    b'{"token_ids":[1,\n true ]}',
])
def test_booleans_are_never_token_ids(body):
    for parse in (parse_query_tokens, parse_token_ids):
        with pytest.raises(BadRequest) as err:
            parse(body, 64)
        assert (status_of(err.value), err.value.message) == (
            400, "token_ids: every element must be an integer")


@pytest.mark.parametrize("element", [b"1.5", b"99999999999999999999999", b"true"])
def test_bad_element_in_a_body_too_deep_for_the_stdlib_parser_is_400(element):
    # orjson takes 1,000 levels, the stdlib parser runs out of stack: the checks keep orjson's
    # list (an integer beyond 64 bits, a float there, reads as "not an integer").
    body = b'{"token_ids": [' + element + b'], "x": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    with pytest.raises(BadRequest) as err:
        parse_query_tokens(body, 64)
    assert (status_of(err.value), err.value.message) == (
        400, "token_ids: every element must be an integer")


# -- in process, synchronized stream -----------------------------------------------------------

@pytest.mark.parametrize("body", [
    json.dumps({"token_ids": list(range(1, 11))}),
    json.dumps({"token_ids": list(range(1, 11))}, indent=2),
    # Letters of "true"/"false" elsewhere in the body: the slow element checks, same answer.
    json.dumps({"model": "full-null-true", "token_ids": list(range(1, 11))}),
])
def test_query_answer_is_exact_for_every_body_form(synced_app, body):
    r = post(synced_app.test_client(), body)
    assert r.status_code == 200
    assert hits(r) == [(True, 8, 8, 2)]
    assert r.get_json()["matches"][0]["instance_name"] == INSTANCE


def test_query_of_a_partial_prefix_and_of_a_miss(synced_app):
    client = synced_app.test_client()
    assert hits(post(client, {"token_ids": [1, 2, 3, 4, 5, 6, 7]})) == [(True, 4, 4, 2)]
    assert hits(post(client, {"token_ids": [9, 2, 3, 4, 5, 6, 7, 8]})) == [(True, 0, 0, 2)]
    assert hits(post(client, {"token_ids": []})) == [(True, 0, 0, 2)]


def test_query_body_without_content_length_is_read_and_answered(synced_app):
    # No Content-Length (a streamed body): the werkzeug path reads it, same answer.
    body = json.dumps({"token_ids": list(range(1, 9))}).encode()
    environ = {"wsgi.input_terminated": True, "CONTENT_TYPE": "application/json"}
    client = synced_app.test_client()
    r = client.post(QUERY_PATH, input_stream=io.BytesIO(body), headers=HEADERS,
                    environ_overrides=environ)
    assert r.status_code == 200
    assert hits(r) == [(True, 8, 8, 2)]


# -- real gunicorn worker ----------------------------------------------------------------------

def _request(body: bytes, close: bool, extra: str = "") -> bytes:
    return (f"POST {QUERY_PATH} HTTP/1.1\r\nHost: x\r\n{TOKEN_HEADER}: {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}"
            f"{'Connection: close' if close else 'Connection: keep-alive'}\r\n\r\n"
            ).encode() + body


def _answers(raw: bytes) -> list[tuple[int, dict]]:
    """(status, JSON body) of each HTTP/1.1 answer in ``raw`` (Content-Length framed)."""
    out = []
    while raw:
        head, rest = raw.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        length = next(int(v) for k, v in (ln.split(": ", 1) for ln in lines[1:])
                      if k.lower() == "content-length")
        out.append((int(lines[0].split(" ")[1]), json.loads(rest[:length])))
        raw = rest[length:]
    return out


def test_gunicorn_pipelined_queries_are_each_read_exactly(tmp_path, zmq_ctx):
    """Two queries on one keep-alive connection, sent back to back: reading exactly
    Content-Length bytes of the first leaves the second intact. A large body too (several
    recv() calls)."""
    big = json.dumps({"token_ids": list(range(1, 9)) + [7] * 4000}).encode()
    small = json.dumps({"token_ids": [1, 2, 3, 4, 5]}).encode()
    with real_service(tmp_path, zmq_ctx) as (server, _):
        raw = raw_request(server.port, _request(big, close=False) + _request(small, close=True))
        answers = _answers(raw)
        assert [status for status, _ in answers] == [200, 200]
        first, second = (doc["matches"][0] for _, doc in answers)
        assert (first["device_hit_tokens"], second["device_hit_tokens"]) == (8, 4)


def test_gunicorn_chunked_query_is_answered(tmp_path, zmq_ctx):
    body = json.dumps({"token_ids": list(range(1, 11))}).encode()
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 7]), body[i:i + 7])
                       for i in range(0, len(body), 7)) + b"0\r\n\r\n"
    with real_service(tmp_path, zmq_ctx) as (server, _):
        raw = raw_request(server.port, (
            f"POST {QUERY_PATH} HTTP/1.1\r\nHost: x\r\n{TOKEN_HEADER}: {TOKEN}\r\n"
            "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n").encode() + chunked)
        [(status, doc)] = _answers(raw)
        assert status == 200
        assert doc["matches"][0]["device_hit_tokens"] == 8


def test_gunicorn_short_body_is_400(tmp_path, zmq_ctx):
    """Content-Length promises the whole body, the client half-closes after part of it."""
    body = json.dumps({"token_ids": [1, 2, 3, 4]}).encode()
    with real_service(tmp_path, zmq_ctx) as (server, _):
        [(status, doc)] = _answers(raw_request(server.port, _request(body, close=True)[:-8]))
        assert (status, doc) == (400, {"error": "body is not valid JSON"})
