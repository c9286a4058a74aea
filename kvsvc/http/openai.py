"""The OpenAI-compatible endpoints (§11), answering errors in OpenAI's shape.

- ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE when ``"stream": true`` or when
  the upstream answers ``text/event-stream``, else one JSON body): validated (400), the model
  checked (404), tokenized, routed, then proxied to the chosen P (retried once on the next-best
  P when it refuses before the first byte; :meth:`kvsvc.routing.router.Router.forward`). Every
  proxied response carries ``x-kvsvc-prefill`` (the P that answered) and, in P/D mode,
  ``x-kvsvc-decode`` (the D; absent when there is none), and ``x-kvsvc-predicted-cached-tokens`` when the policy predicted
  that P's reusable prefix (:func:`~kvsvc.routing.cache_audit.prediction`; not RR), and
  ``x-kvsvc-predicted-ttft-ms`` when it predicted that P's time to first token (SLO_AWARE,
  TTFT; :func:`predicted_ttft_ms`). Bodies over ``--max_request_bytes`` get 413 before they are read.
- A streamed answer whose upstream body breaks after the head (the engine died, reset the
  connection, or sent nothing within ``--upstream_read_timeout_s``) ends with one SSE event in
  OpenAI's streaming error shape, ``data: {"error": {"message", "type", "param", "code":
  "upstream_broken"}}`` and a blank line (event streams only; never ``[DONE]``), and then the
  transfer is aborted (:class:`StreamRelay`): the connection is closed without the last chunk,
  so a chunked HTTP/1.1 client sees an incomplete body, not a clean end. The proxy logs it once
  (WARNING); it counts as status ``upstream_broken``. A non-streamed body that breaks is read
  before anything is sent: 502 (504 for a timeout).
- ``POST /v1/embeddings``: ``model`` and ``input`` checked, then routed with no prompt tokens
  (no cache hit to route on) to an instance serving the model and relayed as it is.
- Every proxied request goes up with its ``X-Request-Id`` (:mod:`kvsvc.http.admission`).
- ``GET /v1/models``: with ``--model`` set, those names (comma-separated flag) as an OpenAI model
  list. With ``--model`` empty every model name is accepted, and the list is the union of the
  backends' own lists (``GET /v1/models`` of every registered schedulable instance, fetched in
  the background by :class:`~kvsvc.routing.models.ModelLister`, never on the request path),
  each model once, by id. ``GET /v1/models/{id}``: that model's object from the same list, 404
  ``model_not_found`` when absent.
- Model-aware candidates (§15): a request's ``model`` is routed only to the instances whose
  own ``/v1/models`` list holds it (an instance whose list is not known yet serves every
  model); no registered instance serving it: 404 ``model_not_found``.

Errors: ``{"error": {"message", "type", "param", "code"}}`` (:func:`kvsvc.http.errors.openai_error`,
every error under ``/v1/`` except ``/v1/internal/*``) with the status of
:func:`kvsvc.http.errors.status_of`: 400 malformed (``param`` the field named by the message),
404 unknown model, 405 wrong method, 413 too large, 503 no candidate, 502/504 no upstream
answered.

Client going away (§15): while the upstream prepares its response head, the client's
connection (gunicorn's ``gunicorn.socket``) is watched (:class:`~kvsvc.routing.proxy.ClientWatch`);
when it closes, the upstream connection is closed, which cancels the request on the engine, and
nothing is answered. A streamed answer's client going away closes the relay, which closes the
upstream connection too.

Metrics (:class:`kvsvc.http.metrics.Metrics`): every answer of the two proxied endpoints counts
in ``kvsvc_proxy_requests_total`` by endpoint and status (a streamed one when its relay ends, as
``upstream_broken`` when the upstream broke it; ``client_closed`` when the client went away
before the head or before the end of its stream); an answer relayed from an upstream is timed
from the request's start to its last byte (``kvsvc_proxy_request_duration_seconds``), a streamed
one also to its first SSE data event (``kvsvc_proxy_time_to_first_token_seconds``).
"""

from __future__ import annotations

import errno
import json
import logging
import time
from typing import Callable, Iterator, Optional, Sequence

import flask
from flask import request

