"""The Flask application: the KV-cache query API, liveness and readiness (§10).

``create_app(settings)`` builds the app and a :class:`Service` (directory, settings, token) kept
in ``app.extensions["kvsvc"]``; nothing starts there. Whoever serves the app starts the service
after any fork (gunicorn: ``post_worker_init``, see :mod:`kvsvc.server`) and closes it at exit.

Endpoints:

- ``POST /v1/internal/kv-cache/query`` ``{"token_ids": [int, ...]}`` -> ``{"matches": [...]}``
  (one :meth:`~kvsvc.streams.state.StreamMatch.to_json` per stream; ``[]`` with the index
  disabled). ``/v1/internal/*`` needs ``X-Internal-Token`` when a token is configured (401).
  Its cost per 4,096-id prompt is mostly ``orjson`` creating the ids as Python ints; the body
  is read with one ``wsgi.input.read`` (:func:`read_query_body`) and packed once
  (:func:`parse_query_tokens`). It goes through Flask like every other endpoint (bench 4
  compares it with ``GET /health`` on the same path).
- ``POST /v1/internal/heartbeat`` (§9, xllm-service's shape) ``{"name", "incarnation_id",
  "load_metrics": {"waiting_requests_num", "gpu_cache_usage_perc"}, "latency_metrics": {...}}``
  -> 200 ``{"ok": true}``; 400 malformed (nothing recorded); 401 bad token; 409 unknown instance
  or stale incarnation; 503 when no registry is configured (``--etcd_addr`` empty).
- ``GET /health``: liveness, always ``{"status": "ok"}``; touches nothing (no etcd, no
  upstream, no stream lock).
- ``GET /metrics``: Prometheus text exposition (:mod:`kvsvc.http.metrics`); not behind the internal
  token unless ``--metrics_require_token`` is set.
- ``GET /ready``: 200 once the service runs, the registry (when configured) is fresh or static
  streams are configured, and every stream has been synchronized at least once; else 503. The
  body shows every stream's state, error, sequence, resident block counts, completed recoveries
  and periodic-resync differences (§6); with a registry also ``registry`` (``fresh``,
  ``is_master``, ``generation``, ``instances``), with discovery also ``discovery.excluded``
  (instance -> reason) and each stream's ``identity`` (the incarnation it was added for). etcd unreachable keeps the last registry snapshot (streams
  go on) and only degrades readiness.

Service wiring (§9): with ``--etcd_addr`` a :class:`~kvsvc.cluster.registry.Registry` runs; with an
enabled ``discovery`` block a :class:`~kvsvc.cluster.discovery.Discovery` thread manages the directory's
streams. :meth:`Service.start` starts registry, directory, discovery in that order;
:meth:`Service.close` stops them in reverse.

Every error answer is JSON ``{"error": "..."}`` (400, 401, 404, 405, 413, 500), never HTML.
:class:`~kvsvc.errors.RequestError` carries the 4xx status of bad input.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
import time
from array import array
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import flask
from gunicorn.http.errors import ParseException as GunicornParseError
import orjson
from flask import current_app, request
from prometheus_client import CONTENT_TYPE_LATEST
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge
from werkzeug.wsgi import get_content_length

from kvsvc.config import KvEventsConfig, check_discovery_needs_etcd
from kvsvc.settings import ServiceSettings
from kvsvc.directory import Directory
from kvsvc.cluster.discovery import Discovery
from kvsvc.errors import (
    InvalidHeartbeat,
    LifecycleError,
    RequestError,
    StaleIncarnation,
    UnknownInstance,
)
from kvsvc.index.keys import ARRAY_IS_WIRE_FORM, pack_tokens
from kvsvc.http.metrics import METRICS_EXTENSION, Metrics
from kvsvc.cluster.model import MAX_WAITING_REQUESTS, RegistrySettings
from kvsvc.cluster.registry import Registry

log = logging.getLogger(__name__)

EXTENSION = "kvsvc"
QUERY_PATH = "/v1/internal/kv-cache/query"
HEARTBEAT_PATH = "/v1/internal/heartbeat"
METRICS_PATH = "/metrics"
INTERNAL_PREFIX = "/v1/internal/"
TOKEN_HEADER = "X-Internal-Token"
MAX_TOKEN_ID = 2**31 - 1

#: Bytes of JSON one token id can take in a body: ``2147483647`` plus ``", "``.
_BYTES_PER_TOKEN = 12
#: Room for the object around the list and for pretty-printing whitespace.
_BODY_SLACK_BYTES = 64 * 1024


def max_content_length(max_query_tokens: int) -> int:
    """Largest query body accepted, bytes: a body with ``max_query_tokens`` of the longest ids,
    comma-space separated, fits with room to spare; anything larger gets 413 before it is read.

    :param max_query_tokens: the ``max_query_tokens`` setting (§10).
    """
    return max_query_tokens * _BYTES_PER_TOKEN + _BODY_SLACK_BYTES


def registry_settings(settings: ServiceSettings) -> Optional[RegistrySettings]:
    """The registry's settings from the service's (§9), ``None`` without ``etcd_addr``.

    :raises ConfigError: a value the registry refuses.
    """
    if not settings.etcd_addr:
        return None
    return RegistrySettings(
        etcd_addr=settings.etcd_addr, namespace=settings.etcd_namespace,
        suspect_removal_s=settings.detect_disconnected_instance_interval,
        self_address=settings.advertised_address())


class Service:
    """Everything one app serves from: settings, the internal token, the instance registry,
    the directory and discovery. Nothing starts in the constructor.

    :param settings: validated service settings.
    :param kv_config: the §8 config, or ``None`` for a disabled index (no directory).
    :param token: the internal API token, ``None`` when none is required.
    :raises ConfigError: discovery enabled without ``--etcd_addr``, or bad registry settings.
    """

    def __init__(self, settings: ServiceSettings, kv_config: Optional[KvEventsConfig],
                 token: Optional[str]) -> None:
        self.settings = settings
        self.token = token
        self.kv_config = kv_config
        if kv_config is not None:
            check_discovery_needs_etcd(kv_config, settings.etcd_addr)
        self.directory: Optional[Directory] = (
            Directory(kv_config, max_concurrent_snapshots=settings.max_concurrent_snapshots)
            if kv_config is not None else None)
        reg_settings = registry_settings(settings)
        self.registry: Optional[Registry] = Registry(reg_settings) if reg_settings else None
        self.discovery: Optional[Discovery] = None
        if (kv_config is not None and kv_config.discovery is not None
                and kv_config.discovery.enabled and self.registry is not None
                and self.directory is not None):
            self.discovery = Discovery(self.registry, self.directory, kv_config.discovery,
                                       kv_config)
        #: Static streams answer without a registry; readiness then ignores its freshness.
        self.static_streams = bool(kv_config is not None and kv_config.streams)
        self._lock = threading.Lock()
        self._running = False
        self._closers: list[Callable[[], None]] = []

    @property
    def running(self) -> bool:
        """True between :meth:`start` and :meth:`close`."""
        with self._lock:
            return self._running

    def start(self, timeout_s: float = 5.0) -> None:
        """Start the registry, the directory's stream threads (none with the index disabled)
        and discovery, in that order (§9). On a failure what was started is closed again.

        :param timeout_s: bound of each component's (and each stream's) start, seconds.
        :raises LifecycleError: already running, or something did not start in time.
        """
        with self._lock:
            if self._running:
                raise LifecycleError("service already started")
        if self.directory is None:
            log.warning("kv_events_config_file is empty: KV index disabled, every query "
                        "answers no matches (hit ratio 0)")
        started: list[Any] = []
        try:
            for part in (self.registry, self.directory, self.discovery):
                if part is not None:
                    part.start(timeout_s=timeout_s)
                    started.append(part)
        except BaseException:
            log.error("service start failed after %d components; closing them", len(started))
            for part in reversed(started):
                try:
                    part.close(timeout_s=timeout_s)
                except LifecycleError as exc:
                    log.error("while undoing the start: %s", exc)
            raise
        with self._lock:
            self._running = True
        log.info("service started (%d streams, registry %s, discovery %s, token %s)",
                 len(self.directory) if self.directory is not None else 0,
                 self.settings.etcd_addr or "off", "on" if self.discovery else "off",
                 "required" if self.token else "not required")

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop discovery, the directory's threads and the registry, in that order.
        Idempotent. Every component is closed even when an earlier one fails.

        :raises LifecycleError: a thread did not stop in time (the first such failure).
        """
        with self._lock:
            if not self._running:
                return
            self._running = False
        failure: Optional[LifecycleError] = None
        for part in (self.discovery, self.directory, self.registry):
            if part is None:
                continue
            try:
                part.close(timeout_s=timeout_s)
            except LifecycleError as exc:
                log.error("service close: %s", exc)
                failure = failure or exc
        for closer in self._closers:
            try:
                closer()
            except Exception:  # noqa: BLE001 - a failing closer must not keep others open
                log.exception("service close: %r failed", closer)
        log.info("service closed")
        if failure is not None:
            raise failure

    def add_closer(self, closer: Callable[[], None]) -> None:
        """Register a callable run by :meth:`close` after the threads stopped (e.g. the routing
        proxy's connection pool). Called at app build time, before the service starts."""
        self._closers.append(closer)


