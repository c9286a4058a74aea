"""Fuzzing the HTTP endpoints (§10): arbitrary methods, paths, headers and bodies get 2xx or 4xx
answers, never 5xx, and never kill the worker.

Two parts:

- the Flask test client against a running app (one stream whose engine is absent, token
  required): every route of the app's URL map (so endpoints added later are fuzzed too) with
  arbitrary bodies, near-valid query and heartbeat bodies, arbitrary header values;
- a short run against a real ``kvsvc serve`` process tree (gunicorn arbiter + one gthread
  worker) with raw HTTP/1.x requests written on a socket (malformed request lines, arbitrary
  header names and values, wrong Content-Length, chunked garbage); afterwards the same worker
  pid serves ``/health`` and the query still answers exactly, and the log holds no traceback.

Documented exceptions (see the report), each accepted only with its exact error text and
counted: ``POST /v1/internal/heartbeat`` answers 503 when no instance registry is configured
(``--etcd_addr`` empty) to a heartbeat that is otherwise valid, and the OpenAI endpoints
(``/v1/completions``, ``/v1/chat/completions``) answer 503 "no instance available" to a valid
request when no instance can serve it (no registry here): both are the app's designed
"unavailable" replies to well-formed input, not failures on bad input; so is ``GET /ready``'s
503 ``{"ready": false, ...}`` while a stream has not synchronized. And gunicorn's own HTTP
parser answers 501 to a request with a ``Transfer-Encoding`` it does not implement (RFC 9112
§6.1 says it SHOULD), before the app sees the request; accepted only with gunicorn's
"Unsupported transfer coding" text, and counted.
"""

from __future__ import annotations

import json
import os
import signal
from contextlib import contextmanager
from typing import Iterator

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsvc.http.app import create_app
from kvsvc.http.auth import TOKEN_HEADER
from kvsvc.http.extensions import EXTENSION
from kvsvc.http.internal import HEARTBEAT_PATH, QUERY_PATH
from kvsvc.config import parse_kv_events_config
from kvsvc.settings import load_service_settings
from tests.support.gunicorn import Server
from tests.support.util import free_ports
from tests.support.http_service import BS, INSTANCE, TOKEN, group_pids, raw_request, real_service

NO_REGISTRY_503 = "no instance registry configured (--etcd_addr is empty)"
OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions")

FUZZ = settings(max_examples=250, deadline=None, derandomize=bool(os.environ.get("CI")),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
FUZZ_LIVE = settings(FUZZ, max_examples=120)

# -- strategies --------------------------------------------------------------------------------

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
              st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=10)),
    lambda c: st.one_of(st.lists(c, max_size=5), st.dictionaries(st.text(max_size=8), c, max_size=4)),
    max_leaves=25)
token_like = st.one_of(st.integers(min_value=-5, max_value=2**31 + 5),
                       st.integers(min_value=-(2**70), max_value=2**70),
                       st.sampled_from([2**31 - 1, 2**31, -1, 0, True, False, None, 1.0, 1.5, "1"]))
query_bodies = st.one_of(
    st.builds(lambda t: {"token_ids": t}, st.lists(token_like, max_size=70)),
    st.builds(lambda t, extra: {"token_ids": t, **extra}, st.lists(
        st.integers(0, 2**31 - 1), max_size=20), st.dictionaries(st.text(max_size=5), json_values,
                                                                  max_size=2)),
    st.builds(lambda v: {"token_ids": v}, json_values),
)
heartbeat_bodies = st.builds(
    lambda name, inc, waiting, usage, lat: {"name": name, "incarnation_id": inc,
                                             "load_metrics": {"waiting_requests_num": waiting,
                                                              "gpu_cache_usage_perc": usage},
                                             "latency_metrics": lat},
    st.one_of(st.text(max_size=12), json_values), st.one_of(st.none(), st.text(max_size=5), json_values),
    st.one_of(st.integers(-3, 10**20), json_values), st.one_of(st.floats(), json_values),
    st.one_of(st.none(), st.dictionaries(st.text(max_size=4), json_values, max_size=2), json_values))
messages = st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                           "content": st.one_of(st.text(max_size=30), json_values)}),
    json_values), max_size=3)
openai_bodies = st.one_of(
    st.builds(lambda m, p, extra: {"model": m, "prompt": p, **extra},
              st.one_of(st.text(max_size=8), json_values),
              st.one_of(st.text(max_size=40), st.lists(st.integers(-3, 2**32), max_size=10),
                        json_values),
              st.dictionaries(st.sampled_from(["stream", "max_tokens", "temperature", "n"]),
                              json_values, max_size=2)),
    st.builds(lambda m, msgs, stream: {"model": m, "messages": msgs, "stream": stream},
              st.one_of(st.text(max_size=8), json_values), messages, json_values),
)
bodies = st.one_of(
    openai_bodies.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=200),
    json_values.map(lambda v: json.dumps(v).encode()),
    query_bodies.map(lambda v: json.dumps(v).encode()),
    heartbeat_bodies.map(lambda v: json.dumps(v, allow_nan=True).encode()),
    st.text(max_size=50).map(lambda s: s.encode("utf-8", "surrogatepass")),
)
header_text = st.text(st.characters(min_codepoint=32, max_codepoint=255, blacklist_characters="\x7f"),
                      max_size=30)
