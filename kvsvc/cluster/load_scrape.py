"""Load without a sidecar (§15): the load of vLLM and SGLang instances read from their own
Prometheus text at ``http://<instance>/metrics``.

Real vLLM and SGLang engines send no heartbeat (§9); they publish their queue and their KV
usage as Prometheus gauges. For every registered instance whose ``backend_type`` is in
``--load_scrape_backends`` (default ``vllm,sglang``), :class:`LoadScraper` reads that text
every ``--load_scrape_interval_ms`` and hands the figures to the registry as a load report,
exactly like a heartbeat (:meth:`kvsvc.cluster.registry.Registry.scraped_load`): dated when
it is received, current for ``--max_load_age_s``, and, like a heartbeat, keeping a
``LEASE_LOST`` instance from turning ``SUSPECT`` (the engine answered). A scrape that fails
(refused, timed out, not 200, larger than :data:`MAX_BODY_BYTES`, not Prometheus text, or
without the metrics) reports nothing, so the last report ages out.

The rule (:func:`parse_engine_load`, pure, tested without sockets):

- vLLM: ``waiting`` = the sum over label sets of ``vllm:num_requests_waiting``; ``usage`` =
  the mean over label sets of ``vllm:kv_cache_usage_perc`` (older releases:
  ``vllm:gpu_cache_usage_perc``, used only when the new name is absent). Per rank: label
  ``engine`` (vLLM labels each DP engine core's gauges with its index).
- SGLang: ``waiting`` = the sum of ``sglang:num_queue_reqs``; ``usage`` = the mean of
  ``sglang:token_usage``. Per rank: label ``dp_rank`` (present when SGLang runs DP). Label
  sets of a tensor- or pipeline-parallel rank other than 0 (``tp_rank`` / ``pp_rank`` /
  ``attn_tp_rank`` not ``"0"``) are skipped: they repeat the queue of their DP group's
  scheduler, and summing them would count it again (the spec says "sum"; it is silent on TP
  duplicates, and counting a queue once is what its sum means: D27 in docs/decisions.md).
- Per-rank values: the waiting sum and usage mean of each rank's label sets, for ranks
  ``0 .. dp_size - 1`` when every one of them is present (otherwise none: a partial split
  would price the missing ranks as idle; D28). They feed DP-rank routing (§15,
  :func:`~kvsvc.routing.in_flight.rank_waiting_estimate`).
- Values must be finite and >= 0 (a queue a whole number); usage above 1 is clamped by
  :func:`~kvsvc.cluster.model.check_load` as for a heartbeat. The text is parsed by
  ``prometheus_client``'s text parser (:func:`prometheus_client.parser.text_string_to_metric_families`).

Thread: :class:`LoadScraper` is a :class:`~kvsvc.lifecycle.BackgroundThread` owned by the
service; it owns its HTTP session and a small pool (at most ``max_parallel`` scrapes at once,
each bounded by its connect and read timeouts and the body limit, so a dead instance delays no
other). It reads the registry's snapshot (lock-free) and never runs on a request thread. One
WARNING per instance when its scrapes start failing, one INFO when they succeed again.

Errors: :class:`~kvsvc.errors.MalformedMetrics` from :func:`parse_engine_load` (the
``prometheus_client`` parser's ``ValueError`` translated here); the thread logs failures and
never raises them.
"""

from __future__ import annotations

import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Optional, Protocol

import requests
import requests.adapters
from prometheus_client.parser import text_string_to_metric_families

from kvsvc.cluster.model import (
    Instance,
    InstanceState,
    RankLoad,
    RegistrySnapshot,
    check_load,
    instance_identity,
)
from kvsvc.errors import MalformedMetrics, MalformedRegistration
from kvsvc.lifecycle import BackgroundThread

log = logging.getLogger(__name__)

#: The path of an engine's Prometheus text.
METRICS_PATH = "/metrics"
#: Largest ``/metrics`` body read, bytes (a vLLM engine's text is some tens of KiB; histograms
#: per engine and LoRA adapter grow it, never to this).
MAX_BODY_BYTES = 4 << 20

#: backend_type -> (waiting metric, usage metrics in order of preference, rank label).
ENGINE_METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "vllm": ("vllm:num_requests_waiting",
             ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"), "engine"),
    "sglang": ("sglang:num_queue_reqs", ("sglang:token_usage",), "dp_rank"),
}
#: Labels of a model-parallel rank whose label sets repeat their DP group's values.
_REPLICA_LABELS = ("tp_rank", "pp_rank", "attn_tp_rank")


