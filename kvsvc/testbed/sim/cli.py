"""``kvsvc sim``: run one simulated engine instance in the foreground.

``--flavor xllm|vllm|sglang`` (default ``xllm``) picks the wire form and the replay behaviour
(:mod:`kvsvc.testbed.sim.flavors`): vLLM and SGLang answer replay requests with the last
``--buffer-steps`` batches (history, §7h); ``--no-replay`` binds no replay endpoint. With
``--etcd`` a vLLM/SGLang instance registers with ``backend_type`` ``"vllm"``/``"sglang"`` and
``type`` 0 (as xllm-service's ``vllm_sidecar`` registers vLLM).

Rank ``r`` publishes on ``port + event_port_offset + r`` and serves snapshots on
``port + replay_port_offset + r`` (the §9 port rule, so a service configured by discovery finds
it). With ``--etcd HOST:PORT`` (also ``--etcd_addr``, ``serve``'s name) it also serves ``GET /health`` on ``--host:--port`` and registers
itself in the instance registry as ``XLLM:<TYPE>:<host:port>`` under a 3 s lease, heartbeating
its load to the master service (§9, :mod:`kvsvc.testbed.sim.registration`); the internal token of the
heartbeat comes from ``KVSVC_INTERNAL_API_TOKEN`` or ``--internal-api-token-file``. A vLLM or
SGLang instance sends no heartbeats unless ``--heartbeats on`` (``--heartbeats auto``, the
default: an xLLM instance does, the others do not), as the real engines: the router reads their
load from ``GET /metrics`` (§15). On a clean
stop the lease is revoked. With ``--serve`` the same HTTP port also serves OpenAI
``/v1/completions`` and ``/v1/chat/completions`` with the latency model of
:mod:`kvsvc.testbed.sim.serving` (``--prefill-base-us``, ``--prefill-us-per-token``,
``--prefill-us-per-token-sq``, ``--decode-us-per-token``, ``--decode-us-per-seq``,
``--decode-us-per-context-token``, ``--max-num-seqs``, ``--time-scale``; text prompts tokenized by ``--tokenizer-path`` or the
built-in byte scheme), its waiting queue is the heartbeated ``waiting_requests_num``, its
registration carries the §12 ``ttft_profiling_data`` / ``tpot_profiling_data`` computed by that
model (unless ``--no-profiling-data``) and ``GET /metrics`` has its TTFT and TPOT. With
``--trace`` it replays trace requests round robin over its ranks, ``--interval-ms`` apart;
otherwise it only serves (an empty cache). ``--native`` (with ``--serve``, flavor xllm) makes
it an xLLM engine with service routing (§13, :mod:`kvsvc.testbed.sim.native`): requests over
``XllmAPIService`` on ``--port`` (baidu_std or HTTP+JSON), every token pushed with
``Generations`` and the heartbeats sent over baidu_std to the master key's address;
``--kv-events off`` publishes no KV events (today's xLLM engines). Ctrl-C or SIGTERM stops it
cleanly.

Ports: ``--port 0`` (the default) picks a free instance port whose derived ports are all outside
the host's ephemeral range (:mod:`kvsvc.testbed.ports`); an explicit port with a derived port in
that range is warned about at start (with the ``sysctl`` that reserves it), since an outgoing
connection may hold it.

Exit codes: 0 clean stop, 2 bad arguments, 1 start-up failure (ports taken).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Optional

from kvsvc.errors import ConfigError, LifecycleError
from kvsvc.testbed.ports import ephemeral_ports, free_instance_port, instance_ports
from kvsvc.settings import add_flag, add_log_level
from kvsvc.testbed.traces import load_trace, request_tokens
from kvsvc.testbed.sim.engine import SimEngine
from kvsvc.testbed.sim.flavors import Flavor
from kvsvc.testbed.sim.serving import ServingConfig, profiling_data
from kvsvc.testbed.sim.native import rpc_heartbeat
from kvsvc.testbed.sim.registration import EtcdRegistration, Load, RegisteredType

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2



def add_latency_flags(parser: argparse.ArgumentParser) -> None:
    """The latency model's flags (:class:`~kvsvc.testbed.sim.serving.ServingConfig`, its
    defaults): prefill ``a + b n + c n^2``, decode steps ``d0 + d1 B + d2 B (L - 1)`` and
    ``max_num_seqs``. ``kvsvc sim`` and ``kvsvc bench-routing`` (which passes them on to its
    engines) take the same ones."""
    d = ServingConfig()
    add_flag(parser, "--prefill-us-per-token", type=float, default=d.prefill_us_per_token,
             help="simulated us per uncached prompt token (b)")
    add_flag(parser, "--decode-us-per-token", type=float, default=d.decode_us_per_token,
             help="fixed part of one decode step (d0), simulated us")
    add_flag(parser, "--prefill-base-us", type=float, default=d.prefill_base_us,
             help="fixed part of one prefill (a), simulated us")
    add_flag(parser, "--prefill-us-per-token-sq", type=float, default=d.prefill_us_per_token_sq,
             help="simulated us per squared uncached prompt token (c, attention)")
    add_flag(parser, "--decode-us-per-seq", type=float, default=d.decode_us_per_seq,
             help="simulated us per decoding sequence per step (d1)")
    add_flag(parser, "--decode-us-per-context-token", type=float,
             default=d.decode_us_per_context_token,
             help="simulated us per context token of each decoding sequence per step (d2)")
    add_flag(parser, "--max-num-seqs", type=int, default=d.max_num_seqs,
             help="running requests per rank; the rest wait")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``kvsvc sim`` flags to ``parser``, each in both spellings (``--block-size``,
    ``--block_size``: :func:`kvsvc.settings.add_flag`) and, where ``serve`` has the same
    thing, under ``serve``'s name too (``--etcd_addr``, ``--etcd_namespace``,
    ``--internal_api_token_file``, ``--log_level``, ``--tokenizer_path``). Help texts leave the
    default to the formatter (``kvsvc sim --help`` shows every one)."""
    add_flag(parser, "--name", default="", help="instance name for logs (empty: host:port)")
    add_flag(parser, "--host", default="127.0.0.1", help="bind address")
    add_flag(parser, "--port", type=int, default=0,
             help="the instance's (nominal) HTTP port the other ports derive from; 0: a free "
                  "one whose derived ports are all outside the ephemeral range "
                  "(kvsvc.testbed.ports)")
    add_flag(parser, "--dp", type=int, default=1, help="DP ranks")
    add_flag(parser, "--block-size", type=int, default=128, help="tokens per block")
    add_flag(parser, "--device-blocks", type=int, default=4096, help="Device pool per rank")
    add_flag(parser, "--host-blocks", type=int, default=0, help="Host pool per rank (0: none)")
    add_flag(parser, "--topic", default="", help="ZMQ topic of the live events")
    add_flag(parser, "--event-port-offset", type=int, default=10000,
             help="rank r publishes on port + this + r (§9)")
    add_flag(parser, "--replay-port-offset", type=int, default=30000,
             help="rank r serves snapshots on port + this + r (§9)")
    add_flag(parser, "--flavor", default=Flavor.XLLM.value, choices=[f.value for f in Flavor],
             help="wire form and replay behaviour: xllm (snapshots, §7), vllm (map batches "
                  "with data_parallel_rank, GPU/CPU media, int Device and bytes CPU hashes, "
                  "history replay §7h), sglang ([ts, events, attn_dp_rank], tagged arrays, "
                  "history replay)")
    add_flag(parser, "--buffer-steps", type=int, default=10_000,
             help="vllm/sglang: batches kept per rank for history replay (vLLM's buffer_steps)")
    add_flag(parser, "--no-replay", action="store_true",
             help="bind no replay endpoint (an engine started without replay_endpoint)")
    add_flag(parser, "--vllm-array", action="store_true",
             help="vllm: publish the older tagged-array batch form instead of the map form")
    add_flag(parser, "--trace", default=None,
             help="replay this trace (conversation, synthetic or a path) after start")
    add_flag(parser, "--requests", type=int, default=0,
             help="replay at most this many trace requests (0: all)")
    add_flag(parser, "--interval-ms", type=float, default=100.0,
             help="pause between replayed requests, ms")
    add_flag(parser, "--etcd", "--etcd_addr", dest="etcd", default="",
             help="etcd host:port: register in the instance registry (§9) and serve GET "
                  "/health on --port (empty: no registry)")
    add_flag(parser, "--etcd-namespace", default="", help="registry key namespace")
    add_flag(parser, "--type", default="DEFAULT", choices=[t.name for t in RegisteredType],
             help="registered instance type")
    add_flag(parser, "--internal-api-token-file", default="",
             help="file holding the service's X-Internal-Token for heartbeats (empty: "
                  "KVSVC_INTERNAL_API_TOKEN)")
    add_flag(parser, "--heartbeat-interval-s", type=float, default=1.0,
             help="heartbeat period, seconds")
    add_flag(parser, "--heartbeats", default="auto", choices=("auto", "on", "off"),
             help="send load heartbeats: auto = xllm only (real vLLM and SGLang send none; "
                  "their load is scraped from /metrics, §15)")
    d = ServingConfig()
    add_flag(parser, "--serve", action="store_true",
             help="serve OpenAI completions on --port (kvsvc.testbed.sim.serving)")
    add_latency_flags(parser)
    add_flag(parser, "--host-load-us-per-token", type=float, default=d.host_load_us_per_token,
             help="simulated us per Host-only hit token")
    add_flag(parser, "--stream-coalesce-ms", type=float, default=d.stream_coalesce_ms,
             help="streams: write the SSE events of decode steps at least this many wall ms "
                  "apart together (0: one write per token)")
    add_flag(parser, "--no-profiling-data", action="store_true",
             help="with --serve --etcd: register without ttft/tpot_profiling_data")
    add_flag(parser, "--time-scale", type=float, default=d.time_scale,
             help="time compression factor (1: real time)")
    add_flag(parser, "--max-connections", type=int, default=d.max_connections,
             help="HTTP connections served at once")
    add_flag(parser, "--model", default=d.model,
             help="the model served: answers name it, a request for another one gets 404")
    add_flag(parser, "--max-model-len", type=int, default=d.max_model_len,
             help="context, tokens: a prompt plus max_tokens beyond it gets 400 (vLLM's "
                  "--max-model-len)")
    add_flag(parser, "--tokenizer-path", default="",
             help="tokenizer.json (or its directory) for text prompts; empty: one token per "
                  "UTF-8 byte")
    add_flag(parser, "--heartbeat-on-change-ms", type=float, default=0.0,
             help="with --serve: heartbeat early when the waiting queue changes, at most "
                  "once per this many ms (0: only every interval)")
    add_flag(parser, "--master-refresh-s", type=float, default=0.0,
             help="re-read the master's address after this long (0: every heartbeat)")
    add_flag(parser, "--native", action="store_true",
             help="with --serve, flavor xllm: an xLLM engine with service routing (§13): "
                  "requests over XllmAPIService (baidu_std or HTTP+JSON on --port), every "
                  "token pushed with Generations and heartbeats over baidu_std to the "
                  "service (kvsvc serve --xllm_dispatch native --rpc_port ...)")
    add_flag(parser, "--kv-events", default="on", choices=("on", "off"),
             help="publish KV events (off: today's xLLM engines publish none; route them "
                  "with discovery.approximate_backends, §14)")
    add_log_level(parser, "info")


