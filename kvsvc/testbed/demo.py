"""``kvsvc demo``: the whole system end to end on one machine, checked against ground truth.

1. Use the etcd given by ``--etcd``, or start a local one (Debian's ``etcd-server``,
   :class:`~kvsvc.testbed.etcd_launcher.LocalEtcd`, free loopback ports, temporary data directory).
2. Start K simulated engines in this process (:class:`~kvsvc.testbed.sim.engine.SimEngine`, one of them
   with 2 DP ranks), each an instance ``127.0.0.1:P`` that serves ``GET /health`` on ``P``,
   publishes on the §9 ports ``P + 10000 + r`` / ``P + 30000 + r``, and registers itself in
   etcd (:class:`~kvsvc.testbed.sim.registration.EtcdRegistration`: 3 s lease, heartbeats to the
   master). Device and Host pools are small enough that the trace exercises eviction and
   offload.
3. Write a §8 *discovery* config (``refresh_interval_ms`` 200, ``resync_interval_ms`` 1000; no
   address list) and start the service as a subprocess: ``python -m kvsvc serve
   --kv_events_config_file F --etcd_addr E --port P --host 127.0.0.1``, with a random
   ``KVSVC_INTERNAL_API_TOKEN`` sent as ``X-Internal-Token`` (§10). Wait (bounded) until
   ``GET /ready`` answers 200 and lists exactly the engines' streams, found by the service
   alone.
4. Replay the first N requests of a trace (:func:`~kvsvc.testbed.traces.load_trace`,
   :func:`~kvsvc.testbed.traces.request_tokens`), round robin over the engines (round robin over the
   ranks inside the 2-DP engine). Before each request: query the service with its token ids
   until every stream is synchronized at its engine rank's last published seq (bounded wait),
   compare every stream's answer with that rank's ground truth
   (:meth:`~kvsvc.testbed.sim.engine.SimEngine.true_prefix`), then execute the request on its engine.
5. Print a table and exit 0 only if every comparison was exact (without ``--chaos``) or no
   answer was a false hit (with ``--chaos``).

A **false hit** is an answer that promises more than the engine has: predicted reusable tokens
above the true reusable tokens, or predicted Device tokens above the true Device tokens.

``--flavor vllm`` (or ``sglang``) runs the same on engines of that flavor
(:mod:`kvsvc.testbed.sim.flavors`: their batch forms and history replay, §7h), registered with
``backend_type`` ``"vllm"`` and ``type`` 0 (as xllm-service's ``vllm_sidecar`` registers them),
found by discovery with ``backends: ["vllm"]`` (their streams run ``replay_mode``
``history``, the backend's §8 default). The first tenth of the trace is executed
before the service starts (a late join: the service must rebuild from the engines' history).
Every answer is audited by its ``completeness`` (§10): an ``exact`` answer must equal the truth;
a ``subset`` answer must hold no block the engine lacks (its missed tokens are reported); an
unsynchronized answer (``completeness`` null) must have no hit. The table shows the answers per
completeness. Pass: no false hit, every ``exact`` answer equal to the truth, and (without
``--chaos``) every answer exact.

``--chaos`` drops 1 % of live messages on every engine (seeded, seqs consumed: the service
sees gaps) and restarts one engine half-way through as a new process: sockets re-bound, cache
cleared, seq 0, and a new ``incarnation_id`` registered at the same address, so discovery
replaces its streams (§9); the demo waits (bounded) until ``/ready`` shows the new identity.
A stream that cannot catch up within the bounded wait is compared all the same; a correct
service then answers zero hits (or hits that are still true).

Everything started is stopped in ``finally`` (also on Ctrl-C): the service by SIGINT (SIGKILL
after a grace period), the registrations (lease revoked), the engines by
:meth:`~kvsvc.testbed.sim.engine.SimEngine.close`, a local etcd by
:meth:`~kvsvc.testbed.etcd_launcher.LocalEtcd.cleanup`.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, TextIO

import requests

from kvsvc.errors import ConfigError, KvsvcError, LifecycleError
from kvsvc.testbed.etcd_launcher import LocalEtcd
# Re-exported: the soak, the benchmarks and the tests take them from here.
from kvsvc.testbed.ports import free_instance_port as free_instance_port
from kvsvc.testbed.ports import free_port_run as free_port_run
from kvsvc.testbed.sim.engine import SimEngine
from kvsvc.testbed.sim.flavors import Flavor
from kvsvc.testbed.sim.native import rpc_heartbeat
from kvsvc.testbed.sim.registration import EtcdRegistration, Load
from kvsvc.testbed.sim.serving import ServingConfig
from kvsvc.testbed.traces import load_trace, request_tokens
from kvsvc.settings import add_flag, add_log_level

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

TOKEN_HEADER = "X-Internal-Token"
QUERY_PATH = "/v1/internal/kv-cache/query"


@dataclass(frozen=True)
class DemoOptions:
    """What the demo runs.

    :param requests: trace requests replayed (the first N).
    :param engines: simulated engine instances K (>= 1); engine 1 (engine 0 when K == 1) has
        2 DP ranks, the others 1.
    :param chaos: drop ``drop_probability`` of live messages everywhere and restart one engine
        half-way.
    :param seed: seeds the drop faults.
    :param trace: ``conversation``, ``synthetic`` or a JSONL path.
    :param block_size: tokens per block (engines and streams).
    :param device_blocks: Device pool per rank, blocks.
    :param host_blocks: Host pool per rank, blocks.
    :param drop_probability: with ``chaos``, per live message.
    :param wait_timeout_s: bound of the catch-up wait before each request, seconds.
    :param ready_timeout_s: bound of the wait for ``/ready`` after starting the service.
    :param resync_interval_ms: the service's periodic snapshot (§8), ms.
    :param etcd: etcd ``host:port`` to use; empty starts a local etcd for the run.
    :param refresh_interval_ms: the service's discovery refresh (§8), ms.
    :param event_port_offset: §9 live port offset (engines and discovery alike).
    :param replay_port_offset: §9 snapshot port offset.
    :param flavor: engine flavor (:class:`~kvsvc.testbed.sim.flavors.Flavor` value); ``vllm``
        and ``sglang`` run history streams (module docstring).
    :param buffer_steps: history flavors: each rank's replay buffer, batches.
    :param xllm: ``http``, or ``native``: the engines are xLLM engines with service routing
        (§13: heartbeats over baidu_std; the service runs ``--xllm_dispatch native`` with a
        baidu_std port) and, after the replay, ``native_answers`` streamed completions are
        sent through the service and their answers (written from the engines' Generations)
        checked token by token.
    :param native_answers: requests of that check.
    """

    requests: int = 2000
    engines: int = 4
    chaos: bool = False
    seed: int = 0
    trace: str = "conversation"
    block_size: int = 128
    device_blocks: int = 4096
    host_blocks: int = 8192
    drop_probability: float = 0.01
    wait_timeout_s: float = 5.0
    ready_timeout_s: float = 60.0
    resync_interval_ms: int = 1000
    etcd: str = ""
    refresh_interval_ms: int = 200
    event_port_offset: int = 10000
    replay_port_offset: int = 30000
    flavor: str = "xllm"
    buffer_steps: int = 10_000
    xllm: str = "http"
    native_answers: int = 16

    @property
    def history(self) -> bool:
        """True when the engines answer replays with history (§7h: vLLM, SGLang)."""
        return Flavor(self.flavor).history


@dataclass
class DemoReport:
    """Outcome figures. Token sums are over every (stream, request) comparison; ``target_*``
    only over the stream that then executed the request.

    :param requests: requests replayed.
    :param streams: streams compared per request.
    :param comparisons: ``requests * streams``.
    :param exact: comparisons whose Device and Host-only tokens both equal the truth.
    :param false_hits: comparisons promising more than the truth (see the module docstring).
    :param wait_timeouts: requests before which some stream had not caught up in time.
    :param unsynchronized_answers: comparisons answered by an unsynchronized stream.
    :param recoveries_observed: synchronized -> unsynchronized transitions seen in answers
        (polls only see a transition whose recovery outlasts the gap between two queries).
    :param recoveries_reported: recoveries after the first synchronization, summed over the
        streams, from ``/ready``'s per-stream ``recoveries`` when the service reports it,
        else ``None``.
    :param resync_differences: blocks corrected by periodic resync snapshots (§6: silently lost
        tail events, e.g. a dropped last message), summed from ``/ready``, else ``None``.
    :param dropped: live messages dropped by the chaos fault, all engines.
    :param restarts: engine restarts done by the chaos mode.
    :param by_completeness: answers per ``completeness`` value (§10): ``"exact"``,
        ``"subset"``, ``"null"`` (unsynchronized) and ``"absent"`` (a service that does not
        send the field; counted as exact when synchronized).
    :param exact_mismatches: answers said to be exact (synchronized, completeness exact or
        absent) that differ from the truth.
    :param subset_missed_tokens: true reusable tokens that ``subset`` answers did not report.
    :param history: the engines answer history (§7h); the verdict then also checks the split.
    :param warmup_requests: requests executed before the service started (late join).
    :param native_ok: ``xllm`` ``native``: answers through the service that were complete and
        equal to the engine's output.
    :param native_failed: ``xllm`` ``native``: answers that were not.
    """

    requests: int = 0
    streams: int = 0
    native_ok: int = 0
    native_failed: int = 0
    comparisons: int = 0
    exact: int = 0
    false_hits: int = 0
    predicted_device_tokens: int = 0
    predicted_host_only_tokens: int = 0
    true_device_tokens: int = 0
    true_host_only_tokens: int = 0
    target_predicted_device_tokens: int = 0
    target_predicted_host_only_tokens: int = 0
    target_true_device_tokens: int = 0
    target_true_host_only_tokens: int = 0
    prompt_tokens: int = 0
    wait_timeouts: int = 0
    unsynchronized_answers: int = 0
    recoveries_observed: int = 0
    recoveries_reported: Optional[int] = None
    resync_differences: Optional[int] = None
    dropped: int = 0
    restarts: int = 0
    elapsed_s: float = 0.0
    false_hit_examples: list[str] = field(default_factory=list)
    by_completeness: dict[str, int] = field(
        default_factory=lambda: {"exact": 0, "subset": 0, "null": 0, "absent": 0})
    exact_mismatches: int = 0
    subset_missed_tokens: int = 0
    history: bool = False
    warmup_requests: int = 0

    @property
    def exact_rate(self) -> float:
        """``exact / comparisons`` (1.0 when nothing was compared)."""
        return self.exact / self.comparisons if self.comparisons else 1.0

    def passed(self, chaos: bool) -> bool:
        """The demo's verdict: all exact without chaos, no false hit with chaos; on history
        engines also every answer said to be exact equal to the truth."""
        if self.history and (self.false_hits or self.exact_mismatches):
            return False
        if self.native_failed:
            return False
        return self.false_hits == 0 if chaos else self.exact == self.comparisons

    def table(self, chaos: bool) -> str:
        """The printed summary table."""
        def pct(n: int) -> str:
            return f"{100.0 * n / self.prompt_tokens:.2f}%" if self.prompt_tokens else "-"
        rows = [
            ("mode", "chaos" if chaos else "clean"),
            ("requests", f"{self.requests}"),
            ("streams", f"{self.streams}"),
            ("(stream, request) comparisons", f"{self.comparisons}"),
            ("predicted device / host-only tokens (all streams)",
             f"{self.predicted_device_tokens} / {self.predicted_host_only_tokens}"),
            ("true device / host-only tokens (all streams)",
             f"{self.true_device_tokens} / {self.true_host_only_tokens}"),
            ("predicted device / host-only on executing rank",
             f"{self.target_predicted_device_tokens} ({pct(self.target_predicted_device_tokens)})"
             f" / {self.target_predicted_host_only_tokens} "
             f"({pct(self.target_predicted_host_only_tokens)})"),
            ("true device / host-only on executing rank",
             f"{self.target_true_device_tokens} ({pct(self.target_true_device_tokens)}) / "
             f"{self.target_true_host_only_tokens} ({pct(self.target_true_host_only_tokens)})"),
            ("exact-match rate", f"{100.0 * self.exact_rate:.2f}% ({self.exact}/{self.comparisons})"),
            ("false hits", f"{self.false_hits}"),
            ("answers while unsynchronized", f"{self.unsynchronized_answers}"),
            ("catch-up waits that timed out", f"{self.wait_timeouts}"),
            ("stream recoveries (reported by /ready / seen in answers)",
             f"{'-' if self.recoveries_reported is None else self.recoveries_reported} / "
             f"{self.recoveries_observed}"),
            ("blocks corrected by periodic resync",
             "-" if self.resync_differences is None else f"{self.resync_differences}"),
            ("live messages dropped / engine restarts", f"{self.dropped} / {self.restarts}"),
        ]
        if self.history:
            c = self.by_completeness
            rows += [
                ("requests before the service started (late join)", f"{self.warmup_requests}"),
                ("answers exact / subset / unsynchronized",
                 f"{c['exact'] + c['absent']} / {c['subset']} / {c['null']}"
                 + (f" ({c['absent']} without completeness)" if c["absent"] else "")),
                ("exact answers equal to the truth",
                 f"{c['exact'] + c['absent'] - self.exact_mismatches}/{c['exact'] + c['absent']}"),
                ("tokens missed by subset answers", f"{self.subset_missed_tokens}"),
            ]
        if self.native_ok or self.native_failed:
            rows.append(("native answers (Generations -> SSE) complete and equal",
                         f"{self.native_ok}/{self.native_ok + self.native_failed}"))
        rows += [
            ("elapsed", f"{self.elapsed_s:.1f} s"),
            ("verdict", "PASS" if self.passed(chaos) else "FAIL"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


# ---- ports: kvsvc.testbed.ports (re-exported here, where the other tools import them) -------

# ---- the service subprocess ---------------------------------------------------------------------

class ServiceProcess:
    """``python -m kvsvc serve`` as a child process, output to ``log_path``.

    :param config_path: the §8 file.
    :param port: HTTP port on 127.0.0.1.
    :param token: internal API token (passed in the environment, never argv).
    :param log_path: file receiving the child's stdout and stderr.
    :param etcd_addr: the registry's etcd ``host:port`` (``--etcd_addr``), empty for none.
    :param extra_args: more ``serve`` flags (e.g. ``--load_balance_policy RR``).
    :param extra_env: more environment variables of the child (e.g. ``GUNICORN_CMD_ARGS``).
    """

    def __init__(self, config_path: Path, port: int, token: str, log_path: Path,
                 etcd_addr: str = "", extra_args: Sequence[str] = (),
                 extra_env: Optional[Mapping[str, str]] = None) -> None:
        self.etcd_addr = etcd_addr
        self.extra_args = list(extra_args)
        self.extra_env = dict(extra_env or {})
        self.config_path = config_path
        self.port = port
        self.token = token
        self.log_path = log_path
        self.base_url = f"http://127.0.0.1:{port}"
        self._proc: Optional[subprocess.Popen[bytes]] = None
        self._log: Optional[TextIO] = None
        self.session = requests.Session()
        self.session.headers[TOKEN_HEADER] = token

    def start(self, ready_timeout_s: float,
              expected_streams: Optional[set[tuple[str, int]]] = None,
              warming_ok: bool = False) -> dict:
        """Start the service and wait until ``GET /ready`` answers 200 (and, with
        ``expected_streams``, lists exactly those (instance_name, dp_rank) streams: with
        discovery an empty stream set is ready too, before anything was found).

        :param warming_ok: also return on a 503 whose only missing parts are streams' first
            synchronizations (the service runs and answers queries; a soak that measures the
            late join, or holds a stream that only a live batch can synchronize, starts there).

        :returns: the ``/ready`` body.
        :raises LifecycleError: the process exited, or was not ready within the timeout (the
            tail of its log is in the message).
        """
        env = dict(os.environ)
        env["KVSVC_INTERNAL_API_TOKEN"] = self.token
        env.setdefault("KVSVC_LOG_LEVEL", "warning")
        env.update(self.extra_env)
        self._log = open(self.log_path, "w", encoding="utf-8")
        argv = [sys.executable, "-m", "kvsvc", "serve", "--kv_events_config_file",
                str(self.config_path), "--port", str(self.port), "--host", "127.0.0.1"]
        if self.etcd_addr:
            argv += ["--etcd_addr", self.etcd_addr]
        if not any(a == "--rpc_port" or a.startswith("--rpc_port=") for a in self.extra_args):
            # The simulated engines heartbeat over HTTP (KVSVC:SERVICE:MASTER:HTTP); no fixed
            # baidu_std port 8889 that another local service may hold (§13).
            argv += ["--rpc_port", "0"]
        argv += self.extra_args
        # Its own session: a terminal's Ctrl-C reaches only the parent, which stops the
        # service in its order (router first, then what it talks to) instead of all at once.
        self._proc = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        log.info("demo: service started (pid %d) on %s", self._proc.pid, self.base_url)
        deadline = time.monotonic() + ready_timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise LifecycleError(f"service exited with {self._proc.returncode}:\n{self.log_tail()}")
            try:
                # The warm-up gate: the demo and the benches need the index, not only a
                # candidate (§15's /ready alone does not wait for streams).
                r = self.session.get(self.base_url + "/ready?streams=synchronized",
                                     timeout=2.0)
                body = r.json() if r.status_code in (200, 503) else {}
                warming = (r.status_code == 503 and warming_ok and body.get("running")
                           and all(w.startswith("stream ") for w in body.get("waiting_for", [])))
                if r.status_code == 200 or warming:
                    found = {(s["instance_name"], s["dp_rank"]) for s in body["streams"]}
                    if expected_streams is None or found == expected_streams:
                        return body
                    last = f"200 but streams {sorted(found)}, expected {sorted(expected_streams)}"
                else:
                    last = f"{r.status_code} {r.text[:300]}"
            except (requests.RequestException, ValueError) as exc:
                last = type(exc).__name__
            time.sleep(0.1)
        raise LifecycleError(f"service not ready within {ready_timeout_s:.0f} s ({last}):\n"
                             f"{self.log_tail()}")

    @property
    def pid(self) -> Optional[int]:
        """The service's pid (gunicorn's arbiter: ``serve`` execs it) while started."""
        return self._proc.pid if self._proc is not None else None

    def wait_routable(self, names: set[str], timeout_s: float) -> None:
        """Wait until every instance of ``names`` is a routing candidate: the router holds a
        load report of each (a candidate needs one, §11). Asks ``POST /v1/internal/route``,
        which sends nothing.

        :raises LifecycleError: not within ``timeout_s`` (the last answer in the message).
        """
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise LifecycleError(f"service exited with {self._proc.returncode}:\n"
                                     f"{self.log_tail()}")
            try:
                r = self.session.post(self.base_url + "/v1/internal/route",
                                      json={"token_ids": [1]}, timeout=5.0)
                if r.status_code == 200:
                    found = {c["name"] for c in r.json().get("candidates", [])}
                    if names <= found:
                        return
                    last = f"candidates {sorted(found)}"
                else:
                    last = f"{r.status_code} {r.text[:200]}"
            except (requests.RequestException, ValueError, KeyError, TypeError) as exc:
                last = type(exc).__name__
            time.sleep(0.1)  # polling another process: bounded by the deadline
        raise LifecycleError(f"router never had {sorted(names)} as candidates within "
                             f"{timeout_s:.0f} s ({last})")

    def query(self, token_ids: list[int]) -> list[dict]:
        """``POST /v1/internal/kv-cache/query``; returns ``matches`` (§10).

        :raises LifecycleError: transport failure or a non-200 answer.
        """
        try:
            r = self.session.post(self.base_url + QUERY_PATH, json={"token_ids": token_ids},
                                  timeout=10.0)
        except requests.RequestException as exc:
            raise LifecycleError(f"query failed: {exc}") from exc
        if r.status_code != 200:
            raise LifecycleError(f"query answered {r.status_code}: {r.text[:300]}")
        return r.json()["matches"]

    def identities(self) -> dict[tuple[str, int], Optional[str]]:
        """Each stream's ``identity`` from ``/ready`` (the incarnation discovery added it for).

        :raises LifecycleError: the service cannot be asked.
        """
        try:
            streams = self.session.get(self.base_url + "/ready", timeout=5.0).json()["streams"]
        except (requests.RequestException, ValueError, KeyError) as exc:
            raise LifecycleError(f"/ready failed: {exc}") from exc
        return {(s["instance_name"], s["dp_rank"]): s.get("identity") for s in streams}

    def recoveries(self) -> Optional[int]:
        """Recoveries after each stream's first synchronization, summed, from ``/ready``'s
        per-stream ``recoveries`` (which counts the first one too); ``None`` when the service
        does not report them or cannot be asked."""
        try:
            streams = self.session.get(self.base_url + "/ready", timeout=5.0).json()["streams"]
            return sum(max(0, int(s["recoveries"]) - 1) for s in streams)
        except (requests.RequestException, ValueError, KeyError, TypeError):
            return None

    def resync_differences(self) -> Optional[int]:
        """Blocks corrected by periodic resyncs, summed over ``/ready``'s streams; ``None``
        when the service does not report them or cannot be asked."""
        try:
            streams = self.session.get(self.base_url + "/ready", timeout=5.0).json()["streams"]
            return sum(int(s["resync_differences"]) for s in streams)
        except (requests.RequestException, ValueError, KeyError, TypeError):
            return None

    def log_tail(self, lines: int = 30) -> str:
        """Last ``lines`` lines of the service's output."""
        try:
            return "\n".join(self.log_path.read_text(encoding="utf-8", errors="replace")
                             .splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def close(self, timeout_s: float = 15.0) -> None:
        """SIGINT, wait up to ``timeout_s``, then SIGKILL. Idempotent."""
        self.session.close()
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout_s)
            except (subprocess.TimeoutExpired, KeyboardInterrupt):
                log.error("demo: service did not stop within %.0f s; killing it", timeout_s)
                proc.kill()
                proc.wait(5.0)
        if proc is not None:
            log.info("demo: service stopped (exit %s)", proc.returncode)
        if self._log is not None:
            self._log.close()
            self._log = None