@dataclass(frozen=True)
class ScrapedLoad:
    """One instance's load as its ``/metrics`` text gives it (:func:`parse_engine_load`).

    :ivar waiting_requests_num: requests queued, all ranks (>= 0).
    :ivar gpu_cache_usage_perc: KV usage, the mean over label sets (>= 0; not clamped here).
    :ivar ranks: per-rank values in rank order, empty when the text has none for every rank.
    """

    waiting_requests_num: int
    gpu_cache_usage_perc: float
    ranks: tuple[RankLoad, ...] = ()


def _samples(families: dict[str, list[tuple[dict[str, str], float]]], name: str
             ) -> list[tuple[dict[str, str], float]]:
    rows = families.get(name, [])
    return [(labels, value) for labels, value in rows
            if all(labels.get(k, "0") == "0" for k in _REPLICA_LABELS)]


def _check(name: str, value: float, whole: bool) -> float:
    if not (math.isfinite(value) and value >= 0) or (whole and value != int(value)):
        raise MalformedMetrics(f"{name}: {value!r} is not a "
                               f"{'whole number' if whole else 'finite number'} >= 0")
    return value


def parse_engine_load(text: str, backend: str, dp_size: int = 1) -> ScrapedLoad:
    """The load in one ``/metrics`` text of an engine of ``backend`` (module docstring).

    :param text: Prometheus text exposition (``text/plain; version=0.0.4``).
    :param backend: ``vllm`` or ``sglang`` (a key of :data:`ENGINE_METRICS`).
    :param dp_size: the instance's registered DP ranks (per-rank values need all of them).
    :raises MalformedMetrics: not Prometheus text, a backend without known metric names, a
        metric missing, or a value that is not a finite number >= 0 (a queue: whole).
    """
    names = ENGINE_METRICS.get(backend)
    if names is None:
        raise MalformedMetrics(f"no load metrics known for backend {backend!r}")
    waiting_name, usage_names, rank_label = names
    wanted = {waiting_name, *usage_names}
    families: dict[str, list[tuple[dict[str, str], float]]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in wanted:
                    families.setdefault(sample.name, []).append(
                        (dict(sample.labels), float(sample.value)))
    except (ValueError, TypeError, IndexError) as exc:  # the parser's errors on bad text
        raise MalformedMetrics(f"not Prometheus text: {exc}") from None
    waiting_rows = _samples(families, waiting_name)
    if not waiting_rows:
        raise MalformedMetrics(f"no {waiting_name} in the text")
    usage_name = next((n for n in usage_names if _samples(families, n)), None)
    if usage_name is None:
        raise MalformedMetrics(f"no {' or '.join(usage_names)} in the text")
    usage_rows = _samples(families, usage_name)
    waiting = sum(_check(waiting_name, v, True) for _, v in waiting_rows)
    usage = sum(_check(usage_name, v, False) for _, v in usage_rows) / len(usage_rows)
    return ScrapedLoad(int(waiting), usage,
                       _per_rank(waiting_rows, usage_rows, rank_label, dp_size))


def _per_rank(waiting_rows: list[tuple[dict[str, str], float]],
              usage_rows: list[tuple[dict[str, str], float]], label: str,
              dp_size: int) -> tuple[RankLoad, ...]:
    def by_rank(rows: Iterable[tuple[dict[str, str], float]]) -> dict[int, list[float]]:
        out: dict[int, list[float]] = {}
        for labels, value in rows:
            raw = labels.get(label)
            if raw is None or not raw.isdigit():
                return {}
            out.setdefault(int(raw), []).append(value)
        return out

    waits, usages = by_rank(waiting_rows), by_rank(usage_rows)
    ranks = range(max(1, dp_size))
    if dp_size <= 1 or any(r not in waits or r not in usages for r in ranks):
        return ()
    return tuple(RankLoad(r, int(sum(waits[r])), min(1.0, sum(usages[r]) / len(usages[r])))
                 for r in ranks)


class LoadSink(Protocol):
    """Where scraped loads go (:class:`kvsvc.cluster.registry.Registry`)."""

    def snapshot(self) -> RegistrySnapshot:
        """The registry's current snapshot (lock-free)."""
        ...

    def scraped_load(self, name: str, identity: Optional[str], waiting_requests_num: int,
                     gpu_cache_usage_perc: float, ranks: tuple[RankLoad, ...]) -> bool:
        """Record one scrape's load; False when the instance is gone or was replaced."""
        ...


@dataclass(frozen=True)
class LoadScrapeSettings:
    """What :class:`LoadScraper` scrapes and how often.

    :ivar backends: ``backend_type`` values scraped (``--load_scrape_backends``).
    :ivar interval_s: period of a round, seconds (``--load_scrape_interval_ms`` / 1000).
    :ivar connect_timeout_s: TCP connect bound of one scrape, seconds.
    :ivar read_timeout_s: bound of the wait for the answer's bytes, seconds.
    :ivar max_parallel: scrapes at once (>= 1).
    :ivar max_body_bytes: longest body read; a longer one fails the scrape.
    """

    backends: frozenset[str] = frozenset({"vllm", "sglang"})
    interval_s: float = 0.5
    connect_timeout_s: float = 0.5
    read_timeout_s: float = 1.0
    max_parallel: int = 8
    max_body_bytes: int = MAX_BODY_BYTES


class LoadScraper(BackgroundThread):
    """Scrapes the load of the registered instances of :attr:`LoadScrapeSettings.backends`
    (module docstring) on the thread ``kvsvc-load-scrape``.

    :param registry: where instances come from and loads go.
    :param settings: what and how often.
    """

    def __init__(self, registry: LoadSink,
                 settings: LoadScrapeSettings = LoadScrapeSettings()) -> None:
        super().__init__("kvsvc-load-scrape")
        self._registry = registry
        self.settings = settings
        self._session: Optional[requests.Session] = None
        self._pool: Optional[ThreadPoolExecutor] = None
        self._failing: dict[str, str] = {}   # the thread's own: name -> why it fails
        self._counts = {"ok": 0, "failed": 0}

    def counts(self) -> dict[str, int]:
        """Scrapes since start by outcome (``ok``, ``failed``); a copy, any thread."""
        return dict(self._counts)

    def failing(self) -> dict[str, str]:
        """Instances whose last scrape failed -> why; a copy, any thread."""
        return dict(self._failing)

    def _setup(self) -> None:
        session = requests.Session()
        session.trust_env = False   # never an environment HTTP proxy, never .netrc
        session.mount("http://", requests.adapters.HTTPAdapter(
            pool_maxsize=self.settings.max_parallel, max_retries=0))
        self._session = session
        self._pool = ThreadPoolExecutor(self.settings.max_parallel,
                                        thread_name_prefix="kvsvc-load-scrape-fetch")

    def _loop(self) -> None:
        while not self.stopping:
            started = time.monotonic()
            self.scrape_once()
            if self._sleep(max(0.0, self.settings.interval_s - (time.monotonic() - started))):
                return

    def _teardown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self._session is not None:
            self._session.close()

    def targets(self, snapshot: RegistrySnapshot) -> list[Instance]:
        """The instances a round scrapes: schedulable (not ``SUSPECT``) ones of the scraped
        backends, by name."""
        return [inst for name, inst in sorted(snapshot.instances.items())
                if inst.backend_type in self.settings.backends
                and inst.state is not InstanceState.SUSPECT]

    def scrape_once(self) -> None:
        """One round (on the thread): scrape every target, report each load that parsed."""
        targets = self.targets(self._registry.snapshot())
        for gone in set(self._failing) - {i.name for i in targets}:
            del self._failing[gone]
        if not targets:
            return
        assert self._pool is not None, "scrape_once() runs on the started thread"
        for inst, (load, why) in zip(targets, self._pool.map(self._scrape, targets),
                                     strict=True):
            self._record(inst, load, why)

    def _record(self, inst: Instance, load: Optional[ScrapedLoad], why: str) -> None:
        name = inst.name
        if load is not None:
            try:
                check_load(load.waiting_requests_num, load.gpu_cache_usage_perc)
            except MalformedRegistration as exc:
                load, why = None, str(exc)
        if load is None:
            self._counts["failed"] += 1
            if name not in self._failing:
                log.warning("instance %s: load scrape of http://%s%s failed (%s); no load "
                            "reported until it answers", name, name, METRICS_PATH, why)
            self._failing[name] = why
            return
        self._counts["ok"] += 1
        if name in self._failing:
            del self._failing[name]
            log.info("instance %s: load scrape answers again", name)
        self._registry.scraped_load(name, instance_identity(inst), load.waiting_requests_num,
                                    load.gpu_cache_usage_perc, load.ranks)

    def _scrape(self, inst: Instance) -> tuple[Optional[ScrapedLoad], str]:
        """``GET http://<name>/metrics`` -> (its load, "") or (None, why it failed)."""
        assert self._session is not None, "scrapes run on the started thread's pool"
        s = self.settings
        try:
            with self._session.get(f"http://{inst.name}{METRICS_PATH}", stream=True,
                                   allow_redirects=False,
                                   timeout=(s.connect_timeout_s, s.read_timeout_s)) as r:
                if r.status_code != 200:
                    return None, f"HTTP {r.status_code}"
                body = bytearray()
                for chunk in r.iter_content(64 * 1024):
                    body += chunk
                    if len(body) > s.max_body_bytes:
                        return None, f"body larger than {s.max_body_bytes} bytes"
            text = body.decode("utf-8", errors="replace")
            return parse_engine_load(text, inst.backend_type, inst.dp_size), ""
        except requests.exceptions.RequestException as exc:
            return None, type(exc).__name__
        except MalformedMetrics as exc:
            return None, str(exc)
