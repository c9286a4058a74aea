"""``kvsvc bench-routing``: replay Mooncake traces through the real router (§11, §12) to serving
simulated engines, once per policy and load level, and compare cache reuse, TTFT, SLO
attainment, TPOT, predicted-vs-actual cached tokens and load balance.

Per trace (``conversation`` and ``synthetic`` by default), per load level (``--load-levels``,
arrival-rate multipliers: 1 replays the trace as recorded, 2 twice as fast on the same
engines) and per policy (RR, CAR lambda 0.5, SLO_AWARE, TTFT; ``--policies`` adds e.g.
``CAR:1.0``), one run of ``window_s / (time_scale * load)`` wall seconds plus start-up (about
10 s); ``--quick`` replays 240 trace seconds of the conversation trace only. ``--flavor vllm
--dp 2 --dp-rank-routing both`` runs each policy on DP engines twice, with DP-rank routing and
with the minimum over ranks (§15), and writes its own section of the results file.

1. etcd: ``--etcd``, or a local one started once for the whole bench
   (:class:`~kvsvc.testbed.etcd_launcher.LocalEtcd`), as the demo does.
2. ``engines`` fresh ``kvsvc sim --serve --etcd`` processes (:class:`EngineProcesses`, empty
   caches), each serving OpenAI requests on its HTTP port with the latency model of
   :mod:`kvsvc.testbed.sim.serving`, registered in etcd and heartbeating its waiting queue every
   ``heartbeat_interval_s`` simulated seconds (§9).
3. ``kvsvc serve`` under gunicorn (:class:`~kvsvc.testbed.demo.ServiceProcess`) with discovery, the
   policy's ``--load_balance_policy`` / ``--car_prefill_lambda`` and ``service_threads``
   gthread threads (``GUNICORN_CMD_ARGS``: the router holds one thread per request in flight).
   The router runs on the wall clock, so its ``--target_ttft`` / ``--target_tpot`` are the
   simulated targets divided by ``time_scale`` (:func:`wall_ms`), as the engines' registered
   profiling data is (:func:`~kvsvc.testbed.sim.serving.profiling_data`).
4. The first ``window_s`` trace seconds are replayed on the wall clock divided by
   ``time_scale``: each request is sent at its (compressed) arrival time (:func:`arrival_ms`:
   the conversation trace's 3-second timestamp buckets are spread out by default) as
   ``POST /v1/completions`` with ``prompt`` = its token ids (:func:`~kvsvc.testbed.traces.request_tokens`)
   and ``max_tokens`` = its ``output_length``, streamed (``stream_options.include_usage``:
   the router hears the first token of each answer, which SLO_AWARE and TTFT use; the engines
   write the events of decode steps closer than ``stream_coalesce_ms`` wall ms together, one
   event per token still), by a bounded pool of client threads.

Figures of a run: cache-hit tokens / prompt tokens as the engines report them
(``usage.prompt_tokens_details.cached_tokens``), the infinite-cache ideal of the same requests
(:func:`~kvsvc.testbed.traces.ideal_hit_ratio`), TTFT p50/p90/p99 in simulated ms (the engine's queue
wait plus modeled prefill, the usage chunk's ``sim_timing``), SLO attainment (the share of
answered requests with TTFT <= ``target_ttft_ms``), TPOT p90 (simulated ms, requests with two
output tokens or more), predicted vs actual cached tokens (the service's own audit,
:mod:`kvsvc.routing.cache_audit`, scraped from its ``/metrics`` at the end of the run: mean
absolute error in tokens, share within one block, and that share for the answers predicted
from synchronized exact streams; RR predicts nothing), requests per engine max/mean (from
``x-kvsvc-prefill``), failed requests, and how late the client sent (p99 dispatch lag, wall
ms: large values mean the machine did not keep up with the compression), and the router's
predicted TTFT of the chosen P (``x-kvsvc-predicted-ttft-ms``, SLO_AWARE and TTFT) against the
engine's. The default compression, 5x, is one a 2-core machine keeps up with: at 20x the router
(relaying about 20k SSE events per wall second) and the engines fell behind, every wall-clock
stall was multiplied 20 times into the simulated queues, and runs of the same policy differed
by 3x in TTFT p90.

Engine capacities (defaults, stated in the report): a Qwen2.5-7B-class model (28 layers, 4 KV
heads of 128, bf16: 56 KiB of KV per token) on one 80 GB H100 per instance: Device 4096 blocks
of 128 tokens (512k tokens, 28 GiB of KV), Host 16384 blocks (2M tokens, 112 GiB of DRAM),
prefill ``5 ms + 50 us n + 0.4 ns n^2`` for ``n`` uncached tokens, Host loads 2 us/token (PCIe),
decode steps ``8 ms + 0.1 ms B + 0.02 us B (L - 1)`` (:class:`~kvsvc.testbed.sim.serving.ServingConfig`),
``max_num_seqs`` 64; the engines register the profiling data of that model (§12).

The routing section of the results file (``--results-file``, default ``bench/RESULTS.md``
relative to the current directory; between :data:`BEGIN` and :data:`END`) is replaced by the
report; the rest of the file is left alone (``python -m bench.run`` keeps this section);
``--no-write`` leaves it alone too. Each run's directory (under ``--log-dir``, else a temporary
one) gets the engines' and the service's logs and ``answers.jsonl`` (:func:`write_answers`).

Errors: :class:`~kvsvc.errors.ConfigError` for an unknown trace or a results file whose
directory does not exist (checked before anything starts), :class:`~kvsvc.errors.LifecycleError`
when etcd, an engine or the service does not start.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import logging
import os
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence, TextIO

import requests

from kvsvc.testbed.demo import DemoOptions, ServiceProcess, discovery_config, free_instance_port, free_port_run
from kvsvc.errors import ConfigError, KvsvcError, LifecycleError
from kvsvc.testbed.etcd_launcher import LocalEtcd
from kvsvc.testbed.sim.cli import add_latency_flags
from kvsvc.testbed.sim.serving import ServingConfig
from kvsvc.testbed.traces import TraceRequest, ideal_hit_ratio, load_trace, request_tokens
from kvsvc.routing.cache_audit import COMPLETENESS_PENDING
from kvsvc.testbed.tokenizer import build_tokenizer, single_token_words, text_of_tokens, write_tokenizer
from kvsvc.settings import add_flag, add_log_level

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_MISSED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

#: ``--results-file`` default, relative to the current directory (the repository root).
DEFAULT_RESULTS_FILE = Path("bench") / "RESULTS.md"
BEGIN = "<!-- routing:begin -->"
END = "<!-- routing:end -->"
#: The markers of the DP-rank section (runs with ``--dp`` above 1 write it instead, §15).
BEGIN_DP = "<!-- routing-dp:begin -->"
END_DP = "<!-- routing-dp:end -->"
#: Label suffix of a run with ``--dp_rank_routing false`` (§11's minimum over ranks).
MIN_RULE = " min-rank"
MODEL = "sim"

#: (policy flag, lambda or None) in report order.
POLICIES: tuple[tuple[str, Optional[float]], ...] = (("RR", None), ("CAR", 0.5),
                                                     ("SLO_AWARE", None), ("TTFT", None))
#: Policies without a lambda.
PLAIN_POLICIES = ("RR", "SLO_AWARE", "TTFT")
#: Default ``--load-levels``: the trace's own rate, and twice it.
LOAD_LEVELS = (1.0, 2.0)


#: The simulated engine's own latency-model defaults, which the bench's engines start with.
SIM_DEFAULTS = ServingConfig()


@dataclass(frozen=True)
class BenchOptions:
    """What the routing bench runs (see the module docstring for the capacities).

    :param traces: trace names or paths, each replayed once per policy.
    :param window_s: trace seconds replayed from the start (0: the whole trace).
    :param max_requests: at most this many requests per trace (0: no limit).
    :param time_scale: time compression factor (wall = simulated / time_scale).
    :param policies: ``(policy, lambda)`` pairs, lambda ``None`` for RR.
    :param engines: simulated engine instances (1 DP rank each).
    :param block_size: tokens per block (engines and service).
    :param device_blocks: Device pool per engine, blocks.
    :param host_blocks: Host pool per engine, blocks.
    :param prefill_us_per_token: see :class:`~kvsvc.testbed.sim.serving.ServingConfig`.
    :param host_load_us_per_token: see :class:`~kvsvc.testbed.sim.serving.ServingConfig`.
    :param decode_us_per_token: see :class:`~kvsvc.testbed.sim.serving.ServingConfig`.
    :param max_num_seqs: see :class:`~kvsvc.testbed.sim.serving.ServingConfig`.
    :param heartbeat_interval_s: engines' heartbeat period, simulated seconds.
    :param heartbeat_gap_s: engines also heartbeat when their waiting queue changes, at most
        once per this many simulated seconds (0: periodic heartbeats only).
    :param service_threads: gunicorn threads of the router (concurrent requests).
    :param client_threads: client threads sending requests (concurrent requests).
    :param request_timeout_s: client read timeout per request, wall seconds.
    :param etcd: etcd ``host:port``; empty starts a local one.
    :param ready_timeout_s: bound of the wait for the service and its streams, wall seconds.
    :param log_dir: directory keeping the service logs (empty: a temporary one, removed).
    :param arrivals: ``spread`` or ``trace`` (:func:`arrival_ms`).
    :param load_levels: arrival-rate multipliers, each a run per trace and policy (> 0).
    :param target_ttft_ms: ``--target_ttft`` of the service and the SLO attainment's bound,
        simulated ms.
    :param target_tpot_ms: ``--target_tpot`` of the service, simulated ms.
    :param prefill_base_us: see :class:`~kvsvc.testbed.sim.serving.ServingConfig`.
    :param prefill_us_per_token_sq: see :class:`~kvsvc.testbed.sim.serving.ServingConfig`.
    :param decode_us_per_seq: see :class:`~kvsvc.testbed.sim.serving.ServingConfig`.
    :param decode_us_per_context_token: see :class:`~kvsvc.testbed.sim.serving.ServingConfig`.
    :param stream: stream the answers (else non-streamed: the router hears only the end).
    :param stream_coalesce_ms: the engines' ``--stream-coalesce-ms``, wall ms.
    :param xllm: ``http``, or ``native``: the engines are xLLM engines with service routing
        (``kvsvc sim --native``, §13) and the router dispatches natively with a baidu_std
        port; the answers carry no ``sim_timing``, so TTFT and TPOT are the client's (wall
        times scaled to simulated ms: they include the router's own time).
    :param kv_events: the engines publish KV events; without, the router's discovery uses the
        approximate index (§14).
    :param flavor: the engines' ``--flavor`` (``vllm`` and ``sglang`` send no heartbeats: the
        service scrapes their ``/metrics``, §15, every heartbeat interval).
    :param dp: DP ranks per engine (``--dp``).
    :param prompts: ``tokens`` (token-id prompts) and/or ``text`` (the same prompts as text,
        :func:`~kvsvc.testbed.tokenizer.text_of_tokens`, tokenized by engines and router with
        the testbed's shared tokenizer), each a run per policy (issue 20: text within 5 points
        of the token-id hit).
    :param dp_rank_routing: the service's ``--dp_rank_routing`` values, each a run per policy
        (``(True, False)``: DP-rank routing against the minimum rule in the same bench).
    """

    traces: tuple[str, ...] = ("conversation", "synthetic")
    window_s: float = 600.0
    max_requests: int = 0
    time_scale: float = 5.0
    policies: tuple[tuple[str, Optional[float]], ...] = POLICIES
    engines: int = 8
    block_size: int = 128
    device_blocks: int = 4096
    host_blocks: int = 16384
    prefill_us_per_token: float = SIM_DEFAULTS.prefill_us_per_token
    host_load_us_per_token: float = SIM_DEFAULTS.host_load_us_per_token
    decode_us_per_token: float = SIM_DEFAULTS.decode_us_per_token
    max_num_seqs: int = SIM_DEFAULTS.max_num_seqs
    heartbeat_interval_s: float = 1.0
    heartbeat_gap_s: float = 0.0
    service_threads: int = 128
    client_threads: int = 128
    request_timeout_s: float = 120.0
    etcd: str = ""
    ready_timeout_s: float = 60.0
    log_dir: str = ""
    arrivals: str = "spread"
    load_levels: tuple[float, ...] = LOAD_LEVELS
    target_ttft_ms: float = 1000.0
    target_tpot_ms: float = 50.0
    prefill_base_us: float = SIM_DEFAULTS.prefill_base_us
    prefill_us_per_token_sq: float = SIM_DEFAULTS.prefill_us_per_token_sq
    decode_us_per_seq: float = SIM_DEFAULTS.decode_us_per_seq
    decode_us_per_context_token: float = SIM_DEFAULTS.decode_us_per_context_token
    stream: bool = True
    stream_coalesce_ms: float = 20.0
    xllm: str = "http"
    kv_events: bool = True
    flavor: str = "xllm"
    dp: int = 1
    dp_rank_routing: tuple[bool, ...] = (True,)
    prompts: tuple[str, ...] = ("tokens",)


#: Label suffix of a run whose prompts were text through the shared tokenizer.
TEXT_RUN = " text"


@dataclass
class RunResult:
    """Figures of one (trace, policy) run.

    :param trace: trace name.
    :param policy: ``RR`` or ``CAR λ=x``.
    :param requests: requests sent.
    :param failed: requests not answered 200 with usage (timeouts included).
    :param prompt_tokens: prompt tokens reported by the engines (answered requests).
    :param cached_tokens: cached tokens reported by the engines.
    :param ideal_ratio: infinite-cache token hit ratio of the same requests.
    :param ttft_ms: simulated TTFT of every answered request, ms, sorted.
    :param per_engine: answered requests per engine name (every engine listed).
    :param lag_ms: dispatch lag of every request, wall ms, sorted.
    :param wall_s: replay wall time, seconds (until the last answer).
    :param load: the arrival-rate multiplier of the run.
    :param tpot_ms: simulated TPOT of every answered request with >= 2 output tokens, sorted.
    :param target_ttft_ms: the SLO bound of :attr:`slo_attainment`, simulated ms.
    :param audit: the service's predicted-vs-actual counters at the end (:class:`AuditFigures`).
    :param misses: the client's explanation of the predictions off by more than one block
        (:func:`explain_misses`).
    :param head_ms: the router delay of every streamed answer
        (:meth:`Answer.router_delay_ms`), wall ms, sorted.
    :param ttft_error_ms: predicted minus actual TTFT of every answer the router predicted
        one for (SLO_AWARE, TTFT), simulated ms, sorted.
    """

    trace: str
    policy: str
    requests: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ideal_ratio: float = 0.0
    ttft_ms: list[float] = field(default_factory=list)
    per_engine: dict[str, int] = field(default_factory=dict)
    lag_ms: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    load: float = 1.0
    tpot_ms: list[float] = field(default_factory=list)
    target_ttft_ms: float = 1000.0
    audit: "AuditFigures" = field(default_factory=lambda: AuditFigures())
    misses: dict[str, float] = field(default_factory=dict)
    head_ms: list[float] = field(default_factory=list)
    ttft_error_ms: list[float] = field(default_factory=list)

    def ttft_abs_error(self, q: float) -> float:
        """Quantile ``q`` of ``|predicted - actual|`` TTFT, simulated ms (NaN when none)."""
        return _quantile(sorted(abs(e) for e in self.ttft_error_ms), q)

    @property
    def ttft_bias(self) -> float:
        """Median of predicted minus actual TTFT, simulated ms (NaN when none)."""
        return _quantile(self.ttft_error_ms, 0.5)

    @property
    def slo_attainment(self) -> float:
        """Share of the *sent* requests answered with TTFT <= ``target_ttft_ms`` (a failed
        request misses it); 0.0 when none was sent."""
        met = sum(1 for t in self.ttft_ms if t <= self.target_ttft_ms)
        return met / self.requests if self.requests else 0.0

    def tpot(self, q: float) -> float:
        """TPOT quantile ``q``, simulated ms (NaN when empty)."""
        return _quantile(self.tpot_ms, q)

    @property
    def hit_ratio(self) -> float:
        """``cached_tokens / prompt_tokens`` (0.0 when nothing was answered)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def of_ideal(self) -> float:
        """``hit_ratio / ideal_ratio`` (0.0 when the ideal is 0)."""
        return self.hit_ratio / self.ideal_ratio if self.ideal_ratio else 0.0

    @property
    def load_imbalance(self) -> float:
        """Max over mean of requests per engine (1.0 is perfectly even; 0.0 when none)."""
        counts = list(self.per_engine.values())
        mean = sum(counts) / len(counts) if counts else 0.0
        return max(counts) / mean if mean else 0.0

    def ttft(self, q: float) -> float:
        """TTFT quantile ``q`` in ``[0, 1]``, simulated ms (nearest rank; NaN when empty)."""
        return _quantile(self.ttft_ms, q)


