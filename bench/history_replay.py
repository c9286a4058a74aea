"""Benchmarks 9 and 10 (issue 12): history-mode streams (§7h) against a vLLM-style publisher.

A forked server process stands in for vLLM engines: per stream an ``XPUB`` (live) and a
``ROUTER`` that answers ``[b"", start_seq]`` with every kept batch whose seq >= start_seq as
``[b"", seq, payload]`` then the end marker, from the publishing loop (no live batch leaves
during a reply), like vLLM's publisher thread. Payloads are vLLM's map form
(:func:`kvsvc.testbed.sim.flavors.encode_batch`), 16 blocks of 128 tokens per batch, each batch
a root chain of its own (distinct token windows, random 64-bit hashes). On a ``gap`` command
the server puts two new batches in a stream's buffer and sends only the second live: the
stream sees ``seq > L + 1`` and catches up from ``L``.

Benchmark 9, catch-up vs rebuild at 100k resident blocks (6,250 batches), in one run:

- *rebuild*: the stream is added to the directory (:meth:`kvsvc.directory.Directory.add_stream`)
  while the engine's buffer holds its whole history: a rebuild from seq 0 (``exact``); time from
  add to synchronized at the last seq; ``REBUILD_ROUNDS`` rounds (removed and added again);
- *catch-up*: a gap of 1 batch (the lost one, then the one that reveals the gap); time from
  the command to synchronized at the new seq; ``GAP_ROUNDS`` rounds on the 100k-block stream,
  the same on a stream of 160 blocks (10 batches) in the same directory.

Targets: the rebuild at 100k >= 20 x the catch-up at 100k (a catch-up costs its missed batches,
not the index size), and catch-up at 100k <= 3 x catch-up at 160 blocks (index size does not
matter).

Benchmark 10, a rebuild from a 10,000-batch history (vLLM's default ``buffer_steps``) at 16
blocks per batch (160,000 blocks) while 8 other history streams serve: ``query`` of a 4,096-token
prompt (held by the first other stream) timed in the request thread, idle windows alternating
with rebuild windows (add to synchronized), ``REBUILD10_ROUNDS`` rounds; then
``QUIET10_ROUNDS`` rebuilds with no request loop. Target as benchmark 8: p99 while rebuilding
<= 5 x p99 idle. Not a timed test: ``python -m bench.run --only 9,10``.
"""

from __future__ import annotations

import collections
import gc
import multiprocessing as mp
import random
import time
from typing import Callable, Sequence

import zmq

from kvsvc.config import KvEventsConfig, StreamConfig
from kvsvc.directory import Directory
from kvsvc.streams.frame import END_MARKER, encode_live
from kvsvc.testbed.sim.flavors import Flavor, encode_batch

from ._common import (
    BLOCK_SIZE,
    HASH_SEED,
    Result,
    ServedStream,
    StreamServer,
    bind_stream_sockets,
    chain_events,
    make_streams,
    percentile,
    poll_requests,
    stored_map,
    token_pool,
    wait_until,
)

BLOCKS_PER_BATCH = 16
BIG_BATCHES = 6_250            # 100,000 blocks
SMALL_BATCHES = 10             # 160 blocks
HISTORY10_BATCHES = 10_000     # vLLM's default buffer_steps
OTHER_STREAMS = 8
OTHER_BATCHES = 64
PROMPT_TOKENS = 4096
REBUILD_ROUNDS = 3
GAP_ROUNDS = 15
REBUILD10_ROUNDS = 2
QUIET10_ROUNDS = 2
IDLE_SAMPLES = 2000
_FORK = mp.get_context("fork")