# ---- the run ------------------------------------------------------------------------------------

def _build_engines(opts: DemoOptions) -> list[SimEngine]:
    """K engines named ``127.0.0.1:P`` (the §9 instance name), ports by the §9 rule, none of
    them colliding with another's."""
    dp_engine = 1 if opts.engines > 1 else 0
    engines = []
    taken: set[int] = set()
    for i in range(opts.engines):
        dp = 2 if i == dp_engine else 1
        port = free_instance_port(dp, opts.event_port_offset, opts.replay_port_offset,
                                  avoid=taken)
        engines.append(SimEngine(
            f"127.0.0.1:{port}", port + opts.event_port_offset, port + opts.replay_port_offset,
            dp_size=dp, block_size=opts.block_size, device_blocks=opts.device_blocks,
            host_blocks=opts.host_blocks, seed=opts.seed + i, http_port=port,
            flavor=opts.flavor, buffer_steps=opts.buffer_steps,
            serving=ServingConfig(time_scale=100.0) if opts.xllm == "native" else None,
            native=opts.xllm == "native"))
    return engines


def discovery_config(opts: DemoOptions) -> dict:
    """The §8 document of the demo's service: discovery only, no address list; for history
    engines ``backends`` is their backend (§8, §9: their streams take the backend's default
    replay mode, ``history``)."""
    discovery = {"enabled": True, "block_size": opts.block_size, "topic": "",
                 "event_port_offset": opts.event_port_offset,
                 "replay_port_offset": opts.replay_port_offset,
                 "refresh_interval_ms": opts.refresh_interval_ms}
    if opts.history:
        discovery["backends"] = [Flavor(opts.flavor).backend_type]
    return {"discovery": discovery, "resync_interval_ms": opts.resync_interval_ms}


