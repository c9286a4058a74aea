"""Shared pieces of the benchmark suite (issue 3): results, machine description, payload
generation, a multi-stream fake-engine server process, and directory helpers.

Nothing here is product code. Timings never go into unit tests; every figure is a ratio measured
side by side in one run (see ``bench/run.py``).

The server process (:class:`StreamServer`) stands in for engines: per stream it binds an
``XPUB`` (live, §1; send high-water mark 0 so a fast publisher queues instead of dropping, which
would be a sequence gap) and a ``ROUTER`` (snapshots, §7), answers every snapshot request with
the stream's preset payloads, and on ``go`` publishes the stream's live payloads with seq 0, 1,
... interleaved across its streams. Processes are forked, so preset payloads are shared with the
parent without pickling; fork happens only while the parent has no ZMQ context and no threads.
"""

from __future__ import annotations

import datetime
import gc
import logging
import multiprocessing as mp
import os
import platform
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import ormsgpack
import zmq

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvsvc.config import KvEventsConfig  # noqa: E402
from kvsvc.directory import Directory  # noqa: E402
from kvsvc.streams.frame import END_MARKER, NO_WATERMARK, encode_live  # noqa: E402
from tests.support.util import free_ports  # noqa: E402

log = logging.getLogger(__name__)

#: Token ids are drawn below this (issue 3: "token ids < 150,000").
VOCAB = 150_000
BLOCK_SIZE = 128
HASH_SEED = 1024
_FORK = mp.get_context("fork")


@dataclass
class Result:
    """One benchmark's outcome for the table and RESULTS.md.

    :param number: issue-3 benchmark number (1..7).
    :param name: short name.
    :param target: the target, as text (e.g. ``"ingest >= 0.6 x raw decode"``).
    :param ratios: ratio name -> (measured ratio, limit, True when "<=" else ">=").
    :param figures: absolute figures, one line each.
    :param notes: profile, what was tried, deviations from the issue's sizes.
    :param skipped: reason the benchmark did not run (then ``ratios`` is empty).
    """

    number: int
    name: str
    target: str
    ratios: dict[str, tuple[float, float, bool]] = field(default_factory=dict)
    figures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    skipped: Optional[str] = None

    @property
    def met(self) -> Optional[bool]:
        """True when every ratio meets its limit; None when skipped."""
        if self.skipped is not None or not self.ratios:
            return None
        return all((r <= lim) if le else (r >= lim) for r, lim, le in self.ratios.values())

    def ratio_text(self) -> str:
        """``name 0.63x (>= 0.6)`` for each ratio, joined."""
        if self.skipped is not None:
            return "not run: " + self.skipped
        return "; ".join(f"{k} {_ratio(r, lim, le)}x ({'<=' if le else '>='} {lim:g})"
                         for k, (r, lim, le) in self.ratios.items())


def _ratio(value: float, limit: float, le: bool) -> str:
    """Two decimals, three where two would round a missed target onto its limit (0.495 for
    ``>= 0.5`` reads 0.495, not 0.50)."""
    met = value <= limit if le else value >= limit
    text = f"{value:.2f}"
    return f"{value:.3f}" if not met and float(text) == limit else text


def machine_info() -> dict[str, str]:
    """CPU model, cores, Python version, date, load average (for RESULTS.md)."""
    model = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": model,
        "cores": str(os.cpu_count()),
        "usable cores": str(len(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else "?",
        "python": sys.version.split()[0] + " (" + platform.python_implementation() + ")",
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        # The machine is often shared: its 1-minute load when the run started.
        "load average": f"{os.getloadavg()[0]:.1f}",
    }


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0..100) of ``values`` (non-empty)."""
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(round(q / 100.0 * len(s) + 0.5)) - 1))
    return s[k]


def cpu_split(pid: Optional[int]) -> Optional[tuple[float, float]]:
    """(user, system) CPU seconds of process ``pid`` so far, all its threads; ``None`` when
    unknown (no pid, not Linux)."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    # Fields 14 and 15 (utime, stime) of proc(5), counted after the ")" closing the name.
    return int(fields[11]) / tick, int(fields[12]) / tick


