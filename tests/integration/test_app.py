"""The Flask app (§10) through its test client, with a real Directory of real subscribers."""

from __future__ import annotations

import inspect
import io
import subprocess
import sys

import pytest

from kvsvc import errors
from kvsvc.errors import LifecycleError
from kvsvc.http.app import create_app
from kvsvc.http.body import (
    NOT_INTEGERS,
    OUT_OF_RANGE,
    is_token_list,
    max_content_length,
    token_ids_problem,
)
from kvsvc.http.errors import STATUS, status_of
from kvsvc.http.extensions import EXTENSION, ROUTING_EXTENSION
from kvsvc.http.internal import QUERY_PATH
from kvsvc.settings import load_service_settings
from tests.support.util import free_ports
from tests.support.app import HEADERS, INSTANCE, TOKEN, one_stream_config, post, running_app


@pytest.fixture
def app():
    """A running app with one stream whose engine is absent (stays unsynchronized)."""
    event_port, replay_port = free_ports(2)
    with running_app(one_stream_config(event_port, replay_port)) as app:
        yield app


def unsynchronized_match(response_match: dict) -> dict:
    """The numeric part of a §10 match of a stream that has no index yet."""
    return {k: response_match[k] for k in (
        "instance_name", "dp_rank", "synchronized", "sequence", "device_hit_tokens",
        "host_only_hit_tokens", "reusable_prefix_tokens", "device_blocks", "host_blocks")}


ZERO = {"instance_name": INSTANCE, "dp_rank": 0, "synchronized": False, "sequence": None,
        "device_hit_tokens": 0, "host_only_hit_tokens": 0, "reusable_prefix_tokens": 0,
        "device_blocks": 0, "host_blocks": 0}


# -- auth ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("headers", [{}, {"X-Internal-Token": "wrong"},
                                     {"X-Internal-Token": TOKEN + "x"},
                                     {"X-Internal-Token": ""}])
def test_query_without_right_token_is_401(app, headers):
    r = post(app.test_client(), {"token_ids": [1, 2, 3, 4]}, headers=headers)
    assert r.status_code == 401
    assert r.get_json() == {"error": "missing or wrong X-Internal-Token"}


def test_query_with_right_token_answers_every_stream(app):
    r = post(app.test_client(), {"token_ids": [1, 2, 3, 4, 5]})
    assert r.status_code == 200
    matches = r.get_json()["matches"]
    assert len(matches) == 1
    assert unsynchronized_match(matches[0]) == ZERO
    assert isinstance(matches[0]["error"], str) and matches[0]["error"]


def test_no_token_configured_needs_no_header():
    event_port, replay_port = free_ports(2)
    with running_app(one_stream_config(event_port, replay_port), token=None) as app:
        r = post(app.test_client(), {"token_ids": [7]}, headers={})
        assert r.status_code == 200
        assert unsynchronized_match(r.get_json()["matches"][0]) == ZERO


def test_unknown_internal_path_needs_token_then_404(app):
    client = app.test_client()
    assert client.get("/v1/internal/nope").status_code == 401
    r = client.get("/v1/internal/nope", headers=HEADERS)
    assert r.status_code == 404
    assert set(r.get_json()) == {"error"}


# -- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("body, error", [
    (b"not json", "body is not valid JSON"),
    (b"", "body is not valid JSON"),
    (b"\xff\xfe", "body is not valid JSON"),
    # Deeper than both JSON parsers go: orjson refuses, the stdlib one runs out of stack.
    # orjson refuses UTF-16, and the stdlib fallback runs out of stack on the nesting.
    pytest.param(('{"token_ids": [1], "x": ' + "[" * 5000 + "]" * 5000 + "}").encode("utf-16"),
                 "body is nested too deeply", id="deeply-nested-fallback"),
    (b"[1, 2]", "body must be a JSON object"),
    (b'"token_ids"', "body must be a JSON object"),
    (b"null", "body must be a JSON object"),
    (b"{}", "token_ids: missing"),
    (b'{"tokens": [1]}', "token_ids: missing"),
    (b'{"token_ids": "1,2"}', "token_ids: must be a list of integers"),
    (b'{"token_ids": null}', "token_ids: must be a list of integers"),
    (b'{"token_ids": {"0": 1}}', "token_ids: must be a list of integers"),
    (b'{"token_ids": [1, "2"]}', "token_ids: every element must be an integer"),
    (b'{"token_ids": [1, 2.0]}', "token_ids: every element must be an integer"),
    (b'{"token_ids": [true]}', "token_ids: every element must be an integer"),
    (b'{"token_ids": [1, null]}', "token_ids: every element must be an integer"),
    (b'{"token_ids": [[1]]}', "token_ids: every element must be an integer"),
    (b'{"token_ids": [NaN]}', "token_ids: every element must be an integer"),
    (b'{"token_ids": [-1]}', "token_ids: every element must be in [0, 2147483647]"),
    (b'{"token_ids": [2147483648]}', "token_ids: every element must be in [0, 2147483647]"),
    (b'{"token_ids": [0, 99999999999999999999999]}',
     "token_ids: every element must be in [0, 2147483647]"),
])
def test_bad_query_body_is_400(app, body, error):
    r = post(app.test_client(), body)
    assert r.status_code == 400
    assert r.get_json() == {"error": error}


