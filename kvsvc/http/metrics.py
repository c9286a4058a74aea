"""Prometheus metrics of one app: the ``GET /metrics`` endpoint (:func:`blueprint`), the
request-path instruments and the scrape-time collector, on a registry of the app's own.

:class:`Metrics` owns a :class:`prometheus_client.CollectorRegistry` built by
:func:`kvsvc.http.app.create_app` and kept in ``app.extensions["kvsvc.metrics"]``; the process-wide
default registry is never used, so tests can build many apps in one process. gunicorn runs one
worker (:mod:`kvsvc.server`), so a single-process registry sees every request.

Two kinds of values:

- **Read at scrape time** by :class:`ServiceCollector` from state the components keep anyway:
  each stream's :meth:`~kvsvc.streams.subscriber.StreamSubscriber.status` and
  :meth:`~kvsvc.streams.subscriber.StreamSubscriber.counters` (plain ints copied under the
  stream lock, O(1) per stream, never an index traversal), the registry's immutable snapshot,
  discovery's counters, the proxy's retries, the in-flight ledger's counts and the cache
  audit's predicted-vs-actual counters (:mod:`kvsvc.routing.cache_audit`) and the baidu_std
  server's counters (:meth:`~kvsvc.rpc.server.RpcServer.stats`: ``kvsvc_rpc_*``, §13), all
  reached through the :class:`~kvsvc.service.Service`. The stream threads never touch a
  prometheus object.
- **Observed on the request path** with prometheus_client instruments (:class:`Metrics`
  attributes): query and route latency, routing decisions, the chosen P's predicted hit ratio,
  heartbeats by outcome, proxied requests by status, the proxy's request duration and time to
  first token (observed when the relay of an answer ends, :meth:`Metrics.relayed`). One
  ``observe``/``inc`` each.

Every name has the ``kvsvc_`` prefix, counters end in ``_total``, durations are seconds and
sizes bytes. Label sets are fixed (:data:`~kvsvc.streams.counters.DECODE_ERROR_REASONS` and
friends); instance names and DP ranks are the only open label values, bounded by the cluster
(§8 ``max_streams``). A per-stream or per-instance series disappears with its stream/instance.

``/metrics`` is not behind the internal token unless ``--metrics_require_token`` is set
(Prometheus scrapes it without credentials by default); it shows names, counts and states,
never a token or a prompt.
"""

from __future__ import annotations

import logging
import platform
import threading
import time
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence

import flask
from flask import current_app
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.utils import floatToGoString
from prometheus_client.registry import Collector

from kvsvc import __version__
from kvsvc.cluster.discovery import CHANGE_KINDS, EXCLUSION_KINDS, exclusion_kind
from kvsvc.cluster.heartbeat import HeartbeatOutcome
from kvsvc.cluster.model import InstanceState
from kvsvc.http.extensions import METRICS_EXTENSION
from kvsvc.routing.cache_audit import DIFF_BUCKETS_TOKENS, UNAUDITED_REASONS
from kvsvc.routing.observer import RequestInfo
from kvsvc.routing.token_cache import TokenCacheStats
from kvsvc.routing.policy import Decision
from kvsvc.routing.proxy import UPSTREAM_ERROR_KINDS, RelayEnd
from kvsvc.routing.router import Router
from kvsvc.service import Service
from kvsvc.streams.state import Completeness, StreamState

log = logging.getLogger(__name__)

METRICS_PATH = "/metrics"

#: Every heartbeat outcome label, in declaration order.
HEARTBEAT_OUTCOMES = tuple(o.value for o in HeartbeatOutcome)
#: Latency buckets of the query and route endpoints, seconds (100 us .. 1 s).
LATENCY_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                     0.25, 1.0)
#: Buckets of the proxy's request duration and time to first token, seconds (10 ms .. 120 s:
#: a cached short prompt to a long generation on a queued engine).
PROXY_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0,
                           60.0, 120.0)
#: Buckets of the inter-token latency of streamed answers, seconds (1 ms .. 2.5 s).
INTER_TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2,
                         0.3, 0.5, 1.0, 2.5)
#: Buckets of prompt and completion token counts (1 .. 128 Ki tokens).
TOKEN_COUNT_BUCKETS = tuple(float(1 << i) for i in range(0, 18))
#: Buckets of the chosen P's predicted hit ratio, a fraction in [0, 1].
HIT_RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.99, 1.0)

_STREAM_LABELS = ("instance", "dp_rank")
#: The ``completeness`` label values of ``kvsvc_stream_completeness`` (§7h, §10).
#: The stream completeness values (approximate indexes are not streams: they have their own
#: ``kvsvc_overlay_*`` families).
COMPLETENESS_VALUES = tuple(c.value for c in Completeness if c is not Completeness.APPROXIMATE)
#: ``event`` labels of ``kvsvc_overlay_block_events_total`` (:class:`~kvsvc.index.overlay.OverlayStats`).
OVERLAY_EVENTS = ("added", "refreshed", "evicted", "expired", "settled")