def cpu_seconds(pid: Optional[int]) -> Optional[float]:
    """User + system CPU seconds of process ``pid`` so far, ``None`` when unknown."""
    split = cpu_split(pid)
    return None if split is None else split[0] + split[1]


def gunicorn_worker_pid(arbiter_pid: int) -> Optional[int]:
    """The one gunicorn worker's pid (the arbiter's only child), ``None`` when unknown."""
    try:
        children = Path(f"/proc/{arbiter_pid}/task/{arbiter_pid}/children").read_text().split()
    except OSError:
        return None
    return int(children[0]) if len(children) == 1 else None


def token_pool(n: int, seed: int) -> list[int]:
    """``n`` random token ids in ``[0, VOCAB)`` as a list of Python ints (like decoded JSON or
    MessagePack would give)."""
    # random.choices over a range object draws in C without a per-item Python call.
    return random.Random(seed).choices(range(VOCAB), k=n)


def stored_map(hashes: Sequence[int], parent: Optional[int], tokens: Sequence[int],
               block_size: int, medium: Optional[str] = "gpu") -> dict:
    """A map-form ``BlockStored`` (§2) with every field, as xLLM sends it."""
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent,
            "token_ids": list(tokens), "block_size": block_size, "lora_id": None,
            "medium": medium, "lora_name": None, "extra_keys": None, "group_idx": None,
            "kv_cache_spec_kind": "full_attention"}


def removed_map(hashes: Sequence[int], medium: Optional[str] = "gpu") -> dict:
    """A map-form ``BlockRemoved`` (§2)."""
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium,
            "group_idx": None}


def batch(events: Sequence[dict], dp_rank: int = 0) -> bytes:
    """One §2 batch ``[ts, events, dp_rank]``."""
    return ormsgpack.packb([time.time(), list(events), dp_rank])


def churn_payloads(n_stored: int, seed: int, blocks_per_event: int = 16,
                   block_size: int = BLOCK_SIZE) -> tuple[list[bytes], int]:
    """Live payloads of issue-3 benchmarks 1 and 2: ``n_stored`` one-event batches storing
    ``blocks_per_event`` root-chained blocks of ``block_size`` tokens, each followed by a batch
    removing the same hashes (so the index stays small and exact: 0 blocks at the end).

    :returns: (payloads in seq order, blocks they touch: stored + removed).
    """
    rng = random.Random(seed)
    pool = token_pool(1 << 21, seed)
    span = blocks_per_event * block_size
    out: list[bytes] = []
    for _ in range(n_stored):
        hashes = [rng.getrandbits(64) for _ in range(blocks_per_event)]
        off = rng.randrange(len(pool) - span)
        out.append(batch([stored_map(hashes, None, pool[off:off + span], block_size)]))
        out.append(batch([removed_map(hashes)]))
    return out, 2 * n_stored * blocks_per_event


def chain_events(tokens: Sequence[int], first_hash: int, blocks_per_event: int = 16) -> list[dict]:
    """Root-chained ``BlockStored`` events covering ``tokens`` (whole blocks), hashes from
    ``first_hash`` on; each event's parent is the previous event's last block."""
    out = []
    parent = None
    n_blocks = len(tokens) // BLOCK_SIZE
    for b in range(0, n_blocks, blocks_per_event):
        k = min(blocks_per_event, n_blocks - b)
        hashes = list(range(first_hash + b, first_hash + b + k))
        out.append(stored_map(hashes, parent, tokens[b * BLOCK_SIZE:(b + k) * BLOCK_SIZE],
                              BLOCK_SIZE))
        parent = hashes[-1]
    return out