@dataclass(frozen=True)
class AuditFigures:
    """Predicted vs actual cached tokens of one run, from the service's ``/metrics``
    (:mod:`kvsvc.routing.cache_audit`).

    :param audited: answers audited (the +Inf bucket of ``kvsvc_cache_prediction_diff_tokens``).
    :param within: the part within one block.
    :param abs_error_tokens: sum of ``|diff|``, tokens.
    :param exact_audited: answers predicted from synchronized exact streams.
    :param exact_within: the part of them within one block.
    :param causes: miss cause -> answers off by more than one block.
    :param unaudited: reason -> answers not audited.
    :param pending_audited: answers whose prediction counted pending blocks (§16), audited
        apart from the exact ones.
    """

    audited: int = 0
    within: int = 0
    abs_error_tokens: float = 0.0
    exact_audited: int = 0
    exact_within: int = 0
    causes: dict[str, int] = field(default_factory=dict)
    unaudited: dict[str, int] = field(default_factory=dict)
    pending_audited: int = 0

    @property
    def mae_tokens(self) -> float:
        """Mean absolute error, tokens (NaN when nothing was audited)."""
        return self.abs_error_tokens / self.audited if self.audited else float("nan")

    @property
    def within_share(self) -> float:
        """Share within one block (NaN when nothing was audited)."""
        return self.within / self.audited if self.audited else float("nan")

    @property
    def exact_within_share(self) -> float:
        """Share within one block on exact streams (NaN when none)."""
        return self.exact_within / self.exact_audited if self.exact_audited else float("nan")