def test_too_many_tokens_is_400_and_the_limit_itself_is_fine(app):
    client = app.test_client()
    r = post(client, {"token_ids": list(range(65))})
    assert r.status_code == 400
    assert r.get_json() == {"error": "token_ids: 65 tokens, more than max_query_tokens=64"}
    r = post(client, {"token_ids": [2**31 - 1] * 64})
    assert r.status_code == 200
    assert unsynchronized_match(r.get_json()["matches"][0]) == ZERO


def test_body_over_derived_limit_is_413(app):
    limit = max_content_length(64)
    assert limit == 64 * 12 + 64 * 1024
    r = post(app.test_client(), b"{" + b" " * limit + b"}")
    assert r.status_code == 413
    assert set(r.get_json()) == {"error"}
    # Exactly at the limit the body is read (and is valid JSON here).
    r = post(app.test_client(), b'{"token_ids": []' + b" " * (limit - 17) + b"}")
    assert r.status_code == 200


def test_empty_token_ids_gives_status_with_zero_hits(app):
    r = post(app.test_client(), {"token_ids": []})
    assert r.status_code == 200
    assert [unsynchronized_match(m) for m in r.get_json()["matches"]] == [ZERO]


def test_json_404_and_405(app):
    client = app.test_client()
    r = client.get("/nope")
    assert (r.status_code, r.content_type) == (404, "application/json")
    assert set(r.get_json()) == {"error"}
    r = client.get(QUERY_PATH, headers=HEADERS)
    assert (r.status_code, r.content_type) == (405, "application/json")
    assert set(r.get_json()) == {"error"}
    assert "POST" in r.headers["Allow"]
    r = client.post("/health")
    assert r.status_code == 405
    assert set(r.get_json()) == {"error"}


def test_unexpected_error_is_json_500(app, monkeypatch):
    directory = app.extensions[EXTENSION].directory

    def broken(token_ids):
        raise RuntimeError("boom")

    # A mock only to force the rare path: an unexpected exception inside a view.
    monkeypatch.setattr(directory, "query", broken)
    r = post(app.test_client(), {"token_ids": [1]})
    assert r.status_code == 500
    assert r.get_json() == {"error": "internal server error"}


# -- health, readiness, disabled index -----------------------------------------------------------

def test_health_is_ok_even_before_start():
    event_port, replay_port = free_ports(2)
    with running_app(one_stream_config(event_port, replay_port), start=False) as app:
        r = app.test_client().get("/health")
        assert (r.status_code, r.get_json()) == (200, {"status": "ok"})


def test_ready_503_before_start_lists_streams():
    event_port, replay_port = free_ports(2)
    with running_app(one_stream_config(event_port, replay_port), start=False) as app:
        r = app.test_client().get("/ready?streams=synchronized")
        assert r.status_code == 503
        assert r.get_json() == {
            "ready": False, "running": False, "index_enabled": True, "warmed_up": False,
            "waiting_for": ["service start", f"stream {INSTANCE}/dp0 first synchronization"],
            "unsynchronized_streams": [f"{INSTANCE}/dp0"], "heartbeat_rejections": {},
            "streams": [{"instance_name": INSTANCE, "dp_rank": 0, "state": "unsynchronized",
                         "synchronized_once": False, "sequence": None,
                         "error": "not started", "device_blocks": 0, "host_blocks": 0,
                         "recoveries": 0, "resync_differences": 0, "completeness": None,
                         "replay_mode": "snapshot"}]}


def test_index_disabled_answers_no_matches_and_is_ready(caplog):
    with caplog.at_level("WARNING", logger="kvsvc.service"):
        with running_app(None) as app:
            client = app.test_client()
            r = post(client, {"token_ids": [1, 2, 3]})
            assert (r.status_code, r.get_json()) == (200, {"matches": []})
            r = client.get("/ready?streams=synchronized")
            assert (r.status_code, r.get_json()) == (200, {
                "ready": True, "running": True, "index_enabled": False, "warmed_up": True,
                "waiting_for": [], "unsynchronized_streams": [], "heartbeat_rejections": {},
                "streams": []})
            # Validation still applies with the index disabled.
            assert post(client, {"token_ids": [-5]}).status_code == 400
    disabled = [r for r in caplog.records if "index disabled" in r.getMessage()]
    assert len(disabled) == 1