from kvsvc.errors import BadRequest, UnknownModel, UpstreamError
from kvsvc.http.admission import REQUEST_ID_HEADER, hand_over_slot, request_id
from kvsvc.http.body import (
    check_generation_fields,
    check_model_and_stream,
    json_object,
    parse_chat_prompt,
    parse_completion_prompt,
    read_query_body,
)
from kvsvc.http.errors import OPENAI_ERRORS, status_of
from kvsvc.http.extensions import router, service
from kvsvc.http.metrics import metrics
from kvsvc.routing.cache_audit import prediction
from kvsvc.routing.policy import Decision
from kvsvc.routing.proxy import ClientWatch, UpstreamBody

log = logging.getLogger(__name__)

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
EMBEDDINGS_PATH = "/v1/embeddings"
MODELS_PATH = "/v1/models"
PREFILL_HEADER = "x-kvsvc-prefill"
DECODE_HEADER = "x-kvsvc-decode"
#: The cached tokens routing predicted on the P that answered (absent when it predicted none).
PREDICTED_HEADER = "x-kvsvc-predicted-cached-tokens"
#: The TTFT (ms, the profiling data's unit) SLO_AWARE or TTFT predicted on the P that answered.
PREDICTED_TTFT_HEADER = "x-kvsvc-predicted-ttft-ms"

#: Endpoint label of ``kvsvc_proxy_requests_total`` per proxied path.
_PROXIED = {COMPLETIONS_PATH: "completions", CHAT_PATH: "chat_completions",
            EMBEDDINGS_PATH: "embeddings"}
#: ``code`` of the SSE error event of a broken stream, and its status label in
#: ``kvsvc_proxy_requests_total``.
UPSTREAM_BROKEN = "upstream_broken"
#: Status label of ``kvsvc_proxy_requests_total`` for an answer nobody waited for: the client
#: went away before the head (non-streamed, :class:`~kvsvc.errors.ClientGone`, status 499) or
#: during the relay (streamed) (§15).
CLIENT_CLOSED = "client_closed"
#: WSGI environ key of the client's socket (gunicorn's workers set it).
CLIENT_SOCKET = "gunicorn.socket"
#: ``flask.g`` keys: the request's start (``time.monotonic()``), and "counted when the relay
#: ends" (streamed answers are counted by their relay, not by ``after_request``).
_STARTED = "kvsvc_started"
_COUNTED_AT_END = "kvsvc_counted_at_end"


def predicted_ttft_ms(decision: Decision, target: str) -> Optional[float]:
    """The predicted TTFT (ms) of ``decision``'s P-side candidate ``target`` (``host:port``),
    ``None`` when the policy predicted none there (RR, CAR) or ``target`` is not a candidate."""
    cand = decision.prefill_candidate(target)
    return cand.predicted_ttft_ms if cand is not None else None

def blueprint() -> flask.Blueprint:
    """The OpenAI endpoints with their body bound, error shape and answer counter."""
    bp = flask.Blueprint("kvsvc_openai", __name__)
    bp.before_request(_limit_body)
    bp.add_url_rule(COMPLETIONS_PATH, "completions", _completions, methods=["POST"])
    bp.add_url_rule(CHAT_PATH, "chat_completions", _chat_completions, methods=["POST"])
    bp.add_url_rule(EMBEDDINGS_PATH, "embeddings", _embeddings, methods=["POST"])
    bp.add_url_rule(MODELS_PATH, "models", _models, methods=["GET"])
    bp.add_url_rule(MODELS_PATH + "/<path:model_id>", "model", _model, methods=["GET"])
    # Errors are answered in OpenAI's shape by the app-wide handlers (kvsvc.http.errors),
    # which choose the shape by path: a 405 never reaches a blueprint's handler.
    bp.after_request(_count_proxied)
    return bp


def _limit_body() -> None:
    flask.g.setdefault(_STARTED, time.monotonic())
    # Per-request bound replacing the app-wide one (sized for token-id queries): werkzeug
    # answers 413 before reading a larger body.
    request.max_content_length = service().settings.max_request_bytes


