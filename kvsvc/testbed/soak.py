"""``kvsvc soak --minutes N``: a chaos soak of the whole service, audited against ground truth.

Set-up: K simulated engines in this process (:class:`~kvsvc.testbed.sim.engine.SimEngine`; engine 1
has 2 DP ranks) with small Device/Host pools so the trace keeps evicting and offloading, and the
service as a subprocess (``python -m kvsvc serve``, :class:`kvsvc.testbed.demo.ServiceProcess`) on a
static §8 config with one stream per engine rank.

One driver thread replays the trace round robin over the engines (and over a 2-DP engine's
ranks). Before each request it queries the service with the request's tokens until every stream
of a running engine is synchronized at its rank's last seq, or ``catch_up_s`` has passed, and
audits **every** answer it got (§10 fields of each stream):

- *ground truth at the same sequence*: after every published batch the driver records the rank's
  residency (``{engine hash: tiers}``) keyed by (epoch, seq), the epoch counting restarts of the
  rank's publisher; the prompt's engine hashes are chained exactly as the engine chains them, so
  the truth of any recorded state is a prefix walk;
- **false hit**: an answer predicting a block the engine does not hold: Device tokens above the
  true Device tokens, or reusable tokens above the true reusable tokens, compared with the state
  at the answer's ``sequence`` (every recorded state with that seq: after a restart two epochs
  may share a seq, and an answer is false only if false against all of them), and for an answer
  that is not synchronized with the current state (§6 says it has 0 hits anyway);
- **checked** answers: synchronized at the rank's current seq (of its current epoch); each must
  equal the truth exactly, otherwise it is a false hit or a **missed hit**.

Faults (one every ``fault_interval_s``, kinds in a seeded shuffled cycle, a stream gets a new
fault only once its previous one is over):

``drop``        the rank's next 1..3 live batches are dropped (seqs consumed: a gap);
``publisher``   the rank's seq counter restarts at 0, cache kept (seq goes backwards);
``restart``     the whole engine restarts (new process: sockets re-bound, cache empty, seq 0);
``kill``        the whole engine is down for ``engine_down_s``, then starts as a new process;
``delay``       the rank's next snapshot reply is delayed (beyond ``replay_timeout_ms`` half the
                time), then a drop forces a recovery;
``truncate``    the rank's next snapshot reply loses its end marker (and maybe data), then a
                drop forces a recovery;
``disconnect``  the rank's live socket is closed and re-bound (``SimEngine.disconnect``).

Each fault takes effect when injected (the triggering request is executed at once). Its
*unsynchronized time* per stream is from injection to the first answer synchronized at the
rank's current seq; a fault not over after ``fault_timeout_s`` is *unrecovered*.

Verdict: pass when there is no false hit, no missed hit and no unrecovered fault; ``kvsvc soak``
exits 0 on pass, 1 on fail, 2 on a usage or start-up error, 130 on Ctrl-C.

``--flavor vllm`` (or ``sglang``): the engines speak that flavor
(:mod:`kvsvc.testbed.sim.flavors`) and answer replays with history from a buffer of
``buffer_steps`` batches (§7h); every stream is configured with ``replay_mode: "history"``. The
last engine (with 2 or more engines) has no replay endpoint. Answers are audited by their
``completeness`` (§10): a checked ``exact`` answer must equal the truth (as above); a checked
``subset`` answer must not exceed it (a false hit fails the run), its shortfall is reported as
missed subset tokens, not as a failure. Faults (:data:`HISTORY_FAULT_KINDS`):

``late_join``   the service starts after every engine has published: one engine fewer batches
                than ``buffer_steps`` (its whole history: exact), one more (a rolled buffer:
                subset), the one without replay endpoint (live-only subset); measured from
                the service's start;
``drop``        1..3 live batches lost on the wire (still in the engine's buffer: catch-up);
``rollover``    ``buffer_steps + 5`` live batches lost: the buffer rolled past the stream's
                last seq (rebuild into a subset);
``reset``       the engine resets its cache: one batch ``[AllBlocksCleared]`` (a subset stream
                becomes exact); picks a stream last seen as subset when there is one;
``disconnect``  as above;
``restart``     a new engine process that publishes 3..6 batches at once, before the service
                asks again (rebuild from seq 0: exact);
``kill``        down ``engine_down_s``, then a new process that publishes 3..6 batches at once;
``idle``        the rank publishes nothing for 1.5 ``resync_interval_ms`` (periodic catch-ups
                with nothing new must keep it synchronized); measured from the end of the
                idle time;
``delay`` / ``truncate``  as above, on the history reply (a delay stalls the engine's
                publishing thread, which sends the reply).

The publisher-only restart (cache kept, seq 0) is not a vLLM event and is left out.

Errors: :class:`~kvsvc.errors.ConfigError` (unknown trace), :class:`~kvsvc.errors.LifecycleError`
(an engine or the service failed), ``ValueError`` (bad options).
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import random
import secrets
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, TextIO

import requests

from kvsvc.testbed.demo import ServiceProcess, free_port_run
from kvsvc.errors import ConfigError, KvsvcError, LifecycleError
from kvsvc.events import DEVICE
from kvsvc.testbed.sim.block_manager import chain_hash
from kvsvc.testbed.sim.engine import SimEngine
from kvsvc.testbed.sim.flavors import Flavor
from kvsvc.testbed.traces import TraceRequest, load_trace, request_tokens
from kvsvc.settings import add_flag, add_log_level

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

FAULT_KINDS = ("drop", "publisher", "restart", "kill", "delay", "truncate", "disconnect")
#: Faults of a soak on history engines (``--flavor vllm|sglang``; module docstring).
HISTORY_FAULT_KINDS = ("late_join", "drop", "rollover", "reset", "disconnect", "restart", "kill",
                       "idle", "delay", "truncate")
#: History faults injected during the run (``late_join`` happens once, at the start).
HISTORY_INJECTED = tuple(k for k in HISTORY_FAULT_KINDS if k != "late_join")

#: Recorded residency states kept per rank (an answer older than that is "unauditable").
HISTORY_STATES = 48
#: After a restart, answers may still describe the previous epoch for this long (the service
#: learns of it from the disconnect or the backward seq); later such an answer is stale.
EPOCH_GRACE_S = 2.0
#: Offset added to trace hash ids on each further pass over the trace (new content).
PASS_ID_OFFSET = 10_000_000


@dataclass(frozen=True)
class SoakOptions:
    """What the soak runs.

    :param minutes: duration of the replay, minutes (> 0).
    :param engines: simulated engines K (>= 1); engine 1 (0 when K == 1) has 2 DP ranks.
    :param seed: seeds the fault schedule.
    :param trace: ``conversation``, ``synthetic`` or a JSONL path; replayed in passes.
    :param block_size: tokens per block (must divide 512).
    :param device_blocks: Device pool per rank, blocks.
    :param host_blocks: Host pool per rank, blocks.
    :param fault_interval_s: time between two injected faults, seconds.
    :param catch_up_s: bound of the catch-up polling before each request, seconds.
    :param fault_timeout_s: a fault still open after this is unrecovered, seconds.
    :param engine_down_s: downtime of a killed engine, seconds.
    :param replay_timeout_ms: the service's §8 ``replay_timeout_ms``.
    :param resync_interval_ms: the service's §8 ``resync_interval_ms``.
    :param ready_timeout_s: bound of the wait for the service's ``/ready``.
    :param flavor: engine flavor (``xllm``, ``vllm``, ``sglang``; module docstring).
    :param buffer_steps: history flavors: each rank's replay buffer, batches.
    :param service_log: keep the service's output in this file (default: a temporary file,
        deleted at the end; its tail is printed if the soak fails to run).
    """

    minutes: float = 10.0
    engines: int = 3
    seed: int = 0
    trace: str = "conversation"
    block_size: int = 64
    device_blocks: int = 512
    host_blocks: int = 1024
    fault_interval_s: float = 1.5
    catch_up_s: float = 0.3
    fault_timeout_s: float = 30.0
    engine_down_s: float = 1.0
    replay_timeout_ms: int = 500
    resync_interval_ms: int = 5000
    ready_timeout_s: float = 60.0
    service_log: str = ""
    flavor: str = "xllm"
    buffer_steps: int = 200

    @property
    def history(self) -> bool:
        """True when the engines answer replays with history (§7h)."""
        return Flavor(self.flavor).history

    @property
    def fault_kinds(self) -> tuple[str, ...]:
        """The fault kinds of this soak (:data:`FAULT_KINDS` or :data:`HISTORY_FAULT_KINDS`)."""
        return HISTORY_FAULT_KINDS if self.history else FAULT_KINDS

    def validate(self) -> None:
        """:raises ValueError: an option out of range."""
        if self.minutes <= 0 or self.engines < 1 or self.fault_interval_s <= 0:
            raise ValueError("minutes and fault_interval_s must be > 0, engines >= 1")
        if self.buffer_steps < 10:
            raise ValueError(f"buffer_steps {self.buffer_steps} must be >= 10")
        if self.block_size < 1 or 512 % self.block_size:
            raise ValueError(f"block_size {self.block_size} must divide 512")


def listen_port_run(n: int, rng: random.Random, low: int = 20000, high: int = 32000,
                    attempts: int = 500, exclude: frozenset[int] | set[int] = frozenset()) -> int:
    """A base port ``p`` in ``[low, high]`` with ``p .. p + n - 1`` free on 127.0.0.1 now.

    Below Linux's ephemeral range (32768-60999 by default) on purpose: a killed engine re-binds
    its ports after its downtime, and a port from the ephemeral range could meanwhile have been
    handed to some outgoing connection as its source port.

    :param exclude: ports already promised to something else (not bound yet).
    :raises LifecycleError: none found in ``attempts`` tries.
    """
    for _ in range(attempts):
        base = rng.randint(low, high - n + 1)
        if exclude.intersection(range(base, base + n)):
            continue
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise LifecycleError(f"no run of {n} free ports in [{low}, {high}]")


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile ``q`` in [0, 100] of ``values``; 0.0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(-(-q * len(s) // 100)) - 1))
    return s[k]


@dataclass
class SoakReport:
    """Outcome figures of one soak.

    :param answers: stream answers audited (one per stream per query).
    :param checked: answers synchronized at the rank's current seq (compared exactly).
    :param false_hits: answers predicting a block the engine did not hold (module docstring).
    :param missed_hits: checked answers below the truth.
    :param unsynchronized_hits: answers with hits while not synchronized (§6 forbids them).
    :param unauditable: synchronized answers at a seq no recorded state has (too old).
    :param epoch_ambiguous: checked answers that differ from the current state but equal the
        state of an earlier epoch with the same seq (a restart not yet seen by the service).
    :param stale_epoch: synchronized answers at a seq of an earlier epoch that the current one
        has not reached, more than ``EPOCH_GRACE_S`` after the restart (compared with the
        current state: false hits if they promise more).
    :param unsync_s: fault kind -> unsynchronized time of every (fault, stream), seconds.
    :param faults: fault kind -> faults injected.
    :param unrecovered: faults not over within ``fault_timeout_s``.
    :param recoveries_reported: recoveries after the first synchronization, summed over the
        streams, from the service's ``/ready`` (``None`` when it could not be read).
    :param kinds: the fault kinds of the run (rows of the table).
    :param history: history engines (the completeness rows are shown).
    :param by_completeness: checked answers per ``completeness`` (``exact``, ``subset``,
        ``absent`` when the service does not send it) and unsynchronized answers (``null``).
    :param subset_missed_tokens: true reusable tokens checked subset answers did not report.
    :param idle_unsynchronized: answers of an idle rank (during its idle time) that were not
        synchronized.
    """

    requests: int = 0
    streams: int = 0
    queries: int = 0
    answers: int = 0
    checked: int = 0
    false_hits: int = 0
    missed_hits: int = 0
    unsynchronized_hits: int = 0
    unauditable: int = 0
    epoch_ambiguous: int = 0
    stale_epoch: int = 0
    hit_tokens_checked: int = 0
    kinds: tuple[str, ...] = FAULT_KINDS
    unsync_s: dict[str, list[float]] = field(default_factory=dict)
    faults: dict[str, int] = field(default_factory=dict)
    unrecovered: int = 0
    recoveries_reported: Optional[int] = None
    dropped: int = 0
    elapsed_s: float = 0.0
    examples: list[str] = field(default_factory=list)
    history: bool = False
    by_completeness: dict[str, int] = field(
        default_factory=lambda: {"exact": 0, "subset": 0, "absent": 0, "null": 0})
    subset_missed_tokens: int = 0
    idle_unsynchronized: int = 0

    def __post_init__(self) -> None:
        for k in self.kinds:
            self.unsync_s.setdefault(k, [])
            self.faults.setdefault(k, 0)

    def passed(self) -> bool:
        """No false hit, no missed hit, no unrecovered fault."""
        return self.false_hits == 0 and self.missed_hits == 0 and self.unrecovered == 0

    def table(self) -> str:
        """The printed summary."""
        rows = [
            ("duration", f"{self.elapsed_s:.0f} s"),
            ("requests replayed / streams", f"{self.requests} / {self.streams}"),
            ("queries / answers audited", f"{self.queries} / {self.answers}"),
            ("answers checked (synchronized at the engine's seq)", f"{self.checked}"),
            ("hit tokens in checked answers", f"{self.hit_tokens_checked}"),
            ("false hits", f"{self.false_hits}"),
            ("missed hits while synchronized", f"{self.missed_hits}"),
            ("hits while unsynchronized", f"{self.unsynchronized_hits}"),
            ("unauditable answers (state too old)", f"{self.unauditable}"),
            ("answers exact for an earlier epoch's same seq", f"{self.epoch_ambiguous}"),
            ("answers still at an earlier epoch's seq after 2 s", f"{self.stale_epoch}"),
            ("recoveries (reported by /ready)",
             "-" if self.recoveries_reported is None else f"{self.recoveries_reported}"),
            ("live messages dropped by faults", f"{self.dropped}"),
            ("faults unrecovered", f"{self.unrecovered}"),
        ]
        if self.history:
            c = self.by_completeness
            rows += [
                ("checked answers exact / subset",
                 f"{c['exact'] + c['absent']} / {c['subset']}"
                 + (f" ({c['absent']} without completeness)" if c["absent"] else "")),
                ("unsynchronized answers (completeness null)", f"{c['null']}"),
                ("tokens missed by checked subset answers", f"{self.subset_missed_tokens}"),
                ("idle ranks' unsynchronized answers while idle", f"{self.idle_unsynchronized}"),
            ]
        for kind in self.kinds:
            d = self.unsync_s[kind]
            rows.append((f"fault {kind}: injected, unsync p50 / p99",
                         f"{self.faults[kind]}, {percentile(d, 50) * 1000:.0f} ms / "
                         f"{percentile(d, 99) * 1000:.0f} ms ({len(d)} stream recoveries)"))
        rows.append(("verdict", "PASS" if self.passed() else "FAIL"))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


@dataclass
class RankAudit:
    """Audit state of one engine rank (one stream), kept by the soak's driver thread.

    :param engine: the engine (its ground truth is :meth:`SimEngine.resident`).
    :param rank: the DP rank.
    :param epoch: restarts of the rank's publisher so far (seq starts again at 0 in each).
    :param history: the last ``HISTORY_STATES`` recorded states, oldest first, each
        ``(epoch, seq, {engine hash: DEVICE | HOST bits})``; seq ``None`` before any batch.
    :param fault: ``(kind, injected at monotonic s)`` while a fault is open, else ``None``.
    :param epoch_started: monotonic time the current epoch began, seconds.
    """

    engine: SimEngine
    rank: int
    epoch: int = 0
    history: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=HISTORY_STATES))
    fault: Optional[tuple[str, float]] = None   # (kind, injected at) while a fault is open
    epoch_started: float = 0.0                   # monotonic time the current epoch began
    idle_until: float = 0.0                      # the rank publishes nothing before this
    completeness: Optional[str] = None           # of its last synchronized answer

    @property
    def key(self) -> tuple[str, int]:
        """``(instance name, dp rank)``, the stream's identity in the service's answers."""
        return (self.engine.name, self.rank)

    def record(self, seq: Optional[int]) -> None:
        """Remember the rank's residency after batch ``seq`` (``None``: no batch yet)."""
        self.history.append((self.epoch, seq, self.engine.resident(self.rank)))

    def states_at(self, seq: Optional[int], now: float = 0.0) -> list[dict[int, int]]:
        """Recorded states with ``seq``: of any epoch within ``EPOCH_GRACE_S`` of the current
        epoch's start (the service may not have seen the restart yet), else of the current
        epoch only (an answer then matching only an older epoch is a stale state, §6)."""
        any_epoch = now - self.epoch_started <= EPOCH_GRACE_S
        return [res for ep, s, res in self.history
                if s == seq and (any_epoch or ep == self.epoch)]

    def current(self) -> tuple[Optional[int], dict[int, int]]:
        """The last recorded ``(seq, residency)``."""
        _, seq, res = self.history[-1]
        return seq, res