def service() -> Service:
    """The :class:`Service` of the current app (inside a request or app context)."""
    return current_app.extensions[EXTENSION]


def create_app(settings: ServiceSettings, kv_config: Optional[KvEventsConfig] = None) -> flask.Flask:
    """Build the Flask app and its (not started) :class:`Service`.

    :param settings: service settings.
    :param kv_config: the §8 config; ``None`` loads ``settings.kv_events_config_file`` when set,
        and an empty path disables the index.
    :raises ConfigError: the §8 file or the token file is invalid or unreadable.
    """
    if kv_config is None:
        kv_config = settings.kv_events_config()
    app = flask.Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = max_content_length(settings.max_query_tokens)
    app.json.sort_keys = False
    svc = Service(settings, kv_config, settings.token())
    app.extensions[EXTENSION] = svc
    # The app's own registry, never prometheus_client's global one (many apps per process).
    app.extensions[METRICS_EXTENSION] = Metrics(svc)
    app.before_request(_check_internal_token)
    app.register_error_handler(RequestError, _request_error)
    app.register_error_handler(HTTPException, _http_error)
    app.register_error_handler(Exception, _internal_error)
    app.add_url_rule(QUERY_PATH, "kv_cache_query", _query, methods=["POST"])
    app.add_url_rule(HEARTBEAT_PATH, "heartbeat", _heartbeat, methods=["POST"])
    app.add_url_rule("/health", "health", _health, methods=["GET"])
    app.add_url_rule("/ready", "ready", _ready, methods=["GET"])
    app.add_url_rule(METRICS_PATH, "metrics", _metrics, methods=["GET"])
    # Routing and OpenAI proxy endpoints (§11) live in kvsvc.http.routes (imported here: it imports
    # this module).
    from kvsvc.http.routes import init_app as init_routing

    init_routing(app)
    return app