def _count_proxied(response: flask.Response) -> flask.Response:
    """Count every answer of a proxied endpoint by status (errors included: Flask runs
    ``after_request`` on error handlers' responses too), except a streamed one, which its
    relay counts when it ends."""
    endpoint = _PROXIED.get(request.path)
    if endpoint is not None and not flask.g.get(_COUNTED_AT_END):
        status = response.status_code
        metrics().proxied_of(endpoint, CLIENT_CLOSED if status == 499 else str(status)).inc()
    return response


def client_watch() -> Optional[ClientWatch]:
    """The watch of the current request's client connection (§15), ``None`` when the WSGI
    server does not expose its socket (Flask's test client, werkzeug's dev server)."""
    sock = request.environ.get(CLIENT_SOCKET)
    return ClientWatch(sock) if sock is not None else None


def sse_error_event(exc: UpstreamError) -> bytes:
    """One SSE event in OpenAI's streaming error shape for a stream the upstream broke:
    ``data: {"error": {"message", "type", "param": null, "code": "upstream_broken"}}`` and a
    blank line; ``type`` is that of the status the error would answer before the head
    (``upstream_error`` for 502, ``upstream_timeout`` for 504)."""
    kind = OPENAI_ERRORS.get(status_of(exc), ("upstream_error", None))[0]
    event = {"error": {"message": exc.message, "type": kind, "param": None,
                       "code": UPSTREAM_BROKEN}}
    return b"data: " + json.dumps(event).encode() + b"\n\n"


class StreamRelay:
    """The WSGI iterable of a streamed answer: the upstream body's chunks as they arrive.

    When the upstream body breaks after the head, it yields one :func:`sse_error_event` (event
    streams only: in another content type it would corrupt the body) and then raises
    ``ConnectionResetError`` (``errno.ECONNRESET``): an exception from the iterable after the
    head is how a WSGI server is told to abort the response, and that errno is the one gunicorn
    (gthread and sync workers) takes as "connection gone": it closes the connection without
    the terminating zero-length chunk and logs it at debug level only (the proxy's WARNING is
    the one line about it). :meth:`close` (called by the WSGI server when the response ends or
    the client goes away) closes the upstream body.

    :param body: the upstream body (released, and its relay end reported, by its close).
    :param event_stream: the answer is ``text/event-stream``.
    :param on_close: called once after the body's close (the request's in-flight slot,
        :func:`~kvsvc.http.admission.hand_over_slot`); ``None``: nothing.
    """

    def __init__(self, body: UpstreamBody, event_stream: bool,
                 on_close: Optional[Callable[[], None]] = None) -> None:
        self._body = body
        self._event_stream = event_stream
        self._on_close = on_close

    def __iter__(self) -> Iterator[bytes]:
        try:
            yield from self._body
        except UpstreamError as exc:
            if self._event_stream:
                yield sse_error_event(exc)
            raise ConnectionResetError(errno.ECONNRESET, "response aborted: the upstream "
                                       f"broke the stream ({exc.message})") from exc

    def close(self) -> None:
        """Close the upstream body, then call ``on_close`` (once). Idempotent."""
        try:
            self._body.close()
        finally:
            on_close, self._on_close = self._on_close, None
            if on_close is not None:
                on_close()


def _completions() -> flask.Response:
    body = read_query_body()  # one read of a known length: no werkzeug stream copies
    doc = json_object(body)
    prompt = parse_completion_prompt(doc)
    check_generation_fields(doc, chat=False)
    check_model_and_stream(doc, router().models)
    return _forward(COMPLETIONS_PATH, body, doc, router().tokens.completion_tokens(prompt))


def _chat_completions() -> flask.Response:
    body = read_query_body()  # one read of a known length: no werkzeug stream copies
    doc = json_object(body)
    prompt = parse_chat_prompt(doc)
    check_generation_fields(doc, chat=True)
    check_model_and_stream(doc, router().models)
    return _forward(CHAT_PATH, body, doc, router().tokens.chat_tokens(prompt))


def _embeddings() -> flask.Response:
    body = read_query_body()  # one read of a known length: no werkzeug stream copies
    doc = json_object(body)
    if "input" not in doc:
        raise BadRequest("input: missing")
    check_model_and_stream(doc, router().models)
    # Passed through by model; no prompt tokens: an embedding reuses no KV cache to route on.
    return _forward(EMBEDDINGS_PATH, body, doc, None)