def history_payloads(sizes: Sequence[int], seed: int, pool: Sequence[int]) -> list[list[bytes]]:
    """Lists of ``sizes[i]`` vLLM map-form batches of ``BLOCKS_PER_BATCH`` root-chained blocks
    each: token windows of ``pool`` at offsets distinct across every list (equal content would
    share content keys: fewer resident blocks than batches), random 64-bit hashes."""
    rng = random.Random(seed)
    span = BLOCKS_PER_BATCH * BLOCK_SIZE
    offsets = iter(rng.sample(range(len(pool) - span), sum(sizes)))
    out = []
    for n in sizes:
        batches = []
        for _ in range(n):
            off = next(offsets)
            hashes = [rng.getrandbits(64) for _ in range(BLOCKS_PER_BATCH)]
            batches.append(encode_batch(Flavor.VLLM, time.time(), [
                stored_map(hashes, None, pool[off:off + span], BLOCK_SIZE)], 0))
        out.append(batches)
    return out


def _serve(streams: list[ServedStream], histories: list[list[bytes]], spares: list[list[bytes]],
           ready, stop, commands, subscribed) -> None:
    """Server process: history replies and live gaps (module docstring)."""
    ctx = zmq.Context()
    pubs: list[zmq.Socket] = []
    routers: list[zmq.Socket] = []
    try:
        # Send high-water marks 0: a benchmark measures the directory, not libzmq's drops.
        pubs, routers = bind_stream_sockets(ctx, streams, sndhwm=0, router_sndhwm=0)
        buffers = [collections.deque(enumerate(h), maxlen=HISTORY10_BATCHES) for h in histories]
        spare = [collections.deque(p) for p in spares]
        poller = zmq.Poller()
        for sock in pubs + routers:
            poller.register(sock, zmq.POLLIN)
        ready.set()
        while not stop.is_set():
            for sock in poll_requests(poller, 1, subscribed):
                i = routers.index(sock)
                frames = sock.recv_multipart()
                ident, start = frames[0], int.from_bytes(frames[-1], "big")
                for seq, payload in buffers[i]:
                    if seq >= start:
                        sock.send_multipart([ident, b"", seq.to_bytes(8, "big"), payload],
                                            copy=False)
                sock.send_multipart([ident, *END_MARKER])
            while not commands.empty():
                _, i = commands.get()
                buf = buffers[i]
                nxt = buf[-1][0] + 1
                lost, shown = spare[i].popleft(), spare[i].popleft()
                buf.append((nxt, lost))          # lost on the wire, kept for replay
                buf.append((nxt + 1, shown))
                pubs[i].send_multipart(encode_live(b"", nxt + 1, shown))
    finally:
        for sock in pubs + routers:
            sock.close(linger=0)
        ctx.term()


class HistoryServer(StreamServer):
    """The forked vLLM-style publisher of the module docstring (start, subscriptions and close
    as :class:`bench._common.StreamServer`'s).

    :param streams: endpoints, one per stream.
    :param histories: each stream's published batches, seq 0 first.
    :param spares: each stream's batches for :meth:`gap`.
    """

    def __init__(self, streams: list[ServedStream], histories: list[list[bytes]],
                 spares: list[list[bytes]]) -> None:
        super().__init__(streams)
        self.histories = histories
        self.spares = spares
        self.last_seq = [len(h) - 1 for h in histories]
        self._commands: mp.Queue = _FORK.Queue()

    def _process_target(self) -> Callable[..., None]:
        return _serve

    def _process_args(self) -> tuple:
        return (self.streams, self.histories, self.spares, self._ready, self._stop,
                self._commands, self._subscribed)

    def gap(self, i: int) -> int:
        """Lose one batch of stream ``i`` on the wire and publish the next one; returns the
        seq the stream must reach."""
        self._commands.put(("gap", i))
        self.last_seq[i] += 2
        return self.last_seq[i]


def history_stream_config(s: ServedStream, i: int) -> StreamConfig:
    """Stream ``i`` of a :class:`HistoryServer` as a §8 history-mode stream (instance
    ``127.0.0.1:<21000 + i>``, rank 0)."""
    return StreamConfig(instance_name=f"127.0.0.1:{21000 + i}", dp_rank=0, block_size=BLOCK_SIZE,
                        endpoint=s.endpoint, replay_endpoint=s.replay_endpoint,
                        hash_seed=HASH_SEED, replay_mode="history")