class Children:
    """The children of one labelled metric by label values, kept once made: ``labels()``
    takes the metric's lock and rebuilds its key on every call, and the request path asks
    for several children per request. Children are never removed (neither does kvsvc remove
    them from the metric), so a kept one is the metric's own.

    :param metric: a labelled ``Counter`` or ``Histogram``.
    """

    def __init__(self, metric: Any) -> None:
        self._metric = metric
        self._kept: dict[tuple[str, ...], Any] = {}

    def __call__(self, *values: str) -> Any:
        """``metric.labels(*values)``."""
        child = self._kept.get(values)
        if child is None:
            child = self._metric.labels(*values)
            self._kept[values] = child
        return child


class Metrics:
    """The app's metrics registry and its request-path instruments.

    :param service: the app's :class:`~kvsvc.service.Service` (read at scrape time only, by the
        :class:`ServiceCollector` registered here).

    :ivar registry: the app's own ``CollectorRegistry``.
    :ivar query_seconds: histogram of ``POST /v1/internal/kv-cache/query`` handling, seconds
        (parse + directory query + answer).
    :ivar route_seconds: histogram of one routing decision (:meth:`Router.decide
        <kvsvc.routing.router.Router.decide>`, timed by :meth:`decide`), seconds, by policy.
    :ivar decisions: counter of routing decisions by policy and chosen P (``none`` when no
        instance could serve).
    :ivar hit_ratio: histogram of the chosen P's predicted hit ratio (CAR only; RR has none).
    :ivar heartbeats: counter of heartbeats by :data:`HEARTBEAT_OUTCOMES`.
    :ivar proxied: counter of OpenAI requests answered, by endpoint and HTTP status
        (``upstream_broken``: a streamed answer whose upstream body broke after the head).
    :ivar request_seconds: histogram of answers relayed from an upstream, from the request's
        start to the last byte relayed, seconds, by endpoint and instance (the one that
        answered).
    :ivar ttft_seconds: histogram of streamed answers, from the request's start to the first
        SSE ``data:`` event relayed, seconds, by endpoint and instance.
    """

    def __init__(self, service: Service) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        reg = self.registry
        self.query_seconds = Histogram(
            "kvsvc_query_duration_seconds", "KV-cache query request handling time (§10).",
            buckets=LATENCY_BUCKETS_S, registry=reg)
        self.route_seconds = Histogram(
            "kvsvc_route_duration_seconds", "Routing decision time (§11), by policy.",
            ["policy"], buckets=LATENCY_BUCKETS_S, registry=reg)
        self.decisions = Counter(
            "kvsvc_routing_decisions_total",
            "Routing decisions by policy and chosen prefill instance (none: no candidate).",
            ["policy", "prefill"], registry=reg)
        self.hit_ratio = Histogram(
            "kvsvc_routing_predicted_hit_ratio",
            "Predicted KV-cache hit ratio of the chosen prefill instance (CAR, TTFT), fraction.",
            buckets=HIT_RATIO_BUCKETS, registry=reg)
        self.heartbeats = Counter(
            "kvsvc_heartbeats_total", "Heartbeats received (§9), by outcome.", ["outcome"],
            registry=reg)
        self.proxied = Counter(
            "kvsvc_proxy_requests_total",
            "OpenAI requests answered by the router, by endpoint and HTTP status.",
            ["endpoint", "status"], registry=reg)
        self.request_seconds = Histogram(
            "kvsvc_proxy_request_duration_seconds",
            "OpenAI answers relayed from an instance, request start to the last byte relayed, "
            "by endpoint and instance.",
            ["endpoint", "instance"], buckets=PROXY_LATENCY_BUCKETS_S, registry=reg)
        self.ttft_seconds = Histogram(
            "kvsvc_proxy_time_to_first_token_seconds",
            "Streamed OpenAI answers, request start to the first SSE data event relayed, by "
            "endpoint and instance.",
            ["endpoint", "instance"], buckets=PROXY_LATENCY_BUCKETS_S, registry=reg)
        self.inter_token_seconds = Histogram(
            "kvsvc_proxy_inter_token_latency_seconds",
            "Streamed answers: time between two token events relayed, by model.",
            ["model"], buckets=INTER_TOKEN_BUCKETS_S, registry=reg)
        self.prompt_tokens = Histogram(
            "kvsvc_proxy_prompt_tokens",
            "Prompt tokens of answered requests (the engine's usage), by model.",
            ["model"], buckets=TOKEN_COUNT_BUCKETS, registry=reg)
        self.completion_tokens = Histogram(
            "kvsvc_proxy_completion_tokens",
            "Generated tokens of answered requests (the engine's usage), by model.",
            ["model"], buckets=TOKEN_COUNT_BUCKETS, registry=reg)
        reg.register(ServiceCollector(service))
        #: Kept children of the request path's labelled instruments (:class:`Children`).
        self.route_seconds_of = Children(self.route_seconds)
        self.decisions_of = Children(self.decisions)
        self.proxied_of = Children(self.proxied)
        self.request_seconds_of = Children(self.request_seconds)
        self.ttft_seconds_of = Children(self.ttft_seconds)
        self.inter_token_seconds_of = Children(self.inter_token_seconds)
        self.prompt_tokens_of = Children(self.prompt_tokens)
        self.completion_tokens_of = Children(self.completion_tokens)
        service.router.proxy.add_observer(TokenMetrics(self))

    def decide(self, router: Router, token_ids: Optional[Sequence[int]],
               model: Optional[str] = None) -> Decision:
        """``router.decide(token_ids, model)``, recorded (:meth:`routed`) with the time it
        took.

        :param router: the app's router.
        :param token_ids: the prompt's tokens, ``None`` when unknown.
        :param model: the request's ``model`` (§15: model-aware candidates), ``None``: any.
        :raises UnknownModel: no registered instance serves ``model``.
        """
        started = time.perf_counter()
        decision = router.decide(token_ids, model)
        self.routed(decision, time.perf_counter() - started)
        return decision

    def routed(self, decision: Decision, seconds: float) -> None:
        """Record one routing decision and how long it took.

        :param decision: the policy's decision.
        :param seconds: time spent deciding, seconds.
        """
        self.route_seconds_of(decision.policy).observe(seconds)
        prefill = decision.prefill
        self.decisions_of(decision.policy,
                          prefill.name if prefill is not None else "none").inc()
        if prefill is None:
            return
        for cand in decision.candidates:
            if cand.side == "P" and cand.name == prefill.name:
                if cand.hit_ratio is not None:
                    self.hit_ratio.observe(cand.hit_ratio)
                return

    def relayed(self, endpoint: str, status: str, started: float, end: RelayEnd) -> None:
        """Record the end of a streamed answer's relay: one answer of ``status``, its duration
        and, when it relayed an SSE data event, its time to first token.

        :param endpoint: the endpoint label (``completions``, ``chat_completions``).
        :param status: the status label (the HTTP status, or ``upstream_broken``).
        :param started: ``time.monotonic()`` seconds at the request's start.
        :param end: how the relay ended (:class:`~kvsvc.routing.proxy.RelayEnd`).
        """
        self.proxied_of(endpoint, status).inc()
        self.request_seconds_of(endpoint, end.target).observe(
            max(0.0, end.ended_at - started))
        if end.first_data_at is not None:
            self.ttft_seconds_of(endpoint, end.target).observe(
                max(0.0, end.first_data_at - started))

    def render(self) -> bytes:
        """The text exposition of every metric (what ``GET /metrics`` answers)."""
        return generate_latest(self.registry)