# -- request handling ----------------------------------------------------------------------------

def metrics() -> Metrics:
    """The :class:`~kvsvc.http.metrics.Metrics` of the current app."""
    return current_app.extensions[METRICS_EXTENSION]


def _check_internal_token() -> None:
    """§10: every ``/v1/internal/*`` request carries the configured token (constant time);
    ``/metrics`` too when ``--metrics_require_token`` is set. The token is never logged."""
    path = request.path
    if not path.startswith(INTERNAL_PREFIX):
        if path != METRICS_PATH:
            return
        if not service().settings.metrics_require_token:
            return
    expected = service().token
    if expected is None:
        return
    given = request.headers.get(TOKEN_HEADER)
    if given is None or not hmac.compare_digest(given.encode("utf-8", "surrogateescape"),
                                                expected.encode("utf-8")):
        if path == HEARTBEAT_PATH:
            metrics().heartbeats.labels("unauthorized").inc()
        raise RequestError(401, f"missing or wrong {TOKEN_HEADER}")


#: Bytes per read of a chunked body.
_CHUNKED_READ_BYTES = 64 * 1024


def read_body() -> bytes:
    """The current request's raw body.

    A chunked body (no ``Content-Length``) is read here up to the size limit plus one byte:
    werkzeug's own limit on such a body stops reading at the limit and returns what it has,
    which could turn an oversized body into a shorter, different, valid one.

    :raises RequestError: 400 when the server cannot read it (gunicorn's ``InvalidChunkSize``
        and other ``ParseException`` errors for bad chunked framing, ``NoMoreData`` when the client
        stops sending): bad input, not a server fault.
    :raises RequestEntityTooLarge: 413, a body over the limit (``Content-Length`` or chunked).
    """
    environ = request.environ
    limit = request.max_content_length
    try:
        if (limit is not None and get_content_length(environ) is None
                and environ.get("wsgi.input_terminated")):
            stream = environ["wsgi.input"]
            chunks: list[bytes] = []
            total = 0
            while True:
                chunk = stream.read(min(_CHUNKED_READ_BYTES, limit + 1 - total))
                if not chunk:
                    return b"".join(chunks)
                total += len(chunk)
                if total > limit:
                    raise RequestEntityTooLarge()
                chunks.append(chunk)
        return request.get_data(cache=False)
    except (OSError, GunicornParseError) as exc:
        raise RequestError(400, f"request body could not be read: {type(exc).__name__}") from exc