def synced_at(directory: Directory, name: str, seq: int) -> bool:
    """True when instance ``name``'s stream is synchronized at ``seq``."""
    return any(st.stream.instance_name == name and st.state.value == "synchronized"
               and st.sequence == seq for st in directory.statuses())


def stream_status(directory: Directory, name: str):
    """Instance ``name``'s :class:`~kvsvc.streams.state.StreamStatus`."""
    return next(st for st in directory.statuses() if st.stream.instance_name == name)


def bench_catch_up_vs_rebuild(big_batches: int = BIG_BATCHES, rebuild_rounds: int = REBUILD_ROUNDS,
                              gap_rounds: int = GAP_ROUNDS) -> Result:
    """Benchmark 9 (module docstring): ``big_batches`` x 16 blocks (the issue: 100,000
    blocks), ``rebuild_rounds`` rebuilds, ``gap_rounds`` 1-batch gaps per stream (the first
    one a warm-up).

    :raises AssertionError: a rebuild or catch-up left another block count than published.
    :raises TimeoutError: a stream did not synchronize in time.
    """
    res = Result(9, "history catch-up vs rebuild at 100k blocks",
                 "rebuild >= 20 x catch-up (1-batch gap) at 100k blocks; catch-up at 100k "
                 "<= 3 x catch-up at 160 blocks")
    pool = token_pool(1 << 21, seed=9)
    big, small, *spares = history_payloads(
        [big_batches, SMALL_BATCHES, 2 * gap_rounds + 4, 2 * gap_rounds + 4], 91, pool)
    streams = make_streams(2)
    server = HistoryServer(streams, [big, small], spares).start()
    directory = None
    rebuild: list[float] = []
    catch: dict[int, list[float]] = {0: [], 1: []}
    try:
        cfg_big, cfg_small = (history_stream_config(s, i) for i, s in enumerate(streams))
        directory = Directory(KvEventsConfig.model_validate({"streams": [
            cfg_small.model_dump(mode="json")], "resync_interval_ms": 600_000}))
        directory.start()
        wait_until(lambda: synced_at(directory, cfg_small.instance_name, SMALL_BATCHES - 1),
                   60, "small stream", interval_s=0.005)
        for r in range(rebuild_rounds):
            gc.collect()
            t0 = time.perf_counter()
            sid = directory.add_stream(cfg_big)
            t1 = wait_until(lambda: synced_at(directory, cfg_big.instance_name,
                                               server.last_seq[0]), 120, "rebuild",
                            interval_s=0.0005)
            rebuild.append(t1 - t0)
            st = stream_status(directory, cfg_big.instance_name)
            if st.device_blocks != big_batches * BLOCKS_PER_BATCH or \
                    getattr(st.completeness, "value", st.completeness) != "exact":
                raise AssertionError(f"rebuild gave {st.device_blocks} blocks, "
                                     f"{st.completeness}")
            if r != rebuild_rounds - 1:
                directory.remove_stream(sid)
        wait_until(lambda: server.subscriptions >= 2 + rebuild_rounds - 1, 30, "subscriptions",
                   interval_s=0.01)
        # A live batch sent before the SUB's subscription reached the XPUB is lost: let each
        # subscription settle by one gap round that is not measured.
        for i in (0, 1):
            target = server.gap(i)
            wait_until(lambda: synced_at(directory,
                                         history_stream_config(streams[i], i).instance_name,
                                         target), 30, "warm-up gap", interval_s=0.001)
        for _ in range(gap_rounds - 1):
            for i in (0, 1):
                name = history_stream_config(streams[i], i).instance_name
                gc.collect()
                t0 = time.perf_counter()
                target = server.gap(i)
                t1 = wait_until(lambda: synced_at(directory, name, target), 30, "catch-up",
                                interval_s=0.0002)
                catch[i].append(t1 - t0)
        st = stream_status(directory, cfg_big.instance_name)
        if st.device_blocks != (big_batches + 2 * gap_rounds) * BLOCKS_PER_BATCH:
            raise AssertionError(f"after the catch-ups the stream holds {st.device_blocks} blocks")
    finally:
        if directory is not None:
            directory.close()
        server.close()
    if big_batches != BIG_BATCHES:
        res.notes.append(f"reduced size: {big_batches} batches (the issue: {BIG_BATCHES})")
    r50, c50, s50 = (percentile(rebuild, 50), percentile(catch[0], 50),
                     percentile(catch[1], 50))
    res.ratios["rebuild / catch-up (100k)"] = (r50 / c50, 20.0, False)
    res.ratios["catch-up 100k / 160 blocks"] = (c50 / s50, 3.0, True)
    res.figures.append(
        f"rebuild from seq 0 of {big_batches} batches ({big_batches * BLOCKS_PER_BATCH} blocks, "
        f"exact): p50 {r50 * 1e3:.0f} ms, max {max(rebuild) * 1e3:.0f} ms ({rebuild_rounds} "
        f"rounds), {r50 / big_batches * 1e6:.0f} us per batch")
    res.figures.append(
        f"catch-up after a 1-batch gap (reply L, L+1, L+2): at 100k blocks p50 "
        f"{c50 * 1e3:.2f} ms, p99 {percentile(catch[0], 99) * 1e3:.2f} ms; at 160 blocks p50 "
        f"{s50 * 1e3:.2f} ms ({len(catch[0])} rounds each; command to synchronized, including "
        f"the server's IPC)")
    return res


