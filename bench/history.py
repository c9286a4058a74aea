"""History-mode measures (issue 12, PROTOCOL.md §7h), side by side in one run:
``python -m bench.history``.

1. The ingest cost of the §7h anchor: the XXH3-64 digest of every live payload, against
   decoding the same payload (vLLM-sized batches: 16 blocks of 16 tokens), in process.
2. Time to synchronized from a 10,000-batch history (vLLM's default ``buffer_steps``) at 16
   blocks per batch, over real sockets (tests/publisher.py ``HistoryPublisher``), and the query
   latency p99 of another, synchronized stream while it runs against idle.
3. Catch-up after a gap of one batch against a full rebuild, at 100,000 resident blocks: the
   catch-up costs its missed batches, not the index size.
4. A 10,000-batch rebuild under request load, before and after the reply's lowered switch
   interval (:data:`kvsvc.streams.pacing.REPLY_SWITCH_INTERVAL_S`; "before" sets it to
   ``None``), in one run: the service's Flask app (``create_app``) with 8 synchronized history
   streams in its directory, served in process by a threaded WSGI server, and the rebuilt
   stream added with ``Directory.add_stream``. Loads: none; a thread spinning on
   ``Directory.query`` (CPU-bound, never blocks: the worst case); HTTP queries through the app
   from a client process (4 keep-alive connections, closed loop: threads blocking on sockets).
   Per case: add -> synchronized, the query p99 of the other streams while it runs against
   idle (a probe thread querying the directory every 0.5 ms; and the spinning loop's own
   queries, or the HTTP answers' latency), and where the rebuild's time goes (the pacing
   yields' GIL waits against the reply's receive calls).

Nothing here is a test: figures are printed, ratios measured in the same run.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)
    __package__ = "bench"

import zmq  # noqa: E402
from xxhash import xxh3_64_intdigest  # noqa: E402

from kvsvc.config import KvEventsConfig, ReplayMode, StreamConfig  # noqa: E402
from kvsvc.index.keys import prompt_keys  # noqa: E402
from kvsvc.streams.decoder import decode_batch  # noqa: E402
from kvsvc.streams.state import StreamState  # noqa: E402
from kvsvc.streams.subscriber import StreamSubscriber  # noqa: E402
from tests.publisher import HistoryPublisher, encode_batch, stored  # noqa: E402
from tests.util import free_ports, wait_for  # noqa: E402

BLOCK = 16          # vLLM's default block size
PER_BATCH = 16      # blocks per batch
SEED = 1024


def _chain_events(rng: random.Random, chain: int) -> list[dict]:
    """One batch: a root and 15 children (``PER_BATCH`` blocks), hashes from ``chain``."""
    base = chain * PER_BATCH
    tokens = [rng.randrange(150_000) for _ in range(BLOCK * PER_BATCH)]
    return [stored([base + i for i in range(PER_BATCH)], None, tokens, BLOCK, "GPU")]


def bench_digest(n: int = 2_000) -> None:
    rng = random.Random(1)
    payloads = [encode_batch(_chain_events(rng, i), 0, form="map") for i in range(n)]
    t = time.perf_counter()
    for p in payloads:
        decode_batch(p, 0, True)
    decode_s = time.perf_counter() - t
    t = time.perf_counter()
    for p in payloads:
        xxh3_64_intdigest(p)
    digest_s = time.perf_counter() - t
    print(f"1. digest: {digest_s / n * 1e6:.2f} us per live batch ({len(payloads[0])} bytes) "
          f"against {decode_s / n * 1e6:.1f} us to decode it: {digest_s / decode_s:.3f}x of "
          "the decode")


def bench_live_path(n: int = 4_000) -> None:
    """The stream thread's per-message work on the live path (frame, decode, rules, index),
    snapshot rules against history rules (digest and byte-hash option included), in process."""
    from kvsvc.streams.frame import encode_live, parse_live
    from kvsvc.streams.history import HistoryRecovery
    from kvsvc.streams.recovery import SnapshotRecovery
    from kvsvc.streams.serving import ServingState
    from kvsvc.streams.state import HistoryResult, SnapshotResult, StreamId
    from kvsvc.index.tier_index import TierIndex

    rng = random.Random(4)
    frames = [encode_live(b"", seq, encode_batch(_chain_events(rng, seq), 0, form="map"))
              for seq in range(n)]
    limits = KvEventsConfig()
    timings = {}
    for mode in (ReplayMode.SNAPSHOT, ReplayMode.HISTORY):
        cfg = StreamConfig(instance_name="10.0.0.1:8000", block_size=BLOCK,
                           endpoint="tcp://127.0.0.1:1", replay_endpoint="tcp://127.0.0.1:2",
                           hash_seed=SEED, replay_mode=mode)
        serving = ServingState(StreamId(cfg.instance_name, 0), BLOCK)
        history = mode is ReplayMode.HISTORY
        rules = (HistoryRecovery if history else SnapshotRecovery)(cfg, limits, serving)
        rules.start(0.0)
        rules.on_live_opened()
        rules.on_live_up(0.0)
        (request,) = rules.tick(0.0)
        rules.on_snapshot_opened(request.attempt, 0.0)
        index = TierIndex(BLOCK, SEED, limits.max_blocks_per_stream)
        if history:
            result = HistoryResult(False, True, index, None, None, None, True, {}, 0, 10)
        else:
            result = SnapshotResult(index=index, empty=True, watermark=None, messages=0,
                                    wire_bytes=10)
        rules.on_snapshot_complete(request.attempt, result, 0.0, 0.0)
        t = time.perf_counter()
        for f in frames:
            frame = parse_live(f, limits.max_message_bytes)
            batch = decode_batch(frame.payload, 0, history)
            rules.on_live_batch(frame.seq, batch, frame.wire_bytes, 1.0,
                                xxh3_64_intdigest(frame.payload) if history else 0)
        timings[mode] = (time.perf_counter() - t) / n
        assert serving.status().sequence == n - 1
    snap, hist = timings[ReplayMode.SNAPSHOT], timings[ReplayMode.HISTORY]
    print(f"1b. live path per message (frame, decode, rules, index; 16 blocks): snapshot mode "
          f"{snap * 1e6:.1f} us, history mode {hist * 1e6:.1f} us: {hist / snap:.3f}x")


def _subscriber(ctx: zmq.Context, pub: HistoryPublisher, name: str, **limits) -> StreamSubscriber:
    cfg = StreamConfig(instance_name=name, block_size=BLOCK, endpoint=pub.endpoint,
                       replay_endpoint=pub.replay_endpoint, hash_seed=SEED,
                       replay_mode=ReplayMode.HISTORY)
    sub = StreamSubscriber(cfg, KvEventsConfig(**limits), ctx)
    sub.start()
    return sub


def _synced(sub: StreamSubscriber, seq: int, timeout_s: float = 300.0) -> None:
    wait_for(lambda: (lambda st: st.state is StreamState.SYNCHRONIZED and st.sequence == seq)(
        sub.status()), timeout_s, interval_s=0.002, what=f"seq {seq}")


def _history(ctx: zmq.Context, batches: int) -> tuple[HistoryPublisher, list[int]]:
    ports = free_ports(2)
    pub = HistoryPublisher(ctx, ports[0], ports[1], buffer_steps=max(batches, 1)).start()
    rng = random.Random(2)
    first_tokens: list[int] = []
    for i in range(batches):
        events = _chain_events(rng, i)
        if i == 0:
            first_tokens = events[0]["token_ids"]
        pub.publish(events, live=False)
    return pub, first_tokens


def _p99(samples: list[float]) -> float:
    samples = sorted(samples)
    return samples[int(len(samples) * 0.99)] * 1e6 if samples else float("nan")


def _query_load(sub: StreamSubscriber, keys: list[int], stop: threading.Event,
                out: list[float]) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        sub.match(keys)
        out.append(time.perf_counter() - t)
        time.sleep(0.0005)


def bench_rebuild(ctx: zmq.Context, batches: int = 10_000) -> None:
    # Another stream, synchronized, serving queries the whole time.
    other_pub, other_tokens = _history(ctx, 50)
    other = _subscriber(ctx, other_pub, "10.0.0.2:8000")
    _synced(other, 49)
    keys = prompt_keys(other_tokens, BLOCK, SEED)
    idle: list[float] = []
    stop = threading.Event()
    thread = threading.Thread(target=_query_load, args=(other, keys, stop, idle))
    thread.start()
    time.sleep(1.0)
    stop.set()
    thread.join()
    pub, _ = _history(ctx, batches)
    busy: list[float] = []
    stop = threading.Event()
    thread = threading.Thread(target=_query_load, args=(other, keys, stop, busy))
    thread.start()
    started = time.monotonic()
    sub = _subscriber(ctx, pub, "10.0.0.1:8000")
    _synced(sub, batches - 1)
    elapsed = time.monotonic() - started
    stop.set()
    thread.join()
    st = sub.status()
    print(f"2. rebuild from a {batches:,}-batch history ({PER_BATCH} blocks per batch, "
          f"{st.device_blocks:,} blocks): synchronized in {elapsed:.2f} s; other stream's query "
          f"p99 {_p99(busy):.0f} us while it ran, {_p99(idle):.0f} us idle: "
          f"{_p99(busy) / _p99(idle):.2f}x")
    sub.close()
    pub.close()
    other.close()
    other_pub.close()


def bench_catch_up(ctx: zmq.Context, blocks: int = 100_000) -> None:
    batches = blocks // PER_BATCH
    pub, _ = _history(ctx, batches)
    started = time.monotonic()
    sub = _subscriber(ctx, pub, "10.0.0.1:8000")
    _synced(sub, batches - 1)
    rebuild_s = time.monotonic() - started
    pub.wait_subscribed()
    rng = random.Random(3)
    pub.publish(_chain_events(rng, batches), live=False)   # one batch lost
    started = time.monotonic()
    pub.publish(_chain_events(rng, batches + 1))
    _synced(sub, batches + 1)
    catch_up_s = time.monotonic() - started
    assert pub.requests == [0, batches - 1], pub.requests
    print(f"3. at {sub.status().device_blocks:,} resident blocks: catch-up after a gap of 1 "
          f"batch {catch_up_s * 1000:.1f} ms against a full rebuild {rebuild_s * 1000:.0f} ms: "
          f"{catch_up_s / rebuild_s:.4f}x")
    sub.close()
    pub.close()


# ---------------------------------------------------------------------------- 4. under load

_HTTP_CLIENT = r"""
import http.client, json, sys, threading, time
port, body, token, conns = int(sys.argv[1]), sys.argv[2].encode(), sys.argv[3], int(sys.argv[4])
stop = threading.Event()
out = []
def loop():
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    mine = []
    while not stop.is_set():
        t = time.monotonic()
        c.request("POST", "/v1/internal/kv-cache/query", body=body,
                  headers={"Content-Type": "application/json", "X-Internal-Token": token})
        r = c.getresponse(); r.read()
        if r.status != 200:
            raise SystemExit(f"HTTP {r.status}")
        mine.append((t, time.monotonic() - t))
    out.extend(mine)