def _truth(hashes: Sequence[int], resident: dict[int, int], block_size: int) -> tuple[int, int]:
    """§10 prefix walk over a recorded residency: (device tokens, host-only tokens)."""
    dev = host = 0
    for h in hashes:
        flags = resident.get(h, 0)
        if not flags:
            break
        if flags & DEVICE:
            dev += 1
        else:
            host += 1
    return dev * block_size, host * block_size


def prompt_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """Engine hashes of the full blocks of ``tokens``, chained as the simulated engine chains
    them (:func:`~kvsvc.testbed.sim.block_manager.chain_hash`), first block first."""
    out: list[int] = []
    parent: Optional[int] = None
    for i in range(len(tokens) // block_size):
        parent = chain_hash(parent, tokens[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out


def _false(pred: tuple[int, int], truth: tuple[int, int]) -> bool:
    return pred[0] > truth[0] or pred[0] + pred[1] > truth[0] + truth[1]


class Soak:
    """One soak run (see the module docstring); :meth:`run` does everything and cleans up.

    :param opts: the options (validated by :meth:`run`).
    :param out: where progress and the table are printed.
    """

    def __init__(self, opts: SoakOptions, out: TextIO) -> None:
        self.opts = opts
        self.out = out
        self.report = SoakReport(kinds=opts.fault_kinds, history=opts.history)
        self.rng = random.Random(opts.seed)
        self.engines: list[SimEngine] = []
        self.ranks: list[RankAudit] = []
        self.down: dict[str, float] = {}          # killed engine name -> restart time
        self._kinds: list[str] = []
        self.service: Optional[ServiceProcess] = None
        self._next_rank: collections.Counter[str] = collections.Counter()

    # -- set-up ---------------------------------------------------------------------------------

    def _build(self) -> None:
        o = self.opts
        dp_engine = 1 if o.engines > 1 else 0
        port_rng = random.Random()  # not the fault schedule's: runs must differ between soaks
        taken: set[int] = set()
        for i in range(o.engines):
            dp = 2 if i == dp_engine else 1
            # One run per engine: event ports base.., replay ports base + dp..; runs of
            # different engines never overlap (nothing is bound until the engines start).
            base = listen_port_run(2 * dp, port_rng, exclude=taken)
            taken.update(range(base, base + 2 * dp))
            # History soaks: the last engine (of 2 or more) has no replay endpoint.
            no_replay = o.history and o.engines > 1 and i == o.engines - 1
            self.engines.append(SimEngine(
                f"127.0.0.1:{base}", base, base + dp, dp_size=dp, block_size=o.block_size,
                device_blocks=o.device_blocks, host_blocks=o.host_blocks, seed=o.seed + i,
                flavor=o.flavor, buffer_steps=o.buffer_steps, replay_endpoint=not no_replay))
        self.ranks = [RankAudit(e, r) for e in self.engines for r in range(e.dp_size)]
        self.report.streams = len(self.ranks)

    def _config(self) -> dict:
        streams = []
        for e in self.engines:
            for r in range(e.dp_size):
                ev, rp = e.endpoints(r)
                stream = {"instance_name": e.name, "dp_rank": r,
                          "block_size": self.opts.block_size, "endpoint": ev,
                          "replay_endpoint": rp, "topic": e.topic.decode()}
                if self.opts.history:
                    stream["replay_mode"] = "history"
                streams.append(stream)
        return {"streams": streams, "replay_timeout_ms": self.opts.replay_timeout_ms,
                "resync_interval_ms": self.opts.resync_interval_ms}

    def run(self) -> SoakReport:
        """Run the soak and return its figures (the table is printed to ``out``).

        :raises ConfigError: unknown trace.
        :raises LifecycleError: an engine or the service failed.
        :raises ValueError: bad options.
        """
        self.opts.validate()
        trace = load_trace(self.opts.trace)
        t0 = time.monotonic()
        service: Optional[ServiceProcess] = None
        with tempfile.TemporaryDirectory(prefix="kvsvc-soak-") as tmp:
            try:
                self._build()
                for e in self.engines:
                    e.start()
                for rk in self.ranks:
                    rk.record(None)
                if self.opts.history:
                    self._warm_up(trace)
                cfg = Path(tmp) / "kv_events.json"
                cfg.write_text(json.dumps(self._config(), indent=2), encoding="utf-8")
                log_path = Path(self.opts.service_log or Path(tmp) / "service.log")
                service = ServiceProcess(cfg, free_port_run(1), secrets.token_hex(16), log_path)
                self.service = service
                t_join = time.monotonic()
                service.start(self.opts.ready_timeout_s, warming_ok=self.opts.history)
                if self.opts.history:
                    # Measured from the service's launch: its streams join engines that
                    # published before it existed.
                    for rk in self.ranks:
                        rk.fault = ("late_join", t_join)
                    self.report.faults["late_join"] += 1
                print(f"kvsvc soak: {len(self.engines)} engines, {len(self.ranks)} streams, "
                      f"{self.opts.minutes:g} min, fault every {self.opts.fault_interval_s:g} s, "
                      f"service on {service.base_url}", file=self.out, flush=True)
                self._replay(trace, service, t0 + self.opts.minutes * 60.0)
                self.report.recoveries_reported = service.recoveries()
            except BaseException:
                if service is not None:
                    print(f"kvsvc soak: service log tail:\n{service.log_tail()}", file=self.out)
                raise
            finally:
                try:
                    if service is not None:
                        service.close()
                finally:
                    for e in self.engines:
                        e.close()
                self.report.dropped = sum(e.stats(r).dropped for e in self.engines
                                          for r in range(e.dp_size))
                self.report.elapsed_s = time.monotonic() - t0
        print(self.report.table(), file=self.out, flush=True)
        for line in self.report.examples:
            print(f"  {line}", file=self.out)
        return self.report

    # -- the replay -------------------------------------------------------------------------------

    def _warm_up(self, trace: list[TraceRequest]) -> None:
        """History soaks, before the service starts (the late join): the first rank publishes
        ``buffer_steps // 2`` batches (its whole history stays in the buffer), the second
        ``buffer_steps + 20`` (its buffer rolls over), every other rank 10."""
        counts = [self.opts.buffer_steps // 2, self.opts.buffer_steps + 20]
        reqs = self._requests(trace)
        for i, rk in enumerate(self.ranks):
            n = counts[i] if i < len(counts) else 10
            published = 0
            for _ in range(4 * n):  # a request that changes nothing publishes nothing
                if published >= n:
                    break
                res = rk.engine.execute(request_tokens(next(reqs), self.opts.block_size), rk.rank)
                if res.seq is not None:
                    rk.record(res.seq)
                    published += 1

    def _requests(self, trace: list[TraceRequest]):
        n = 0
        while True:
            offset = n * PASS_ID_OFFSET
            for req in trace:
                yield req if not offset else TraceRequest(
                    req.timestamp_ms, req.input_length, req.output_length,
                    tuple(h + offset for h in req.hash_ids))
            n += 1

    def _replay(self, trace: list[TraceRequest], service: ServiceProcess, end: float) -> None:
        next_fault = time.monotonic() + self.opts.fault_interval_s
        progress = time.monotonic() + 30.0
        i = 0
        for req in self._requests(trace):
            now = time.monotonic()
            if now >= end:
                break
            self._revive(now)
            if now >= next_fault:
                self._inject(now)
                next_fault = now + self.opts.fault_interval_s
            up = [e for e in self.engines if e.name not in self.down]
            tokens = request_tokens(req, self.opts.block_size)
            self._audit_until_caught_up(service, tokens)
            if up:
                eng = up[i % len(up)]
                rank = self._next_rank[eng.name] % eng.dp_size
                self._next_rank[eng.name] += 1
                if self._rank_of(eng, rank).idle_until <= now:   # an idle rank publishes nothing
                    self._execute(eng, rank, tokens)
                    self.report.requests += 1
            i += 1
            if now >= progress:
                progress = now + 30.0
                r = self.report
                print(f"  {r.requests} requests, {r.checked} checked, false {r.false_hits}, "
                      f"missed {r.missed_hits}, faults {sum(r.faults.values())}",
                      file=self.out, flush=True)
        # Let every open fault finish (bounded), so each one is measured or unrecovered.
        deadline = time.monotonic() + self.opts.fault_timeout_s
        tokens = request_tokens(trace[0], self.opts.block_size)
        while any(rk.fault for rk in self.ranks) and time.monotonic() < deadline:
            self._revive(time.monotonic())
            self._audit_until_caught_up(service, tokens)
            for rk in self.ranks:
                if (rk.fault and rk.engine.name not in self.down
                        and rk.idle_until <= time.monotonic()):
                    # A silent rank with an open drop fault needs one more batch to see its gap.
                    self._execute(rk.engine, rk.rank, tokens)
        self.expire_faults(float("inf") if time.monotonic() >= deadline else time.monotonic())

    def _rank_of(self, engine: SimEngine, rank: int) -> RankAudit:
        return next(rk for rk in self.ranks if rk.engine is engine and rk.rank == rank)

    def _execute(self, engine: SimEngine, rank: int, tokens: list[int]) -> None:
        res = engine.execute(tokens, rank)
        if res.seq is not None:
            self._rank_of(engine, rank).record(res.seq)

    # -- auditing ---------------------------------------------------------------------------------

    def _audit_until_caught_up(self, service: ServiceProcess, tokens: list[int]) -> None:
        hashes = prompt_hashes(tokens, self.opts.block_size)
        deadline = time.monotonic() + self.opts.catch_up_s
        pause = 0.002
        while True:
            matches = service.query(tokens)
            now = time.monotonic()
            self.report.queries += 1
            caught_up = self.audit(matches, hashes, now)
            self.expire_faults(now)
            if caught_up or now >= deadline:
                return
            time.sleep(pause)  # polling another process, bounded by the deadline above
            pause = min(pause * 2, 0.02)

    def audit(self, matches: list[dict], hashes: list[int], now: float) -> bool:
        """Audit one query's answers against the recorded ground truth (module docstring),
        counting into :attr:`report`; closes the fault of every stream found caught up.

        :param matches: the service's per-stream answers (§10 fields: ``instance_name``,
            ``dp_rank``, ``synchronized``, ``sequence``, ``device_hit_tokens``,
            ``host_only_hit_tokens``, ``error``), one per stream of :attr:`ranks`.
        :param hashes: the prompt's engine hashes (:func:`prompt_hashes`).
        :param now: monotonic time of the answer, seconds.
        :returns: True when every stream of a running engine is synchronized at its rank's
            current seq.
        :raises LifecycleError: a stream of :attr:`ranks` is missing from ``matches``.
        """
        got = {(m["instance_name"], m["dp_rank"]): m for m in matches}
        bs = self.opts.block_size
        all_caught_up = True
        for rk in self.ranks:
            m = got.get(rk.key)
            if m is None:
                raise LifecycleError(f"service answer lacks stream {rk.key}")
            self.report.answers += 1
            pred = (m["device_hit_tokens"], m["host_only_hit_tokens"])
            cur_seq, cur_res = rk.current()
            truth_now = _truth(hashes, cur_res, bs)
            down = rk.engine.name in self.down
            if not m["synchronized"]:
                self.report.by_completeness["null"] += 1
                if rk.idle_until > now:
                    self.report.idle_unsynchronized += 1
                if pred != (0, 0):
                    self.report.unsynchronized_hits += 1
                    self._fail("hit while unsynchronized", rk, m, truth_now)
                if _false(pred, (0, 0) if down else truth_now):
                    self.report.false_hits += 1
                all_caught_up = all_caught_up and down
                continue
            seq = m["sequence"]
            completeness = m.get("completeness", "absent") or "absent"
            rk.completeness = completeness
            if seq == cur_seq and not down:
                self.report.checked += 1
                self.report.hit_tokens_checked += pred[0] + pred[1]
                if self.opts.history:
                    self.report.by_completeness[completeness] = (
                        self.report.by_completeness.get(completeness, 0) + 1)
                if completeness == "subset" and pred != truth_now:
                    # §7h: a subset misses blocks stored before its history; never more.
                    if _false(pred, truth_now):
                        self.report.false_hits += 1
                        self._fail("false hit (subset)", rk, m, truth_now)
                    else:
                        self.report.subset_missed_tokens += (
                            truth_now[0] + truth_now[1] - pred[0] - pred[1])
                elif pred != truth_now:
                    older = [_truth(hashes, res, bs) for res in rk.states_at(seq, now)[:-1]]
                    if pred in older:
                        # The same seq in an earlier epoch (a restart the service has not
                        # seen yet): exact for that state, so neither false nor missed.
                        self.report.epoch_ambiguous += 1
                    elif _false(pred, truth_now):
                        self.report.false_hits += 1
                        self._fail("false hit (checked)", rk, m, truth_now)
                    else:
                        self.report.missed_hits += 1
                        self._fail("missed hit (checked)", rk, m, truth_now)
                if rk.fault is not None and now >= rk.fault[1]:   # an idle fault: after the idle
                    kind, t_inj = rk.fault
                    self.report.unsync_s[kind].append(now - t_inj)
                    rk.fault = None
                continue
            all_caught_up = all_caught_up and down
            states = rk.states_at(seq, now)
            if not states:
                if now - rk.epoch_started <= EPOCH_GRACE_S or seq is None or (
                        cur_seq is not None and seq <= cur_seq):
                    self.report.unauditable += 1   # too old for the recorded window
                    continue
                # A seq the current epoch has not reached, long after the restart: the
                # service still serves the previous engine's state (§6: stale).
                self.report.stale_epoch += 1
                if _false(pred, truth_now):
                    self.report.false_hits += 1
                    self._fail("false hit (previous epoch's state)", rk, m, truth_now)
                continue
            truths = [_truth(hashes, res, bs) for res in states]
            if all(_false(pred, t) for t in truths):
                self.report.false_hits += 1
                self._fail("false hit (lagging answer)", rk, m, truths[-1])
        return all_caught_up

    def _fail(self, what: str, rk: RankAudit, m: dict, truth: tuple[int, int]) -> None:
        if len(self.report.examples) < 10:
            self.report.examples.append(
                f"{what}: {rk.key[0]}/dp{rk.key[1]} predicted {m['device_hit_tokens']}+"
                f"{m['host_only_hit_tokens']}, true {truth[0]}+{truth[1]}, synchronized "
                f"{m['synchronized']}, sequence {m['sequence']}, engine seq {rk.current()[0]} "
                f"(epoch {rk.epoch}), error {m['error']!r}")
        log.error("soak: %s on %s/dp%d", what, rk.key[0], rk.key[1])

    def expire_faults(self, now: float) -> None:
        """Count as unrecovered (and close) every fault open for more than
        ``fault_timeout_s`` at monotonic time ``now``, seconds."""
        for rk in self.ranks:
            if rk.fault is not None and now - rk.fault[1] > self.opts.fault_timeout_s:
                self.report.unrecovered += 1
                status = self._stream_status(rk)
                log.error("soak: fault %s on %s/dp%d not over after %.0f s; engine seq %s "
                          "(epoch %d); service says %s", rk.fault[0], rk.key[0], rk.key[1],
                          self.opts.fault_timeout_s, rk.current()[0], rk.epoch, status)
                if len(self.report.examples) < 10:
                    self.report.examples.append(
                        f"unrecovered {rk.fault[0]} on {rk.key[0]}/dp{rk.key[1]}: engine seq "
                        f"{rk.current()[0]}, service {status}")
                rk.fault = None

    def _stream_status(self, rk: RankAudit) -> Optional[dict]:
        """The stream's ``/ready`` entry (diagnostics only), ``None`` if unavailable."""
        if self.service is None:
            return None
        try:
            r = self.service.session.get(self.service.base_url + "/ready", timeout=5.0)
            return next((s for s in r.json()["streams"]
                         if (s["instance_name"], s["dp_rank"]) == rk.key), None)
        except (requests.RequestException, ValueError, KeyError, TypeError):
            return None

    # -- faults -----------------------------------------------------------------------------------

    def _next_kind(self) -> str:
        if not self._kinds:
            self._kinds = list(HISTORY_INJECTED if self.opts.history else FAULT_KINDS)
            self.rng.shuffle(self._kinds)
        return self._kinds.pop()

    def _inject(self, now: float) -> None:
        kind = self._next_kind()
        if kind in ("restart", "kill"):
            free = [e for e in self.engines if e.name not in self.down and all(
                rk.fault is None for rk in self.ranks if rk.engine is e)]
            if not free:
                return
            eng = self.rng.choice(free)
            targets = [rk for rk in self.ranks if rk.engine is eng]
        else:
            free_ranks = [rk for rk in self.ranks
                          if rk.fault is None and rk.engine.name not in self.down
                          and rk.idle_until <= now]
            if kind == "reset" and any(rk.completeness == "subset" for rk in free_ranks):
                free_ranks = [rk for rk in free_ranks if rk.completeness == "subset"]
            if not free_ranks:
                return
            targets = [self.rng.choice(free_ranks)]
            eng = targets[0].engine
        self.report.faults[kind] += 1
        rk = targets[0]
        log.info("soak: fault %s on %s", kind, ", ".join(f"{t.key[0]}/dp{t.key[1]}" for t in targets))
        t_inj = time.monotonic()
        for t in targets:
            t.fault = (kind, t_inj)
        tokens = self._filler_tokens()
        if kind == "drop":
            # n dropped batches, then one delivered batch that reveals the gap at once (a
            # silent engine would hide it until its next batch or the periodic resync).
            n = self.rng.randint(1, 3)
            eng.drop_next(rk.rank, n)
            for _ in range(n + 1):
                self._execute(eng, rk.rank, tokens())
        elif kind == "publisher":
            eng.restart_publisher(rk.rank)
            self._new_epoch(rk)
            self._execute(eng, rk.rank, tokens())
        elif kind == "restart":
            eng.restart()
            # History engines: several batches before the service asks again (§7h rebuild).
            n = self.rng.randint(3, 6) if self.opts.history else 1
            for t in targets:
                self._new_epoch(t)
                for _ in range(n):
                    self._execute(eng, t.rank, tokens())
        elif kind == "rollover":
            # More lost batches than the buffer holds: catch-up fails, the rebuild is a subset.
            n = self.opts.buffer_steps + 5
            eng.drop_next(rk.rank, n)
            for _ in range(n + 1):
                self._execute(eng, rk.rank, tokens())
        elif kind == "reset":
            seq = eng.clear_cache(rk.rank)
            rk.record(seq)
        elif kind == "idle":
            rk.idle_until = t_inj + 1.5 * self.opts.resync_interval_ms / 1000.0
            rk.fault = (kind, rk.idle_until)
        elif kind == "kill":
            eng.close()
            self.down[eng.name] = time.monotonic() + self.opts.engine_down_s
            for t in targets:
                self._new_epoch(t, resident={})
        elif kind in ("delay", "truncate"):
            if kind == "delay":
                # Half the time past replay_timeout_ms: that attempt fails and is retried.
                seconds = self.rng.choice([0.2, 2.0]) * self.opts.replay_timeout_ms / 1000.0
                eng.delay_snapshots(rk.rank, seconds)
            else:
                eng.truncate_snapshots(rk.rank, self.rng.randint(0, 1))
            eng.drop_next(rk.rank, 1)
            self._execute(eng, rk.rank, tokens())
            self._execute(eng, rk.rank, tokens())
        elif kind == "disconnect":
            eng.disconnect(rk.rank)
            self._execute(eng, rk.rank, tokens())

    def _filler_tokens(self):
        """Prompts of fresh content for the requests that trigger a fault."""
        bs = self.opts.block_size

        def make() -> list[int]:
            base = self.rng.randrange(150_000 - 4 * bs)
            return [base + j for j in range(4 * bs)]
        return make

    def _new_epoch(self, rk: RankAudit, resident: Optional[dict[int, int]] = None) -> None:
        rk.epoch += 1
        rk.epoch_started = time.monotonic()
        if resident is None:
            rk.record(None)
        else:
            rk.history.append((rk.epoch, None, resident))

    def _revive(self, now: float) -> None:
        for name, at in list(self.down.items()):
            if now >= at:
                eng = next(e for e in self.engines if e.name == name)
                eng.restart()   # new process: cache empty, seq 0 (sockets bound by start)
                eng.start()
                del self.down[name]
                for rk in self.ranks:
                    if rk.engine is eng:
                        rk.record(None)
                        if self.opts.history:
                            # Several batches before the service asks again (§7h rebuild).
                            tokens = self._filler_tokens()
                            for _ in range(self.rng.randint(3, 6)):
                                self._execute(eng, rk.rank, tokens())
                log.info("soak: engine %s back after kill", name)


def run_soak(opts: SoakOptions, out: Optional[TextIO] = None) -> SoakReport:
    """Run one soak (module docstring) and return its figures; prints the table to ``out``.

    :raises ConfigError: unknown trace.
    :raises LifecycleError: an engine or the service failed.
    :raises ValueError: bad options.
    """
    return Soak(opts, out or sys.stdout).run()


# ---- CLI ---------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``kvsvc soak`` flags to ``parser``, each in both spellings
    (:func:`kvsvc.settings.add_flag`). The formatter shows the defaults."""
    d = SoakOptions()
    add_flag(parser, "--minutes", type=float, default=d.minutes, help="replay duration, minutes")
    add_flag(parser, "--engines", type=int, default=d.engines,
             help="simulated engines, one with 2 DP ranks")
    add_flag(parser, "--seed", type=int, default=d.seed, help="seed of the fault schedule")
    add_flag(parser, "--trace", default=d.trace,
             help="conversation, synthetic or a JSONL path")
    add_flag(parser, "--fault-interval-s", type=float, default=d.fault_interval_s,
             help="seconds between faults")
    add_flag(parser, "--flavor", default=d.flavor, choices=[f.value for f in Flavor],
             help="engine flavor: vllm and sglang answer replays with history (§7h), their "
                  "streams run replay_mode history, with their own faults")
    add_flag(parser, "--buffer-steps", type=int, default=d.buffer_steps,
             help="vllm/sglang: replay buffer per rank, batches (small, so it rolls over)")
    add_flag(parser, "--service-log", default="",
             help="keep the service's output in this file (empty: discarded)")
    add_log_level(parser, "warning")


def run(args: argparse.Namespace) -> int:
    """``kvsvc soak``: run and print the report.

    :returns: 0 on pass, 1 on a false hit, missed hit or unrecovered fault, 2 on bad options
        or a start-up failure, 130 on Ctrl-C.
    """
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        opts = SoakOptions(minutes=args.minutes, engines=args.engines, seed=args.seed,
                           trace=args.trace, fault_interval_s=args.fault_interval_s,
                           service_log=args.service_log, flavor=args.flavor,
                           buffer_steps=args.buffer_steps)
        report = run_soak(opts)
    except KeyboardInterrupt:
        print("kvsvc soak: interrupted; everything stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (ConfigError, ValueError) as exc:
        print(f"kvsvc soak: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KvsvcError as exc:
        print(f"kvsvc soak: failed: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK if report.passed() else EXIT_FAILED