def read_query_body() -> bytes:
    """The current query request's raw body, read straight from ``wsgi.input``.

    A body of known ``Content-Length`` within ``MAX_CONTENT_LENGTH`` is read with one
    ``read(length)`` call (what WSGI promises to support), skipping werkzeug's limited-stream
    wrapper (64 KiB ``bytearray`` per read, three copies of the body). A chunked body or one
    over the limit takes :func:`read_body`, whose werkzeug checks answer 413 exactly as before.

    :raises RequestError: 400 when the server cannot read the body (see :func:`read_body`).
    :raises RequestEntityTooLarge: 413, ``Content-Length`` over the limit.
    """
    environ = request.environ
    length = get_content_length(environ)
    limit = request.max_content_length
    if length is None or (limit is not None and length > limit):
        return read_body()
    if length == 0:
        return b""
    try:
        return environ["wsgi.input"].read(length)
    except (OSError, GunicornParseError) as exc:
        raise RequestError(400, f"request body could not be read: {type(exc).__name__}") from exc


def _token_list(body: bytes, max_tokens: int) -> list:
    """The ``token_ids`` list of a query body (§10), its elements not checked yet.

    ``orjson`` parses (Rust-backed; bodies it refuses but the stdlib accepts, such as integers
    beyond 64 bits or UTF-16, go to ``json.loads``, so the accepted language is unchanged).

    :raises RequestError: 400, not JSON, not an object, no ``token_ids`` list, too long.
    """
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        try:
            doc = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
            raise RequestError(400, "body is not valid JSON") from exc
        except RecursionError as exc:  # nesting deeper than the stdlib parser's stack
            raise RequestError(400, "body is nested too deeply") from exc
    if not isinstance(doc, dict):
        raise RequestError(400, "body must be a JSON object")
    if "token_ids" not in doc:
        raise RequestError(400, "token_ids: missing")
    token_ids = doc["token_ids"]
    if not isinstance(token_ids, list):
        raise RequestError(400, "token_ids: must be a list of integers")
    if len(token_ids) > max_tokens:
        raise RequestError(400, f"token_ids: {len(token_ids)} tokens, more than "
                                f"max_query_tokens={max_tokens}")
    return token_ids


def _packed_token_ids(body: bytes, token_ids: list) -> bytes:
    """``token_ids`` (non-empty, from :func:`_token_list` of ``body``) packed as §4's 32-bit
    little-endian integers; packing checks type and range in C.

    Only a boolean packs although it is no token id (as 0/1), so a body containing ``true``
    or ``false`` somewhere gets the element-by-element checks. The words are searched for only
    when their rarest letters are there: a ``u`` / ``l`` byte is one ``memchr`` (~0.3 us for
    30 kB) where a word search takes ~15 us, and a body of only numbers has neither letter.

    :raises RequestError: 400, an element that is not an int or not in ``[0, 2**31 - 1]``.
    """
    if (b"u" in body and b"true" in body) or (b"l" in body and b"false" in body):
        _check_token_ids(body, token_ids)  # a boolean may hide among them
    try:
        return pack_tokens(token_ids)
    except ValueError:
        _check_token_ids(body, token_ids)  # raises, naming the problem
        raise RequestError(400, "token_ids: every element must be an integer in "
                                f"[0, {MAX_TOKEN_ID}]") from None