def bind_stream_sockets(ctx: zmq.Context, streams: Sequence["ServedStream"],
                        sndhwm: Optional[int] = None, router_sndhwm: Optional[int] = None
                        ) -> tuple[list[zmq.Socket], list[zmq.Socket]]:
    """One bound ``XPUB`` (live) and ``ROUTER`` (snapshot or history replies) per stream,
    linger 0, for a benchmark's server process; the caller closes them. ``sndhwm`` /
    ``router_sndhwm`` 0 = never drop (``None``: libzmq's default of 1,000 messages)."""
    pubs, routers = [], []
    for s in streams:
        pub = ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, 0)
        if sndhwm is not None:
            pub.setsockopt(zmq.SNDHWM, sndhwm)
        pub.bind(s.endpoint)
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        if router_sndhwm is not None:
            router.setsockopt(zmq.SNDHWM, router_sndhwm)
        router.bind(s.replay_endpoint)
        pubs.append(pub)
        routers.append(router)
    return pubs, routers


def poll_requests(poller: zmq.Poller, timeout_ms: int, subscribed) -> list[zmq.Socket]:
    """One poll of a server process's sockets: every subscription an ``XPUB`` reports is
    counted in ``subscribed`` (a shared ``multiprocessing.Value``; tests wait on it instead of
    sleeping until a subscription has reached the publisher) and the ``ROUTER`` sockets with a
    request waiting are returned (the caller receives the request)."""
    routers = []
    for sock, _ in poller.poll(timeout_ms):
        if sock.type == zmq.XPUB:
            if sock.recv()[:1] == b"\x01":
                with subscribed.get_lock():
                    subscribed.value += 1
        else:
            routers.append(sock)
    return routers


def snapshot_payloads(events: Sequence[dict], events_per_message: int = 64) -> list[bytes]:
    """Snapshot reply payloads (§7) of ``events``, ``events_per_message`` per batch."""
    return [batch(events[i:i + events_per_message])
            for i in range(0, len(events), events_per_message)] or [batch([])]


@dataclass
class ServedStream:
    """One fake engine stream served by a :class:`StreamServer`.

    :param snapshot: reply payloads; empty means one batch without events (state empty,
        watermark "no live batch yet", so the stream's next expected seq is 0).
    :param live: payloads published with seq 0, 1, ... after :meth:`StreamServer.go`.
    """

    event_port: int
    replay_port: int
    snapshot: list[bytes] = field(default_factory=list)
    live: list[bytes] = field(default_factory=list)

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.event_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"


def _serve(streams: list[ServedStream], ready, go, stop, subscribed) -> None:
    """Server process body: see :class:`StreamServer`."""
    ctx = zmq.Context()
    pubs, routers = [], []
    try:
        pubs, routers = bind_stream_sockets(ctx, streams, sndhwm=0)
        empty = [batch([])]
        poller = zmq.Poller()
        for sock in pubs + routers:
            poller.register(sock, zmq.POLLIN)
        ready.set()
        sent = False
        while not stop.is_set():
            # Until "go", wake every 1 ms: the ingest benchmarks time from go() on, and a
            # 50 ms poll added up to 50 ms (25 on average, ~2% of benchmark 1) before the
            # first send.
            for sock in poll_requests(poller, 50 if sent else 1, subscribed):
                i = routers.index(sock)
                frames = sock.recv_multipart()
                ident = frames[0]
                for payload in streams[i].snapshot or empty:
                    sock.send_multipart([ident, b"", NO_WATERMARK.to_bytes(8, "big"), payload])
                sock.send_multipart([ident, *END_MARKER])
            if not sent and go.is_set():
                sent = True
                longest = max(len(s.live) for s in streams)
                for seq in range(longest):
                    for pub, s in zip(pubs, streams):
                        if seq < len(s.live):
                            pub.send_multipart(encode_live(b"", seq, s.live[seq]), copy=False)
    finally:
        for sock in pubs + routers:
            sock.close(linger=0)
        ctx.term()