def sends_heartbeats(mode: str, flavor: str) -> bool:
    """``--heartbeats`` for an engine of ``flavor``: ``on``, ``off``, or ``auto`` (only xLLM
    heartbeats; vLLM and SGLang publish their load in ``/metrics`` instead, §15)."""
    if mode == "auto":
        return flavor == "xllm"
    return mode == "on"


def ephemeral_hint(port: int, dp_size: int, event_port_offset: int,
                   replay_port_offset: int) -> str:
    """What to do when a port of instance ``port`` (§9 rule) is in the host's ephemeral range,
    where an outgoing connection may hold it (``Address already in use``); empty when none is.
    """
    eph = ephemeral_ports()
    hit = sorted(p for p in instance_ports(port, dp_size, event_port_offset, replay_port_offset)
                 if eph.collides(p))
    if not hit:
        return ""
    listed = ",".join(str(p) for p in hit)
    return (f"port(s) {listed} in the ephemeral range {eph.describe()} "
            f"(net.ipv4.ip_local_port_range): an outgoing connection can hold them; reserve "
            f"them (sysctl -w net.ipv4.ip_local_reserved_ports={listed}) or pick a --port "
            f"whose derived ports are outside it (--port 0 does)")


def run(args: argparse.Namespace, stop: Optional[threading.Event] = None) -> int:
    """Run the engine until SIGINT/SIGTERM (or ``stop`` is set, for embedding and tests).

    :param args: parsed :func:`add_arguments` flags.
    :param stop: optional external stop switch; signal handlers are installed only when this
        runs on the main thread.
    :returns: exit code.
    """
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.port == 0 and args.dp >= 1:
        try:
            args.port = free_instance_port(args.dp, args.event_port_offset,
                                           args.replay_port_offset, host=args.host)
        except (LifecycleError, OSError) as exc:
            log.error("--port 0: %s", exc)
            return EXIT_USAGE
    event_port = args.port + args.event_port_offset
    replay_port = args.port + args.replay_port_offset
    if args.dp < 1 or args.port < 1 or max(event_port, replay_port) + args.dp - 1 > 65535:
        log.error("bad --port/--dp/offsets: ports out of range")
        return EXIT_USAGE
    hint = ephemeral_hint(args.port, args.dp, args.event_port_offset, args.replay_port_offset)
    if hint:
        log.warning("sim %s:%d: %s", args.host, args.port, hint)
    token = os.environ.get("KVSVC_INTERNAL_API_TOKEN") or None
    if args.etcd:
        if args.host in ("0.0.0.0", "::", "*"):
            log.error("--etcd needs a connectable --host (the instance name is host:port)")
            return EXIT_USAGE
        if args.internal_api_token_file:
            try:
                token = Path(args.internal_api_token_file).read_text(encoding="utf-8").strip()
            except OSError as exc:
                log.error("cannot read --internal-api-token-file: %s", exc.strerror)
                return EXIT_USAGE
    requests = []
    if args.trace:
        try:
            requests = load_trace(args.trace)
        except ConfigError as exc:
            log.error("%s", exc)
            return EXIT_USAGE
        if args.requests > 0:
            requests = requests[:args.requests]
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: stop.set())
    serving: Optional[ServingConfig] = None
    tokenizer = None
    try:
        if args.serve:
            serving = ServingConfig(
                prefill_us_per_token=args.prefill_us_per_token,
                host_load_us_per_token=args.host_load_us_per_token,
                decode_us_per_token=args.decode_us_per_token, max_num_seqs=args.max_num_seqs,
                time_scale=args.time_scale, max_connections=args.max_connections,
                model=args.model, prefill_base_us=args.prefill_base_us,
                prefill_us_per_token_sq=args.prefill_us_per_token_sq,
                decode_us_per_seq=args.decode_us_per_seq,
                decode_us_per_context_token=args.decode_us_per_context_token,
                stream_coalesce_ms=args.stream_coalesce_ms,
                max_model_len=args.max_model_len)
            if args.tokenizer_path:
                from kvsvc.routing.prompt import PromptTokenizer  # tokenizers/jinja2 only when asked

                # The router's segment cache too: a conversation's earlier turns are not
                # tokenized again (exact; a real engine's cost is not the sim's subject).
                tokenizer = PromptTokenizer.load(args.tokenizer_path, cache_tokens=1 << 20)
        engine = SimEngine(args.name or f"{args.host}:{args.port}", event_port, replay_port,
                           dp_size=args.dp, block_size=args.block_size,
                           device_blocks=args.device_blocks, host_blocks=args.host_blocks,
                           topic=args.topic, host=args.host,
                           http_port=args.port if args.etcd or args.serve else None,
                           serving=serving, tokenizer=tokenizer, flavor=args.flavor,
                           buffer_steps=args.buffer_steps,
                           replay_endpoint=not args.no_replay, vllm_array=args.vllm_array,
                           native=args.native, kv_events=args.kv_events == "on")
    except (ValueError, ConfigError) as exc:
        log.error("%s", exc)
        return EXIT_USAGE
    registration: Optional[EtcdRegistration] = None
    try:
        engine.start()
        if args.etcd:
            registration = EtcdRegistration(
                args.etcd, f"{args.host}:{args.port}", args.dp,
                lambda: Load(engine.waiting_requests(), engine.device_usage()),
                instance_type=RegisteredType[args.type], namespace=args.etcd_namespace,
                token=token, heartbeat_interval_s=args.heartbeat_interval_s,
                min_heartbeat_gap_s=(args.heartbeat_on_change_ms / 1000.0
                                     if args.heartbeat_on_change_ms > 0 else None),
                master_refresh_s=args.master_refresh_s,
                backend_type=engine.flavor.backend_type,
                profiling=(profiling_data(serving)
                           if serving is not None and not args.no_profiling_data else None),
                heartbeats=sends_heartbeats(args.heartbeats, engine.flavor.value),
                heartbeat=(rpc_heartbeat(engine.native.client) if engine.native is not None
                           else None))
            if engine.native is not None:
                engine.native.set_master(registration.master)
            if engine.serving is not None:
                engine.serving.add_load_listener(registration.load_changed)
            registration.start()
    except (LifecycleError, ConfigError) as exc:
        log.error("%s%s", exc, f" ({hint})" if hint else "")
        engine.close()
        return EXIT_FAILED
    try:
        log.info("sim %s: %d %s rank(s) running: HTTP port %d, events tcp://%s:%d, %s "
                 "tcp://%s:%d (+ rank); Ctrl-C to stop", engine.name, args.dp,
                 engine.flavor.value, args.port, args.host, event_port,
                 "no replay on" if args.no_replay else
                 ("history" if engine.flavor.history else "snapshots"), args.host, replay_port)
        for i, req in enumerate(requests):
            if stop.is_set():
                break
            res = engine.execute(request_tokens(req, args.block_size))
            log.info("sim %s: request %d on dp%d: device hit %d, host-only hit %d, stored %d "
                     "blocks, seq %s", engine.name, i, res.rank, res.device_hit_tokens,
                     res.host_only_hit_tokens, res.stored_blocks, res.seq)
            stop.wait(args.interval_ms / 1000.0)
        stop.wait()
    finally:
        try:
            if registration is not None:
                registration.close()
        finally:
            engine.close()
        log.info("sim %s: stopped", engine.name)
    return EXIT_OK
