"""The routing endpoints (§11): OpenAI-compatible proxying and the decision endpoint.

:func:`init_app` (one call in :func:`kvsvc.http.app.create_app`) builds a :class:`Router` (policy,
tokenizer, proxy) kept in ``app.extensions["kvsvc.routing"]`` and registers two blueprints:

- ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE when ``"stream": true`` or when
  the upstream answers ``text/event-stream``, else one JSON body): validated (400), the model
  checked (404), tokenized, routed, then proxied to the chosen P (retried once on the next-best
  P when it refuses before the first byte). In P/D mode the upstream body also carries
  ``"routing": {"prefill_name": P, "decode_name": D}`` (xLLM's field). Every proxied response
  carries ``x-kvsvc-prefill`` (the P that answered) and ``x-kvsvc-decode`` (the D, empty when
  none). Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400
  malformed, 404 unknown model, 413 body over ``--max_request_bytes``, 503 no candidate,
  502/504 no upstream answered.
- ``GET /v1/models``: the ``--model`` names (comma-separated flag; kvsvc does not learn names
  from the registry, §9 carries none) as an OpenAI model list. With ``--model`` empty every
  model name is accepted and the list is empty.
- ``POST /v1/internal/route`` (``X-Internal-Token``, §10): ``{"token_ids": [...]}`` or a
  completion/chat body -> the decision (chosen P/D and every candidate's per-rank hit tokens,
  hit ratio, queue cost, score, tie) without sending anything; errors in kvsvc's
  ``{"error": "..."}`` shape like the other internal endpoints.

The request path reads only ``registry.snapshot()``, ``directory.identity()``,
``directory.query()`` and the router's :class:`~kvsvc.routing.policy.InFlight` snapshot for routing
(§11: no ZMQ, etcd or network I/O; an unsynchronized stream only lowers its instance's hit
ratio). The :class:`~kvsvc.routing.policy.InFlight` ledger (``Router.in_flight``) counts every proxied
request from the moment it is sent upstream until its body is closed, against its P and, in
P/D mode, its D; CAR adds the part dispatched after each load report to ``waiting`` (README
"Where the spec is silent"), and ``/v1/internal/route`` shows both figures per candidate.
"""

from __future__ import annotations

import json
import logging
import time
from types import MappingProxyType
from typing import Any, Optional

import flask
from flask import current_app, request
from werkzeug.exceptions import HTTPException

from kvsvc.http.app import EXTENSION, MAX_TOKEN_ID, Service, parse_token_ids, read_body
from kvsvc.settings import ServiceSettings
from kvsvc.errors import RequestError
from kvsvc.http.metrics import METRICS_EXTENSION, Metrics
from kvsvc.routing.policy import Decision, InFlight, Policy, make_policy
from kvsvc.routing.proxy import Proxy, ProxySettings, UpstreamError, upstream_headers
from kvsvc.cluster.model import RegistrySnapshot
from kvsvc.routing.prompt import ChatPrompt, CompletionPrompt, PromptTokenizer, TokenSource

log = logging.getLogger(__name__)

ROUTING_EXTENSION = "kvsvc.routing"
COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
MODELS_PATH = "/v1/models"
ROUTE_PATH = "/v1/internal/route"
PREFILL_HEADER = "x-kvsvc-prefill"
DECODE_HEADER = "x-kvsvc-decode"

_EMPTY_SNAPSHOT = RegistrySnapshot(MappingProxyType({}), False, False, 0)


class NoCandidate(RequestError):
    """503: no instance can serve the request (§11 candidates empty)."""

    def __init__(self, reason: str) -> None:
        super().__init__(503, f"no instance available: {reason}")