threads = [threading.Thread(target=loop) for _ in range(conns)]
for th in threads: th.start()
print("ready", flush=True)
sys.stdin.readline()
stop.set()
for th in threads: th.join()
print(json.dumps(out))
"""


def _serve_history(ports: list[int], batches: int, ready, stop) -> None:
    """Child process: one vLLM-style engine (``HistoryPublisher``) holding ``batches``."""
    ctx = zmq.Context()
    pub = HistoryPublisher(ctx, ports[0], ports[1], buffer_steps=max(batches, 1)).start()
    rng = random.Random(2)
    for i in range(batches):
        pub.publish(_chain_events(rng, i), live=False)
    ready.set()
    stop.wait()
    pub.close()
    ctx.term()


class _ForkedHistory:
    """An engine in its own process (forked), so that its replay sender does not compete for
    this process's GIL: the rebuild is measured against a real engine's pace."""

    def __init__(self, batches: int) -> None:
        import multiprocessing as mp
        fork = mp.get_context("fork")
        ports = free_ports(2)
        self.endpoint = f"tcp://127.0.0.1:{ports[0]}"
        self.replay_endpoint = f"tcp://127.0.0.1:{ports[1]}"
        rng = random.Random(2)
        self.first_tokens = _chain_events(rng, 0)[0]["token_ids"]
        self._stop = fork.Event()
        ready = fork.Event()
        self._proc = fork.Process(target=_serve_history, args=(ports, batches, ready, self._stop),
                                  daemon=True)
        self._proc.start()
        if not ready.wait(120):
            raise TimeoutError("history engine process did not start")

    def close(self) -> None:
        self._stop.set()
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(10)


class _Instrument:
    """Where a rebuild's time goes: the pacing yields and the reply's receive calls, timed on
    the stream thread (a monkeypatch of this run only: ``perf_counter`` around each)."""

    def __init__(self) -> None:
        self.yield_s = 0.0
        self.yields = 0
        self.yields_slow = 0      # > 1 ms: the GIL came back after another thread's interval
        self.recv_s = 0.0
        self.recvs = 0

    def install(self):
        import kvsvc.streams.history_client as hc
        import kvsvc.streams.snapshot_client as sc
        inst = self
        orig_pace = hc.HistoryAttempt._pace

        def pace(attempt) -> None:
            before = attempt._slice_start
            t = time.perf_counter()
            orig_pace(attempt)
            if attempt._slice_start != before:       # it yielded
                took = time.perf_counter() - t
                inst.yield_s += took
                inst.yields += 1
                inst.yields_slow += took > 0.001

        class TimedDealer:
            def __init__(self, sock) -> None:
                self._sock = sock

            def recv_multipart(self, flags: int = 0):
                t = time.perf_counter()
                try:
                    return self._sock.recv_multipart(flags=flags)
                finally:
                    inst.recv_s += time.perf_counter() - t
                    inst.recvs += 1

            def __getattr__(self, name):
                return getattr(self._sock, name)

        orig_send = sc.SnapshotAttempt._send_request

        def send(attempt) -> None:
            orig_send(attempt)
            if not isinstance(attempt._dealer, TimedDealer):
                attempt._dealer = TimedDealer(attempt._dealer)

        hc.HistoryAttempt._pace = pace
        sc.SnapshotAttempt._send_request = send

        def undo() -> None:
            hc.HistoryAttempt._pace = orig_pace
            sc.SnapshotAttempt._send_request = orig_send
        return undo


def bench_rebuild_under_load(batches: int = 10_000, others: int = 8,
                             loads: tuple[str, ...] = ("none", "spin", "http"),
                             rounds: int = 2) -> None:
    import json
    import subprocess
    from werkzeug.serving import make_server

    from kvsvc.config import parse_kv_events_config
    from kvsvc.http.app import create_app
    from kvsvc.http.extensions import EXTENSION
    from kvsvc.settings import load_service_settings
    from kvsvc.streams import pacing

    pubs = [_ForkedHistory(50) for _ in range(others)]
    big = _ForkedHistory(batches)
    prompt = pubs[0].first_tokens
    names = [f"10.0.1.{i}:8000" for i in range(others)]

    def cfg(pub: _ForkedHistory, name: str) -> dict:
        return {"instance_name": name, "block_size": BLOCK, "endpoint": pub.endpoint,
                "replay_endpoint": pub.replay_endpoint, "hash_seed": SEED,
                "replay_mode": "history"}

    kv = parse_kv_events_config({"streams": [cfg(p, n) for p, n in zip(pubs, names)],
                                 "resync_interval_ms": 600_000})
    token = "bench-token"
    app = create_app(load_service_settings(internal_api_token=token, max_query_tokens=4096), kv)
    svc = app.extensions[EXTENSION]
    svc.start(timeout_s=10.0)
    directory = svc.directory
    assert directory is not None
    import logging
    logging.getLogger("werkzeug").setLevel(logging.WARNING)   # no line per request
    server = make_server("127.0.0.1", free_ports(1)[0], app, threaded=True)
    server_thread = threading.Thread(target=server.serve_forever, daemon=True)
    server_thread.start()
    big_cfg = StreamConfig.model_validate(cfg(big, "10.0.0.1:8000"))
    keys = prompt_keys(prompt, BLOCK, SEED)

    def synced(name: str, seq: int) -> bool:
        return any(st.stream.instance_name == name and st.state is StreamState.SYNCHRONIZED
                   and st.sequence == seq for st in directory.statuses())

    wait_for(lambda: all(synced(n, 49) for n in names), 60, what="other streams")
    got = [m.device_hit_tokens for m in directory.query(prompt)]
    assert got == [len(keys) * BLOCK] * others, got   # the same history on each

    def probe(out: list[float], stop: threading.Event) -> None:
        while not stop.is_set():
            t = time.perf_counter()
            directory.query(prompt)
            out.append(time.perf_counter() - t)
            time.sleep(0.0005)

    def spin(out: list[float], stop: threading.Event) -> None:
        while not stop.is_set():
            t = time.perf_counter()
            directory.query(prompt)
            out.append(time.perf_counter() - t)

    def window(load: str, rebuild: bool) -> dict:
        """One window: idle for 1.5 s, or the rebuild; samples of each load taken in it."""
        stop = threading.Event()
        probe_s: list[float] = []
        spin_s: list[float] = []
        threads = [threading.Thread(target=probe, args=(probe_s, stop))]
        if load == "spin":
            threads.append(threading.Thread(target=spin, args=(spin_s, stop)))
        client = None
        if load == "http":
            body = json.dumps({"token_ids": prompt})
            client = subprocess.Popen([sys.executable, "-c", _HTTP_CLIENT,
                                       str(server.server_port), body, token, "4"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert client.stdout is not None and client.stdout.readline().strip() == "ready"
        for th in threads:
            th.start()
        inst = _Instrument()
        undo = inst.install()
        t0 = time.monotonic()
        try:
            if rebuild:
                sid = directory.add_stream(big_cfg)
                wait_for(lambda: synced(big_cfg.instance_name, batches - 1), 600,
                         interval_s=0.002, what="rebuild")
            else:
                time.sleep(1.5)
            t1 = time.monotonic()
        finally:
            undo()
            stop.set()
            for th in threads:
                th.join()
        http_s: list[float] = []
        if client is not None:
            out, _ = client.communicate("stop\n", timeout=60)
            http_s = [lat for t, lat in json.loads(out) if t0 <= t <= t1]
        if rebuild:
            st = next(s for s in directory.statuses() if s.stream.instance_name
                      == big_cfg.instance_name)
            assert st.device_blocks == batches * PER_BATCH, st
            assert sys.getswitchinterval() == 0.005, sys.getswitchinterval()   # given back
            directory.remove_stream(sid)
        return {"s": t1 - t0, "probe": probe_s, "spin": spin_s, "http": http_s, "inst": inst}

    defaults = (pacing.REPLY_SLICE_MAX_S, pacing.REPLY_SWITCH_INTERVAL_S)
    variants = (("before", pacing.BUILD_SLICE_S, None),          # fixed 0.3 ms slices
                ("adaptive", defaults[0], defaults[1]),          # as shipped
                ("switch", pacing.BUILD_SLICE_S, 0.0005))        # the rejected alternative
    print(f"4. rebuild of {batches:,} batches ({batches * PER_BATCH:,} blocks, exact) with "
          f"{others} other streams; before = fixed 0.3 ms build slices; adaptive = a slice "
          f"after a late yield up to {defaults[0] * 1e3:.1f} ms (shipped); switch = "
          "switch interval 0.5 ms while the reply is received (not shipped)")
    try:
        for load in loads:
            # Rounds alternate idle and each variant, pooled: the shared machine's load drifts.
            idle = {"s": 0.0, "probe": [], "spin": [], "http": []}
            rows: dict = {}
            for _ in range(rounds):
                w = window(load, False)
                for k in ("probe", "spin", "http"):
                    idle[k] += w[k]
                idle["s"] += w["s"]
                for variant, slice_max, interval in variants:
                    pacing.REPLY_SLICE_MAX_S, pacing.REPLY_SWITCH_INTERVAL_S = slice_max, interval
                    w = window(load, True)
                    r = rows.setdefault(variant, {"s": 0.0, "probe": [], "spin": [],
                                                  "http": [], "inst": w["inst"], "runs": []})
                    for k in ("probe", "spin", "http"):
                        r[k] += w[k]
                    r["s"] += w["s"]
                    r["runs"].append(w["s"])
                    if r["inst"] is not w["inst"]:
                        for k in ("yield_s", "yields", "yields_slow", "recv_s", "recvs"):
                            setattr(r["inst"], k, getattr(r["inst"], k) + getattr(w["inst"], k))
                pacing.REPLY_SLICE_MAX_S, pacing.REPLY_SWITCH_INTERVAL_S = defaults
            for variant, r in rows.items():
                inst = r["inst"]
                parts = [f"   {load:4} {variant:8}: synchronized in "
                         + "/".join(f"{x:.2f}" for x in r["runs"]) + " s",
                         f"probe p99 {_p99(r['probe']):5.0f} us vs idle "
                         f"{_p99(idle['probe']):4.0f} ({_p99(r['probe']) / _p99(idle['probe']):.2f}x)"]
                for kind in ("spin", "http"):
                    if idle[kind] and r[kind]:
                        parts.append(f"{kind} p99 {_p99(r[kind]):5.0f} us vs idle "
                                     f"{_p99(idle[kind]):4.0f} "
                                     f"({_p99(r[kind]) / _p99(idle[kind]):.2f}x), "
                                     f"{len(r[kind]) / r['s']:.0f} queries/s vs "
                                     f"{len(idle[kind]) / idle['s']:.0f}")
                parts.append(f"yields {inst.yields} ({inst.yields_slow} over 1 ms) "
                             f"{inst.yield_s:.2f} s, receive calls {inst.recvs} "
                             f"{inst.recv_s:.2f} s")
                print("; ".join(parts), flush=True)
            b = rows["before"]["s"]
            print(f"   {load:4} time / before: " + ", ".join(
                f"{v} {rows[v]['s'] / b:.3f}x" for v in rows if v != "before"), flush=True)
    finally:
        pacing.REPLY_SLICE_MAX_S, pacing.REPLY_SWITCH_INTERVAL_S = defaults
        server.shutdown()
        svc.close(timeout_s=10.0)
        big.close()
        for pub in pubs:
            pub.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=10_000)
    parser.add_argument("--blocks", type=int, default=100_000)
    parser.add_argument("--only", type=int, default=None, help="run measure 4 only (4)")
    parser.add_argument("--loads", default="none,spin,http", help="measure 4's loads")
    parser.add_argument("--rounds", type=int, default=2, help="measure 4's rounds")
    args = parser.parse_args()
    if args.only == 4:
        bench_rebuild_under_load(args.batches, loads=tuple(args.loads.split(",")),
                                 rounds=args.rounds)
        return
    bench_digest()
    bench_live_path()
    ctx = zmq.Context()
    try:
        bench_rebuild(ctx, args.batches)
        bench_catch_up(ctx, args.blocks)
    finally:
        ctx.term()
    bench_rebuild_under_load(args.batches)


if __name__ == "__main__":
    main()
