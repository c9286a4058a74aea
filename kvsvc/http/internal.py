"""The internal API (``/v1/internal/*``, §9-§11); every path needs ``X-Internal-Token`` when a
token is configured (:mod:`kvsvc.http.auth`). Errors answer ``{"error": "..."}``
(:mod:`kvsvc.http.errors`).

- ``POST /v1/internal/kv-cache/query`` ``{"token_ids": [int, ...]}`` -> ``{"matches": [...]}``
  (§10; one :meth:`~kvsvc.streams.state.StreamMatch.to_json` per stream, ``[]`` with the index
  disabled). The body is read with one ``wsgi.input.read`` (:func:`~kvsvc.http.body.read_query_body`)
  and packed once (:func:`~kvsvc.http.body.parse_query_tokens`); most of its cost per long
  prompt is ``orjson`` creating the ids as Python ints. Bodies over
  :func:`~kvsvc.http.body.max_content_length` get 413.
- ``POST /v1/internal/heartbeat`` (§9, xllm-service's shape) ``{"name", "incarnation_id",
  "load_metrics": {"waiting_requests_num", "gpu_cache_usage_perc"}, "latency_metrics": {...}}``
  -> 200 ``{"ok": true}``. Refused (nothing recorded): 400 a body of the wrong shape
  (``malformed``) or a load out of range (``invalid_load``, the registry's message), 401 bad
  token, 409 unknown instance or stale incarnation, 503 no registry (``--etcd_addr`` empty).
  Each answer counts once in ``kvsvc_heartbeats_total`` by :data:`~kvsvc.http.metrics.HEARTBEAT_OUTCOMES`.
  A 401 or 409 is also reported to the service's
  :class:`~kvsvc.cluster.rejections.HeartbeatRejections` (one WARNING per instance and reason,
  a reminder at most once a minute); a 200 ends the instance's episode there (one INFO).
- ``POST /v1/internal/route`` ``{"token_ids": [...]}`` or a completion/chat body -> the decision
  (chosen P/D and every candidate's per-rank hit tokens, hit ratio, queue cost, score, tie, in
  flight) plus ``tokenized``, ``heartbeat_rejections`` (the instances whose heartbeats are
  refused, as in ``/ready``) and ``recent_cache_predictions`` (the last proxied answers'
  predicted vs engine-reported cached tokens, oldest first:
  :meth:`~kvsvc.routing.cache_audit.PredictionRecord.to_json`), without sending anything (§11). Bodies up to
  ``--max_request_bytes``.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence, cast

import flask
import orjson
from flask import current_app, request

from kvsvc.errors import (
    BadRequest,
    InvalidHeartbeat,
    NoRegistry,
    StaleIncarnation,
    UnknownInstance,
)
from kvsvc.http.body import (
    check_model_and_stream,
    json_object,
    parse_chat_prompt,
    parse_completion_prompt,
    parse_heartbeat,
    parse_query_tokens,
    parse_token_ids,
    read_body,
    read_query_body,
)
from kvsvc.http.extensions import router, service
from kvsvc.http.metrics import HeartbeatOutcome, metrics

INTERNAL_PREFIX = "/v1/internal/"
QUERY_PATH = "/v1/internal/kv-cache/query"
HEARTBEAT_PATH = "/v1/internal/heartbeat"
ROUTE_PATH = "/v1/internal/route"


def blueprint() -> flask.Blueprint:
    """The internal endpoints (see the module docstring)."""
    bp = flask.Blueprint("kvsvc_internal", __name__)
    bp.add_url_rule(QUERY_PATH, "kv_cache_query", _query, methods=["POST"])
    bp.add_url_rule(HEARTBEAT_PATH, "heartbeat", _heartbeat, methods=["POST"])
    bp.add_url_rule(ROUTE_PATH, "route", _route, methods=["POST"])
    return bp


def _query() -> flask.Response:
    started = time.perf_counter()
    svc = service()
    token_ids = parse_query_tokens(read_query_body(), svc.settings.max_query_tokens)
    if svc.directory is None:
        response = flask.jsonify(matches=[])
    else:
        matches = svc.directory.query(token_ids)
        # orjson: much faster than flask.jsonify for many answers; same keys, same order.
        response = current_app.response_class(
            orjson.dumps({"matches": [m.to_json() for m in matches]}),
            mimetype="application/json")
    # Answered queries only: a 4xx body error is the client's, not the directory's latency.
    metrics().query_seconds.observe(time.perf_counter() - started)
    return response


def _heartbeat() -> flask.Response:
    svc = service()
    counter = metrics().heartbeats
    try:
        hb = parse_heartbeat(read_body())
    except BadRequest:
        counter.labels(HeartbeatOutcome.MALFORMED).inc()
        raise
    try:
        # The one intake of both transports (kvsvc.cluster.heartbeat): the registry's rules,
        # refusals reported to the rejections ledger.
        svc.heartbeats.receive(hb.name, hb.incarnation_id, cast(int, hb.waiting_requests_num),
                               hb.gpu_cache_usage_perc)
    except NoRegistry:
        counter.labels(HeartbeatOutcome.NO_REGISTRY).inc()
        raise
    except InvalidHeartbeat:
        counter.labels(HeartbeatOutcome.INVALID_LOAD).inc()
        raise
    except UnknownInstance:
        counter.labels(HeartbeatOutcome.UNKNOWN_INSTANCE).inc()
        raise
    except StaleIncarnation:
        counter.labels(HeartbeatOutcome.STALE_INCARNATION).inc()
        raise
    counter.labels(HeartbeatOutcome.OK).inc()
    if svc.baidu_std_heartbeats is not None:   # --xllm_dispatch auto: this one is HTTP
        svc.baidu_std_heartbeats.heard_http(hb.name, hb.incarnation_id)
    return flask.jsonify(ok=True)


def _route() -> flask.Response:
    svc = service()
    routing = router()
    # This endpoint takes OpenAI bodies too: their bound, not the query's.
    request.max_content_length = svc.settings.max_request_bytes
    body = read_body()
    doc = json_object(body)
    token_ids: Optional[Sequence[int]]
    if "token_ids" in doc:
        token_ids = parse_token_ids(body, svc.settings.max_query_tokens)
        tokenized = True
    elif "messages" in doc:
        prompt = parse_chat_prompt(doc)
        if "model" in doc:
            check_model_and_stream(doc, routing.models)
        token_ids = routing.tokens.chat_tokens(prompt)
        tokenized = token_ids is not None
    elif "prompt" in doc:
        completion = parse_completion_prompt(doc)
        if "model" in doc:
            check_model_and_stream(doc, routing.models)
        token_ids = routing.tokens.completion_tokens(completion)
        tokenized = token_ids is not None
    else:
        raise BadRequest("body needs token_ids, prompt or messages")
    model = doc.get("model")
    out = metrics().decide(routing, token_ids,
                           model if isinstance(model, str) and model else None).to_json()
    out["tokenized"] = tokenized
    out["heartbeat_rejections"] = svc.heartbeat_rejections.to_json()
    # The last answers' predicted vs actual cached tokens (issue 14), oldest first.
    out["recent_cache_predictions"] = [r.to_json() for r in svc.cache_audit.snapshot().recent]
    return flask.jsonify(out)