class Router:
    """Policy, tokenizer, proxy and served model names of one app. Thread-safe.

    :param policy: the §11 policy.
    :param tokens: prompt tokenization.
    :param proxy: upstream forwarding.
    :param models: served model names (empty: any name accepted).
    :param max_request_bytes: largest OpenAI body, bytes.
    :param metrics: where decisions are recorded (:meth:`Metrics.routed`), ``None`` for none.

    The in-flight ledger is the proxy's (``proxy.in_flight``); a proxy built without one gets
    a fresh :class:`~kvsvc.routing.policy.InFlight`, so routing and forwarding share one.
    """

    def __init__(self, policy: Policy, tokens: TokenSource, proxy: Proxy,
                 models: tuple[str, ...], max_request_bytes: int,
                 metrics: Optional[Metrics] = None) -> None:
        self.policy = policy
        self.tokens = tokens
        if proxy.in_flight is None:
            proxy.in_flight = InFlight()
        self.in_flight: InFlight = proxy.in_flight
        self.proxy = proxy
        self.models = models
        self.max_request_bytes = max_request_bytes
        self.metrics = metrics

    @classmethod
    def from_settings(cls, settings: ServiceSettings, index_enabled: bool) -> "Router":
        """Build from the service settings (policy, tokenizer loaded now, proxy session).

        :raises ConfigError: bad policy parameters or an unloadable ``--tokenizer_path``.
        """
        policy = make_policy(settings.load_balance_policy, settings.car_prefill_lambda,
                             settings.car_host_hit_weight, index_enabled=index_enabled)
        tokenizer = (PromptTokenizer.load(settings.tokenizer_path)
                     if settings.tokenizer_path else None)
        # One kept-alive connection per worker thread and instance: a thread proxies one
        # request at a time, so the pool never discards a connection it will need again.
        proxy = Proxy(ProxySettings(connect_timeout_s=settings.upstream_connect_timeout_s,
                                    read_timeout_s=settings.upstream_read_timeout_s,
                                    pool_maxsize=settings.worker_threads),
                      InFlight())
        return cls(policy, TokenSource(tokenizer), proxy, served_models(settings.model),
                   settings.max_request_bytes)

    def decide(self, svc: Service, token_ids: Optional[list[int]]) -> Decision:
        """Route one prompt with in-process state only (§11).

        Stream identities are read before the query, so a stream replaced in between is judged
        by its predecessor's identity (counts 0) rather than lending its hits to a new
        incarnation.

        The in-flight snapshot is read after the registry's, so a load report received in
        between makes requests look unreported (counted) rather than reported twice over.

        :param svc: the app's service (registry and directory, either may be absent).
        :param token_ids: the prompt's tokens, ``None`` when unknown.
        """
        started = time.perf_counter()
        snapshot = svc.registry.snapshot() if svc.registry is not None else _EMPTY_SNAPSHOT
        in_flight = self.in_flight.snapshot()
        directory = svc.directory
        if directory is None:
            decision = self.policy.choose(token_ids, snapshot, None, None, in_flight)
        else:
            identities = {sid: directory.identity(sid) for sid in directory.stream_ids()}
            matches = directory.query(token_ids if token_ids is not None else [])
            decision = self.policy.choose(token_ids, snapshot, matches, identities, in_flight)
        if self.metrics is not None:
            self.metrics.routed(decision, time.perf_counter() - started)
        return decision

    def close(self) -> None:
        """Close the proxy's pooled connections."""
        self.proxy.close()


def served_models(value: str) -> tuple[str, ...]:
    """``--model`` -> distinct names in order (``"a, b"`` -> ``("a", "b")``)."""
    return tuple(dict.fromkeys(n.strip() for n in value.split(",") if n.strip()))


def routing() -> Router:
    """The :class:`Router` of the current app."""
    return current_app.extensions[ROUTING_EXTENSION]


def init_app(app: flask.Flask) -> Router:
    """Build the app's :class:`Router` and register the routing blueprints (call once, from
    ``create_app``, after the :class:`~kvsvc.http.app.Service` exists).

    :raises ConfigError: see :meth:`Router.from_settings`.
    """
    svc: Service = app.extensions[EXTENSION]
    router = Router.from_settings(svc.settings, index_enabled=svc.directory is not None)
    metrics: Optional[Metrics] = app.extensions.get(METRICS_EXTENSION)
    if metrics is not None:
        router.metrics = metrics
        metrics.upstream_retries = router.proxy.retries
        metrics.upstream_in_flight = router.in_flight.counts
    app.extensions[ROUTING_EXTENSION] = router
    svc.add_closer(router.close)  # the proxy's pooled upstream connections
    app.register_blueprint(_openai_blueprint())
    app.register_blueprint(_internal_blueprint())
    return router