def rebuild_fixture(batches: int) -> tuple[HistoryServer, list[StreamConfig], list[int]]:
    """The engines of benchmarks 10 and 12, started: ``OTHER_STREAMS`` streams of
    ``OTHER_BATCHES`` batches (the first one also holds the ``PROMPT_TOKENS``-token prompt,
    parent-chained in two batches) and, last, the stream to rebuild (``batches`` batches).

    :returns: (the server, the streams' configs in that order, the prompt).
    :raises RuntimeError: threads running (unsafe fork) or the server did not start.
    """
    pool = token_pool(1 << 21, seed=10)
    prompt = pool[:PROMPT_TOKENS]
    *others, big = history_payloads([OTHER_BATCHES] * OTHER_STREAMS + [batches], 100,
                                    pool[PROMPT_TOKENS:])
    others[0] += [encode_batch(Flavor.VLLM, time.time(), [e], 0) for e in chain_events(prompt, 1)]
    streams = make_streams(OTHER_STREAMS + 1)
    server = HistoryServer(streams, others + [big], [[] for _ in streams]).start()
    return server, [history_stream_config(s, i) for i, s in enumerate(streams)], prompt


def others_config(cfgs: list[StreamConfig]) -> KvEventsConfig:
    """The §8 config of the fixture's other streams (all but the last), periodic resync off."""
    return KvEventsConfig.model_validate({
        "streams": [c.model_dump(mode="json") for c in cfgs[:-1]], "resync_interval_ms": 600_000})


def wait_others(directory: Directory, server: HistoryServer, cfgs: list[StreamConfig],
                prompt: list[int]) -> None:
    """Wait until the fixture's other streams are synchronized at their last seq and check the
    query answer: all of the prompt on the first stream, nothing on the others.

    :raises TimeoutError: not synchronized within 60 s.
    :raises AssertionError: other answers.
    """
    wait_until(lambda: all(synced_at(directory, c.instance_name, server.last_seq[i])
                           for i, c in enumerate(cfgs[:-1])), 60, "other streams",
               interval_s=0.005)
    got = [m.device_hit_tokens for m in directory.query(prompt)]
    if got != [PROMPT_TOKENS] + [0] * (OTHER_STREAMS - 1):
        raise AssertionError(f"query answers are not the expected ones: {got}")