def _client_headers() -> list[tuple[str, str]]:
    """The client's headers, its ``X-Request-Id`` replaced by the request's id
    (:mod:`kvsvc.http.admission`: the client's own when valid, else a new one)."""
    rid = request_id()
    if rid is None:
        return list(request.headers.items())
    headers = [(k, v) for k, v in request.headers.items() if k.lower() != "x-request-id"]
    headers.append((REQUEST_ID_HEADER, rid))
    return headers


def _forward(path: str, body: bytes, doc: dict, token_ids: Optional[Sequence[int]]
             ) -> flask.Response:
    """Route and proxy one validated request; relay the upstream's answer."""
    routing = router()
    instruments = metrics()
    started: float = flask.g.get(_STARTED, time.monotonic())
    endpoint = _PROXIED[path]
    model = doc.get("model")
    decision = instruments.decide(routing, token_ids, model if isinstance(model, str) else None)
    query = request.query_string.decode("latin-1")
    routed = routing.forward(decision, path + ("?" + query if query else ""), body, doc,
                             _client_headers(), client_watch(), token_ids)
    reply = routed.reply
    try:
        headers = reply.headers + [(PREFILL_HEADER, reply.target)]
        if routed.decode:   # no D (no P/D split): no header, rather than an empty one
            headers.append((DECODE_HEADER, routed.decode))
        predicted = prediction(decision, reply.target)  # what the cache audit compares
        if predicted is not None:
            headers.append((PREDICTED_HEADER, str(predicted.predicted_tokens)))
        ttft = predicted_ttft_ms(decision, reply.target)
        if ttft is not None:
            headers.append((PREDICTED_TTFT_HEADER, f"{ttft:.1f}"))
        if log.isEnabledFor(logging.DEBUG):  # its arguments cost more than the check
            log.debug("%s %s -> %s/%s (%s, %d tokens) head in %.1f ms", request.method, path,
                      reply.target, routed.decode or "-", decision.policy,
                      decision.input_tokens, (time.monotonic() - started) * 1000)
        if doc.get("stream") is True or reply.is_event_stream:
            # The WSGI server closes the relay when the stream ends or the client goes away;
            # that releases the request's in-flight count, then counts and times the answer.
            status = str(reply.status)
            reply.body.when_closed(lambda end: instruments.relayed(
                endpoint, UPSTREAM_BROKEN if end.broken
                else status if end.complete else CLIENT_CLOSED, started, end))
            response = flask.Response(StreamRelay(reply.body, reply.is_event_stream,
                                                  hand_over_slot()),
                                      status=reply.status, headers=headers,
                                      direct_passthrough=True)
            flask.g.setdefault(_COUNTED_AT_END, True)
            return response
        response = flask.Response(reply.body.read_all(), status=reply.status, headers=headers)
        target = reply.target
        # Runs when the WSGI server closes the response, after its last byte was written.
        response.call_on_close(lambda: instruments.request_seconds_of(
            endpoint, target).observe(time.monotonic() - started))
        return response
    except BaseException:
        reply.body.close()  # idempotent: read_all() may have closed it already
        raise


def _model_objects() -> list[dict]:
    """The OpenAI model objects of ``/v1/models``: the ``--model`` names when set, else the
    union of the instances' own lists (:class:`~kvsvc.routing.models.ModelLister`)."""
    served = router().models
    if served:
        return [{"id": name, "object": "model", "created": 0, "owned_by": "kvsvc"}
                for name in served]
    lister = service().models
    return [{"id": m.id, "object": "model", "created": m.created, "owned_by": m.owned_by}
            for m in (lister.models() if lister is not None else ())]


def _models() -> flask.Response:
    return flask.jsonify(object="list", data=_model_objects())


def _model(model_id: str) -> flask.Response:
    """``GET /v1/models/{id}`` (the SDK's ``models.retrieve``): that model's object from the
    same list as ``/v1/models``; 404 ``model_not_found`` when it is not in it."""
    for obj in _model_objects():
        if obj["id"] == model_id:
            return flask.jsonify(obj)
    raise UnknownModel(f"The model `{model_id}` does not exist.")