def parse_token_ids(body: bytes, max_tokens: int) -> list[int]:
    """Validate a query body (§10) and return its token ids.

    ~80 us for 4,096 ids (``orjson``, then one ``struct`` pack for type and range) against
    ~280 us with ``json.loads``, a type set and ``min``/``max``.

    :param body: raw request body, JSON ``{"token_ids": [int, ...]}``.
    :param max_tokens: most token ids accepted.
    :raises RequestError: 400 naming what is wrong.
    """
    token_ids = _token_list(body, max_tokens)
    if token_ids:
        _packed_token_ids(body, token_ids)
    return token_ids


def parse_query_tokens(body: bytes, max_tokens: int) -> Sequence[int]:
    """:func:`parse_token_ids` for the query endpoint: the same checks and errors, but the
    ids come back as an ``array("I")`` over the packed bytes, which
    :func:`~kvsvc.index.keys.pack_tokens` (inside ``Directory.query``) takes as is instead of
    packing 4,096 ints a second time (~14 us).

    :returns: the token ids, an ``array("I")`` (a ``list`` on a big-endian host or where a C
        ``unsigned int`` is not 4 bytes: the array's buffer must be the §4 byte form).
    :raises RequestError: 400 naming what is wrong.
    """
    token_ids = _token_list(body, max_tokens)
    if not token_ids:
        return token_ids
    packed = _packed_token_ids(body, token_ids)
    if not ARRAY_IS_WIRE_FORM:
        return token_ids
    out = array("I")
    out.frombytes(packed)
    return out


def _check_token_ids(body: bytes, token_ids: list) -> None:
    """Element checks of :func:`parse_token_ids`, element by element (slow path: bad bodies
    and bodies that may hold a boolean).

    Where ``orjson`` produced a float, the stdlib's parse of ``body`` decides: orjson turns
    integers beyond 64 bits into floats, which would change the message. A body the stdlib
    parser cannot take (nested deeper than its stack) keeps orjson's list.

    :param body: the raw body ``token_ids`` was parsed from.
    :param token_ids: the parsed list.
    :raises RequestError: 400, an element that is not an int, or not in range.
    """
    types = set(map(type, token_ids))
    if float in types:
        try:
            token_ids = json.loads(body)["token_ids"]
        except (ValueError, UnicodeDecodeError, RecursionError):
            pass
        else:
            types = set(map(type, token_ids))
    # type() is not isinstance(): bool is an int subclass but never a token id.
    if types != {int}:
        raise RequestError(400, "token_ids: every element must be an integer")
    if min(token_ids) < 0 or max(token_ids) > MAX_TOKEN_ID:
        raise RequestError(400, f"token_ids: every element must be in [0, {MAX_TOKEN_ID}]")


def _query() -> flask.Response:
    started = time.perf_counter()
    svc = service()
    token_ids = parse_query_tokens(read_query_body(), svc.settings.max_query_tokens)
    if svc.directory is None:
        response = flask.jsonify(matches=[])
    else:
        matches = svc.directory.query(token_ids)
        # orjson: ~10x faster than flask.jsonify for 16 answers; same keys, same order.
        response = current_app.response_class(
            orjson.dumps({"matches": [m.to_json() for m in matches]}),
            mimetype="application/json")
    # Answered queries only: a 4xx body error is the client's, not the directory's latency.
    metrics().query_seconds.observe(time.perf_counter() - started)
    return response


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """A validated heartbeat body (§9).

    :param name: instance ``host:port``.
    :param incarnation_id: the sender's incarnation (``None`` when absent).
    :param waiting_requests_num: queued requests, int >= 0.
    :param gpu_cache_usage_perc: Device usage, float in ``[0, 1]``.
    """

    name: str
    incarnation_id: Optional[str]
    waiting_requests_num: int
    gpu_cache_usage_perc: float


