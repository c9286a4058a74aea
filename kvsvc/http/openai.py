"""The OpenAI-compatible endpoints (§11), answering errors in OpenAI's shape.

- ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE when ``"stream": true`` or when
  the upstream answers ``text/event-stream``, else one JSON body): validated (400), the model
  checked (404), tokenized, routed, then proxied to the chosen P (retried once on the next-best
  P when it refuses before the first byte; :meth:`kvsvc.routing.router.Router.forward`). Every
  proxied response carries ``x-kvsvc-prefill`` (the P that answered) and ``x-kvsvc-decode``
  (the D, empty when none). Bodies over ``--max_request_bytes`` get 413 before they are read.
- ``GET /v1/models``: the ``--model`` names (comma-separated flag; kvsvc does not learn names
  from the registry, §9 carries none) as an OpenAI model list. With ``--model`` empty every
  model name is accepted and the list is empty.

Errors: ``{"error": {"message", "type", "param", "code"}}`` with the status of
:func:`kvsvc.http.errors.status_of`: 400 malformed (``param`` the field named by the message),
404 unknown model, 413 too large, 503 no candidate, 502/504 no upstream answered. Every answer of
the two proxied endpoints counts in ``kvsvc_proxy_requests_total`` by endpoint and status.
"""

from __future__ import annotations

import logging
import time
from typing import Optional, Sequence

import flask
from flask import request
from werkzeug.exceptions import HTTPException

from kvsvc.errors import BadRequest, RequestError, UnknownModel, UpstreamError
from kvsvc.http.body import (
    check_model_and_stream,
    json_object,
    parse_chat_prompt,
    parse_completion_prompt,
    read_body,
)
from kvsvc.http.errors import status_of
from kvsvc.http.extensions import router, service
from kvsvc.http.metrics import metrics

log = logging.getLogger(__name__)

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
MODELS_PATH = "/v1/models"
PREFILL_HEADER = "x-kvsvc-prefill"
DECODE_HEADER = "x-kvsvc-decode"

#: Endpoint label of ``kvsvc_proxy_requests_total`` per proxied path.
_PROXIED = {COMPLETIONS_PATH: "completions", CHAT_PATH: "chat_completions"}

#: HTTP status -> OpenAI's error ``type`` and ``code``.
_OPENAI_ERRORS = {400: ("invalid_request_error", None), 404: ("invalid_request_error",
                                                              "model_not_found"),
                  413: ("invalid_request_error", "request_too_large"),
                  502: ("upstream_error", None), 503: ("service_unavailable", None),
                  504: ("upstream_timeout", None)}


def blueprint() -> flask.Blueprint:
    """The OpenAI endpoints with their body bound, error shape and answer counter."""
    bp = flask.Blueprint("kvsvc_openai", __name__)
    bp.before_request(_limit_body)
    bp.add_url_rule(COMPLETIONS_PATH, "completions", _completions, methods=["POST"])
    bp.add_url_rule(CHAT_PATH, "chat_completions", _chat_completions, methods=["POST"])
    bp.add_url_rule(MODELS_PATH, "models", _models, methods=["GET"])
    bp.register_error_handler(RequestError, _kvsvc_error)
    bp.register_error_handler(UpstreamError, _kvsvc_error)
    bp.register_error_handler(HTTPException, _http_error)
    bp.after_request(_count_proxied)
    return bp


def _limit_body() -> None:
    # Per-request bound replacing the app-wide one (sized for token-id queries): werkzeug
    # answers 413 before reading a larger body.
    request.max_content_length = service().settings.max_request_bytes


def _count_proxied(response: flask.Response) -> flask.Response:
    """Count every answer of a proxied endpoint by status (errors included: Flask runs
    ``after_request`` on error handlers' responses too)."""
    endpoint = _PROXIED.get(request.path)
    if endpoint is not None:
        metrics().proxied.labels(endpoint, str(response.status_code)).inc()
    return response


def _completions() -> flask.Response:
    body = read_body()
    doc = json_object(body)
    prompt = parse_completion_prompt(doc)
    check_model_and_stream(doc, router().models)
    return _forward(COMPLETIONS_PATH, body, doc, router().tokens.completion_tokens(prompt))


def _chat_completions() -> flask.Response:
    body = read_body()
    doc = json_object(body)
    prompt = parse_chat_prompt(doc)
    check_model_and_stream(doc, router().models)
    return _forward(CHAT_PATH, body, doc, router().tokens.chat_tokens(prompt))


def _forward(path: str, body: bytes, doc: dict, token_ids: Optional[Sequence[int]]
             ) -> flask.Response:
    """Route and proxy one validated request; relay the upstream's answer."""
    routing = router()
    started = time.monotonic()
    decision = metrics().decide(routing, token_ids)
    query = request.query_string.decode("latin-1")
    routed = routing.forward(decision, path + ("?" + query if query else ""), body, doc,
                             list(request.headers.items()))
    reply = routed.reply
    try:
        headers = reply.headers + [(PREFILL_HEADER, reply.target), (DECODE_HEADER, routed.decode)]
        log.debug("%s %s -> %s/%s (%s, %d tokens) head in %.1f ms", request.method, path,
                  reply.target, routed.decode or "-", decision.policy, decision.input_tokens,
                  (time.monotonic() - started) * 1000)
        if doc.get("stream") is True or reply.is_event_stream:
            # The WSGI server closes the body when the stream ends or the client goes away;
            # that releases the request's in-flight count.
            return flask.Response(reply.body, status=reply.status, headers=headers,
                                  direct_passthrough=True)
        return flask.Response(reply.body.read_all(), status=reply.status, headers=headers)
    except BaseException:
        reply.body.close()  # idempotent: read_all() may have closed it already
        raise


def _models() -> flask.Response:
    return flask.jsonify(object="list", data=[
        {"id": name, "object": "model", "created": 0, "owned_by": "kvsvc"}
        for name in router().models])


def openai_error(status: int, message: str, param: Optional[str] = None) -> flask.Response:
    """OpenAI's error body ``{"error": {"message", "type", "param", "code"}}`` with
    ``status``."""
    kind, code = _OPENAI_ERRORS.get(status, ("invalid_request_error" if status < 500
                                             else "server_error", None))
    response = flask.jsonify(error={"message": message, "type": kind, "param": param,
                                    "code": code})
    response.status_code = status
    return response


def _kvsvc_error(exc: RequestError | UpstreamError) -> flask.Response:
    param: Optional[str] = None
    if isinstance(exc, BadRequest) and ":" in exc.message:
        param = exc.message.split(":", 1)[0]
    elif isinstance(exc, UnknownModel):
        param = "model"
    return openai_error(status_of(exc), exc.message, param)


def _http_error(exc: HTTPException) -> flask.Response:
    return openai_error(exc.code or 500, exc.description or exc.name)