methods = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])


def _ok_status(path: str, status: int, body: bytes) -> bool:
    """2xx/4xx, or one of the documented exceptions (module docstring)."""
    if status < 500:
        return True
    if status == 501 and b"Unsupported transfer coding" in body:
        return True  # gunicorn's parser, RFC 9112 §6.1; the app never saw the request
    if path == "/ready" and status == 503:
        # Readiness probe: "not ready yet" (a HEAD answer has no body to show it).
        return not body or json.loads(body).get("ready") is False
    if path in OPENAI_PATHS and status == 503:
        error = json.loads(body).get("error")
        return isinstance(error, dict) and str(error.get("message", "")).startswith(
            "no instance available")
    return (path == HEARTBEAT_PATH and status == 503
            and json.loads(body).get("error") == NO_REGISTRY_503)


# -- Flask test client -------------------------------------------------------------------------

@contextmanager
def running_app() -> Iterator:
    event_port, replay_port = free_ports(2)
    kv = parse_kv_events_config({
        "streams": [{"instance_name": INSTANCE, "block_size": BS,
                     "endpoint": f"tcp://127.0.0.1:{event_port}",
                     "replay_endpoint": f"tcp://127.0.0.1:{replay_port}"}],
        "replay_timeout_ms": 300})
    app = create_app(load_service_settings(internal_api_token=TOKEN, max_query_tokens=64), kv)
    service = app.extensions[EXTENSION]
    service.start(timeout_s=5.0)
    try:
        yield app
    finally:
        service.close(timeout_s=5.0)


def test_flask_endpoints_never_5xx():
    with running_app() as app:
        client = app.test_client()
        routes = sorted({(r.rule, m) for r in app.url_map.iter_rules()
                         for m in r.methods if "<" not in r.rule})
        paths = sorted({p for p, _ in routes} | {"/", "/v1/internal/", "/v1/internal/x",
                                                   QUERY_PATH + "/", "/ready/../health"})
        seen: dict[int, int] = {}
        unavailable = [0]

        # Biased towards requests that reach the views (POST, known paths, right token), where
        # the body parsing happens; the rest explores routing, auth and method handling.
        @FUZZ
        @given(st.one_of(st.just("POST"), methods),
               st.one_of(st.sampled_from([QUERY_PATH, HEARTBEAT_PATH, *OPENAI_PATHS,
                                          "/v1/internal/route"]), st.sampled_from(paths),
                         # A leading "//" would be a network location to the test client.
                         st.text(max_size=20).map(lambda s: "/" + s.lstrip("/"))),
               st.sampled_from(["right"] * 4 + ["wrong", "absent"]), header_text,
               st.one_of(st.none(), st.sampled_from(["application/json", "text/plain",
                                                      "application/x-www-form-urlencoded",
                                                      "multipart/form-data; boundary=x"]),
                         header_text),
               st.dictionaries(st.sampled_from(["Accept", "X-Forwarded-For", "User-Agent",
                                                "Content-Encoding", "X-Request-Id", "Cookie"]),
                               header_text, max_size=3),
               bodies)
        def one(method, path, token_mode, wrong_token, ctype, extra, body):
            headers = dict(extra)
            if token_mode == "right":
                headers[TOKEN_HEADER] = TOKEN
            elif token_mode == "wrong":
                headers[TOKEN_HEADER] = wrong_token
            kwargs = {"headers": headers, "data": body}
            if ctype is not None:
                kwargs["content_type"] = ctype
            r = client.open(path, method=method, **kwargs)
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            data = r.get_data()
            assert _ok_status(path, r.status_code, data), \
                f"{method} {path} -> {r.status_code} {data[:300]!r}"
            if r.status_code >= 500:
                unavailable[0] += 1
            if r.status_code >= 400 and method != "HEAD":
                assert r.is_json, f"{r.status_code} answer is not JSON: {data[:200]!r}"
            if path == QUERY_PATH and method == "POST" and r.status_code == 200:
                # The engine is absent: the one stream is never synchronized, never a hit.
                (m,) = r.get_json()["matches"]
                assert (m["synchronized"], m["device_hit_tokens"], m["host_only_hit_tokens"],
                        m["sequence"]) == (False, 0, 0, None)

        one()
        assert app.extensions[EXTENSION].running
        assert client.get("/health").status_code == 200
        assert sum(seen.values()) >= 250
        assert all(code < 500 for code in seen if code != 503)
        assert seen.get(503, 0) == unavailable[0]


# -- real gunicorn -----------------------------------------------------------------------------