def _openai_blueprint() -> flask.Blueprint:
    bp = flask.Blueprint("kvsvc_openai", __name__)
    bp.before_request(_limit_body)
    bp.add_url_rule(COMPLETIONS_PATH, "completions", _completions, methods=["POST"])
    bp.add_url_rule(CHAT_PATH, "chat_completions", _chat_completions, methods=["POST"])
    bp.add_url_rule(MODELS_PATH, "models", _models, methods=["GET"])
    bp.register_error_handler(RequestError, _openai_request_error)
    bp.register_error_handler(UpstreamError, _openai_upstream_error)
    bp.register_error_handler(HTTPException, _openai_http_error)
    bp.after_request(_count_proxied)
    return bp


#: Endpoint label of ``kvsvc_proxy_requests_total`` per proxied path.
_PROXIED = {COMPLETIONS_PATH: "completions", CHAT_PATH: "chat_completions"}


def _count_proxied(response: flask.Response) -> flask.Response:
    """Count every answer of a proxied endpoint by status (errors included: Flask runs
    ``after_request`` on error handlers' responses too)."""
    endpoint = _PROXIED.get(request.path)
    metrics: Optional[Metrics] = current_app.extensions.get(METRICS_EXTENSION)
    if endpoint is not None and metrics is not None:
        metrics.proxied.labels(endpoint, str(response.status_code)).inc()
    return response


def _internal_blueprint() -> flask.Blueprint:
    bp = flask.Blueprint("kvsvc_route", __name__)
    bp.before_request(_limit_body)
    bp.add_url_rule(ROUTE_PATH, "route", _route, methods=["POST"])
    return bp


def _limit_body() -> None:
    # Per-request bound replacing the app-wide one (sized for token-id queries): werkzeug
    # answers 413 before reading a larger body.
    request.max_content_length = routing().max_request_bytes


# -- body validation (400 before any routing) ----------------------------------------------------

def _json_object(body: bytes) -> dict:
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise RequestError(400, "body is not valid JSON") from exc
    if not isinstance(doc, dict):
        raise RequestError(400, "body must be a JSON object")
    return doc


def _is_token_list(value: Any) -> bool:
    return (isinstance(value, list) and bool(value) and set(map(type, value)) == {int}
            and min(value) >= 0 and max(value) <= MAX_TOKEN_ID)


def parse_completion_prompt(doc: dict) -> CompletionPrompt:
    """``prompt`` of a completion body: a string, a list of strings, a token-id list or a list
    of token-id lists. A one-element batch is unwrapped; a larger batch routes with hit 0.

    :raises RequestError: 400 naming ``prompt``.
    """
    if "prompt" not in doc:
        raise RequestError(400, "prompt: missing")
    prompt = doc["prompt"]
    if isinstance(prompt, str):
        return CompletionPrompt(text=prompt)
    if isinstance(prompt, list) and prompt:
        if _is_token_list(prompt):
            return CompletionPrompt(token_ids=prompt)
        if all(isinstance(p, str) for p in prompt):
            return CompletionPrompt(text=prompt[0]) if len(prompt) == 1 else CompletionPrompt()
        if all(_is_token_list(p) for p in prompt):
            return (CompletionPrompt(token_ids=prompt[0]) if len(prompt) == 1
                    else CompletionPrompt())
    raise RequestError(400, "prompt: must be a string, a non-empty list of strings, a list of "
                            f"token ids in [0, {MAX_TOKEN_ID}] or a list of such lists")


def parse_chat_prompt(doc: dict) -> ChatPrompt:
    """Template inputs of a chat body.

    :raises RequestError: 400 naming the field (``messages``, ``messages[i].role``, ...).
    """
    messages = doc.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages: must be a non-empty list of objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(400, f"messages[{i}]: must be an object")
        if not isinstance(message.get("role"), str):
            raise RequestError(400, f"messages[{i}].role: must be a string")
    add_gen = doc.get("add_generation_prompt", True)
    if not isinstance(add_gen, bool):
        raise RequestError(400, "add_generation_prompt: must be a boolean")
    tools = doc.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RequestError(400, "tools: must be a list")
    kwargs = doc.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise RequestError(400, "chat_template_kwargs: must be an object")
    return ChatPrompt(messages, add_gen, tools, kwargs or {})


def _check_common(doc: dict, router: Router) -> None:
    """``model`` (400 missing/not a string, 404 unknown) and ``stream`` (400 not a boolean)."""
    if "stream" in doc and not isinstance(doc["stream"], bool):
        raise RequestError(400, "stream: must be a boolean")
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError(400, "model: must be a non-empty string")
    if router.models and model not in router.models:
        raise RequestError(404, f"The model `{model}` does not exist.")