def _load(engine: SimEngine) -> Load:
    """The heartbeat load of ``engine`` now (§9)."""
    return Load(engine.waiting_requests(), engine.device_usage())


def _register(engines: list[SimEngine], etcd_addr: str, token: str) -> list[EtcdRegistration]:
    regs = []
    for eng in engines:
        # vLLM and SGLang send no heartbeats (§15): the service scrapes their /metrics.
        reg = EtcdRegistration(etcd_addr, eng.name, eng.dp_size, functools.partial(_load, eng),
                               token=token, backend_type=eng.flavor.backend_type,
                               heartbeats=eng.flavor.value == "xllm",
                               heartbeat=(rpc_heartbeat(eng.native.client)
                                          if eng.native is not None else None))
        if eng.native is not None:
            eng.native.set_master(reg.master)
        regs.append(reg)
        reg.start()
    for reg in regs:
        reg.wait_registered()
    return regs


def _caught_up(matches: list[dict], expected: dict[tuple[str, int], Optional[int]]) -> bool:
    got = {(m["instance_name"], m["dp_rank"]): m for m in matches}
    return all(key in got and got[key]["synchronized"] and got[key]["sequence"] == seq
               for key, seq in expected.items())


def run_demo(opts: DemoOptions, out: Optional[TextIO] = None) -> DemoReport:
    """Run the demo (see the module docstring) and return its figures; prints the table to
    ``out`` (``sys.stdout`` by default).

    :raises ConfigError: unknown trace.
    :raises LifecycleError: an engine or the service did not start, or the service failed.
    :raises ValueError: bad options.
    """
    out = out or sys.stdout
    if opts.requests < 0 or opts.engines < 1:
        raise ValueError("requests must be >= 0 and engines >= 1")
    trace = load_trace(opts.trace)[:opts.requests]
    report = DemoReport(history=opts.history)
    t0 = time.monotonic()
    engines: list[SimEngine] = []
    regs: list[EtcdRegistration] = []
    service: Optional[ServiceProcess] = None
    etcd: Optional[LocalEtcd] = None
    token = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="kvsvc-demo-") as tmp:
        try:
            etcd_addr = opts.etcd
            if not etcd_addr:
                etcd = LocalEtcd(name="kvsvc-demo")
                etcd.start()
                etcd_addr = etcd.addr
            engines = _build_engines(opts)
            for eng in engines:
                eng.start()
            if opts.chaos:
                for eng in engines:
                    eng.set_drop_probability(opts.drop_probability)
            regs = _register(engines, etcd_addr, token)
            if opts.history:
                # A late join: the engines have published before the service exists.
                report.warmup_requests = len(trace) // 10
                _warm_up(opts, trace[:report.warmup_requests], engines)
                trace = trace[report.warmup_requests:]
            cfg = discovery_config(opts)
            cfg_path = Path(tmp) / "kv_events.json"
            cfg_path.write_text(json.dumps(cfg, indent=2), encoding="utf-8")
            native_args = (["--xllm_dispatch", "native", "--rpc_port", str(free_port_run(1)),
                            "--rpc_host", "127.0.0.1"] if opts.xllm == "native" else [])
            service = ServiceProcess(cfg_path, free_port_run(1), token,
                                     Path(tmp) / "service.log", etcd_addr=etcd_addr,
                                     extra_args=native_args)
            ready = service.start(opts.ready_timeout_s,
                                  {(e.name, r) for e in engines for r in range(e.dp_size)})
            modes = {st.get("replay_mode", "snapshot") for st in ready["streams"]}
            if modes != {"history" if opts.history else "snapshot"}:
                raise LifecycleError(f"discovered streams run replay modes {sorted(modes)}")
            print(f"kvsvc demo: {len(engines)} engines registered in etcd {etcd_addr}"
                  f"{' (local)' if etcd is not None else ''}, "
                  f"{sum(e.dp_size for e in engines)} streams discovered, service on "
                  f"{service.base_url}, {len(trace)} {opts.trace} requests"
                  f"{' (chaos)' if opts.chaos else ''}", file=out, flush=True)
            _replay(opts, trace, engines, regs, service, report, out)
            if opts.xllm == "native":
                _check_native(opts, trace, engines, service, report)
            report.recoveries_reported = service.recoveries()
            report.resync_differences = service.resync_differences()
        finally:
            # Nested so that a second Ctrl-C while one part stops still stops the rest.
            try:
                if service is not None:
                    service.close()
            finally:
                try:
                    for reg in regs:
                        reg.close()
                finally:
                    try:
                        for eng in engines:
                            eng.close()
                    finally:
                        if etcd is not None:
                            etcd.cleanup()
            report.dropped = sum(eng.stats(r).dropped for eng in engines for r in range(eng.dp_size))
            report.elapsed_s = time.monotonic() - t0
    print(report.table(opts.chaos), file=out, flush=True)
    for line in report.false_hit_examples:
        print(f"  false hit: {line}", file=out)
    return report