header_names = st.one_of(
    st.sampled_from([TOKEN_HEADER, "Content-Type", "Content-Length", "Transfer-Encoding", "Host",
                     "Expect", "Connection", "Content-Encoding", "X-Forwarded-For"]),
    st.text(st.characters(min_codepoint=33, max_codepoint=126, blacklist_characters=":"),
            min_size=1, max_size=12))
raw_requests = st.builds(
    lambda method, path, version, headers, body, length_mode: (method, path, version, headers,
                                                                body, length_mode),
    st.one_of(st.just("POST"), methods, st.text(st.characters(min_codepoint=33, max_codepoint=126),
                                                 min_size=1, max_size=8)),
    st.one_of(st.sampled_from([QUERY_PATH, HEARTBEAT_PATH, *OPENAI_PATHS, "/v1/internal/route"]),
              st.sampled_from([QUERY_PATH, HEARTBEAT_PATH, "/health", "/ready", "/v1/models", "/",
                               "*"]),
              st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=30)
              .map(lambda s: "/" + s)),
    st.sampled_from(["HTTP/1.1"] * 6 + ["HTTP/1.0", "HTTP/2.0", "HTTP/1.x", "HTTP/9"]),
    st.lists(st.tuples(header_names, header_text), max_size=3),
    bodies,
    st.sampled_from(["exact", "exact", "short", "long", "none", "chunked", "chunked_bad"]),
)


def _encode(req, port: int) -> bytes:
    method, path, version, headers, body, length_mode = req
    lines = [f"{method} {path} {version}", f"Host: 127.0.0.1:{port}", "Connection: close",
             f"{TOKEN_HEADER}: {TOKEN}"]
    lines += [f"{k}: {v}" for k, v in headers]
    if length_mode == "chunked":
        lines.append("Transfer-Encoding: chunked")
        payload = (b"%x\r\n" % len(body) + body + b"\r\n" if body else b"") + b"0\r\n\r\n"
    elif length_mode == "chunked_bad":
        # A chunk size line that is not hex, after a valid chunk (test_malformed_chunked_body_is_4xx
        # pins the once-500 answer).
        lines.append("Transfer-Encoding: chunked")
        payload = b"%x\r\n" % len(body) + body + b"\r\nzz\r\n"
    else:
        n = {"exact": len(body), "short": max(0, len(body) - 3), "long": len(body) + 7}.get(length_mode)
        if n is not None:
            lines.append(f"Content-Length: {n}")
        payload = body
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + payload


def test_malformed_chunked_body_is_4xx(tmp_path, zmq_ctx):
    with real_service(tmp_path, zmq_ctx) as (server, _):
        answer = raw_request(server.port, (
            f"POST {QUERY_PATH} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            f"{TOKEN_HEADER}: {TOKEN}\r\nTransfer-Encoding: chunked\r\n\r\n"
            "4\r\nnull\r\nzz\r\n").encode())
        status = int(answer.split(b" ", 2)[1])
        assert 400 <= status < 500, answer[:200]


def test_gunicorn_worker_survives_raw_requests(tmp_path, zmq_ctx):
    with real_service(tmp_path, zmq_ctx) as (server, _):
        _fuzz_raw(server)


def _fuzz_raw(server: Server) -> None:
    http_port = server.port
    pids = group_pids(server.pgid)
    statuses: dict[int, int] = {}

    @FUZZ_LIVE
    @given(raw_requests)
    def one(req):
        answer = raw_request(http_port, _encode(req, http_port))
        if not answer:
            statuses[0] = statuses.get(0, 0) + 1  # closed without an answer: not a 5xx
            return
        status_line = answer.split(b"\r\n", 1)[0]
        parts = status_line.split(b" ")
        assert len(parts) >= 2 and parts[0].startswith(b"HTTP/") and parts[1].isdigit(), \
            f"not an HTTP answer: {answer[:200]!r}"
        status = int(parts[1])
        statuses[status] = statuses.get(status, 0) + 1
        body = answer.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in answer else b""
        assert _ok_status(req[1], status, body or b"{}"), \
            f"{req[0]} {req[1]} -> {answer[:300]!r}"

    one()
    assert sum(statuses.values()) >= 120
    assert not [c for c in statuses if c >= 500 and c not in (501, 503)]
    # The same two processes (no worker was killed and replaced), still answering exactly.
    assert group_pids(server.pgid) == pids
    assert server.get("/health").status_code == 200
    r = server.post(QUERY_PATH, headers={TOKEN_HEADER: TOKEN},
                    json={"token_ids": list(range(1, 11))})
    assert r.status_code == 200
    m = r.json()["matches"][0]
    assert (m["synchronized"], m["device_hit_tokens"], m["device_blocks"]) == (True, 8, 2)
    assert server.stop(signal.SIGINT) == 0
    log_text = server.log()
    assert "Traceback" not in log_text
    assert "WORKER TIMEOUT" not in log_text and "Booting worker" in log_text
    assert log_text.count("Booting worker") == 1