class StreamServer:
    """A child process serving ``streams`` (fake engines; module docstring). Subclasses serve
    other replies by overriding :meth:`_process_target` and :meth:`_process_args`.

    :param streams: the streams; their payloads are inherited by the fork (no pickling).
    """

    def __init__(self, streams: list[ServedStream]) -> None:
        self.streams = streams
        self._ready = _FORK.Event()
        self._go = _FORK.Event()
        self._stop = _FORK.Event()
        self._subscribed = _FORK.Value("i", 0)
        self._proc: Optional[mp.Process] = None

    def start(self, timeout_s: float = 30.0) -> "StreamServer":
        """Fork the process; return once every socket is bound.

        :raises RuntimeError: the parent has other threads (unsafe fork) or the child did not
            come up in time.
        """
        check_fork_safe()
        self._proc = _FORK.Process(target=self._process_target(), args=self._process_args(),
                                   daemon=True)
        self._proc.start()
        if not self._ready.wait(timeout_s):
            self.close()
            raise RuntimeError(f"{type(self).__name__} did not start")
        return self

    def _process_target(self) -> Callable[..., None]:
        """The child's body (a subclass serves other replies)."""
        return _serve

    def _process_args(self) -> tuple:
        """The child body's arguments (inherited by the fork, not pickled)."""
        return (self.streams, self._ready, self._go, self._stop, self._subscribed)

    @property
    def subscriptions(self) -> int:
        """Subscriptions received by all the ``XPUB`` sockets so far."""
        return self._subscribed.value

    def go(self) -> None:
        """Publish every stream's live payloads now."""
        self._go.set()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the process (terminate it if it does not stop in time)."""
        self._stop.set()
        if self._proc is not None:
            self._proc.join(timeout_s)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(timeout_s)
            self._proc = None

    def __enter__(self) -> "StreamServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_fork_safe() -> None:
    """:raises RuntimeError: the process has threads besides the main one (fork would copy
    locks held by them)."""
    others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if others:
        raise RuntimeError(f"cannot fork a stream server while threads run: {others}")


def make_streams(n: int) -> list[ServedStream]:
    """``n`` streams on fresh loopback ports, no payloads yet."""
    ports = free_ports(2 * n)
    return [ServedStream(ports[2 * i], ports[2 * i + 1]) for i in range(n)]


def directory_config(streams: Sequence[ServedStream], names: Optional[Sequence[str]] = None,
                     **limits: int) -> KvEventsConfig:
    """A §8 config for ``streams`` (instance ``127.0.0.1:<20000 + i>`` or ``names[i]``, rank 0)."""
    doc = {"streams": [{
        "instance_name": names[i] if names else f"127.0.0.1:{20000 + i}",
        "dp_rank": 0, "block_size": BLOCK_SIZE, "endpoint": s.endpoint,
        "replay_endpoint": s.replay_endpoint, "hash_seed": HASH_SEED}
        for i, s in enumerate(streams)]}
    doc.update(limits)
    return KvEventsConfig.model_validate(doc)


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str,
               interval_s: float = 0.002) -> float:
    """Poll ``predicate``; return the ``perf_counter`` time it first held.

    :raises TimeoutError: naming ``what`` after ``timeout_s``.
    """
    deadline = time.perf_counter() + timeout_s
    while True:
        if predicate():
            return time.perf_counter()
        if time.perf_counter() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


def all_synchronized(directory: Directory) -> bool:
    """True when every stream of ``directory`` is synchronized."""
    return all(st.state.value == "synchronized" for st in directory.statuses())


def best_of(fn: Callable[[], object], repeat: int = 3,
            clock: Callable[[], float] = time.perf_counter) -> float:
    """Shortest time of ``repeat`` calls of ``fn`` (GC collected before each), seconds, by
    ``clock`` (wall time; ``time.thread_time`` for this thread's CPU, which other processes on
    a shared machine do not stretch)."""
    best = float("inf")
    for _ in range(repeat):
        gc.collect()
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


def decode_all(payloads: Sequence[bytes]) -> None:
    """Plain ``ormsgpack.unpackb`` of every payload in one thread (the issue's raw decode)."""
    unpackb = ormsgpack.unpackb
    for p in payloads:
        unpackb(p)
