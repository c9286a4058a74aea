"""``kvsvc up``: a whole local cluster in the foreground until Ctrl-C, like ``docker compose up``.

What runs, each a child process in its own session (a terminal's Ctrl-C reaches only this
process, which then stops them in order):

1. etcd, the instance registry of §9: a local member on free loopback ports with a temporary
   data directory (:class:`~kvsvc.testbed.etcd_launcher.LocalEtcd`, Debian's ``etcd-server``),
   or the one given by ``--etcd``.
2. ``--engines`` simulated engines, each exactly ``kvsvc sim --serve --etcd E --port P``
   (:mod:`kvsvc.testbed.sim.cli`): it serves ``/health``, ``/v1/completions``,
   ``/v1/chat/completions`` and ``/v1/embeddings`` on ``P``, publishes its KV events on the §9
   ports ``P + 10000 + r`` / ``P + 30000 + r``, registers in etcd and heartbeats its load to
   the master (``--flavor vllm``/``sglang``: their event forms and history replay, no
   heartbeats: the router scrapes their ``/metrics``, and with ``--dp`` > 1 DP-rank routing). ``P`` is picked so that all of its ports are free and outside the ephemeral range
   (:func:`~kvsvc.testbed.ports.free_instance_port`), unless ``--engine-port`` says.
Engines and router share one tokenizer, written once into the temporary directory
(:func:`~kvsvc.testbed.tokenizer.write_tokenizer`: a byte-level BPE built in code, ChatML chat
template), so text prompts (OpenAI SDK, aiperf, guidellm) tokenize alike on both sides and are
routed on their cache hits.

3. The router: ``kvsvc serve`` on ``127.0.0.1:--port`` (default ``$KVSVC_PORT``, else 8888)
   with a §8 *discovery* config (:func:`~kvsvc.testbed.demo.discovery_config`) on that etcd
   and the internal token of ``--token-file`` (:class:`~kvsvc.testbed.demo.ServiceProcess`).
   The token file is created (mode 0600, a random token) when missing, and kept on exit so
   that the README's later commands (and the next ``kvsvc up``) use the same token.

Once ``/ready`` answers 200 listing every engine's streams and every engine is a routing
candidate (its first load report arrived, §11), it prints ``kvsvc up: ready``, the URLs and
the curl lines to try, then waits. SIGINT, SIGTERM or SIGHUP stops the router, then the engines (a
clean stop revokes their leases while etcd still runs), then etcd, and removes the temporary
directory (logs, config, etcd data); further signals are ignored while that runs (every stop
is bounded). Exit codes: 0 after Ctrl-C / SIGTERM, 1 when a part did not start (its log tail
on stderr), 2 bad options or a router port that cannot be bound (nothing started).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Optional, TextIO

import requests

from kvsvc.cli import check_bind
from kvsvc.errors import ConfigError, KvsvcError, LifecycleError
from kvsvc.settings import add_flag, add_log_level
from kvsvc.testbed.demo import DemoOptions, ServiceProcess, discovery_config
from kvsvc.testbed.etcd_launcher import LocalEtcd
from kvsvc.testbed.sim.flavors import Flavor
from kvsvc.testbed.ports import free_instance_port, instance_ports
from kvsvc.testbed.tokenizer import write_tokenizer

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

#: The line printed once everything answers (tests and scripts wait for it).
READY_LINE = "kvsvc up: ready"
DEFAULT_PORT = 8888
MODEL = "sim"


@dataclass(frozen=True)
class UpOptions:
    """What ``kvsvc up`` starts.

    :param engines: simulated engines (>= 1).
    :param dp: DP ranks per engine (>= 1): streams = ``engines * dp``.
    :param port: the router's HTTP port on 127.0.0.1.
    :param engine_port: first engine's port, the next ones ``dp`` apart; 0 picks free ones
        outside the ephemeral range.
    :param token_file: the internal token's file (created when missing, kept on exit).
    :param etcd: an etcd ``host:port`` to use instead of starting one.
    :param ready_timeout_s: bound of each start-up wait, seconds.
    :param refresh_interval_ms: the router's discovery refresh (§8), ms.
    :param resync_interval_ms: the router's periodic snapshot (§8), ms.
    :param xllm: ``http`` (the engines serve OpenAI over HTTP, the router relays it) or
        ``native`` (§13: xLLM engines with service routing; the router runs ``--xllm_dispatch
        native`` with a baidu_std port and a byte-level tokenizer,
        :mod:`kvsvc.testbed.tokenizer`, for text prompts).
    :param kv_events: the engines publish KV events; without, the router routes the
        engines with the approximate index (§14: ``backends`` ``[]``,
        ``approximate_backends`` ``[flavor]``).
    :param flavor: the engines' flavor (``kvsvc sim --flavor``,
        :class:`~kvsvc.testbed.sim.flavors.Flavor`): ``xllm`` (snapshots, heartbeats),
        ``vllm`` or ``sglang`` (their event forms and history replay, §7h; no heartbeats: the
        router reads their load from ``/metrics``, §15; with ``dp`` > 1 they honour
        ``X-data-parallel-rank``, so the router routes to an (engine, DP rank) pair).
    """

    engines: int = 2
    dp: int = 1
    port: int = DEFAULT_PORT
    engine_port: int = 0
    token_file: str = "kvsvc.token"
    etcd: str = ""
    ready_timeout_s: float = 60.0
    refresh_interval_ms: int = 200
    resync_interval_ms: int = 30000
    xllm: str = "http"
    kv_events: bool = True
    flavor: str = Flavor.XLLM.value

    def sim_flags(self) -> tuple[str, ...]:
        """The ``kvsvc sim --serve`` flags every engine of this cluster takes from these
        options (the DP ranks apart): native mode, no KV events, the flavor."""
        return (("--native",) if self.xllm == "native" else ()) + (
            () if self.kv_events else ("--kv-events", "off")) + (
            ("--flavor", self.flavor) if self.flavor != Flavor.XLLM.value else ())

    def check(self) -> None:
        """:raises ConfigError: a value out of range (naming the flag)."""
        if self.engines < 1:
            raise ConfigError("--engines", "must be >= 1")
        if self.dp < 1:
            raise ConfigError("--dp", "must be >= 1")
        if not 1 <= self.port <= 65535:
            raise ConfigError("--port", "must be in 1-65535")
        if self.engine_port and not 1024 <= self.engine_port <= 65535:
            raise ConfigError("--engine-port", "must be 0 (pick) or in 1024-65535")
        if self.ready_timeout_s <= 0:
            raise ConfigError("--ready-timeout-s", "must be > 0")
        if self.xllm not in ("http", "native"):
            raise ConfigError("--xllm", f"must be http or native, got {self.xllm!r}")
        if self.flavor not in {f.value for f in Flavor}:
            raise ConfigError("--flavor", f"must be xllm, vllm or sglang, got {self.flavor!r}")
        if self.xllm == "native" and self.flavor != Flavor.XLLM.value:
            raise ConfigError("--xllm", f"native needs --flavor xllm, got {self.flavor!r}")


def read_or_create_token(path: Path) -> str:
    """The token in ``path`` (first line), or a new random one written there with mode 0600.

    :raises ConfigError: the file cannot be read or created, or is empty.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        try:
            token = path.read_text(encoding="utf-8").splitlines()[0].strip()
        except (OSError, IndexError, UnicodeDecodeError) as exc:
            raise ConfigError("--token-file", f"cannot read {path}: {exc}") from exc
        if not token:
            raise ConfigError("--token-file", f"{path} is empty")
        return token
    except OSError as exc:
        raise ConfigError("--token-file", f"cannot create {path}: {exc.strerror}") from exc
    token = secrets.token_hex(32)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(token + "\n")
    return token