class TokenMetrics:
    """A request observer (:class:`~kvsvc.routing.observer.RequestObserver`) feeding the
    per-model token instruments of :class:`Metrics`: the time between token events of each
    streamed attempt, and the prompt and completion token counts of every answer that ended
    with a ``usage`` object. The ``model`` label is the request's ``model`` of answers an
    engine served (status < 400), so its values are bounded by the models the engines serve.

    :param instruments: where to observe.
    """

    def __init__(self, instruments: Metrics) -> None:
        self._m = instruments
        self._lock = threading.Lock()
        self._last: dict[int, float] = {}

    def _gap(self, model: str) -> Any:
        # The kept child (Children): labels() would lock and build a key once per token.
        return self._m.inter_token_seconds_of(model)

    def on_dispatch(self, info: RequestInfo) -> None:
        """Nothing to observe yet."""

    def on_first_token(self, info: RequestInfo) -> None:
        """Start timing the attempt's token gaps."""
        with self._lock:
            self._last[info.attempt_id] = time.monotonic()

    def on_token(self, info: RequestInfo) -> None:
        """One gap since the attempt's previous token."""
        self.on_tokens(info, 1)

    def on_tokens(self, info: RequestInfo, n: int) -> None:
        """``n`` tokens relayed together: the gap since the previous token, then ``n - 1``
        gaps of 0 (they reach the client in one write)."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(info.attempt_id)
            self._last[info.attempt_id] = now
        if last is None:
            return
        child = self._gap(info.model or "unknown")
        child.observe(now - last)
        for _ in range(n - 1):
            child.observe(0.0)

    def on_end(self, info: RequestInfo, usage: Optional[dict]) -> None:
        """The token counts of the answer's ``usage``."""
        self._forget(info)
        if not isinstance(usage, dict):
            return
        model = info.model or "unknown"
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if type(prompt) is int and prompt >= 0:
            self._m.prompt_tokens_of(model).observe(prompt)
        if type(completion) is int and completion >= 0:
            self._m.completion_tokens_of(model).observe(completion)

    def on_cancel(self, info: RequestInfo, reason: str) -> None:
        """Forget the attempt."""
        self._forget(info)

    def _forget(self, info: RequestInfo) -> None:
        with self._lock:
            self._last.pop(info.attempt_id, None)