def parse_heartbeat(body: bytes) -> Heartbeat:
    """Validate a heartbeat body (xllm-service's JSON, §9). Unknown keys are ignored
    (``latency_metrics`` is accepted and not used yet).

    :param body: raw request body.
    :raises RequestError: 400 naming what is wrong.
    """
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise RequestError(400, "body is not valid JSON") from exc
    if not isinstance(doc, dict):
        raise RequestError(400, "body must be a JSON object")
    name = doc.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError(400, "name: must be a non-empty string")
    incarnation = doc.get("incarnation_id")
    if incarnation is not None and not isinstance(incarnation, str):
        raise RequestError(400, "incarnation_id: must be a string")
    load = doc.get("load_metrics")
    if not isinstance(load, dict):
        raise RequestError(400, "load_metrics: must be an object")
    waiting = load.get("waiting_requests_num")
    if type(waiting) is not int or not 0 <= waiting <= MAX_WAITING_REQUESTS:
        raise RequestError(400, "load_metrics.waiting_requests_num: must be an integer in "
                                f"[0, {MAX_WAITING_REQUESTS}]")
    usage = load.get("gpu_cache_usage_perc")
    if type(usage) not in (int, float) or not 0.0 <= usage <= 1.0:  # NaN fails the range too
        raise RequestError(400, "load_metrics.gpu_cache_usage_perc: must be a number in [0, 1]")
    latency = doc.get("latency_metrics")
    if latency is not None and not isinstance(latency, dict):
        raise RequestError(400, "latency_metrics: must be an object")
    return Heartbeat(name, incarnation or None, waiting, float(usage))


def _heartbeat() -> flask.Response:
    svc = service()
    counter = metrics().heartbeats
    try:
        hb = parse_heartbeat(read_body())
    except RequestError:
        counter.labels("malformed").inc()
        raise
    if svc.registry is None:
        counter.labels("no_registry").inc()
        raise RequestError(503, "no instance registry configured (--etcd_addr is empty)")
    # UnknownInstance / StaleIncarnation (409) and InvalidHeartbeat (400) are RequestErrors.
    try:
        svc.registry.heartbeat(hb.name, hb.incarnation_id, hb.waiting_requests_num,
                               hb.gpu_cache_usage_perc)
    except UnknownInstance:
        counter.labels("unknown_instance").inc()
        raise
    except StaleIncarnation:
        counter.labels("stale_incarnation").inc()
        raise
    except InvalidHeartbeat:
        counter.labels("invalid_load").inc()
        raise
    counter.labels("ok").inc()
    return flask.jsonify(ok=True)


def _health() -> flask.Response:
    return flask.jsonify(status="ok")


def _metrics() -> flask.Response:
    return current_app.response_class(metrics().render(), mimetype=None,
                                      content_type=CONTENT_TYPE_LATEST)


def _ready() -> tuple[flask.Response, int]:
    svc = service()
    directory = svc.directory
    statuses = directory.statuses() if directory is not None else []
    registry: dict[str, Any] = {}
    registry_ok = True
    if svc.registry is not None:
        snap = svc.registry.snapshot()
        registry.update(fresh=snap.fresh, is_master=snap.is_master, generation=snap.generation,
                        instances=len(snap.instances))
        registry_ok = snap.fresh or svc.static_streams
    ready = svc.running and registry_ok and all(st.synchronized_once for st in statuses)
    streams = [{
            "instance_name": st.stream.instance_name,
            "dp_rank": st.stream.dp_rank,
            "state": st.state.value,
            "synchronized_once": st.synchronized_once,
            "sequence": st.sequence,
            "error": st.error,
            "device_blocks": st.device_blocks,
            "host_blocks": st.host_blocks,
            "recoveries": st.recoveries,
            "resync_differences": st.resync_differences,
        } for st in statuses]
    body: dict[str, Any] = {
        "ready": ready,
        "running": svc.running,
        "index_enabled": directory is not None,
    }
    # The registry and discovery parts appear only when configured (the body of a static
    # service is unchanged).
    if svc.registry is not None:
        body["registry"] = registry
    if svc.discovery is not None and directory is not None:
        body["discovery"] = {"excluded": dict(svc.discovery.excluded())}
        for entry, st in zip(streams, statuses):
            entry["identity"] = directory.identity(st.stream)
    body["streams"] = streams
    return flask.jsonify(body), 200 if ready else 503


# -- JSON errors ---------------------------------------------------------------------------------

def _request_error(exc: RequestError) -> tuple[flask.Response, int]:
    return flask.jsonify(error=exc.message), exc.status


def _http_error(exc: HTTPException) -> flask.Response:
    # Keep werkzeug's response (status, and headers such as Allow on 405); replace the HTML.
    response = exc.get_response()
    response.set_data(json.dumps({"error": exc.description or exc.name}))
    response.content_type = "application/json"
    return response


def _internal_error(exc: Exception) -> tuple[flask.Response, int]:
    log.exception("unhandled error on %s %s", request.method, request.path)
    return flask.jsonify(error="internal server error"), 500