def _check_native(opts: DemoOptions, trace: list, engines: list[SimEngine],
                  service: ServiceProcess, report: DemoReport) -> None:
    """Send ``native_answers`` streamed completions through the service (§13: dispatched over
    baidu_std, answered from the engines' Generations) and count those whose SSE answer is
    complete (``[DONE]``) and equal to the engine's output (``" t0 t1 ..."``)."""
    service.wait_routable({e.name for e in engines}, opts.ready_timeout_s)
    want = "".join(f" t{i}" for i in range(8))
    with requests.Session() as http:
        http.trust_env = False
        for req in trace[:opts.native_answers]:
            body: dict[str, Any] = {"model": "sim", "max_tokens": 8, "stream": True,
                                    "prompt": request_tokens(req, opts.block_size) or [1]}
            try:
                r = http.post(service.base_url + "/v1/completions", json=body, timeout=30)
                events = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
                text = "".join(c.get("text", "") for e in events[:-1]
                               for c in json.loads(e).get("choices", []))
                good = r.status_code == 200 and events[-1:] == ["[DONE]"] and text == want
            except (requests.RequestException, ValueError):
                good = False
            if good:
                report.native_ok += 1
            else:
                report.native_failed += 1


def _warm_up(opts: DemoOptions, trace: list, engines: list[SimEngine]) -> None:
    """Execute ``trace`` round robin over every engine rank before the service starts."""
    ranks = [(eng, r) for eng in engines for r in range(eng.dp_size)]
    for i, req in enumerate(trace):
        eng, r = ranks[i % len(ranks)]
        eng.execute(request_tokens(req, opts.block_size), r)