def audit_figures(text: str) -> AuditFigures:
    """The :class:`AuditFigures` of one ``/metrics`` exposition of the service."""
    from prometheus_client.parser import text_string_to_metric_families

    audited = within = exact_audited = exact_within = pending_audited = 0
    abs_error = 0.0
    causes: dict[str, int] = {}
    unaudited: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for smp in family.samples:
            n = int(smp.value)
            if smp.name == "kvsvc_cache_predictions_total":
                audited += n
                within += n if smp.labels.get("outcome") == "within_block" else 0
            elif smp.name == "kvsvc_cache_predictions_exact_total":
                exact_audited += n
                exact_within += n if smp.labels.get("outcome") == "within_block" else 0
            elif smp.name == "kvsvc_cache_prediction_abs_error_tokens_total":
                abs_error = smp.value
            elif smp.name == "kvsvc_cache_prediction_misses_total":
                cause = smp.labels.get("cause", "")
                causes[cause] = causes.get(cause, 0) + n
            elif smp.name == "kvsvc_cache_predictions_unaudited_total":
                unaudited[smp.labels.get("reason", "")] = n
            elif (smp.name == "kvsvc_cache_predictions_by_backend_total"
                  and smp.labels.get("completeness") == COMPLETENESS_PENDING):
                pending_audited += n
    return AuditFigures(audited, within, abs_error, exact_audited, exact_within, causes,
                        unaudited, pending_audited)


def _quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, max(0, int(round(q * len(values) + 0.5)) - 1))]


def policy_label(policy: str, lam: Optional[float]) -> str:
    """``RR``, ``SLO_AWARE``, ``TTFT`` or ``CAR λ=0.5``."""
    return policy if lam is None else f"{policy} λ={lam:g}"


# ---- one run --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Answer:
    """One answered request as the bench client saw it.

    :param engine: the P that answered (``x-kvsvc-prefill``).
    :param prompt_tokens: the engine's ``prompt_tokens``.
    :param cached_tokens: the engine's ``cached_tokens``.
    :param ttft_ms: simulated TTFT, ms.
    :param tpot_ms: simulated TPOT, ms; ``None`` with one output token.
    :param predicted: the router's predicted cached tokens on ``engine``
        (``x-kvsvc-predicted-cached-tokens``), ``None`` when it predicted none (RR, SLO_AWARE).
    :param predicted_ttft_ms: the router's predicted TTFT on ``engine``
        (``x-kvsvc-predicted-ttft-ms``), ``None`` when it predicted none; *wall* ms, like the
        engines' profiling data (:func:`~kvsvc.testbed.sim.serving.profiling_data`).
    :param sent_at: ``time.monotonic()`` when the client sent it, seconds.
    :param head_at: ``time.monotonic()`` when the response head arrived, seconds: for a
        stream, with its first token (the engine's WSGI server sends the head with the first
        body bytes); for a non-streamed answer ``sent_at``.
    """

    engine: str
    prompt_tokens: int
    cached_tokens: int
    ttft_ms: float
    tpot_ms: Optional[float]
    predicted: Optional[int]
    sent_at: float
    head_at: float
    predicted_ttft_ms: Optional[float] = None

    def prefilled_at(self, time_scale: float) -> float:
        """``time.monotonic()`` seconds when the engine finished its prefill (about): a
        stream's head came with its first token; otherwise the send plus the TTFT."""
        if self.head_at > self.sent_at:
            return self.head_at
        return self.sent_at + self.ttft_ms / 1000.0 / time_scale

    def router_delay_ms(self, time_scale: float) -> Optional[float]:
        """A stream's wall ms from the client's send to its first token, less the engine's
        own TTFT: the router's decision, forwarding and relay, and the transport (``None``
        for a non-streamed answer)."""
        if self.head_at <= self.sent_at:
            return None
        return (self.head_at - self.sent_at) * 1000.0 - self.ttft_ms / time_scale


#: Wall seconds within which an earlier request's prefill may end after a later one was routed
#: and still explain the later one's extra cached tokens (event publish + index apply).
INDEX_LAG_S = 0.05
MISS_CONCURRENT = "prefix prefilled by an earlier request after routing"
MISS_LAG = "prefix prefilled before routing (index lag)"
MISS_EVICTED = "engine reused fewer (evicted or replaced)"
MISS_UNEXPLAINED = "unexplained"


def common_prefix_tokens(a: TraceRequest, b: TraceRequest) -> int:
    """Tokens of the prompt prefix ``a`` and ``b`` share (equal leading trace hash ids)."""
    k = 0
    for x, y in zip(a.hash_ids, b.hash_ids):
        if x != y:
            break
        k += 1
    return min(k * 512, a.input_length, b.input_length)


def explain_misses(reqs: Sequence[TraceRequest], answers: Sequence[Optional[Answer]],
                   block_size: int, time_scale: float) -> dict[str, float]:
    """The client-side explanation of every prediction off by more than one block: ``{why:
    count}`` over :data:`MISS_CONCURRENT` (the engine reported more because another request
    sharing at least that prefix, answered by the same engine, finished its prefill before
    this one's but less than :data:`INDEX_LAG_S` before this one was sent, or after: the
    blocks did not exist, or were not yet indexed, when this one was routed; on a loaded
    machine a request sent later can reach the engine first), :data:`MISS_LAG` (such a request
    finished its prefill earlier still, before this one was sent: the engine had the blocks
    but the router's index had not applied their events when it routed this one; the largest
    such gap is returned under ``"max lag s"``), :data:`MISS_EVICTED` (the engine reported
    less) and :data:`MISS_UNEXPLAINED` (none of these: a bug to find).

    :param time_scale: the engines' time compression (simulated ms -> wall s).
    """
    out: dict[str, float] = {}
    by_engine: dict[str, list[int]] = collections.defaultdict(list)
    for i, a in enumerate(answers):
        if a is not None:
            by_engine[a.engine].append(i)
    for j, a in enumerate(answers):
        if a is None or a.predicted is None or abs(a.cached_tokens - a.predicted) <= block_size:
            continue
        if a.cached_tokens < a.predicted:
            why = MISS_EVICTED
        else:
            why = MISS_UNEXPLAINED
            lag = 0.0
            for i in by_engine[a.engine]:
                b = answers[i]
                assert b is not None
                if i == j:
                    continue
                prefilled = b.prefilled_at(time_scale)
                if (prefilled > a.prefilled_at(time_scale)
                        or common_prefix_tokens(reqs[i], reqs[j]) < a.cached_tokens - block_size):
                    continue
                if prefilled >= a.sent_at - INDEX_LAG_S:
                    why = MISS_CONCURRENT
                    break
                # The most recent such prefill bounds the lag from below.
                gap = a.sent_at - prefilled
                lag = gap if why != MISS_LAG else min(lag, gap)
                why = MISS_LAG
            if why == MISS_LAG:
                out["max lag s"] = max(out.get("max lag s", 0.0), round(lag, 2))
        out[why] = out.get(why, 0.0) + 1
    return out


