"""The composition root: every component one kvsvc process serves from, built from settings.

:class:`Service` builds, in its constructor and without starting anything (so it can be built
before gunicorn forks, STYLE 8):

- the :class:`~kvsvc.directory.Directory` of the §8 config's streams (none with the index
  disabled: every query answers no matches);
- with ``--etcd_addr`` the instance :class:`~kvsvc.cluster.registry.Registry` (§9);
- with an enabled ``discovery`` block the :class:`~kvsvc.cluster.discovery.Discovery` thread that
  manages the directory's streams from the registry (§9);
- the :class:`~kvsvc.routing.router.Router` (§11): the policy from ``--load_balance_policy``,
  the tokenizer from ``--tokenizer_path`` (loaded now), the proxy's pooled session, the
  in-flight ledger shared by the proxy and the policy, and the request-metrics ledger the
  proxy's observer seam feeds and SLO_AWARE / TTFT read (§12), reading the registry and the
  directory;
- with ``--etcd_addr`` and ``--load_scrape_backends`` non-empty the
  :class:`~kvsvc.cluster.load_scrape.LoadScraper` thread that reads vLLM's and SGLang's load
  from their ``/metrics`` (§15);
- with ``--etcd_addr`` the :class:`~kvsvc.routing.models.ModelLister`
  thread that keeps the instances' own model lists: model-aware candidates (§15) and, with
  ``--model`` empty, ``GET /v1/models`` (§11);
- with ``--etcd_addr`` and ``--rpc_port`` not 0 the baidu_std
  :class:`~kvsvc.rpc.server.RpcServer` of real xLLM engines (§13): heartbeats through the
  same intake as HTTP's, Generations into :attr:`Service.generations`.

:meth:`Service.start` starts the baidu_std server, registry, load scraper, directory, discovery and
the model lister, in that order
(the router has no thread); :meth:`Service.close` closes them in the reverse order, then the
router's upstream connections, every one of them even when an earlier one fails.

Whoever serves the service starts it after any fork and closes it at exit (gunicorn:
``post_worker_init`` / ``worker_exit``, :mod:`kvsvc.server`). Nothing here knows HTTP.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from types import MappingProxyType
from typing import Callable, Mapping, Optional, Protocol

from kvsvc.clock import MONOTONIC, Clock
from kvsvc.cluster.discovery import Discovery
from kvsvc.cluster.load_scrape import LoadScraper, LoadScrapeSettings
from kvsvc.cluster.pd_links import HttpLinkCaller, PdLinks, registration_fields
from kvsvc.cluster.model import Instance, RegistrySettings, RegistrySnapshot
from kvsvc.cluster.heartbeat import HeartbeatIntake
from kvsvc.cluster.rejections import HeartbeatRejections
from kvsvc.cluster.registry import Registry
from kvsvc.config import KvEventsConfig, check_discovery_needs_etcd
from kvsvc.settings import ServiceSettings, scrape_backends
from kvsvc.directory import Directory, OverlayLimits
from kvsvc.errors import LifecycleError
from kvsvc.routing.in_flight import InFlight
from kvsvc.routing.models import ModelLister
from kvsvc.routing.policies import make_policy
from kvsvc.routing.prompt import PromptTokenizer, TokenSource
from kvsvc.routing.proxy import Proxy, ProxySettings
from kvsvc.routing.cache_audit import CacheAudit, block_sizes
from kvsvc.routing.dispatch_record import DispatchRecorder
from kvsvc.routing.observer import ObserverChain, RequestObserver
from kvsvc.routing.request_metrics import RequestMetricsLedger
from kvsvc.routing.router import EMPTY_SNAPSHOT, Router, served_models
from kvsvc.routing.engine_loss import LostEngines
from kvsvc.routing.generations import PendingRequests
from kvsvc.routing.xllm_dispatch import BaiduStdHeartbeats, XllmDispatcher
from kvsvc.rpc.engines import BaiduStdCaller
from kvsvc.rpc.server import RpcServer, XllmRpcHandler

log = logging.getLogger(__name__)


class _Component(Protocol):
    """What :class:`Service` starts and closes (the registry, the directory, discovery)."""

    def start(self, timeout_s: float = ...) -> None: ...

    def close(self, timeout_s: float = ...) -> None: ...


def registry_settings(settings: ServiceSettings) -> Optional[RegistrySettings]:
    """The registry's settings from the service's (§9), ``None`` without ``etcd_addr``.

    :raises ConfigError: a value the registry refuses, or a baidu_std port without an IPv4
        address to advertise (:meth:`~kvsvc.settings.ServiceSettings.rpc_address`).
    """
    if not settings.etcd_addr:
        return None
    # With a baidu_std port the master key holds its ip:port, the only form an xLLM engine
    # accepts (§13), and the replica keeps XLLM:SERVICE:<ip:port>; else the HTTP address.
    rpc = settings.rpc_address()
    return RegistrySettings(
        etcd_addr=settings.etcd_addr, namespace=settings.etcd_namespace,
        suspect_removal_s=settings.detect_disconnected_instance_interval,
        self_address=rpc or settings.advertised_address(), service_address=rpc or "",
        http_address=settings.advertised_address(),
        max_load_age_s=settings.max_load_age_s)


def build_router(settings: ServiceSettings, registry: Optional[Registry],
                 directory: Optional[Directory],
                 cache_audit: Optional[CacheAudit] = None, clock: Clock = MONOTONIC) -> Router:
    """The §11 router from the service settings: policy, tokenizer (loaded now), a proxy with
    its pooled session and the in-flight ledger it shares with the policy.

    :param settings: validated service settings.
    :param registry: where candidates come from, ``None`` without ``--etcd_addr``.
    :param directory: where hits come from, ``None`` with the index disabled.
    :param cache_audit: hears every answer after the ledger (predicted vs actual cached
        tokens, :mod:`kvsvc.routing.cache_audit`); ``None``: not audited.
    :param clock: the service's clock, the in-flight ledger's dates (:mod:`kvsvc.clock`).

    With a directory, every dispatch is also recorded in its overlays (approximate indexes,
    pending blocks: :class:`~kvsvc.routing.dispatch_record.DispatchRecorder`, §14, §16).
    :raises ConfigError: bad policy parameters or an unloadable ``--tokenizer_path``.
    """
    # The per-instance request metrics (§12), heard through the proxy's observer seam and
    # read by SLO_AWARE and TTFT.
    ledger = RequestMetricsLedger()
    policy = make_policy(settings.load_balance_policy, settings.car_prefill_lambda,
                         settings.car_host_hit_weight,
                         max_load_age_s=settings.max_load_age_s, ledger=ledger,
                         target_ttft_ms=settings.target_ttft,
                         target_tpot_ms=settings.target_tpot,
                         default_prefill_tokens_per_s=settings.default_prefill_tokens_per_s,
                         dp_rank_routing=settings.dp_rank_routing,
                         ttft_work_weight=settings.ttft_work_weight,
                         ttft_host_hit_weight=settings.ttft_host_hit_weight)
    tokenizer = (PromptTokenizer.load(settings.tokenizer_path,
                                      cache_tokens=settings.tokenizer_cache_tokens)
                 if settings.tokenizer_path else None)
    in_flight = InFlight(clock.now)
    # One kept-alive connection per worker thread and instance: a thread proxies one request
    # at a time, so the pool never discards a connection it will need again.
    observers: list[RequestObserver] = [ledger]
    if cache_audit is not None:
        observers.append(cache_audit)
    if directory is not None:
        observers.append(DispatchRecorder(directory))
    proxy = Proxy(ProxySettings(connect_timeout_s=settings.upstream_connect_timeout_s,
                                read_timeout_s=settings.upstream_read_timeout_s,
                                pool_maxsize=settings.worker_threads), in_flight,
                  observer=ObserverChain(observers) if len(observers) > 1 else ledger)
    return Router(policy, TokenSource(tokenizer), proxy, in_flight,
                  served_models(settings.model), registry, directory)


def pending_limits(settings: ServiceSettings) -> Optional[OverlayLimits]:
    """The bounds of every exact stream's pending blocks (§16), ``None`` with
    ``--pending_ttl_ms 0`` (off)."""
    if settings.pending_ttl_ms <= 0:
        return None
    return OverlayLimits(settings.pending_ttl_ms / 1000.0, settings.pending_blocks)


def _native_view(snapshot: Callable[[], RegistrySnapshot], native: Callable[[Instance], bool]
                 ) -> Callable[[], RegistrySnapshot]:
    """``snapshot`` with only the instances ``native`` accepts."""
    def view() -> RegistrySnapshot:
        snap = snapshot()
        return dataclasses.replace(snap, instances=MappingProxyType(
            {n: i for n, i in snap.instances.items() if native(i)}))
    return view


def _no_candidates(pd_links: Optional[PdLinks], lost: Optional[LostEngines]
                   ) -> Optional[Callable[[], Mapping[str, str]]]:
    """The instances that are no routing candidate however the registry sees them -> why: a
    failed P/D link (§13) and an engine known dead (:mod:`kvsvc.routing.engine_loss`);
    ``None`` when neither applies."""
    parts = [p.excluded for p in (pd_links, lost) if p is not None]
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    first, second = parts

    def excluded() -> Mapping[str, str]:
        a, b = first(), second()
        return {**a, **b} if a and b else (a or b)
    return excluded


def _backend_reader(registry: Optional[Registry]) -> Callable[[str], str]:
    """``instance -> backend_type`` from the registry's snapshot (the audit per backend, §14);
    ``""`` for an unknown instance or without a registry."""
    def backend_of(name: str) -> str:
        if registry is None:
            return ""
        inst = registry.snapshot().instances.get(name)
        return inst.backend_type if inst is not None else ""

    return backend_of


def startup_warnings(settings: ServiceSettings,
                     kv_config: Optional[KvEventsConfig]) -> list[str]:
    """What a valid configuration does that an operator may not mean, one line each. Logged
    once by :meth:`Service.start` and printed by ``kvsvc check-config`` after its validation
    passed: never while building (``serve`` builds a service to validate, then the worker
    builds its own), so a line is neither repeated nor printed before a configuration error.

    :param settings: validated settings.
    :param kv_config: the §8 config, ``None`` with the index disabled.
    """
    lines: list[str] = []
    if kv_config is None:
        line = ("kv_events_config_file is empty: KV index disabled, every query answers no "
                "matches (hit ratio 0)")
        if settings.load_balance_policy == "CAR":
            line += "; routing policy CAR routes on queue costs only"
        elif settings.load_balance_policy == "TTFT":
            line += "; routing policy TTFT predicts every prompt uncached"
        lines.append(line)
    if not settings.etcd_addr:
        lines.append("etcd_addr is empty: no instance registry, so no routing candidate: "
                     "every OpenAI request is answered 503")
    if settings.xllm_dispatch == "native":
        if settings.etcd_addr and not settings.rpc_port:
            lines.append("xllm_dispatch is native but rpc_port is 0: xLLM engines have no "
                         "baidu_std port to send their Generations to, so every request "
                         "dispatched to them times out (upstream_read_timeout_s)")
        if not settings.tokenizer_path:
            lines.append("xllm_dispatch is native without tokenizer_path: xLLM engines take "
                         "token ids only, so text and chat prompts sent to them get 400")
    return lines


class Service:
    """Everything one process serves from (see the module docstring). Nothing starts in the
    constructor.

    :param settings: validated service settings (the internal token is read from them here).
    :param kv_config: the §8 config, or ``None`` for a disabled index (no directory).
    :param clock: the one clock of every timer rule the service applies (:mod:`kvsvc.clock`):
        the registry's §9 timers and the loads' ``received_at``, the router's load ages and
        in-flight dates, the directory's streams and overlay TTLs (§14, §16), the refused
        heartbeats' reminders, the P/D links' retries and the model lists' refreshes; real by
        default, a virtual one in tests.
    :raises ConfigError: discovery enabled without ``--etcd_addr``, bad registry or routing
        settings, an unreadable token file or tokenizer.

    :ivar settings: the settings it was built from.
    :ivar clock: the clock it was given (the one every component here was given).
    :ivar token: the internal API token, ``None`` when none is required (§10).
    :ivar kv_config: the §8 config, ``None`` with the index disabled.
    :ivar directory: the directory, ``None`` with the index disabled.
    :ivar registry: the registry, ``None`` without ``--etcd_addr``.
    :ivar discovery: discovery, ``None`` unless enabled (it needs a registry and a directory).
    :ivar router: the §11 router (always present).
    :ivar cache_audit: predicted vs actual cached tokens of every proxied answer
        (:mod:`kvsvc.routing.cache_audit`), shown in ``/metrics`` and ``/v1/internal/route``.
    :ivar models: the backends' model lists (model-aware candidates, §15; ``/v1/models``
        with ``--model`` empty), ``None`` without a registry.
    :ivar load_scraper: reads the load of the ``--load_scrape_backends`` instances from their
        ``/metrics`` (§15), ``None`` without a registry or with no backend listed.
    :ivar static_streams: the §8 config lists streams.
    :ivar heartbeat_rejections: the ledger of refused heartbeats (§9, §10), fed by the
        heartbeat intake, shown in ``/ready`` and ``/v1/internal/route``.
    :ivar heartbeats: the one heartbeat intake of the HTTP and baidu_std heartbeats (§9, §13).
    :ivar generations: the requests waiting for xLLM engines' ``Generations`` (§13), where the
        baidu_std server delivers every entry.
    :ivar rpc_address: this replica's baidu_std ``ip:port`` as engines reach it (the master
        key's value, ``source_xservice_addr``), ``None`` without a baidu_std port
        (``--rpc_port`` 0 or no ``--etcd_addr``).
    :ivar rpc_server: the ``XllmRpcService`` server (:mod:`kvsvc.rpc.server`), ``None``
        without a baidu_std port.
    :ivar rpc_source_address: this replica's baidu_std ``ip:port`` sent to engines as
        ``source_xservice_addr`` (§13): :attr:`rpc_address`, ``""`` without one.
    :ivar pd_links: the P/D links of the xLLM instances (§13), with ``--xllm_dispatch native``
        and a registry; ``None`` otherwise. An instance whose link failed is no candidate.
    """

    def __init__(self, settings: ServiceSettings,
                 kv_config: Optional[KvEventsConfig] = None, clock: Clock = MONOTONIC) -> None:
        self.settings = settings
        self.clock = clock
        self.token: Optional[str] = settings.token()
        self.kv_config = kv_config
        if kv_config is not None:
            check_discovery_needs_etcd(kv_config, settings.etcd_addr)
        self.directory: Optional[Directory] = (
            Directory(kv_config, max_concurrent_snapshots=settings.max_concurrent_snapshots,
                      pending=pending_limits(settings), clock=clock)
            if kv_config is not None else None)
        reg_settings = registry_settings(settings)
        # The registry's clock dates the loads; the router judges their age on it (§11).
        self.registry: Optional[Registry] = (Registry(reg_settings, clock) if reg_settings
                                             else None)
        self.discovery: Optional[Discovery] = None
        if (kv_config is not None and kv_config.discovery is not None
                and kv_config.discovery.enabled and self.registry is not None
                and self.directory is not None):
            self.discovery = Discovery(self.registry, self.directory, kv_config.discovery,
                                       kv_config)
        # Predicted vs actual cached tokens of every answer (issue 14).
        self.cache_audit = CacheAudit(block_sizes(kv_config),
                                      backend_of=_backend_reader(self.registry))
        self.router = build_router(settings, self.registry, self.directory, self.cache_audit,
                                   clock)
        backends = scrape_backends(settings.load_scrape_backends)
        # §15: vLLM and SGLang send no heartbeats; their load is read from their /metrics.
        self.load_scraper: Optional[LoadScraper] = (
            LoadScraper(self.registry, LoadScrapeSettings(
                backends=backends, interval_s=settings.load_scrape_interval_ms / 1000.0))
            if self.registry is not None and backends else None)
        self.generations = PendingRequests()
        # The baidu_std port of real xLLM engines (§13): only with a registry, where engines
        # find it (XLLM:SERVICE:MASTER).
        self.rpc_address: Optional[str] = (reg_settings.service_address or None
                                           if reg_settings is not None else None)
        self.rpc_source_address = self.rpc_address or ""
        # xLLM engines whose baidu_std connection closed and whose port refuses: their
        # requests fail at once, not when their lease expires (issue 19).
        self.lost_engines: Optional[LostEngines] = None
        # --xllm_dispatch auto: native for the xLLM instances heard heartbeating over
        # baidu_std here (possible only with the baidu_std port), HTTP for the others.
        self.baidu_std_heartbeats: Optional[BaiduStdHeartbeats] = (
            BaiduStdHeartbeats() if settings.xllm_dispatch == "auto"
            and self.rpc_address is not None else None)
        native = settings.xllm_dispatch == "native" or self.baidu_std_heartbeats is not None
        if native:
            registry = self.registry
            snapshot = registry.snapshot if registry is not None else (lambda: EMPTY_SNAPSHOT)
            self.lost_engines = LostEngines(snapshot)
            self.router.xllm = XllmDispatcher(
                BaiduStdCaller(settings.upstream_connect_timeout_s),
                self.generations, snapshot,
                self.router.in_flight, self.router.proxy.observer,
                settings.upstream_read_timeout_s, lambda: self.rpc_source_address,
                lost=self.lost_engines,
                native_for=(self.baidu_std_heartbeats.native
                            if self.baidu_std_heartbeats is not None else None))
        self.pd_links: Optional[PdLinks] = None
        if native and self.registry is not None:
            registry = self.registry
            # Under auto only the natively dispatched instances are linked (an HTTP one
            # has no LinkInstance to call).
            links_view = (_native_view(registry.snapshot, self.baidu_std_heartbeats.native)
                          if self.baidu_std_heartbeats is not None else registry.snapshot)
            self.pd_links = PdLinks(links_view, HttpLinkCaller(
                registration=lambda name: registration_fields(registry.registration(name))),
                clock=clock.now)
        excluded = _no_candidates(self.pd_links, self.lost_engines)
        if excluded is not None:
            self.router.excluded = excluded
        # §15: the instances' own model lists decide which serve a request's model; with
        # --model empty they are also /v1/models.
        self.models: Optional[ModelLister] = (
            ModelLister(self.registry, clock=clock.now) if self.registry is not None else None)
        self.router.model_lists = self.models
        self.static_streams = bool(kv_config is not None and kv_config.streams)
        self.heartbeats = HeartbeatIntake(self.registry, HeartbeatRejections(clock.now),
                                          settings.etcd_namespace)
        self.rpc_server: Optional[RpcServer] = (
            RpcServer(XllmRpcHandler(self.heartbeats, self.registry, self.generations,
                                     excluded,
                                     on_heartbeat=(self.baidu_std_heartbeats.heard
                                                   if self.baidu_std_heartbeats is not None
                                                   else None)),
                      settings.rpc_host, settings.rpc_port,
                      on_connection_closed=(self.lost_engines.connection_closed
                                            if self.lost_engines is not None else None))
            if self.rpc_address is not None else None)
        self._lock = threading.Lock()
        self._running = False

    @property
    def heartbeat_rejections(self) -> HeartbeatRejections:
        """The ledger of refused heartbeats, the intake's (replaceable, e.g. by a test with
        its own clock)."""
        return self.heartbeats.rejections

    @heartbeat_rejections.setter
    def heartbeat_rejections(self, ledger: HeartbeatRejections) -> None:
        self.heartbeats.rejections = ledger

    @property
    def running(self) -> bool:
        """True between :meth:`start` and :meth:`close`."""
        with self._lock:
            return self._running

    def _threads(self) -> list[_Component]:
        """The components with threads, in start order."""
        # The baidu_std server first: the master key the registry's election writes points
        # at it, so it listens before the key can exist.
        parts: list[Optional[_Component]] = [self.rpc_server, self.registry, self.load_scraper,
                                             self.directory, self.discovery, self.models,
                                             self.pd_links]
        return [p for p in parts if p is not None]

    def start(self, timeout_s: float = 5.0) -> None:
        """Start the registry, the directory's stream threads (none with the index disabled),
        discovery and the model lister, in that order (§9, §11). On a failure what was
        started is closed again.

        :param timeout_s: bound of each component's (and each stream's) start, seconds.
        :raises LifecycleError: already running, or something did not start in time.
        """
        with self._lock:
            if self._running:
                raise LifecycleError("service already started")
        for line in startup_warnings(self.settings, self.kv_config):
            log.warning("%s", line)
        started: list[_Component] = []
        try:
            for part in self._threads():
                part.start(timeout_s=timeout_s)
                started.append(part)
        except BaseException:
            log.error("service start failed after %d components; closing them", len(started))
            for part in reversed(started):
                try:
                    part.close(timeout_s=timeout_s)
                except Exception as exc:  # noqa: BLE001 - undo the rest, raise the start's
                    log.error("while undoing the start: %s", exc)
            raise
        with self._lock:
            self._running = True
        log.info("service started (%d streams, registry %s, discovery %s, token %s, "
                 "baidu_std %s)",
                 len(self.directory) if self.directory is not None else 0,
                 self.settings.etcd_addr or "off", "on" if self.discovery else "off",
                 "required" if self.token else "not required",
                 f"{self.settings.rpc_host}:{self.rpc_server.port} as {self.rpc_address}"
                 if self.rpc_server is not None else "off")

    def close(self, timeout_s: float = 5.0) -> None:
        """Close discovery, the directory's threads, the registry and the router's upstream
        connections, in that order. Idempotent; does nothing unless running. Every component
        is closed even when an earlier one fails.

        :param timeout_s: bound of each thread's join, seconds.
        :raises LifecycleError: a thread did not stop in time (the first failure is raised,
            after every component was closed; any other exception likewise).
        """
        with self._lock:
            if not self._running:
                return
            self._running = False
        failure: Optional[Exception] = None
        for part in reversed(self._threads()):
            try:
                part.close(timeout_s=timeout_s)
            except Exception as exc:  # noqa: BLE001 - close the others, raise the first
                log.error("service close: %s", exc)
                failure = failure or exc
        try:
            self.router.close()
        except Exception as exc:  # noqa: BLE001 - as above
            log.exception("service close: the router's connections")
            failure = failure or exc
        log.info("service closed")
        if failure is not None:
            raise failure