def metrics() -> Metrics:
    """The :class:`Metrics` of the current app."""
    instruments: Metrics = current_app.extensions[METRICS_EXTENSION]
    return instruments


def _metrics_endpoint() -> flask.Response:
    return current_app.response_class(metrics().render(), mimetype=None,
                                      content_type=CONTENT_TYPE_LATEST)


def blueprint() -> flask.Blueprint:
    """``GET /metrics``: the text exposition of :meth:`Metrics.render`. Not behind the internal
    token unless ``--metrics_require_token`` is set (:mod:`kvsvc.http.auth`)."""
    bp = flask.Blueprint("kvsvc_metrics", __name__)
    bp.add_url_rule(METRICS_PATH, "metrics", _metrics_endpoint, methods=["GET"])
    return bp


def _counts_by_label(name: str, documentation: str, labels: tuple[str, str],
                     counts: Mapping[tuple[str, str], int]) -> CounterMetricFamily:
    """A counter family with one sample per label pair of ``counts``, in sorted order."""
    family = CounterMetricFamily(name, documentation, labels=labels)
    for key, count in sorted(counts.items()):
        family.add_metric(key, float(count))
    return family


def _counters(service: Service) -> dict:
    """stream id -> :class:`~kvsvc.streams.counters.StreamCounters` (empty without a
    directory)."""
    directory = service.directory
    return {} if directory is None else directory.counters()


def real_cluster_families(svc: Service) -> Iterator[Metric]:
    """§15: the routing candidates now (what ``/ready`` needs one of), and the load scrapes
    of vLLM/SGLang ``/metrics`` by outcome and the instances whose last scrape failed."""
    if svc.registry is None:
        return
    yield GaugeMetricFamily(
        "kvsvc_routing_candidates",
        "Instances a request could be routed to now (schedulable, current load report; "
        "0 makes /ready 503).", float(len(svc.router.prefill_candidates())))
    scraper = svc.load_scraper
    if scraper is None:
        return
    scrapes = CounterMetricFamily(
        "kvsvc_load_scrapes", "Load scrapes of the engines' /metrics (§15), by outcome.",
        labels=("outcome",))
    for outcome, n in sorted(scraper.counts().items()):
        scrapes.add_metric((outcome,), float(n))
    yield scrapes
    failing = GaugeMetricFamily(
        "kvsvc_load_scrape_failing",
        "1 for each instance whose last /metrics scrape failed (no load reported from it).",
        labels=("instance",))
    for name in sorted(scraper.failing()):
        failing.add_metric((name,), 1.0)
    yield failing


def _token_cache_families(stats: TokenCacheStats) -> Iterator[Metric]:
    """The segment token cache's counters (:class:`~kvsvc.routing.token_cache.TokenCacheStats`)."""
    family = CounterMetricFamily("kvsvc_tokenizer_cache_segments_total",
                                 "Prompt segments tokenized through the segment token cache, "
                                 "by outcome (hit: ids reused; miss: tokenized).",
                                 labels=("outcome",))
    family.add_metric(("hit",), float(stats.segment_hits))
    family.add_metric(("miss",), float(stats.segment_misses))
    yield family
    yield CounterMetricFamily("kvsvc_tokenizer_cache_reused_tokens_total",
                              "Token ids taken from the segment token cache instead of "
                              "tokenizing.", float(stats.tokens_reused))
    yield GaugeMetricFamily("kvsvc_tokenizer_cache_tokens",
                            "Token ids held by the segment token cache.",
                            float(stats.cached_tokens))
    yield GaugeMetricFamily("kvsvc_tokenizer_cache_enabled",
                            "1 while the segment token cache is on (0: its structure check or "
                            "a verification turned it off).",
                            1.0 if stats.enabled else 0.0)