class _Client:
    """Sends the replayed requests from a bounded thread pool, one ``requests.Session`` per
    thread (sessions are not thread-safe), all closed by :meth:`close`."""

    def __init__(self, base_url: str, threads: int, timeout_s: float,
                 client_timing_scale: Optional[float] = None) -> None:
        # Native xLLM answers carry no sim_timing: time them here, scaled to simulated ms.
        self._client_scale = client_timing_scale
        self._url = base_url + "/v1/completions"
        self._timeout_s = timeout_s
        self._local = threading.local()
        self._sessions: list[requests.Session] = []
        self._lock = threading.Lock()
        self.pool = concurrent.futures.ThreadPoolExecutor(threads, "bench-client")

    def _session(self) -> requests.Session:
        s = getattr(self._local, "session", None)
        if s is None:
            s = requests.Session()
            s.trust_env = False
            self._local.session = s
            with self._lock:
                self._sessions.append(s)
        return s

    def send(self, body: bytes) -> Optional[Answer]:
        """POST one body; its :class:`Answer`, or ``None`` when it failed. Streamed answers
        are read to their end; their usage chunk carries the engine's ``sim_timing``."""
        sent = time.monotonic()
        try:
            r = self._session().post(self._url, data=body, timeout=(5.0, self._timeout_s),
                                     # A fresh connection per request: reusing one that
                                     # gunicorn's keep-alive timer is closing races (reset).
                                     headers={"Content-Type": "application/json",
                                              "Connection": "close"}, stream=True)
            head_at = time.monotonic()
            if r.status_code != 200:
                log.warning("bench: request answered %d: %s", r.status_code, r.text[:200])
                return None
            stream = r.headers.get("Content-Type", "").startswith("text/event-stream")
            if stream and self._client_scale is not None:
                first_at: Optional[float] = None
                parts = []
                for chunk in r.iter_content(None):
                    if first_at is None and b'"choices":[{' in chunk:
                        first_at = time.monotonic()
                    parts.append(chunk)
                end_at = time.monotonic()
                usage = _last_usage_event(b"".join(parts))["usage"]
                first_at = first_at if first_at is not None else end_at
                ttft = (first_at - sent) * 1000.0 * self._client_scale
                n = int(usage["completion_tokens"])
                tpot = ((end_at - first_at) * 1000.0 * self._client_scale / (n - 1)
                        if n >= 2 else 0.0)
            elif stream:
                doc = _last_usage_event(r.content)
                usage, timing = doc["usage"], doc["sim_timing"]
                ttft, tpot = float(timing["ttft_ms"]), float(timing["tpot_ms"])
            elif self._client_scale is not None:
                usage = r.json()["usage"]
                ttft = (time.monotonic() - sent) * 1000.0 * self._client_scale
                tpot = 0.0
            else:
                usage = r.json()["usage"]
                ttft, tpot = float(r.headers["x-sim-ttft-ms"]), float(r.headers["x-sim-tpot-ms"])
            predicted = r.headers.get("x-kvsvc-predicted-cached-tokens")
            return Answer(r.headers["x-kvsvc-prefill"], int(usage["prompt_tokens"]),
                          int(usage["prompt_tokens_details"]["cached_tokens"]), ttft,
                          tpot if int(usage["completion_tokens"]) >= 2 else None,
                          int(predicted) if predicted is not None else None, sent,
                          head_at if stream else sent,
                          float(pttft) if (pttft := r.headers.get(
                              "x-kvsvc-predicted-ttft-ms")) is not None else None)
        except (requests.RequestException, ValueError, KeyError, TypeError) as exc:
            log.warning("bench: request failed: %s", exc)
            return None

    def close(self) -> None:
        """Wait for the requests in flight (each bounded by its timeout), close sessions."""
        self.pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            for s in self._sessions:
                s.close()
            self._sessions.clear()


def _last_usage_event(body: bytes) -> dict:
    """The last SSE event of ``body`` carrying ``usage`` (the stream's usage chunk).

    :raises ValueError: there is none (the stream was cut or the engine sent no usage).
    """
    end = len(body)
    while True:
        start = body.rfind(b"data: ", 0, end)
        if start < 0:
            raise ValueError("stream without a usage chunk")
        line = body[start + 6:end].strip()
        end = start
        if line.startswith(b"{") and b'"usage"' in line:
            doc = json.loads(line)
            if isinstance(doc, dict) and isinstance(doc.get("usage"), dict):
                return doc


def _select(trace: list[TraceRequest], opts: BenchOptions) -> list[TraceRequest]:
    out = [r for r in trace if opts.window_s <= 0 or r.timestamp_ms < opts.window_s * 1000]
    return out[:opts.max_requests] if opts.max_requests > 0 else out


def _bodies(reqs: Sequence[TraceRequest], block_size: int, stream: bool = True,
            words: Optional[list[str]] = None) -> list[bytes]:
    """Request bodies; with ``words`` the prompts are text (:func:`text_of_tokens`)."""
    extra: dict = ({"stream": True, "stream_options": {"include_usage": True}} if stream
                   else {})
    return [json.dumps({"model": MODEL, "prompt": request_tokens(r, block_size) if words is None
                        else text_of_tokens(request_tokens(r, block_size), words),
                        "max_tokens": max(1, r.output_length), **extra},
                       separators=(",", ":")).encode()
            for r in reqs]