def bench_rebuild_10k(batches: int = HISTORY10_BATCHES, rounds: int = REBUILD10_ROUNDS,
                      quiet_rounds: int = QUIET10_ROUNDS) -> Result:
    """Benchmark 10 (module docstring): a history of ``batches`` x 16 blocks (the issue:
    10,000), ``rounds`` rebuilds with the request loop, ``quiet_rounds`` without.

    :raises AssertionError: wrong query answers or block count.
    :raises TimeoutError: a rebuild did not finish in 120 s.
    """
    res = Result(10, "query p99 while a 10,000-batch history rebuilds",
                 "query p99 while rebuilding <= 5 x idle p99")
    server, cfgs, prompt = rebuild_fixture(batches)
    directory = None
    idle: list[float] = []
    busy: list[float] = []
    windows: list[float] = []
    quiet: list[float] = []
    try:
        directory = Directory(others_config(cfgs))
        directory.start()
        wait_others(directory, server, cfgs, prompt)
        clock = time.perf_counter
        for _ in range(200):
            directory.query(prompt)
        name = cfgs[-1].instance_name
        for _ in range(rounds):
            gc.collect()
            for _ in range(IDLE_SAMPLES):
                t0 = clock()
                directory.query(prompt)
                idle.append(clock() - t0)
            t_add = clock()
            sid = directory.add_stream(cfgs[-1])
            deadline = t_add + 120
            while not synced_at(directory, name, server.last_seq[-1]):
                if clock() > deadline:
                    raise TimeoutError("10,000-batch rebuild did not finish in 120 s")
                t0 = clock()
                directory.query(prompt)
                busy.append(clock() - t0)
            windows.append(clock() - t_add)
            st = stream_status(directory, name)
            if st.device_blocks != batches * BLOCKS_PER_BATCH:
                raise AssertionError(f"rebuild gave {st.device_blocks} blocks")
            directory.remove_stream(sid)
        # The same rebuild with no request loop competing for the GIL.
        for _ in range(quiet_rounds):
            gc.collect()
            t_add = clock()
            sid = directory.add_stream(cfgs[-1])
            quiet.append(wait_until(lambda: synced_at(directory, name, server.last_seq[-1]),
                                    120, "quiet rebuild", interval_s=0.002) - t_add)
            directory.remove_stream(sid)
    finally:
        if directory is not None:
            directory.close()
        server.close()
    if not busy:
        raise AssertionError("no query sample taken while rebuilding")
    if batches != HISTORY10_BATCHES:
        res.notes.append(f"reduced size: {batches} batches (the issue: {HISTORY10_BATCHES})")
    i99, b99 = percentile(idle, 99), percentile(busy, 99)
    res.ratios["query p99"] = (b99 / i99, 5.0, True)
    res.figures.append(
        f"query ({PROMPT_TOKENS} tokens, {OTHER_STREAMS} streams answering): idle p50 "
        f"{percentile(idle, 50) * 1e6:.0f} us, p99 {i99 * 1e6:.0f} us ({len(idle)} samples); "
        f"rebuilding p50 {percentile(busy, 50) * 1e6:.0f} us, p99 {b99 * 1e6:.0f} us "
        f"({len(busy)} samples)")
    res.figures.append(
        f"rebuild from seq 0 of {batches} batches x {BLOCKS_PER_BATCH} blocks "
        f"({batches * BLOCKS_PER_BATCH} blocks, exact): add to synchronized p50 "
        f"{percentile(windows, 50) * 1e3:.0f} ms, max {max(windows) * 1e3:.0f} ms "
        f"({rounds} rounds, the query loop running); without requests p50 "
        f"{percentile(quiet, 50) * 1e3:.0f} ms, max {max(quiet) * 1e3:.0f} ms "
        f"({quiet_rounds} rounds)")
    if percentile(windows, 50) > 4 * percentile(quiet, 50):
        res.notes.append(
            "the rebuild window with a spinning request loop is far longer than without: "
            "each of the 10,000 reply messages is one receive on the stream thread, which "
            "gives up the GIL and waits up to a switch interval (5 ms) to get it back from the "
            "request thread (benchmark 8's snapshots come in a few large messages); benchmark "
            "12 measures where the time goes")
    return res