class SimProcess:
    """One ``kvsvc sim --serve`` child registered in etcd, output to ``log_path``.

    :param port: its instance port (the §9 name is ``127.0.0.1:port``).
    :param dp: its DP ranks.
    :param etcd_addr: the registry.
    :param token: the router's internal token (heartbeats), passed in the environment.
    :param extra_args: more ``kvsvc sim`` flags (``--native``, ``--kv-events off``).
    :param tokenizer_path: the shared tokenizer's directory (:mod:`kvsvc.testbed.tokenizer`),
        ``None``: the sim's byte scheme.
    """

    def __init__(self, port: int, dp: int, etcd_addr: str, token: str, log_path: Path,
                 extra_args: tuple[str, ...] = (),
                 tokenizer_path: Optional[Path] = None) -> None:
        self.port = port
        self.dp = dp
        self.name = f"127.0.0.1:{port}"
        self.log_path = log_path
        self._argv = [sys.executable, "-m", "kvsvc", "sim", "--serve", "--host", "127.0.0.1",
                      "--port", str(port), "--dp", str(dp), "--etcd", etcd_addr,
                      "--model", MODEL, "--log-level", "warning", *extra_args]
        if tokenizer_path is not None:
            self._argv += ["--tokenizer-path", str(tokenizer_path)]
        self._env = dict(os.environ, KVSVC_INTERNAL_API_TOKEN=token)
        self._proc: Optional[subprocess.Popen[bytes]] = None
        self._log: Optional[TextIO] = None

    @property
    def pid(self) -> Optional[int]:
        """The child's pid while started."""
        return self._proc.pid if self._proc is not None else None

    def command(self) -> str:
        """The equivalent shell command (without the token, which travels in the env)."""
        return shlex.join(["kvsvc", *self._argv[3:]])

    def start(self) -> None:
        """Start the child (returns at once; :meth:`wait_serving` waits for it)."""
        self._log = open(self.log_path, "w", encoding="utf-8")
        self._proc = subprocess.Popen(self._argv, env=self._env, stdout=self._log,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True)

    def wait_serving(self, deadline: float, http: requests.Session) -> None:
        """Return once ``GET /health`` answers 200.

        :param deadline: ``time.monotonic()`` bound.
        :raises LifecycleError: the child exited or did not answer in time (log tail).
        """
        while True:
            if self._proc is None or self._proc.poll() is not None:
                code = None if self._proc is None else self._proc.returncode
                raise LifecycleError(f"engine {self.name} exited with {code}:\n{self.log_tail()}")
            try:
                if http.get(f"http://{self.name}/health", timeout=1.0).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() >= deadline:
                raise LifecycleError(f"engine {self.name} not serving in time:\n"
                                     f"{self.log_tail()}")
            time.sleep(0.05)  # polling a child process: bounded by the deadline

    def log_tail(self, n_bytes: int = 2000) -> str:
        """The end of the child's output."""
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")[-n_bytes:]
        except OSError:
            return "(no log)"

    def close(self, timeout_s: float = 10.0) -> None:
        """SIGINT (a clean stop revokes the lease), SIGKILL after ``timeout_s``. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.error("up: engine %s did not stop within %.0f s; killing it", self.name,
                          timeout_s)
                proc.kill()
                proc.wait(5.0)
        if self._log is not None:
            self._log.close()
            self._log = None


class LocalCluster:
    """etcd, the engines and the router of :class:`UpOptions`, started by :meth:`start` and
    stopped by :meth:`close` (see the module docstring).

    :ivar router_url: ``http://127.0.0.1:<port>``.
    :ivar etcd_addr: the registry's ``host:port`` (after :meth:`start`).
    :ivar engines: the engine processes.
    :ivar tmp: the temporary directory (removed by :meth:`close`).
    """

    def __init__(self, opts: UpOptions) -> None:
        self.opts = opts
        self.router_url = f"http://127.0.0.1:{opts.port}"
        self.etcd_addr = opts.etcd
        self.engines: list[SimProcess] = []
        self.tmp = Path(tempfile.mkdtemp(prefix="kvsvc-up-"))
        self.token_file = Path(opts.token_file)
        self.service: Optional[ServiceProcess] = None
        self._etcd: Optional[LocalEtcd] = None
        #: The router's baidu_std port with ``xllm`` ``native``, else 0.
        self.rpc_port = 0

    def _engine_ports(self) -> list[int]:
        o = self.opts
        offsets = (DemoOptions.event_port_offset, DemoOptions.replay_port_offset)
        taken = {o.port}
        if not o.engine_port:
            return [free_instance_port(o.dp, *offsets, avoid=taken) for _ in range(o.engines)]
        ports = [o.engine_port + i * o.dp for i in range(o.engines)]
        for p in ports:
            for q in sorted(instance_ports(p, o.dp, *offsets)):
                if q > 65535 or q in taken:
                    raise ConfigError("--engine-port", f"engine port {q} out of range or "
                                                       "taken by the router")
                check_bind("127.0.0.1", q, "--engine-port")
        return ports

    def start(self) -> None:
        """Start everything and return once it answers (see the module docstring).

        :raises ConfigError: the router port or an ``--engine-port`` cannot be bound, or the
            token file cannot be used (nothing is left running).
        :raises LifecycleError: a part did not start (log tail in the message).
        """
        o = self.opts
        check_bind("127.0.0.1", o.port, "--port")
        token = read_or_create_token(self.token_file)
        ports = self._engine_ports()
        if not self.etcd_addr:
            self._etcd = LocalEtcd(name="kvsvc-up")
            self._etcd.start(o.ready_timeout_s)
            self.etcd_addr = self._etcd.addr
        deadline = time.monotonic() + o.ready_timeout_s
        sim_args = o.sim_flags()
        # One tokenizer for the engines and the router: text prompts hit (issue 20 item 5);
        # a native xLLM engine takes the router's token ids.
        tokenizer = write_tokenizer(self.tmp / "tokenizer")
        for i, port in enumerate(ports):
            eng = SimProcess(port, o.dp, self.etcd_addr, token, self.tmp / f"engine-{i}.log",
                             sim_args, tokenizer)
            self.engines.append(eng)
            eng.start()
        with requests.Session() as http:
            http.trust_env = False  # loopback: never through a proxy of the environment
            for eng in self.engines:
                eng.wait_serving(deadline, http)
        demo_opts = DemoOptions(refresh_interval_ms=o.refresh_interval_ms,
                                resync_interval_ms=o.resync_interval_ms, flavor=o.flavor)
        doc = discovery_config(demo_opts)
        if not o.kv_events:
            doc["discovery"]["backends"] = []
            doc["discovery"]["approximate_backends"] = [Flavor(o.flavor).backend_type]
        cfg = self.tmp / "kv_events.json"
        cfg.write_text(json.dumps(doc, indent=2), encoding="utf-8")
        router_args = ["--log_format", "text", "--tokenizer_path", str(tokenizer)]
        if o.xllm == "native":
            self.rpc_port = free_instance_port(1, 1, 2, avoid={o.port, *ports})
            router_args += ["--xllm_dispatch", "native", "--rpc_port", str(self.rpc_port),
                            "--rpc_host", "127.0.0.1"]
        self.service = ServiceProcess(cfg, o.port, token, self.tmp / "router.log",
                                      etcd_addr=self.etcd_addr, extra_args=router_args)
        self.service.session.trust_env = False
        self.service.start(o.ready_timeout_s,
                           {(e.name, r) for e in self.engines for r in range(e.dp)}
                           if o.kv_events else None)
        self.service.wait_routable({e.name for e in self.engines}, o.ready_timeout_s)

    def pids(self) -> list[int]:
        """Pids of every child process started (router, engines, etcd) still tracked."""
        out = [e.pid for e in self.engines if e.pid is not None]
        if self.service is not None and self.service.pid is not None:
            out.append(self.service.pid)
        if self._etcd is not None and self._etcd.pid is not None:
            out.append(self._etcd.pid)
        return out

    def close(self) -> None:
        """Stop the router, then the engines, then etcd; remove the temporary directory.
        Idempotent; each stop is bounded."""
        try:
            if self.service is not None:
                self.service.close()
        finally:
            try:
                for eng in self.engines:
                    eng.close()
            finally:
                try:
                    if self._etcd is not None:
                        self._etcd.cleanup()
                finally:
                    shutil.rmtree(self.tmp, ignore_errors=True)

    def banner(self) -> str:
        """What ``kvsvc up`` prints once ready: the parts, their URLs and the lines to try."""
        o = self.opts
        auth = f'"X-Internal-Token: $(cat {shlex.quote(str(self.token_file))})"'
        lines = [f"{READY_LINE}: router {self.router_url}, {len(self.engines)} engines, etcd "
                 f"{self.etcd_addr}{' (local)' if self._etcd is not None else ''}. "
                 "Ctrl-C stops everything.",
                 f"  router   {self.router_url}  (kvsvc serve, discovery; log "
                 f"{self.tmp / 'router.log'})"]
        flavor = Flavor(o.flavor)
        replay = "history" if flavor.history else "snapshots"
        for eng in self.engines:
            # Without KV events nothing is published or replayed there: no endpoint to show.
            ports = (f"events tcp://127.0.0.1:{eng.port + DemoOptions.event_port_offset}, "
                     f"{replay} tcp://127.0.0.1:{eng.port + DemoOptions.replay_port_offset}"
                     f"{' (+ rank)' if o.dp > 1 else ''}" if o.kv_events else "no KV events")
            lines.append(f"  engine   http://{eng.name}  {flavor.value}, {o.dp} DP "
                         f"rank{'s' if o.dp > 1 else ''}, {ports}  ({eng.command()})")
        if flavor is not Flavor.XLLM:
            lines.append(f"  load     {flavor.value} engines send no heartbeats: the router reads "
                         "their load from their /metrics (§15)")
            if o.dp > 1:
                lines.append("  DP rank  the router picks an (engine, DP rank) pair and sends "
                             "X-data-parallel-rank; the answer's x-sim-rank header (curl -i) "
                             "and /v1/internal/route's prefill_dp_rank show it")
        if self.rpc_port:
            lines.append(f"  xLLM     native (§13): the router's baidu_std port 127.0.0.1:"
                         f"{self.rpc_port} takes the engines' heartbeats and Generations")
        if not o.kv_events:
            lines.append("  index    no KV events: approximate (§14, completeness "
                         "\"approximate\")")
        lines += [f"  etcd     {self.etcd_addr}",
                  f"  token    {self.token_file} (X-Internal-Token of /v1/internal/*; kept on exit)",
                  "",
                  "Try, in another terminal in this directory:",
                  f"  URL={self.router_url}; AUTH={auth}; PROMPT=$(seq -s, 1 1024)",
                  "  curl -s $URL/health",
                  "  curl -s $URL/ready",
                  "  curl -s $URL/metrics | grep ^kvsvc_instance_state",
                  "  curl -s $URL/v1/completions -H 'Content-Type: application/json' "
                  f"-d \"{{\\\"model\\\": \\\"{MODEL}\\\", \\\"prompt\\\": [$PROMPT], "
                  "\\\"max_tokens\\\": 8}\"",
                  "  curl -sN $URL/v1/completions -H 'Content-Type: application/json' "
                  f"-d \"{{\\\"model\\\": \\\"{MODEL}\\\", \\\"prompt\\\": [$PROMPT], "
                  "\\\"max_tokens\\\": 4, \\\"stream\\\": true}\"",
                  "  curl -s $URL/v1/chat/completions -H 'Content-Type: application/json' "
                  f"-d '{{\"model\": \"{MODEL}\", \"messages\": [{{\"role\": \"user\", "
                  "\"content\": \"Hello!\"}], \"max_tokens\": 8}'",
                  "  curl -sN $URL/v1/chat/completions -H 'Content-Type: application/json' "
                  f"-d '{{\"model\": \"{MODEL}\", \"messages\": [{{\"role\": \"user\", "
                  "\"content\": \"Hello!\"}], \"max_tokens\": 4, \"stream\": true}'",
                  "  curl -s $URL/v1/embeddings -H 'Content-Type: application/json' "
                  f"-d '{{\"model\": \"{MODEL}\", \"input\": \"Hello!\"}}'",
                  "  curl -s -X POST $URL/v1/internal/kv-cache/query -H \"$AUTH\" "
                  "-H 'Content-Type: application/json' -d \"{\\\"token_ids\\\": [$PROMPT]}\"",
                  "  curl -s -X POST $URL/v1/internal/route -H \"$AUTH\" "
                  "-H 'Content-Type: application/json' -d \"{\\\"token_ids\\\": [$PROMPT]}\"",
                  "",
                  "Add your own engine to this cluster:",
                  f"  kvsvc sim --serve --etcd {self.etcd_addr} "
                  f"--internal-api-token-file {shlex.quote(str(self.token_file))}"
                  + "".join(" " + shlex.quote(f) for f in o.sim_flags())
                  + (f" --dp {o.dp}" if o.dp > 1 else "")]
        return "\n".join(lines)


# ---- CLI ---------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``kvsvc up`` flags to ``parser``."""
    d = UpOptions()
    env_port = os.environ.get("KVSVC_PORT", "")
    add_flag(parser, "--engines", type=int, default=d.engines, help="simulated engines")
    add_flag(parser, "--dp", type=int, default=d.dp, help="DP ranks per engine")
    add_flag(parser, "--port", type=int,
             default=int(env_port) if env_port.isdigit() else d.port,
             help=f"the router's port on 127.0.0.1 ($KVSVC_PORT when set, else {DEFAULT_PORT})")
    add_flag(parser, "--engine-port", type=int, default=d.engine_port,
             help="first engine's port, the others --dp apart (0: free ports whose derived "
                  "ports are outside the ephemeral range)")
    add_flag(parser, "--token-file", default=d.token_file,
             help="internal token file, created (0600) when missing and kept on exit")
    add_flag(parser, "--etcd", "--etcd_addr", dest="etcd", default=d.etcd,
             help="etcd host:port to use (empty: start a local one; needs Debian's "
                  "etcd-server)")
    add_flag(parser, "--ready-timeout-s", type=float, default=d.ready_timeout_s,
             help="bound of each start-up wait, seconds")
    add_flag(parser, "--xllm", default=d.xllm, choices=("http", "native"),
             help="native: the engines are xLLM engines with service routing (§13: requests "
                  "and every token over baidu_std; the router gets --xllm_dispatch native, a "
                  "baidu_std port and a byte-level tokenizer)")
    add_flag(parser, "--kv-events", default="on", choices=("on", "off"),
             help="off: the engines publish no KV events (today's xLLM); the router uses the "
                  "approximate index (§14)")
    add_flag(parser, "--flavor", default=d.flavor, choices=[f.value for f in Flavor],
             help="the engines' flavor (kvsvc sim --flavor): vllm and sglang publish their "
                  "own event forms, answer replays with history (§7h), send no heartbeats "
                  "(the router scrapes /metrics) and, with --dp > 1, honour "
                  "X-data-parallel-rank (DP-rank routing)")
    add_log_level(parser, "warning")