class EngineProcesses:
    """``engines`` simulated engines, each a ``kvsvc sim --serve --etcd`` child process (its own
    interpreter: the engines' work never competes with the client for one GIL), registered in
    etcd and heartbeating to the master. Output goes to ``log_dir/sim-<i>.log``.

    :param opts: capacities and latency model.
    :param etcd_addr: the registry's etcd.
    :param token: the service's internal token (heartbeats), passed in the environment.
    :param log_dir: where the logs go.
    """

    def __init__(self, opts: BenchOptions, etcd_addr: str, token: str, log_dir: Path,
                 event_port_offset: int, replay_port_offset: int,
                 tokenizer_path: Optional[Path] = None) -> None:
        self._opts = opts
        self._tokenizer_path = tokenizer_path
        self._etcd_addr = etcd_addr
        self._token = token
        self._log_dir = log_dir
        self._offsets = (event_port_offset, replay_port_offset)
        self.names: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._logs: list[TextIO] = []

    def start(self, timeout_s: float) -> None:
        """Start every engine; return once each answers ``GET /health``.

        :raises LifecycleError: an engine exited or did not answer within ``timeout_s``.
        """
        o = self._opts
        taken: set[int] = set()
        env = dict(os.environ)
        env["KVSVC_INTERNAL_API_TOKEN"] = self._token
        for i in range(o.engines):
            port = free_instance_port(o.dp, *self._offsets, avoid=taken)
            taken.update({port, *(port + off + r for off in self._offsets
                                  for r in range(o.dp))})
            self.names.append(f"127.0.0.1:{port}")
            argv = [sys.executable, "-m", "kvsvc", "sim", "--serve", "--host", "127.0.0.1",
                    "--port", str(port), "--etcd", self._etcd_addr,
                    "--event-port-offset", str(self._offsets[0]),
                    "--replay-port-offset", str(self._offsets[1]),
                    "--block-size", str(o.block_size), "--device-blocks", str(o.device_blocks),
                    "--host-blocks", str(o.host_blocks),
                    "--prefill-us-per-token", repr(o.prefill_us_per_token),
                    "--host-load-us-per-token", repr(o.host_load_us_per_token),
                    "--decode-us-per-token", repr(o.decode_us_per_token),
                    "--prefill-base-us", repr(o.prefill_base_us),
                    "--prefill-us-per-token-sq", repr(o.prefill_us_per_token_sq),
                    "--decode-us-per-seq", repr(o.decode_us_per_seq),
                    "--decode-us-per-context-token", repr(o.decode_us_per_context_token),
                    "--stream-coalesce-ms", repr(o.stream_coalesce_ms),
                    "--max-num-seqs", str(o.max_num_seqs), "--time-scale", repr(o.time_scale),
                    "--max-connections", str(max(256, 2 * o.client_threads)),
                    "--flavor", o.flavor, "--dp", str(o.dp),
                    "--model", MODEL, "--heartbeat-interval-s",
                    repr(max(0.02, o.heartbeat_interval_s / o.time_scale)),
                    "--heartbeat-on-change-ms", repr(1000.0 * o.heartbeat_gap_s / o.time_scale),
                    "--master-refresh-s", "1.0",
                    "--log-level", "warning"]
            if o.xllm == "native":
                argv.append("--native")
            if not o.kv_events:
                argv += ["--kv-events", "off"]
            if self._tokenizer_path is not None:
                argv += ["--tokenizer-path", str(self._tokenizer_path)]
            log_file = open(self._log_dir / f"sim-{i}.log", "w", encoding="utf-8")
            self._logs.append(log_file)
            self._procs.append(subprocess.Popen(argv, env=env, stdout=log_file,
                                                stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL))
        deadline = time.monotonic() + timeout_s
        with requests.Session() as http:
            http.trust_env = False
            for i, (name, proc) in enumerate(zip(self.names, self._procs)):
                while True:
                    if proc.poll() is not None:
                        raise LifecycleError(f"engine {name} exited with {proc.returncode}: "
                                             f"{self._tail(i)}")
                    try:
                        if http.get(f"http://{name}/health", timeout=1.0).status_code == 200:
                            break
                    except requests.RequestException:
                        pass
                    if time.monotonic() >= deadline:
                        raise LifecycleError(f"engine {name} not serving within "
                                             f"{timeout_s:.0f} s: {self._tail(i)}")
                    time.sleep(0.05)  # polling a child process: bounded by the deadline

    def _tail(self, i: int) -> str:
        try:
            return (self._log_dir / f"sim-{i}.log").read_text(encoding="utf-8")[-2000:]
        except OSError:
            return "(no log)"

    def close(self, timeout_s: float = 10.0) -> None:
        """SIGINT every engine (a clean stop revokes its lease), wait, SIGKILL stragglers."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + timeout_s
        for proc in self._procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("bench: engine pid %d did not stop; killing it", proc.pid)
                proc.kill()
                proc.wait(5.0)
        self._procs.clear()
        for f in self._logs:
            f.close()
        self._logs.clear()


def run_one(opts: BenchOptions, trace_name: str, reqs: Sequence[TraceRequest],
            bodies: Sequence[bytes], policy: str, lam: Optional[float], etcd_addr: str,
            tmp: Path, load: float = 1.0, dp_rank_routing: bool = True,
            tokenizer_path: Optional[Path] = None) -> RunResult:
    """One replay of ``reqs`` at ``load`` times their arrival rate with fresh engines and a
    fresh service running ``policy``.

    :raises LifecycleError: an engine or the service did not start.
    """
    result = RunResult(trace_name, policy_label(policy, lam)
                       + ("" if dp_rank_routing else MIN_RULE)
                       + ("" if tokenizer_path is None else TEXT_RUN),
                       ideal_ratio=ideal_hit_ratio(reqs).token_ratio, load=load,
                       target_ttft_ms=opts.target_ttft_ms)
    token = secrets.token_hex(16)
    demo_opts = DemoOptions(block_size=opts.block_size, refresh_interval_ms=200,
                            resync_interval_ms=5000, flavor=opts.flavor)
    label = ((f"{policy}_{lam}" if lam is not None else policy) + f"_x{load:g}"
             + ("" if dp_rank_routing else "_min") + ("" if tokenizer_path is None else "_text"))
    run_dir = tmp / label
    run_dir.mkdir(parents=True, exist_ok=True)
    engines = EngineProcesses(opts, etcd_addr, token, run_dir, demo_opts.event_port_offset,
                              demo_opts.replay_port_offset, tokenizer_path)
    service: Optional[ServiceProcess] = None
    client: Optional[_Client] = None
    try:
        engines.start(opts.ready_timeout_s)
        cfg = run_dir / "kv_events.json"
        doc = discovery_config(demo_opts)
        if not opts.kv_events:
            doc["discovery"]["backends"] = []
            doc["discovery"]["approximate_backends"] = ["xllm"]
        cfg.write_text(json.dumps(doc), encoding="utf-8")
        args = ["--load_balance_policy", policy, "--model", MODEL,
                # The service's targets are whole ms (its settings table).
                "--target_ttft", str(wall_ms(opts.target_ttft_ms, opts.time_scale)),
                "--target_tpot", str(wall_ms(opts.target_tpot_ms, opts.time_scale))]
        if lam is not None:
            args += ["--car_prefill_lambda", repr(lam)]
        # §15: vLLM/SGLang engines send no heartbeat; their /metrics is read as often as the
        # xLLM ones heartbeat.
        args += ["--dp_rank_routing", "true" if dp_rank_routing else "false",
                 "--load_scrape_interval_ms",
                 str(max(50, round(1000.0 * opts.heartbeat_interval_s / opts.time_scale)))]
        if tokenizer_path is not None:
            args += ["--tokenizer_path", str(tokenizer_path)]
        if opts.xllm == "native":
            args += ["--xllm_dispatch", "native", "--rpc_port", str(free_port_run(1)),
                     "--rpc_host", "127.0.0.1"]
        service = ServiceProcess(cfg, free_port_run(1), token, run_dir / "service.log",
                                 etcd_addr=etcd_addr, extra_args=args,
                                 extra_env={"GUNICORN_CMD_ARGS": f"--threads {opts.service_threads}"})
        service.start(opts.ready_timeout_s,
                      {(name, r) for name in engines.names for r in range(opts.dp)}
                      if opts.kv_events else None)
        service.wait_routable(set(engines.names), opts.ready_timeout_s)
        client = _Client(service.base_url, opts.client_threads, opts.request_timeout_s,
                         opts.time_scale if opts.xllm == "native" else None)
        result.per_engine = {name: 0 for name in engines.names}
        futures = _replay(client, reqs, bodies, opts.time_scale * load, result, opts.arrivals)
        answers: list[Optional[Answer]] = []
        for fut in futures:
            got = fut.result()
            answers.append(got)
            if got is None:
                result.failed += 1
                continue
            result.per_engine[got.engine] = result.per_engine.get(got.engine, 0) + 1
            result.prompt_tokens += got.prompt_tokens
            result.cached_tokens += got.cached_tokens
            result.ttft_ms.append(got.ttft_ms)
            if got.predicted_ttft_ms is not None:
                result.ttft_error_ms.append(got.predicted_ttft_ms * opts.time_scale
                                            - got.ttft_ms)
            if got.tpot_ms is not None:
                result.tpot_ms.append(got.tpot_ms)
        result.misses = explain_misses(reqs, answers, opts.block_size, opts.time_scale)
        result.head_ms = sorted(d for a in answers
                                if a is not None
                                and (d := a.router_delay_ms(opts.time_scale)) is not None)
        result.wall_s = time.monotonic() - result.wall_s
        result.ttft_ms.sort()
        result.ttft_error_ms.sort()
        result.tpot_ms.sort()
        write_answers(run_dir / "answers.jsonl", reqs, answers)
        result.lag_ms.sort()
        try:
            # Every answer ended before its client returned: the audit has heard it.
            result.audit = audit_figures(service.session.get(service.base_url + "/metrics",
                                                             timeout=10.0).text)
        except (requests.RequestException, ValueError) as exc:
            log.warning("bench: could not scrape the service's metrics: %s", exc)
    finally:
        try:
            if client is not None:
                client.close()
        finally:
            try:
                if service is not None:
                    service.close()
            finally:
                engines.close()
    return result


def wall_ms(simulated_ms: float, time_scale: float) -> int:
    """A service target (whole ms, >= 1) for ``simulated_ms`` on engines compressed by
    ``time_scale``: the service times them on the wall clock, as their profiling data is."""
    return max(1, round(simulated_ms / time_scale))


def write_answers(path: Path, reqs: Sequence[TraceRequest],
                  answers: Sequence[Optional[Answer]]) -> None:
    """One JSON line per request, in trace order: its trace timestamp and input length, and
    what the client saw (:class:`Answer` fields; ``null`` for a failed request), for reading a
    run afterwards. Units as in :class:`Answer`: ``ttft_ms`` / ``tpot_ms`` simulated ms,
    ``predicted_ttft_ms`` wall ms (multiply by the compression to compare), ``sent_at`` /
    ``head_at`` the client's ``time.monotonic()`` seconds."""
    with path.open("w", encoding="utf-8") as f:
        for req, got in zip(reqs, answers):
            row: dict = {"timestamp_ms": req.timestamp_ms, "input_length": req.input_length}
            row["answer"] = asdict(got) if got is not None else None
            f.write(json.dumps(row) + "\n")