class ServiceCollector(Collector):
    """Collector reading the service's components at scrape time (see the module docstring).

    :param service: the app's service.
    """

    def __init__(self, service: Service) -> None:
        self._service = service

    def _token_cache(self, svc: Service) -> Iterator[Metric]:
        tokenizer = svc.router.tokens.tokenizer
        cache = tokenizer.cache if tokenizer is not None else None
        if cache is not None:
            yield from _token_cache_families(cache.stats())

    def collect(self) -> Iterator[Metric]:
        """Yield every scrape-time family (called by the registry on each scrape)."""
        svc = self._service
        yield GaugeMetricFamily("kvsvc_service_running",
                                "1 between the service's start and close.",
                                1.0 if svc.running else 0.0)
        build = GaugeMetricFamily("kvsvc_build_info",
                                  "Always 1; the labels name kvsvc's version and Python's.",
                                  labels=("version", "python"))
        build.add_metric((__version__, platform.python_version()), 1.0)
        yield build
        yield from self._streams(svc)
        yield from self._registry(svc)
        yield from self._discovery(svc)
        yield CounterMetricFamily(
            "kvsvc_proxy_upstream_retries_total",
            "Upstream attempts on the next-best prefill after one failed before the "
            "first byte.", svc.router.proxy.retries())
        yield CounterMetricFamily(
            "kvsvc_proxy_client_cancelled_total",
            "Upstream attempts cancelled because the client went away before the response "
            "head (the upstream connection closed, §15).", svc.router.proxy.client_gone())
        yield self._upstream_errors(svc)
        yield from self._token_cache(svc)
        yield from self._rpc(svc)
        yield from self._cache_audit(svc)
        yield from self._overlays(svc)
        yield from real_cluster_families(svc)
        counts = svc.router.in_flight.counts()
        if svc.registry is not None:
            # Registered instances with nothing in flight show 0 rather than no series.
            counts = {**dict.fromkeys(svc.registry.snapshot().instances, 0), **counts}
        family = GaugeMetricFamily(
            "kvsvc_proxy_in_flight_requests",
            "Requests this worker has sent to the instance and not finished relaying "
            "(CAR adds those sent after the last load report to its waiting).",
            labels=("instance",))
        for name, count in sorted(counts.items()):
            family.add_metric((name,), float(count))
        yield family

    @staticmethod
    def _rpc(svc: Service) -> Iterator[Metric]:
        """The baidu_std server's counters (§13); nothing without one."""
        if svc.rpc_server is None:
            return
        stats = svc.rpc_server.stats()
        calls = CounterMetricFamily(
            "kvsvc_rpc_calls_total", "baidu_std calls answered, by method (XllmRpcService).",
            labels=("method",))
        for method, count in sorted(stats.calls.items()):
            calls.add_metric((method,), count)
        yield calls
        errors = CounterMetricFamily(
            "kvsvc_rpc_errors_total", "baidu_std calls answered with a brpc error code "
            "(1001 ENOSERVICE, 1002 ENOMETHOD, 1003 EREQUEST, 2001 EINTERNAL).",
            labels=("code",))
        for code, count in sorted(stats.errors.items()):
            errors.add_metric((str(code),), count)
        yield errors
        heartbeats = CounterMetricFamily(
            "kvsvc_rpc_heartbeats_total", "baidu_std heartbeats by outcome (the HTTP ones are "
            "kvsvc_heartbeats_total).", labels=("outcome",))
        for outcome in HEARTBEAT_OUTCOMES:
            heartbeats.add_metric((outcome,), stats.heartbeats.get(outcome, 0))
        yield heartbeats
        entries = CounterMetricFamily(
            "kvsvc_rpc_generation_entries_total", "Generations entries answered, by the "
            "Status given (false: unknown service_req_id, client gone, cancelled).",
            labels=("ok",))
        entries.add_metric(("true",), stats.entries_ok)
        entries.add_metric(("false",), stats.entries_refused)
        yield entries
        yield GaugeMetricFamily("kvsvc_rpc_connections", "baidu_std connections open.",
                                stats.connections)
        yield CounterMetricFamily("kvsvc_rpc_broken_streams_total",
                                  "baidu_std connections closed for a broken stream (not "
                                  "baidu_std, a body over 64 MiB, an undecodable meta).",
                                  stats.broken_streams)

    @staticmethod
    def _upstream_errors(svc: Service) -> Metric:
        errors = svc.router.proxy.errors()
        if svc.registry is not None:
            # Registered instances show 0 for every kind rather than no series.
            zeros = {(name, kind): 0 for name in svc.registry.snapshot().instances
                     for kind in UPSTREAM_ERROR_KINDS}
            errors = {**zeros, **errors}
        family = CounterMetricFamily(
            "kvsvc_proxy_upstream_errors",
            "Upstream errors by instance and kind (refused, reset, timeout: before the "
            "response head or in the body; broken_body: the body broke after the head; "
            "http_5xx: the instance answered 5xx).", labels=("instance", "kind"))
        for (name, kind), count in sorted(errors.items()):
            family.add_metric((name, kind), float(count))
        return family

    @staticmethod
    def _cache_audit(svc: Service) -> Iterable[Metric]:
        """Predicted vs actual cached tokens (:mod:`kvsvc.routing.cache_audit`)."""
        snap = svc.cache_audit.snapshot()
        hist = HistogramMetricFamily(
            "kvsvc_cache_prediction_diff_tokens",
            "Proxied answers: the engine's cached_tokens minus the reusable prefix predicted "
            "for the chosen prefill at routing time, tokens (negative: over-predicted; no "
            "_sum/_count, the buckets go negative: the +Inf bucket is the count).")
        cumulative, buckets = 0, []
        for bound, count in zip((*DIFF_BUCKETS_TOKENS, float("inf")), snap.bucket_counts):
            cumulative += count
            buckets.append((floatToGoString(bound), float(cumulative)))
        hist.add_metric((), buckets, snap.diff_sum)
        abs_error = CounterMetricFamily(
            "kvsvc_cache_prediction_abs_error_tokens",
            "Sum over audited answers of |engine cached_tokens - predicted|, tokens (divided "
            "by the +Inf bucket: the mean absolute error).", snap.abs_error_sum)
        outcomes = _counts_by_label(
            "kvsvc_cache_predictions",
            "Audited answers by instance and outcome (within_block; over: the engine reused "
            "more than one block less than predicted; under: more than one block more).",
            ("instance", "outcome"), snap.outcomes)
        exact = _counts_by_label(
            "kvsvc_cache_predictions_exact",
            "The audited answers predicted from synchronized exact streams (every rank of the "
            "P counted, none subset), by instance and outcome.", ("instance", "outcome"),
            snap.exact_outcomes)
        causes = _counts_by_label(
            "kvsvc_cache_prediction_misses",
            "Audited answers off by more than one block, by instance and likely cause.",
            ("instance", "cause"), snap.causes)
        unaudited = CounterMetricFamily(
            "kvsvc_cache_predictions_unaudited",
            "Answers not audited, by reason (no_prediction: the policy computed no hits, "
            "e.g. RR; no_usage: the answer carried no cached_tokens).", labels=("reason",))
        for reason in UNAUDITED_REASONS:
            unaudited.add_metric((reason,), float(snap.unaudited.get(reason, 0)))
        by_backend = CounterMetricFamily(
            "kvsvc_cache_predictions_by_backend",
            "Audited answers by the prefill's backend_type, by what the prediction came from "
            "(exact, subset, approximate: the §14 approximate index; none: a rank counted 0) "
            "and by outcome.", labels=("backend", "completeness", "outcome"))
        for key, count in sorted(snap.by_backend.items()):
            by_backend.add_metric(key, float(count))
        backend_abs = CounterMetricFamily(
            "kvsvc_cache_prediction_abs_error_by_backend_tokens",
            "Sum of |engine cached_tokens - predicted| by backend_type and completeness, "
            "tokens (divided by the matching kvsvc_cache_predictions_by_backend: the mean "
            "absolute error of, e.g., the approximate index).",
            labels=("backend", "completeness"))
        for key2, total in sorted(snap.backend_abs_error.items()):
            backend_abs.add_metric(key2, float(total))
        return hist, abs_error, outcomes, exact, causes, unaudited, by_backend, backend_abs

    @staticmethod
    def _overlays(svc: Service) -> Iterable[Metric]:
        """The approximate indexes (§14) and pending blocks (§16) of every (instance, rank)."""
        labels = ("instance", "dp_rank", "kind")
        held = GaugeMetricFamily(
            "kvsvc_overlay_blocks",
            "Blocks held by an overlay (kind approximate: the §14 approximate index of an "
            "instance without KV events; pending: §16 blocks routed to an exact stream whose "
            "events have not arrived), expired ones not yet swept included.", labels=labels)
        touches = CounterMetricFamily(
            "kvsvc_overlay_dispatches",
            "Dispatches recorded in an overlay (each routed request's prompt).", labels=labels)
        events = CounterMetricFamily(
            "kvsvc_overlay_block_events",
            "Blocks by what happened to them: added, refreshed (touched again), evicted (the "
            "LRU bound), expired (the TTL), settled (pending: stored, removed or cleared by "
            "the stream's events).", labels=(*labels, "event"))
        directory = svc.directory
        stats = directory.overlay_stats() if directory is not None else {}
        for sid, (kind, st) in stats.items():
            key = (sid.instance_name, str(sid.dp_rank), kind)
            held.add_metric(key, float(st.blocks))
            touches.add_metric(key, float(st.touches))
            for event in OVERLAY_EVENTS:
                events.add_metric((*key, event), float(getattr(st, event)))
        return held, touches, events

    # -- streams -----------------------------------------------------------------------------

    @staticmethod
    def _streams(svc: Service) -> Iterable[Metric]:
        counters: dict = _counters(svc)
        state = GaugeMetricFamily(
            "kvsvc_stream_state", "1 for the stream's current §6 state, 0 for the others.",
            labels=(*_STREAM_LABELS, "state"))
        complete = GaugeMetricFamily(
            "kvsvc_stream_completeness",
            "1 for what the synchronized stream's index holds (exact: the engine's whole "
            "residency; subset: history was lost, hits may be missed, never false, §7h), 0 for "
            "the other; both 0 while not synchronized.",
            labels=(*_STREAM_LABELS, "completeness"))
        once = GaugeMetricFamily(
            "kvsvc_stream_synchronized_once", "1 once the stream has been synchronized.",
            labels=_STREAM_LABELS)
        seq = GaugeMetricFamily(
            "kvsvc_stream_last_applied_sequence",
            "Sequence number of the last applied live batch (absent while unknown).",
            labels=_STREAM_LABELS)
        age = GaugeMetricFamily(
            "kvsvc_stream_seconds_since_last_event",
            "Seconds since the last live batch was decoded (absent before the first).",
            labels=_STREAM_LABELS)
        blocks = GaugeMetricFamily(
            "kvsvc_stream_resident_blocks", "Resident blocks of the serving index, by tier.",
            labels=(*_STREAM_LABELS, "tier"))
        entries = GaugeMetricFamily(
            "kvsvc_stream_engine_map_entries",
            "Engine hashes remembered (blocks, aliases, EXCLUDED/ORPHAN markers; §8 capacity).",
            labels=_STREAM_LABELS)
        applied = CounterMetricFamily(
            "kvsvc_stream_events_applied", "Live events applied to the serving index, by type.",
            labels=(*_STREAM_LABELS, "type"))
        events_skipped = CounterMetricFamily(
            "kvsvc_stream_events_not_indexed",
            "Live events accepted without indexing, by reason (other_medium: tier 0, §2).",
            labels=(*_STREAM_LABELS, "reason"))
        blocks_skipped = CounterMetricFamily(
            "kvsvc_stream_blocks_not_indexed",
            "Live block hashes accepted without indexing, by reason (excluded §3, "
            "unknown_tokenless, unknown_removal §5).", labels=(*_STREAM_LABELS, "reason"))
        decode = CounterMetricFamily(
            "kvsvc_stream_decode_errors", "Malformed messages, batches or events, by reason.",
            labels=(*_STREAM_LABELS, "reason"))
        recov = CounterMetricFamily(
            "kvsvc_stream_recoveries",
            "Recoveries started (§6), by trigger (start: the first one of the thread).",
            labels=(*_STREAM_LABELS, "trigger"))
        syncs = CounterMetricFamily(
            "kvsvc_stream_synchronizations",
            "Completed recoveries (snapshot swaps and AllBlocksCleared baselines).",
            labels=_STREAM_LABELS)
        attempts = CounterMetricFamily(
            "kvsvc_stream_snapshot_attempts", "Snapshot attempts (§7) ended, by outcome.",
            labels=(*_STREAM_LABELS, "outcome"))
        snap_dur = SummaryMetricFamily(
            "kvsvc_stream_snapshot_duration_seconds",
            "Successful snapshots, request to swap, seconds.", labels=_STREAM_LABELS)
        last_dur = GaugeMetricFamily(
            "kvsvc_stream_last_snapshot_duration_seconds",
            "Duration of the last successful snapshot, seconds (absent before one).",
            labels=_STREAM_LABELS)
        last_bytes = GaugeMetricFamily(
            "kvsvc_stream_last_snapshot_bytes",
            "Wire bytes of the last successful snapshot reply.", labels=_STREAM_LABELS)
        last_msgs = GaugeMetricFamily(
            "kvsvc_stream_last_snapshot_messages",
            "Data messages of the last successful snapshot reply.", labels=_STREAM_LABELS)
        buffered = GaugeMetricFamily(
            "kvsvc_stream_buffered_bytes",
            "Live bytes buffered by the snapshot attempt in flight (§6 max_buffered_bytes).",
            labels=_STREAM_LABELS)
        resync = CounterMetricFamily(
            "kvsvc_stream_resync_differences",
            "Blocks that differed at periodic resyncs (silently lost events).",
            labels=_STREAM_LABELS)
        dropped = CounterMetricFamily(
            "kvsvc_stream_messages_dropped",
            "Live messages dropped without error, by reason (topic_mismatch §1, duplicate "
            "§6: covered by the swapped-in snapshot).", labels=(*_STREAM_LABELS, "reason"))
        states = [s.value for s in StreamState]
        directory = svc.directory
        for st in directory.statuses() if directory is not None else []:
            labels = (st.stream.instance_name, str(st.stream.dp_rank))
            for name in states:
                state.add_metric((*labels, name), 1.0 if st.state.value == name else 0.0)
            current = st.completeness if st.state is StreamState.SYNCHRONIZED else None
            for kind in COMPLETENESS_VALUES:
                complete.add_metric((*labels, kind), 1.0 if current == kind else 0.0)
            once.add_metric(labels, 1.0 if st.synchronized_once else 0.0)
            if st.sequence is not None:
                seq.add_metric(labels, float(st.sequence))
            blocks.add_metric((*labels, "device"), float(st.device_blocks))
            blocks.add_metric((*labels, "host"), float(st.host_blocks))
            entries.add_metric(labels, float(st.entries))
            syncs.add_metric(labels, float(st.recoveries))
            resync.add_metric(labels, float(st.resync_differences))
            c = counters.get(st.stream)
            if c is None:
                continue  # directory not started: no thread, no counters yet
            if c.seconds_since_event is not None:
                age.add_metric(labels, c.seconds_since_event)
            for kind, n in c.events_applied.items():
                applied.add_metric((*labels, kind), float(n))
            for reason, n in c.not_indexed.items():
                (events_skipped if reason == "other_medium" else blocks_skipped).add_metric(
                    (*labels, reason), float(n))
            for reason, n in c.decode_errors.items():
                decode.add_metric((*labels, reason), float(n))
            for trigger, n in c.recoveries_started.items():
                recov.add_metric((*labels, trigger), float(n))
            for outcome, n in c.snapshot_attempts.items():
                attempts.add_metric((*labels, outcome), float(n))
            snap_dur.add_metric(labels, c.snapshot_attempts["ok"], c.snapshot_seconds_sum)
            if c.last_snapshot_seconds is not None:
                last_dur.add_metric(labels, c.last_snapshot_seconds)
            last_bytes.add_metric(labels, float(c.last_snapshot_bytes))
            last_msgs.add_metric(labels, float(c.last_snapshot_messages))
            buffered.add_metric(labels, float(c.buffered_bytes))
            dropped.add_metric((*labels, "topic_mismatch"), float(c.topic_mismatches))
            dropped.add_metric((*labels, "duplicate"), float(c.duplicates_dropped))
        return (state, complete, once, seq, age, blocks, entries, applied, events_skipped,
                blocks_skipped, decode, recov, syncs, attempts, snap_dur, last_dur, last_bytes,
                last_msgs, buffered, resync, dropped)

    # -- registry and discovery --------------------------------------------------------------

    @staticmethod
    def _registry(svc: Service) -> Iterable[Metric]:
        registry = svc.registry
        if registry is None:
            return ()
        snap = registry.snapshot()  # immutable, lock-free
        now = registry.clock.now()   # the clock that dated the loads (received_at)
        fresh = GaugeMetricFamily("kvsvc_registry_fresh",
                                  "1 while the registry's etcd view is fresh (§9).",
                                  1.0 if snap.fresh else 0.0)
        master = GaugeMetricFamily("kvsvc_registry_is_master",
                                   "1 while this process holds XLLM:SERVICE:MASTER.",
                                   1.0 if snap.is_master else 0.0)
        state = GaugeMetricFamily(
            "kvsvc_instance_state", "1 for the instance's current §9 state, 0 for the others.",
            labels=("instance", "state"))
        load_age = GaugeMetricFamily(
            "kvsvc_instance_load_age_seconds",
            "Seconds since the instance's last load report (absent before one).",
            labels=("instance",))
        waiting = GaugeMetricFamily(
            "kvsvc_instance_waiting_requests", "Queued requests last reported by the instance.",
            labels=("instance",))
        usage = GaugeMetricFamily(
            "kvsvc_instance_gpu_cache_usage_ratio",
            "Device KV-cache usage last reported by the instance, fraction.",
            labels=("instance",))
        for name, inst in snap.instances.items():
            for s in InstanceState:
                state.add_metric((name, s.value), 1.0 if inst.state is s else 0.0)
            if inst.load is not None:
                load_age.add_metric((name,), max(0.0, now - inst.load.received_at))
                waiting.add_metric((name,), float(inst.load.waiting_requests_num))
                usage.add_metric((name,), inst.load.gpu_cache_usage_perc)
        clamped = CounterMetricFamily(
            "kvsvc_load_clamped",
            "Load reports whose gpu_cache_usage_perc was above 1, used as 1.0, by instance and "
            "source (heartbeat or etcd).", labels=("instance", "source"))
        for (name, source), count in sorted(registry.load_clamped_counts().items()):
            clamped.add_metric((name, source), float(count))
        return fresh, master, state, load_age, waiting, usage, clamped

    @staticmethod
    def _discovery(svc: Service) -> Iterable[Metric]:
        discovery = svc.discovery
        if discovery is None:
            return ()
        changes_by_kind, exclusions_by_kind = discovery.counters()
        changes = CounterMetricFamily(
            "kvsvc_discovery_stream_changes", "Streams changed by discovery (§9), by kind.",
            labels=("kind",))
        for kind in CHANGE_KINDS:
            changes.add_metric((kind,), float(changes_by_kind[kind]))
        exclusions = CounterMetricFamily(
            "kvsvc_discovery_exclusions",
            "Instances newly excluded by discovery's rules (conflicts), by reason.",
            labels=("reason",))
        for kind in EXCLUSION_KINDS:
            exclusions.add_metric((kind,), float(exclusions_by_kind[kind]))
        current = dict.fromkeys(EXCLUSION_KINDS, 0)
        for reason in discovery.excluded().values():
            current[exclusion_kind(reason)] += 1
        excluded = GaugeMetricFamily(
            "kvsvc_discovery_excluded_instances",
            "Instances excluded by the last discovery plan, by reason.", labels=("reason",))
        for kind in EXCLUSION_KINDS:
            excluded.add_metric((kind,), float(current[kind]))
        return changes, exclusions, excluded