def _interrupt(signum: int, frame: Optional[FrameType]) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace, stop: Optional[threading.Event] = None,
        out: Optional[TextIO] = None) -> int:
    """``kvsvc up``: start, print :meth:`LocalCluster.banner`, wait for SIGINT/SIGTERM (or
    ``stop``, for embedding), stop everything.

    :returns: the exit code (see the module docstring).
    """
    out = out or sys.stdout
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    opts = UpOptions(engines=args.engines, dp=args.dp, port=args.port,
                     engine_port=args.engine_port, token_file=args.token_file, etcd=args.etcd,
                     ready_timeout_s=args.ready_timeout_s, xllm=args.xllm,
                     kv_events=args.kv_events == "on", flavor=args.flavor)
    main = threading.current_thread() is threading.main_thread()
    if main:
        # SIGTERM and SIGHUP (the terminal closed) as Ctrl-C: each ends the start-up waits or
        # the idle wait alike, and the children are stopped (they run in sessions of their
        # own, so a hang-up would not reach them).
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _interrupt)
    code = EXIT_OK
    cluster: Optional[LocalCluster] = None
    try:
        opts.check()
        cluster = LocalCluster(opts)
        print(f"kvsvc up: starting etcd, {opts.engines} engines and the router on "
              f"{cluster.router_url} ...", file=out, flush=True)
        cluster.start()
        print(cluster.banner(), file=out, flush=True)
        if stop is not None:
            stop.wait()
        else:
            while True:
                signal.pause()
    except KeyboardInterrupt:
        print("kvsvc up: stopping ...", file=out, flush=True)
    except ConfigError as exc:
        print(f"kvsvc up: {exc.field}: {exc.message}", file=sys.stderr)
        code = EXIT_USAGE
    except KvsvcError as exc:
        print(f"kvsvc up: failed: {exc}", file=sys.stderr)
        code = EXIT_FAILED
    finally:
        if main:
            # Every stop below is bounded; a second Ctrl-C must not leave children behind.
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)
        try:
            if cluster is not None:
                cluster.close()
        finally:
            if main:
                signal.signal(signal.SIGINT, signal.default_int_handler)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if code == EXIT_OK:
        print("kvsvc up: stopped; everything it started is gone", file=out, flush=True)
    return code