def arrival_ms(reqs: Sequence[TraceRequest], mode: str = "spread") -> list[float]:
    """Arrival time of each request, trace ms from the first one.

    ``trace``: the timestamps as recorded. ``spread``: the requests sharing a timestamp are
    spread evenly over the gap to the next distinct timestamp (the last group over the median
    gap), in trace order. The conversation trace is recorded in 3-second buckets (1180
    distinct timestamps for 12031 requests, up to 28 at one instant): replayed as is, each
    bucket arrives as one burst that every policy must route on the same load report.

    :raises ValueError: unknown ``mode``.
    """
    if mode not in ("trace", "spread"):
        raise ValueError(f"unknown arrival mode {mode!r} (trace or spread)")
    if not reqs:
        return []
    base = reqs[0].timestamp_ms
    if mode == "trace":
        return [float(r.timestamp_ms - base) for r in reqs]
    stamps = sorted({r.timestamp_ms for r in reqs})
    gaps = sorted(b - a for a, b in zip(stamps, stamps[1:])) or [0]
    nxt = {a: b for a, b in zip(stamps, stamps[1:])}
    groups: dict[int, list[int]] = collections.defaultdict(list)
    for i, r in enumerate(reqs):
        groups[r.timestamp_ms].append(i)
    out = [0.0] * len(reqs)
    for ts, idx in groups.items():
        width = nxt.get(ts, ts + gaps[len(gaps) // 2]) - ts
        for k, i in enumerate(idx):
            out[i] = ts - base + k * width / len(idx)
    return out


def _replay(client: _Client, reqs: Sequence[TraceRequest], bodies: Sequence[bytes],
            time_scale: float, result: RunResult, arrivals: str = "spread"
            ) -> list[concurrent.futures.Future]:
    """Submit every request at its compressed arrival time (:func:`arrival_ms` divided by
    ``time_scale``, which includes the load level); returns the futures in trace order."""
    futures = []
    t0 = time.monotonic()
    result.wall_s = t0
    at = arrival_ms(reqs, arrivals)
    order = sorted(range(len(reqs)), key=lambda i: (at[i], i))
    by_index: dict[int, concurrent.futures.Future] = {}
    for i in order:
        body = bodies[i]
        due = t0 + at[i] / 1000.0 / time_scale
        delay = due - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # the trace's own pacing
        result.lag_ms.append(max(0.0, time.monotonic() - due) * 1000.0)
        by_index[i] = client.pool.submit(client.send, body)
    futures = [by_index[i] for i in range(len(reqs))]
    result.requests = len(futures)
    return futures


# ---- the whole bench ------------------------------------------------------------------------

def run_bench(opts: BenchOptions, out: Optional[TextIO] = None) -> list[RunResult]:
    """Every trace x policy run (see the module docstring); prints progress and the tables.

    :raises ConfigError: unknown trace.
    :raises LifecycleError: etcd, an engine or the service did not start.
    :raises ValueError: bad options.
    """
    out = out or sys.stdout
    if opts.engines < 1 or opts.time_scale <= 0 or not opts.load_levels \
            or min(opts.load_levels) <= 0 or opts.dp < 1 or not opts.dp_rank_routing:
        raise ValueError("engines and dp must be >= 1, time_scale > 0, every load level > 0 "
                         "and at least one --dp-rank-routing value")
    selected = {name: _select(load_trace(name), opts) for name in opts.traces}
    results: list[RunResult] = []
    etcd: Optional[LocalEtcd] = None
    with tempfile.TemporaryDirectory(prefix="kvsvc-bench-routing-") as tmp:
        try:
            etcd_addr = opts.etcd
            if not etcd_addr:
                etcd = LocalEtcd(name="kvsvc-bench-routing")
                etcd.start()
                etcd_addr = etcd.addr
            tokenizer_dir = write_tokenizer(Path(tmp) / "tokenizer")
            words = single_token_words(build_tokenizer())
            for name, reqs in selected.items():
                by_prompts = {kind: _bodies(reqs, opts.block_size, opts.stream,
                                            words if kind == "text" else None)
                              for kind in opts.prompts}
                print(f"bench-routing: {name}: {len(reqs)} requests "
                      f"({(reqs[-1].timestamp_ms - reqs[0].timestamp_ms) / 1000:.0f} trace s) "
                      f"at {opts.time_scale:g}x", file=out, flush=True)
                for load in opts.load_levels:
                    for (policy, lam), by_rank, kind in ((p, d, k) for p in opts.policies
                                                         for d in opts.dp_rank_routing
                                                         for k in opts.prompts):
                        logs = Path(opts.log_dir) / name if opts.log_dir else Path(tmp)
                        logs.mkdir(parents=True, exist_ok=True)
                        r = run_one(opts, name, reqs, by_prompts[kind], policy, lam, etcd_addr,
                                    logs, load, by_rank,
                                    tokenizer_dir if kind == "text" else None)
                        results.append(r)
                        print(f"  x{load:g} {r.policy:<18} hit {100 * r.hit_ratio:5.1f}% "
                              f"({100 * r.of_ideal:5.1f}% of ideal), TTFT p50/p90/p99 "
                              f"{r.ttft(0.5):.0f}/{r.ttft(0.9):.0f}/{r.ttft(0.99):.0f} ms, "
                              f"SLO {100 * r.slo_attainment:.1f}%, TPOT p90 "
                              f"{r.tpot(0.9):.1f} ms, pred MAE "
                              f"{r.audit.mae_tokens:.0f} tok within-block "
                              f"{100 * r.audit.within_share:.1f}% (exact "
                              f"{100 * r.audit.exact_within_share:.1f}%), max/mean "
                              f"{r.load_imbalance:.2f}, failed {r.failed}, {r.wall_s:.0f} s",
                              file=out, flush=True)
        finally:
            if etcd is not None:
                etcd.cleanup()
    return results


def targets(results: Sequence[RunResult], trace: str = "conversation") -> list[tuple[str, bool]]:
    """The issues' targets: ``(description, met)``, each measured only when its runs exist.

    Issue 14 on ``trace`` at the lowest load level: TTFT's p90 <= 0.7 x CAR λ=0.5's and
    <= 0.5 x RR's, its p50 below both, its hit >= 85% of the ideal, its max/mean load <= 1.5;
    at the highest level (when there are two): TTFT's SLO attainment >= CAR λ=0.5's + 10
    points, and RR's below 80% (the level is high enough to matter); over every run of every
    trace: the answers predicted from synchronized exact streams within one block >= 99%.
    Issue 5 on the lowest level: CAR λ=0.5's hit >= 80% of the ideal and >= 2x RR's, max/mean
    <= 1.5, TTFT p90 below RR's. Issue 20 (DP runs with ``--dp-rank-routing both``): each
    policy's hit with DP-rank routing >= 85% of the ideal, beside the minimum rule's figure of
    the same bench. Always: no failed request.
    """
    out: list[tuple[str, bool]] = []
    mine = [r for r in results if r.trace == trace]
    if mine:
        low, high = min(r.load for r in mine), max(r.load for r in mine)
        by = {(r.load, r.policy): r for r in mine}
        car, rr, tt = (by.get((low, policy_label("CAR", 0.5))), by.get((low, "RR")),
                       by.get((low, "TTFT")))
        if tt is not None and car is not None and rr is not None:
            out += [
                (f"TTFT p90 <= 0.7x CAR λ=0.5's ({tt.ttft(0.9):.0f} vs "
                 f"{0.7 * car.ttft(0.9):.0f} ms)", tt.ttft(0.9) <= 0.7 * car.ttft(0.9)),
                (f"TTFT p90 <= 0.5x RR's ({tt.ttft(0.9):.0f} vs {0.5 * rr.ttft(0.9):.0f} ms)",
                 tt.ttft(0.9) <= 0.5 * rr.ttft(0.9)),
                (f"TTFT p50 below CAR λ=0.5's and RR's ({tt.ttft(0.5):.0f} vs "
                 f"{car.ttft(0.5):.0f} and {rr.ttft(0.5):.0f} ms)",
                 tt.ttft(0.5) < min(car.ttft(0.5), rr.ttft(0.5))),
                (f"TTFT hit >= 85% of ideal ({100 * tt.of_ideal:.1f}%)", tt.of_ideal >= 0.85),
                (f"TTFT max/mean load <= 1.5 ({tt.load_imbalance:.2f})",
                 tt.load_imbalance <= 1.5),
            ]
        car_h, rr_h, tt_h = (by.get((high, policy_label("CAR", 0.5))), by.get((high, "RR")),
                             by.get((high, "TTFT")))
        if high > low and tt_h is not None and car_h is not None:
            out.append((f"TTFT SLO attainment at x{high:g} >= CAR λ=0.5's + 10 points "
                        f"({100 * tt_h.slo_attainment:.1f}% vs "
                        f"{100 * car_h.slo_attainment:.1f}%)",
                        tt_h.slo_attainment >= car_h.slo_attainment + 0.10))
        if high > low and rr_h is not None:
            out.append((f"RR SLO attainment at x{high:g} below 80% (the high level is high "
                        f"enough: {100 * rr_h.slo_attainment:.1f}%)",
                        rr_h.slo_attainment < 0.80))
        if car is not None and rr is not None:
            out += [
                (f"CAR hit >= 80% of ideal ({100 * car.of_ideal:.1f}%)", car.of_ideal >= 0.8),
                (f"CAR hit >= 2x RR ({car.hit_ratio / rr.hit_ratio if rr.hit_ratio else float('inf'):.2f}x)",
                 car.hit_ratio >= 2 * rr.hit_ratio),
                (f"CAR max/mean load <= 1.5 ({car.load_imbalance:.2f})",
                 car.load_imbalance <= 1.5),
                (f"CAR TTFT p90 < RR ({car.ttft(0.9):.0f} vs {rr.ttft(0.9):.0f} ms)",
                 car.ttft(0.9) < rr.ttft(0.9)),
            ]
    mins = {(r.trace, r.load, r.policy[:-len(MIN_RULE)]): r for r in results
             if r.policy.endswith(MIN_RULE)}
    for r in results:
        floor = mins.get((r.trace, r.load, r.policy))
        if floor is not None and r.trace == trace:
            out.append((f"{r.policy} x{r.load:g}: hit with DP-rank routing >= 85% of ideal "
                        f"({100 * r.of_ideal:.1f}%; the minimum rule's in the same bench "
                        f"{100 * floor.of_ideal:.1f}%)", r.of_ideal >= 0.85))
    exact = sum(r.audit.exact_audited for r in results)
    if exact:
        within = sum(r.audit.exact_within for r in results)
        out.append((f"predicted vs actual within one block on synchronized exact streams "
                    f">= 99% ({within} of {exact}, {100 * within / exact:.2f}%)",
                    within >= 0.99 * exact))
    if results:
        out.append(("no failed request", all(r.failed == 0 for r in results)))
    return out


def _pct(x: float) -> str:
    return "-" if x != x else f"{100 * x:.1f}%"  # NaN: nothing measured


def report(results: Sequence[RunResult], opts: BenchOptions, command: str = "") -> str:
    """The Markdown routing section (without the markers); ``command`` is the command line
    that produced it."""
    lines = ["## Routing (issues 5 and 14): `kvsvc bench-routing`" if opts.dp <= 1 else
             f"## DP={opts.dp} routing (issue 20, §15): `kvsvc bench-routing --dp {opts.dp}`",
             ""]
    if command:
        lines += [f"Command: `{command}`", ""]
    lines += [
        f"{opts.engines} simulated {opts.flavor} engines ({opts.dp} DP rank"
        f"{'s' if opts.dp > 1 else ''} each"
        + (", load scraped from their /metrics, no heartbeat; runs marked"
           f" `{MIN_RULE.strip()}` route with `--dp_rank_routing false`, §11's minimum over"
           " ranks" if opts.flavor != "xllm" or opts.dp > 1 else "")
        + f"): Device {opts.device_blocks} "
        f"blocks of {opts.block_size} tokens, Host {opts.host_blocks} blocks, prefill "
        f"{opts.prefill_base_us / 1000:g} ms + {opts.prefill_us_per_token:g} us n + "
        f"{opts.prefill_us_per_token_sq * 1000:g} ns n^2 for n uncached tokens, Host load "
        f"{opts.host_load_us_per_token:g} us/token, decode steps "
        f"{opts.decode_us_per_token / 1000:g} ms + {opts.decode_us_per_seq / 1000:g} ms B + "
        f"{opts.decode_us_per_context_token:g} us B (L - 1), max_num_seqs "
        f"{opts.max_num_seqs}, heartbeat every {opts.heartbeat_interval_s:g} simulated s; the "
        "engines register the profiling data of that model (§12). Real `kvsvc serve` under "
        f"gunicorn ({opts.service_threads} threads), discovery on etcd, `--target_ttft "
        f"{wall_ms(opts.target_ttft_ms, opts.time_scale)}` `--target_tpot "
        f"{wall_ms(opts.target_tpot_ms, opts.time_scale)}` (wall ms: "
        f"{opts.target_ttft_ms:g} and {opts.target_tpot_ms:g} simulated ms; the engines "
        "register wall-clock profiling data); the first "
        f"{opts.window_s:g} trace seconds of each trace replayed at {opts.time_scale:g}x "
        f"time compression with token-id prompts, "
        + ("streamed with usage, " if opts.stream else "non-streamed, ")
        + f"arrivals `{opts.arrivals}`, at "
        + " and ".join(f"x{x:g}" for x in opts.load_levels)
        + " the trace's arrival rate"
        + (f", early heartbeats on queue changes (gap {opts.heartbeat_gap_s:g} simulated s)"
           if opts.heartbeat_gap_s > 0 else "")
        + ". Hit = cached/prompt tokens reported by the engines; ideal = infinite cache "
        "shared by all (same requests); TTFT and TPOT in simulated ms (TTFT: engine queue + "
        f"prefill); SLO = share of requests with TTFT <= {opts.target_ttft_ms:g} ms; pred = "
        "the router's predicted cached tokens for the chosen P against the engine's "
        "(mean absolute error in tokens; share within one block, of all audited answers and "
        "of those predicted from synchronized exact streams; RR predicts nothing); TTFT "
        "err = the router's predicted TTFT for the chosen P against the engine's (median of "
        "predicted - actual, and p50/p90 of its absolute value, simulated ms; SLO_AWARE and "
        "TTFT only).", "",
        "| trace | load | policy | requests | failed | hit | % of ideal | TTFT p50 | p90 | "
        "p99 | SLO | TPOT p90 | pred MAE | pred within 1 block (exact) | TTFT err median "
        "(abs p50/p90) | max/mean load | client lag p99 (wall ms) | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        a = r.audit
        pred = "-" if not a.audited else (f"{_pct(a.within_share)} "
                                          f"({_pct(a.exact_within_share)})")
        mae = "-" if not a.audited else f"{a.mae_tokens:.0f}"
        terr = ("-" if not r.ttft_error_ms else f"{round(r.ttft_bias):+d} "
                f"({r.ttft_abs_error(0.5):.0f}/{r.ttft_abs_error(0.9):.0f})")
        lines.append(f"| {r.trace} | x{r.load:g} | {r.policy} | {r.requests} | {r.failed} | "
                     f"{100 * r.hit_ratio:.1f}% | {100 * r.of_ideal:.1f}% | "
                     f"{r.ttft(0.5):.0f} | {r.ttft(0.9):.0f} | {r.ttft(0.99):.0f} | "
                     f"{100 * r.slo_attainment:.1f}% | {r.tpot(0.9):.1f} | {mae} | {pred} | "
                     f"{terr} | {r.load_imbalance:.2f} | {_quantile(r.lag_ms, 0.99):.0f} | "
                     f"{r.wall_s:.0f} |")
    causes: dict[str, int] = {}
    for r in results:
        for cause, n in r.audit.causes.items():
            causes[cause] = causes.get(cause, 0) + n
    if causes:
        lines += ["", "Prediction misses beyond one block, by the audit's likely cause (all "
                  "runs): " + ", ".join(f"{c} {n}" for c, n in sorted(
                      causes.items(), key=lambda kv: -kv[1])) + "."]
    misses: dict[str, float] = {}
    for r in results:
        for why, value in r.misses.items():
            misses[why] = (max(misses.get(why, 0.0), value) if why == "max lag s"
                           else misses.get(why, 0.0) + value)
    if misses:
        lines += ["", "The same misses as the bench client explains them from its own "
                  "timeline (an earlier request to the same engine sharing the prefix whose "
                  f"prefill ended after routing, less {INDEX_LAG_S * 1000:g} wall ms): "
                  + ", ".join(f"{why} {n:g}" for why, n in sorted(
                      misses.items(), key=lambda kv: -kv[1])) + ". Router delay (a stream's "
                  "client send to first token less the engine's TTFT, wall ms) p50/p99 per "
                  "run: "
                  + ", ".join(f"{r.policy} x{r.load:g} {_quantile(r.head_ms, 0.5):.0f}/"
                              f"{_quantile(r.head_ms, 0.99):.0f}"
                              for r in results if r.audit.audited) + "."]
    met = targets(results)
    if met:
        lines += ["", "Targets (conversation trace unless said; issue 14, then issue 5):", ""]
        lines += [f"- {desc}: {'met' if ok else '**missed**'}" for desc, ok in met]
    return "\n".join(lines)


def write_section(text: str, path: Path, begin: str = BEGIN, end: str = END) -> None:
    """Replace the routing section of ``path`` (between ``begin`` and ``end``: :data:`BEGIN`
    and :data:`END`, or :data:`BEGIN_DP` and :data:`END_DP` for DP runs), or append it; the
    rest of the file is kept byte for byte. A missing file is created.

    :param text: the section body (:func:`report`), without the markers.
    :param path: the results file; its directory must exist.
    :raises OSError: the file cannot be read or written.
    """
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    section = f"{begin}\n{text}\n{end}"
    if begin in old and end in old and old.index(begin) < old.index(end):
        new = old[:old.index(begin)] + section + old[old.index(end) + len(end):]
    else:
        new = old.rstrip("\n") + ("\n\n" if old else "") + section + "\n"
    path.write_text(new, encoding="utf-8")


# ---- CLI ------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``kvsvc bench-routing`` flags to ``parser``, each in both spellings
    (:func:`kvsvc.settings.add_flag`); ``--etcd`` is also ``serve``'s ``--etcd_addr``. The
    formatter shows the defaults."""
    d = BenchOptions()
    add_flag(parser, "--traces", default=",".join(d.traces),
             help="comma-separated trace names or paths, e.g. conversation,synthetic")
    add_flag(parser, "--window-s", type=float, default=d.window_s,
             help="trace seconds replayed from the start, 0 = all")
    add_flag(parser, "--requests", type=int, default=d.max_requests,
             help="at most this many requests per trace (0: no limit)")
    add_flag(parser, "--time-scale", type=float, default=d.time_scale,
             help="time compression factor")
    add_flag(parser, "--policies", default="RR,CAR:0.5,SLO_AWARE,TTFT",
             help="comma-separated RR, CAR:<lambda>, SLO_AWARE, TTFT")
    add_flag(parser, "--load-levels", default=",".join(f"{x:g}" for x in d.load_levels),
             help="comma-separated arrival-rate multipliers, each a run per trace and policy")
    add_flag(parser, "--target-ttft", "--target_ttft", dest="target_ttft", type=float,
             default=d.target_ttft_ms,
             help="the service's --target_ttft and the SLO attainment's bound, simulated ms")
    add_flag(parser, "--target-tpot", "--target_tpot", dest="target_tpot", type=float,
             default=d.target_tpot_ms, help="the service's --target_tpot, simulated ms")
    add_flag(parser, "--quick", action="store_true",
             help="the conversation trace only, its first 240 trace seconds (about 7 min with "
                  "the 4 default policies at 5x)")
    add_flag(parser, "--flavor", default=d.flavor, choices=("xllm", "vllm", "sglang"),
             help="engine flavor: vllm and sglang send no heartbeat (their /metrics is "
                  "scraped) and honour X-data-parallel-rank (§15)")
    add_flag(parser, "--dp", type=int, default=d.dp, help="DP ranks per engine")
    add_flag(parser, "--dp-rank-routing", default="on", choices=("on", "off", "both"),
             help="the service's --dp_rank_routing; both: each policy once with and once "
                  "without (the minimum over ranks), in the same bench")
    add_flag(parser, "--prompts", default="tokens", choices=("tokens", "text", "both"),
             help="token-id prompts, the same prompts as text through the testbed's shared "
                  "tokenizer (engines and router), or both in one run")
    add_flag(parser, "--no-stream", action="store_true",
             help="non-streamed requests (the router then hears only each answer's end)")
    add_flag(parser, "--xllm", default=d.xllm, choices=("http", "native"),
             help="native: xLLM engines with service routing (§13; requests and tokens over "
                  "baidu_std, timed by the client)")
    add_flag(parser, "--kv-events", default="on", choices=("on", "off"),
             help="off: engines without KV events, the router's approximate index (§14)")
    add_flag(parser, "--engines", type=int, default=d.engines, help="simulated engines")
    add_flag(parser, "--device-blocks", type=int, default=d.device_blocks,
             help="Device pool per rank, blocks")
    add_flag(parser, "--host-blocks", type=int, default=d.host_blocks,
             help="Host pool per rank, blocks")
    add_latency_flags(parser)
    add_flag(parser, "--heartbeat-interval-s", type=float, default=d.heartbeat_interval_s,
             help="engines' heartbeat period, simulated seconds")
    add_flag(parser, "--heartbeat-gap-s", type=float, default=d.heartbeat_gap_s,
             help="early heartbeat on a queue change at most every this many simulated s; "
                  "0: periodic only")
    add_flag(parser, "--etcd", "--etcd_addr", dest="etcd", default=d.etcd,
             help="etcd host:port (empty: a local one)")
    add_flag(parser, "--arrivals", default=d.arrivals, choices=("spread", "trace"),
             help="spread: same-timestamp requests spread over the gap to the next "
                  "timestamp; trace: as recorded (bursts)")
    add_flag(parser, "--log-dir", default="", help="keep the service logs here")
    add_flag(parser, "--results-file", default=str(DEFAULT_RESULTS_FILE), metavar="PATH",
             help="file whose routing section (between the routing:begin/end markers) is "
                  "rewritten; the rest of it is kept; its directory must exist (relative to "
                  "the current directory)")
    add_flag(parser, "--no-write", action="store_true",
             help="write no results file (leave --results-file alone)")
    add_log_level(parser, "warning")


def parse_policies(text: str) -> tuple[tuple[str, Optional[float]], ...]:
    """``"RR,CAR:0.5,TTFT"`` -> ``(("RR", None), ("CAR", 0.5), ("TTFT", None))``.

    :raises ValueError: an unknown policy or a bad lambda.
    """
    out: list[tuple[str, Optional[float]]] = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, _, lam = item.partition(":")
        if name.upper() in PLAIN_POLICIES and not lam:
            out.append((name.upper(), None))
        elif name.upper() == "CAR":
            value = float(lam) if lam else 0.5
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"lambda {value} outside [0, 1]")
            out.append(("CAR", value))
        else:
            raise ValueError(f"unknown policy {item!r} (RR, CAR:<lambda>, SLO_AWARE or TTFT)")
    if not out:
        raise ValueError("no policy")
    return tuple(out)


def results_file(args: argparse.Namespace) -> Optional[Path]:
    """The file ``kvsvc bench-routing`` writes: ``--results-file``, or ``None`` with
    ``--no-write``.

    :raises ConfigError: (field ``--results-file``) its directory does not exist.
    """
    if args.no_write:
        return None
    path = Path(args.results_file)
    if not path.parent.is_dir():
        raise ConfigError("--results-file", f"{path}: directory {path.parent} does not exist "
                          f"(run from the repository root, or pass --results-file or --no-write)")
    return path


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    """The :class:`BenchOptions` of parsed :func:`add_arguments` flags (the rest default).

    :raises ValueError: a bad ``--policies`` value (:func:`parse_policies`), ``--load-levels``
        not numbers, ``--target-ttft`` / ``--target-tpot`` / ``--time-scale`` not > 0.
    """
    traces = tuple(t for t in args.traces.split(",") if t)
    window_s = args.window_s
    if args.quick:
        traces, window_s = ("conversation",), min(window_s, 240.0) if window_s > 0 else 240.0
    try:
        loads = tuple(float(x) for x in args.load_levels.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--load-levels: not numbers: {args.load_levels!r}") from None
    for flag, value in (("--target-ttft", args.target_ttft), ("--target-tpot", args.target_tpot),
                        ("--time-scale", args.time_scale)):
        if not value > 0 or value == float("inf"):
            raise ValueError(f"{flag}: must be a number > 0, got {value!r}")
    return BenchOptions(traces=traces,
                        window_s=window_s, max_requests=args.requests,
                        time_scale=args.time_scale, policies=parse_policies(args.policies),
                        engines=args.engines, device_blocks=args.device_blocks,
                        host_blocks=args.host_blocks,
                        prefill_us_per_token=args.prefill_us_per_token,
                        decode_us_per_token=args.decode_us_per_token,
                        max_num_seqs=args.max_num_seqs, etcd=args.etcd,
                        heartbeat_interval_s=args.heartbeat_interval_s,
                        heartbeat_gap_s=args.heartbeat_gap_s,
                        log_dir=args.log_dir, arrivals=args.arrivals, load_levels=loads,
                        target_ttft_ms=args.target_ttft, target_tpot_ms=args.target_tpot,
                        prefill_base_us=args.prefill_base_us,
                        prefill_us_per_token_sq=args.prefill_us_per_token_sq,
                        decode_us_per_seq=args.decode_us_per_seq,
                        decode_us_per_context_token=args.decode_us_per_context_token,
                        stream=not args.no_stream, xllm=args.xllm,
                        kv_events=args.kv_events == "on", flavor=args.flavor, dp=args.dp,
                        dp_rank_routing={"on": (True,), "off": (False,),
                                         "both": (True, False)}[args.dp_rank_routing],
                        prompts={"tokens": ("tokens",), "text": ("text",),
                                 "both": ("tokens", "text")}[args.prompts])


def publish(results: list[RunResult], opts: BenchOptions, path: Optional[Path],
            out: Optional[TextIO] = None, command: str = "") -> int:
    """Print the report to ``out`` (stdout by default), write its routing section to ``path``
    (:func:`write_section`; nothing when ``None``) and return the exit code.

    :returns: :data:`EXIT_OK` when every target is met, else :data:`EXIT_MISSED`.
    :raises OSError: ``path`` cannot be written.
    """
    out = out or sys.stdout
    text = report(results, opts, command)
    print(text, file=out)
    if path is not None:
        write_section(text, path, *((BEGIN_DP, END_DP) if opts.dp > 1 else (BEGIN, END)))
        print(f"wrote the routing section of {path}", file=out)
    met = targets(results)
    return EXIT_OK if all(ok for _, ok in met) else EXIT_MISSED


def run(args: argparse.Namespace) -> int:
    """``kvsvc bench-routing``.

    :returns: 0 when the conversation targets are met (or not measured), 1 when missed, 2 on
        bad options (a results file whose directory is missing included, found before
        anything starts) or a start-up failure, 130 on Ctrl-C or SIGTERM.
    """
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    main = threading.current_thread() is threading.main_thread()
    if main:
        # SIGTERM (a timeout, systemd, kill) stops like Ctrl-C: the runs' finally blocks stop
        # the engines, the service and etcd; the default action would orphan them.
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        path = results_file(args)
        opts = options_from_args(args)
        results = run_bench(opts)
    except KeyboardInterrupt:
        print("kvsvc bench-routing: interrupted; everything stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (ConfigError, ValueError) as exc:
        print(f"kvsvc bench-routing: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KvsvcError as exc:
        print(f"kvsvc bench-routing: failed: {exc}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        if main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    command = "kvsvc " + " ".join(shlex.quote(a) for a in sys.argv[1:]) \
        if sys.argv[1:2] == ["bench-routing"] else ""
    return publish(results, opts, path, command=command)