# -- OpenAI endpoints ----------------------------------------------------------------------------

def _completions() -> flask.Response:
    router = routing()
    body = read_body()
    doc = _json_object(body)
    prompt = parse_completion_prompt(doc)
    _check_common(doc, router)
    return _forward(router, COMPLETIONS_PATH, body, doc,
                    router.tokens.completion_tokens(prompt))


def _chat_completions() -> flask.Response:
    router = routing()
    body = read_body()
    doc = _json_object(body)
    prompt = parse_chat_prompt(doc)
    _check_common(doc, router)
    return _forward(router, CHAT_PATH, body, doc, router.tokens.chat_tokens(prompt))


def _forward(router: Router, path: str, body: bytes, doc: dict,
             token_ids: Optional[list[int]]) -> flask.Response:
    """Route and proxy one validated OpenAI request; the client's bytes go up unchanged
    unless P/D mode adds ``routing``."""
    svc: Service = current_app.extensions[EXTENSION]
    started = time.monotonic()
    decision = router.decide(svc, token_ids)
    if decision.prefill is None:
        raise NoCandidate(decision.reason)
    decode = decision.decode.name if decision.decode is not None else ""

    def body_for(target: str) -> bytes:
        if not decode:
            return body
        return json.dumps({**doc, "routing": {"prefill_name": target,
                                              "decode_name": decode}}).encode()

    query = request.query_string.decode("latin-1")
    reply = router.proxy.forward([i.name for i in decision.prefill_ranking],
                                 path + ("?" + query if query else ""), body_for,
                                 upstream_headers(list(request.headers.items())),
                                 companions=(decode,) if decode else ())
    try:
        headers = reply.headers + [(PREFILL_HEADER, reply.target), (DECODE_HEADER, decode)]
        log.debug("%s %s -> %s/%s (%s, %d tokens) head in %.1f ms", request.method, path,
                  reply.target, decode or "-", decision.policy, decision.input_tokens,
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
        for name in routing().models])


_OPENAI_ERRORS = {400: ("invalid_request_error", None), 404: ("invalid_request_error",
                                                              "model_not_found"),
                  413: ("invalid_request_error", "request_too_large"),
                  502: ("upstream_error", None), 503: ("service_unavailable", None),
                  504: ("upstream_timeout", None)}


def openai_error(status: int, message: str, param: Optional[str] = None) -> flask.Response:
    """OpenAI's error body ``{"error": {"message", "type", "param", "code"}}`` with
    ``status``."""
    kind, code = _OPENAI_ERRORS.get(status, ("invalid_request_error" if status < 500
                                             else "server_error", None))
    response = flask.jsonify(error={"message": message, "type": kind, "param": param,
                                    "code": code})
    response.status_code = status
    return response


def _openai_request_error(exc: RequestError) -> flask.Response:
    param = exc.message.split(":", 1)[0] if exc.status == 400 and ":" in exc.message else None
    if exc.status == 404:
        param = "model"
    return openai_error(exc.status, exc.message, param)


def _openai_upstream_error(exc: UpstreamError) -> flask.Response:
    return openai_error(exc.status, exc.message)


def _openai_http_error(exc: HTTPException) -> flask.Response:
    return openai_error(exc.code or 500, exc.description or exc.name)


# -- decision endpoint ---------------------------------------------------------------------------

def _route() -> flask.Response:
    router = routing()
    svc: Service = current_app.extensions[EXTENSION]
    body = read_body()
    doc = _json_object(body)
    if "token_ids" in doc:
        token_ids: Optional[list[int]] = parse_token_ids(body, svc.settings.max_query_tokens)
        tokenized = True
    elif "messages" in doc:
        prompt = parse_chat_prompt(doc)
        if "model" in doc:
            _check_common(doc, router)
        token_ids = router.tokens.chat_tokens(prompt)
        tokenized = token_ids is not None
    elif "prompt" in doc:
        completion = parse_completion_prompt(doc)
        if "model" in doc:
            _check_common(doc, router)
        token_ids = router.tokens.completion_tokens(completion)
        tokenized = token_ids is not None
    else:
        raise RequestError(400, "body needs token_ids, prompt or messages")
    decision = router.decide(svc, token_ids)
    out = decision.to_json()
    out["tokenized"] = tokenized
    return flask.jsonify(out)