def _replay(opts: DemoOptions, trace: list, engines: list[SimEngine],
            regs: list[EtcdRegistration], service: ServiceProcess, report: DemoReport,
            out: TextIO) -> None:
    ranks = [(eng, r) for eng in engines for r in range(eng.dp_size)]
    report.streams = len(ranks)
    next_rank = [0] * len(engines)
    was_synced: dict[tuple[str, int], bool] = {}
    restart_at = len(trace) // 2 if opts.chaos else -1
    progress_every = max(1, len(trace) // 10)
    for i, req in enumerate(trace):
        if i == restart_at:
            victim, reg = engines[0], regs[0]
            victim.restart()
            incarnation = reg.reincarnate()
            report.restarts += 1
            print(f"  [chaos] request {i}: engine sim-0 restarted ({victim.name}, new "
                  f"incarnation {incarnation})", file=out, flush=True)
            _wait_replaced(service, victim, incarnation, opts.wait_timeout_s + 5.0)
        tokens = request_tokens(req, opts.block_size)
        expected = {(eng.name, r): eng.last_seq(r) for eng, r in ranks}
        deadline = time.monotonic() + opts.wait_timeout_s
        pause = 0.002
        while True:
            matches = service.query(tokens)
            for m in matches:
                key = (m["instance_name"], m["dp_rank"])
                if was_synced.get(key) and not m["synchronized"]:
                    report.recoveries_observed += 1
                was_synced[key] = m["synchronized"]
            if _caught_up(matches, expected):
                break
            if time.monotonic() >= deadline:
                report.wait_timeouts += 1
                break
            time.sleep(pause)  # polling an external process: bounded by the deadline above
            pause = min(pause * 2, 0.05)
        eng = engines[i % len(engines)]
        rank = next_rank[i % len(engines)]
        next_rank[i % len(engines)] = (rank + 1) % eng.dp_size
        _compare(matches, ranks, tokens, (eng.name, rank), report)
        eng.execute(tokens, rank)
        report.requests += 1
        report.prompt_tokens += len(tokens)
        if (i + 1) % progress_every == 0:
            print(f"  {i + 1}/{len(trace)} requests, exact {report.exact}/{report.comparisons}, "
                  f"false hits {report.false_hits}", file=out, flush=True)


def _wait_replaced(service: ServiceProcess, eng: SimEngine, incarnation: str,
                   timeout_s: float) -> None:
    """Wait until discovery has replaced every stream of ``eng`` by one of ``incarnation``
    (§9), so no answer compared afterwards comes from the old process's stream.

    :raises LifecycleError: not within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        ids = service.identities()
        if all(ids.get((eng.name, r)) == incarnation for r in range(eng.dp_size)):
            return
        if time.monotonic() >= deadline:
            raise LifecycleError(f"streams of {eng.name} not replaced within {timeout_s:.0f} s")
        time.sleep(0.02)  # polling an external process: bounded by the deadline above


def _compare(matches: list[dict], ranks: list[tuple[SimEngine, int]], tokens: list[int],
             target: tuple[str, int], report: DemoReport) -> None:
    got = {(m["instance_name"], m["dp_rank"]): m for m in matches}
    for eng, r in ranks:
        key = (eng.name, r)
        true_dev, true_host = eng.true_prefix(r, tokens)
        m = got.get(key)
        if m is None:
            pred_dev = pred_host = 0
            synced = False
        else:
            pred_dev, pred_host = m["device_hit_tokens"], m["host_only_hit_tokens"]
            synced = m["synchronized"]
        if report.history:
            _audit_completeness(m, (pred_dev, pred_host), (true_dev, true_host), report)
        report.comparisons += 1
        report.unsynchronized_answers += 0 if synced else 1
        report.predicted_device_tokens += pred_dev
        report.predicted_host_only_tokens += pred_host
        report.true_device_tokens += true_dev
        report.true_host_only_tokens += true_host
        if key == target:
            report.target_predicted_device_tokens += pred_dev
            report.target_predicted_host_only_tokens += pred_host
            report.target_true_device_tokens += true_dev
            report.target_true_host_only_tokens += true_host
        if (pred_dev, pred_host) == (true_dev, true_host):
            report.exact += 1
        if pred_dev + pred_host > true_dev + true_host or pred_dev > true_dev:
            report.false_hits += 1
            if len(report.false_hit_examples) < 10:
                report.false_hit_examples.append(
                    f"request {report.requests} {key[0]}/dp{key[1]}: predicted {pred_dev}+{pred_host}, "
                    f"true {true_dev}+{true_host}, synchronized {synced}, "
                    f"sequence {m['sequence'] if m else None}, engine seq {eng.last_seq(r)}")


def _audit_completeness(m: Optional[dict], pred: tuple[int, int], truth: tuple[int, int],
                        report: DemoReport) -> None:
    """Count one answer by its ``completeness`` (§7h, §10): an exact answer (or a
    synchronized one without the field) that differs from the truth is an exact mismatch; a
    subset answer's shortfall is counted as missed tokens (a surplus is a false hit, counted by
    the caller)."""
    synced = bool(m and m["synchronized"])
    kind = "null" if not synced else (m or {}).get("completeness", "absent") or "null"
    report.by_completeness[kind] = report.by_completeness.get(kind, 0) + 1
    if kind in ("exact", "absent") and pred != truth:
        report.exact_mismatches += 1
    elif kind == "subset":
        report.subset_missed_tokens += max(0, truth[0] + truth[1] - pred[0] - pred[1])


# ---- CLI ---------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``kvsvc demo`` flags to ``parser``, each in both spellings
    (:func:`kvsvc.settings.add_flag`); ``--etcd`` is also ``serve``'s ``--etcd_addr``. The
    formatter shows the defaults."""
    d = DemoOptions()
    add_flag(parser, "--requests", type=int, default=d.requests, help="trace requests replayed")
    add_flag(parser, "--engines", type=int, default=d.engines,
             help="simulated engines, one with 2 DP ranks")
    add_flag(parser, "--chaos", action="store_true",
             help="drop 1%% of live messages and restart one engine mid-run")
    add_flag(parser, "--seed", type=int, default=d.seed, help="seed of the chaos faults")
    add_flag(parser, "--trace", default=d.trace,
             help="conversation, synthetic or a JSONL path")
    add_flag(parser, "--device-blocks", type=int, default=d.device_blocks,
             help="Device pool per rank, blocks")
    add_flag(parser, "--host-blocks", type=int, default=d.host_blocks,
             help="Host pool per rank, blocks")
    add_flag(parser, "--wait-timeout-s", type=float, default=d.wait_timeout_s,
             help="bound of the catch-up wait before each request, seconds")
    add_flag(parser, "--flavor", default=d.flavor, choices=[f.value for f in Flavor],
             help="engine flavor (kvsvc sim --flavor): vllm and sglang answer replays with "
                  "history (§7h), their streams run replay_mode history")
    add_flag(parser, "--xllm", default=d.xllm, choices=("http", "native"),
             help="native: xLLM engines with service routing (§13); after the replay, "
                  "answers written from their Generations are checked through the service")
    add_flag(parser, "--buffer-steps", type=int, default=d.buffer_steps,
             help="vllm/sglang engines: batches kept for history replay")
    add_flag(parser, "--etcd", "--etcd_addr", dest="etcd", default=d.etcd,
             help="etcd host:port to register the engines in (empty: start a local etcd; "
                  "needs `apt-get install etcd-server`)")
    add_log_level(parser, "warning")


def run(args: argparse.Namespace) -> int:
    """``kvsvc demo``: run and print the table.

    :returns: 0 if the verdict passed, 1 if not, 2 on bad options or a start-up failure,
        130 on Ctrl-C.
    """
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        opts = DemoOptions(requests=args.requests, engines=args.engines, chaos=args.chaos,
                           seed=args.seed, trace=args.trace, device_blocks=args.device_blocks,
                           host_blocks=args.host_blocks, wait_timeout_s=args.wait_timeout_s,
                           etcd=args.etcd, flavor=args.flavor, buffer_steps=args.buffer_steps,
                           xllm=args.xllm)
        report = run_demo(opts)
    except KeyboardInterrupt:
        print("kvsvc demo: interrupted; everything stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (ConfigError, ValueError) as exc:
        print(f"kvsvc demo: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KvsvcError as exc:
        print(f"kvsvc demo: failed: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK if report.passed(opts.chaos) else EXIT_MISMATCH