def test_chunked_body_over_the_limit_is_413_not_cut_short(app):
    """A chunked body has no Content-Length to refuse up front; it is read up to the limit
    plus one byte. Cut at the limit, this body would be a different, valid query."""
    limit = max_content_length(64)
    head = b'{"token_ids": [1]}'
    client = app.test_client()

    def chunked(body: bytes):
        # As gunicorn serves a chunked body: no length, the stream ends at the last chunk.
        return client.post(QUERY_PATH, input_stream=io.BytesIO(body), headers={
            **HEADERS, "Content-Type": "application/json", "Transfer-Encoding": "chunked"},
            environ_overrides={"wsgi.input_terminated": True})

    r = chunked(head + b" " * (limit - len(head)) + b"this is not json")
    assert (r.status_code, set(r.get_json())) == (413, {"error"})
    r = chunked(head + b" " * (limit - len(head)))   # exactly at the limit: read and answered
    assert r.status_code == 200 and r.get_json()["matches"][0]["device_hit_tokens"] == 0


# -- one rule each: token ids, error statuses; the composition root ------------------------------

@pytest.mark.parametrize("ids, problem", [
    ([], None),
    ([0, 1, 2**31 - 1], None),
    ([1, True], NOT_INTEGERS),
    ([1, 2.0], NOT_INTEGERS),
    ([1, "2"], NOT_INTEGERS),
    ([None], NOT_INTEGERS),
    ([-1], OUT_OF_RANGE),
    ([2**31], OUT_OF_RANGE),
])
def test_the_token_id_rule(ids, problem):
    assert token_ids_problem(ids) == problem
    # A prompt of token ids follows the same rule, and must not be empty.
    assert is_token_list(ids) is (problem is None and bool(ids))


def test_every_refusal_kind_has_its_http_status_in_the_one_table():
    kinds = [cls for _, cls in inspect.getmembers(errors, inspect.isclass)
             if issubclass(cls, (errors.RequestError, errors.UpstreamError))]
    assert set(kinds) <= set(STATUS)
    assert {cls.__name__: status_of(cls.__new__(cls)) for cls in kinds} == {
        "BadRequest": 400, "InvalidHeartbeat": 400, "HeartbeatRejected": 400,
        "RequestError": 400, "Unauthorized": 401, "InvalidApiKey": 401, "UnknownModel": 404,
        "TooManyRequests": 429, "UnknownInstance": 409,
        "StaleIncarnation": 409, "PayloadTooLarge": 413, "UpstreamError": 502,
        "UpstreamUnreachable": 502, "NoRegistry": 503, "NoCandidate": 503,
        "UpstreamTimeout": 504, "RpcUnreachable": 502, "RpcTimeout": 504}
    assert status_of(RuntimeError("x")) == 500
    # No error class carries a status of its own.
    assert not [cls for cls in kinds if "status" in vars(cls)]


def test_service_and_routing_import_neither_flask_nor_the_http_layer():
    code = ("import sys, kvsvc.service, kvsvc.routing.router; "
            "print(sorted(m for m in sys.modules if m == 'flask' or m.startswith('kvsvc.http')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_service_close_closes_every_component_and_raises_the_first_failure(monkeypatch):
    event_port, replay_port = free_ports(2)
    app = create_app(load_service_settings(), one_stream_config(event_port, replay_port))
    svc = app.extensions[EXTENSION]
    assert app.extensions[ROUTING_EXTENSION] is svc.router
    svc.start(timeout_s=5.0)
    closed = []
    real_close = svc.directory.close

    def failing_close(timeout_s: float = 5.0) -> None:
        real_close(timeout_s=timeout_s)  # the threads do stop; only the report fails
        closed.append("directory")
        raise LifecycleError("directory: forced failure")

    # Mocks only to force the rare path (a component failing to close) and to see the next one.
    monkeypatch.setattr(svc.directory, "close", failing_close)
    monkeypatch.setattr(svc.router, "close", lambda: closed.append("router"))
    with pytest.raises(LifecycleError, match="forced failure"):
        svc.close(timeout_s=5.0)
    assert closed == ["directory", "router"]
    assert not svc.running
    svc.close(timeout_s=5.0)  # idempotent: nothing is closed twice
    assert closed == ["directory", "router"]
