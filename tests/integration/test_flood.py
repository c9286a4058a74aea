"""Memory-bound flood (§5 capacity, §6 buffer): one engine floods the real service
(``python -m kvsvc serve``: gunicorn arbiter + one worker) with unique hashes and unknown
parents past ``max_blocks_per_stream`` and past ``max_buffered_bytes`` during a recovery, while
two other engines publish normally.

Memory is measured as the RSS of the **gunicorn worker process** (the one holding the streams),
read from ``/proc/<pid>/status``: ``VmRSS`` once the service is ready (the baseline) and
``VmHWM`` (the kernel's peak RSS of the process) at the end. The stated bound::

    peak RSS <= baseline RSS + FLOOD_RSS_BOUND_MIB (24 MiB)

derived from the configured limits and measured sizes: the index at capacity (20,000 entries,
~130 bytes each measured with tracemalloc: ~2.5 MiB), counted twice because a recovery builds a
second, private index before the swap (5 MiB); the recovery buffer (``max_buffered_bytes`` =
1 MiB of wire bytes plus decoded records: ~3 MiB); the live ``SUB`` receive queue (ZMQ's default
RCVHWM of 1000 messages of ~2 KiB, doubled for socket buffers: ~4 MiB); 12 MiB of slack for
allocator fragmentation and transient batches. Unbounded growth would exceed it: phase 1 alone
delivers 240,000 unique blocks (the publisher's send HWM is 0, so none is dropped), ~30 MiB
as index entries, besides the 25,000-block snapshot and the buffer flood.

The flooded stream must report ``index capacity exceeded`` and ``buffer overflow`` (§5, §6) in
``/ready``; the two other streams stay synchronized, never recover, and answer exactly.
"""

from __future__ import annotations

import itertools
import json
import re
import signal
from pathlib import Path
from typing import Optional

from tests.support.publisher import ProtocolPublisher, stored
from tests.support.gunicorn import Server, group_alive, serve_env
from tests.support.http_service import group_pids
from tests.support.util import free_ports, wait_for

BS = 4
TOKEN = "flood-token"
AUTH = {"X-Internal-Token": TOKEN}
QUERY = "/v1/internal/kv-cache/query"
MAX_BLOCKS = 20_000
MAX_BUFFERED = 1 << 20
FLOOD_RSS_BOUND_MIB = 24
BLOCKS_PER_BATCH = 64
#: 12 x max_blocks_per_stream of unique blocks in phase 1.
FLOOD_BATCHES = 12 * MAX_BLOCKS // BLOCKS_PER_BATCH


def status_kib(pid: int, field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of ``pid`` in KiB (from /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"{field} not in /proc/{pid}/status")


class Flooder:
    """Batches of ``BLOCKS_PER_BATCH`` never-seen blocks (unique hashes and tokens)."""

    def __init__(self, pub: ProtocolPublisher) -> None:
        self.pub = pub
        self.ids = itertools.count(10_000_000)
        self.blocks_sent = 0

    def _tokens(self, n_blocks: int) -> list[int]:
        return [next(self.ids) % (2**31 - 1) for _ in range(n_blocks * BS)]

    def unique(self, batches: int, unknown_parent: bool = False) -> None:
        for _ in range(batches):
            hashes = [next(self.ids) for _ in range(BLOCKS_PER_BATCH)]
            parent = next(self.ids) if unknown_parent else None
            ev = stored(hashes, parent, self._tokens(BLOCKS_PER_BATCH), BS)
            self.pub.publish([ev])
            self.blocks_sent += BLOCKS_PER_BATCH

    def snapshot_events(self, n_blocks: int) -> list[dict]:
        """A snapshot state of ``n_blocks`` root chains (64 blocks per event)."""
        out = []
        for _ in range(0, n_blocks, BLOCKS_PER_BATCH):
            out.append(stored([next(self.ids) for _ in range(BLOCKS_PER_BATCH)], None,
                              self._tokens(BLOCKS_PER_BATCH), BS))
        return out


def stream_status(server: Server, name: str) -> dict:
    body = server.get("/ready?streams=synchronized").json()
    return next(s for s in body["streams"] if s["instance_name"] == name)


def query(server: Server, tokens: list[int]) -> dict:
    r = server.post(QUERY, headers=AUTH, json={"token_ids": tokens})
    assert r.status_code == 200, r.text
    return {m["instance_name"]: m for m in r.json()["matches"]}


def test_flood_stays_within_memory_bound(tmp_path, zmq_ctx):
    ports = free_ports(7)
    names = ["flood:1", "calm-a:1", "calm-b:1"]
    pubs = [ProtocolPublisher(zmq_ctx, ports[2 * i], ports[2 * i + 1]) for i in range(3)]
    calm_tokens = {n: [[1000 * (i + 1) + j for j in range(BS)] for i in range(3)] for n in names}
    # Calm engines: one block (hash 1) resident from the start.
    for name, pub in zip(names[1:], pubs[1:]):
        pub.set_snapshot([stored([1], None, calm_tokens[name][0], BS)], watermark=None)
    pubs[0].set_snapshot([], watermark=None)
    cfg = tmp_path / "kv.json"
    cfg.write_text(json.dumps({
        "streams": [{"instance_name": n, "block_size": BS, "endpoint": p.endpoint,
                     "replay_endpoint": p.replay_endpoint} for n, p in zip(names, pubs)],
        "max_blocks_per_stream": MAX_BLOCKS, "max_buffered_bytes": MAX_BUFFERED,
        "replay_timeout_ms": 1000, "resync_interval_ms": 600_000}), encoding="utf-8")
    server: Optional[Server] = None
    for p in pubs:
        p.start()
    try:
        server = Server(tmp_path, ports[6], ["--kv_events_config_file", str(cfg)],
                        env={**serve_env(), "KVSVC_INTERNAL_API_TOKEN": TOKEN,
                             "KVSVC_LOG_LEVEL": "warning"})
        server.wait_healthy()
        wait_for(lambda: server.get("/ready?streams=synchronized").status_code == 200, timeout_s=20, interval_s=0.05,
                 what="/ready 200")
        for p in pubs:
            p.wait_subscribed(timeout_s=10)
        wait_for(lambda: len(group_pids(server.pgid)) == 2, timeout_s=10, what="worker")
        (worker,) = group_pids(server.pgid) - {server.proc.pid}
        baseline_kib = status_kib(worker, "VmRSS")

        flood = Flooder(pubs[0])
        calm_seq = {n: None for n in names[1:]}

        def calm_step(k: int) -> None:
            # Calm engines store their next block (child of the previous one), live.
            for name, pub in zip(names[1:], pubs[1:]):
                if k < len(calm_tokens[name]):
                    calm_seq[name] = pub.publish([stored([k + 1], k, calm_tokens[name][k], BS)])

        # 1. Live flood of unique roots, 12x max_blocks_per_stream, none dropped by the
        #    publisher (send HWM 0: the backlog waits in this process, the service's SUB only
        #    ever holds its receive HWM): the index hits capacity again and again (§5).
        pubs[0].set_send_hwm(0)
        flood.unique(FLOOD_BATCHES)
        calm_step(1)
        # 2. Unknown parents: every batch is a §5 error in a live delta.
        flood.unique(200, unknown_parent=True)
        # 3. A snapshot state bigger than the capacity: every recovery fails on it, steadily.
        pubs[0].set_snapshot(flood.snapshot_events(MAX_BLOCKS + 5000), watermark=None)
        flood.unique(1, unknown_parent=True)
        capacity = wait_for(lambda: (lambda s: s if "index capacity exceeded" in (s["error"] or "")
                                     else None)(stream_status(server, "flood:1")),
                            timeout_s=30, interval_s=0.05, what="capacity error reported")
        assert capacity["state"] != "synchronized"
        # 4. Hold snapshot replies: a recovery is in flight while the flood goes on, past
        #    max_buffered_bytes.
        pubs[0].set_snapshot([], watermark=None)
        pubs[0].hold_replies()
        flood.unique(1, unknown_parent=True)  # a fresh error: the next attempt waits on us

        def overflowed() -> Optional[dict]:
            flood.unique(20)
            s = stream_status(server, "flood:1")
            return s if "buffer overflow" in (s["error"] or "") else None
        overflow = wait_for(overflowed, timeout_s=30, interval_s=0.0, what="buffer overflow")
        assert overflow["state"] != "synchronized"
        calm_step(2)

        # The fault stops: replies flow, the engine's state is small again; it must come back.
        final_state = [stored([5], None, calm_tokens["flood:1"][0], BS)]
        pubs[0].set_snapshot(final_state, watermark=pubs[0].next_seq - 1)
        pubs[0].release_replies()

        def flood_synced() -> bool:
            # An empty batch keeps the live side moving; the snapshot follows its seq (a real
            # engine's watermark is always its last published seq, §7).
            seq = pubs[0].publish([])
            pubs[0].set_snapshot(final_state, watermark=seq)
            s = stream_status(server, "flood:1")
            return s["state"] == "synchronized" and s["sequence"] == seq
        wait_for(flood_synced, timeout_s=30, interval_s=0.05, what="flooded stream back")

        peak_kib = status_kib(worker, "VmHWM")
        end_kib = status_kib(worker, "VmRSS")
        print(f"flood: {flood.blocks_sent} blocks sent; worker RSS baseline "
              f"{baseline_kib / 1024:.1f} MiB, peak {peak_kib / 1024:.1f} MiB, end "
              f"{end_kib / 1024:.1f} MiB; bound baseline + {FLOOD_RSS_BOUND_MIB} MiB")
        assert flood.blocks_sent > 12 * MAX_BLOCKS
        assert peak_kib - baseline_kib <= FLOOD_RSS_BOUND_MIB * 1024, \
            f"peak {peak_kib} KiB over baseline {baseline_kib} KiB + {FLOOD_RSS_BOUND_MIB} MiB"

        # Exact answers: the flooded stream holds the one block of its final state; each calm
        # stream its three blocks; the calm streams never left synchronized.
        answers = query(server, calm_tokens["flood:1"][0])
        assert (answers["flood:1"]["device_hit_tokens"], answers["flood:1"]["device_blocks"]) == (BS, 1)
        for name in names[1:]:
            wait_for(lambda: stream_status(server, name)["sequence"] == calm_seq[name],
                     timeout_s=10, what=f"{name} at its last seq")
            prompt = [t for block in calm_tokens[name] for t in block]
            m = query(server, prompt)[name]
            assert (m["synchronized"], m["sequence"], m["device_hit_tokens"],
                    m["host_only_hit_tokens"], m["device_blocks"], m["error"]) == \
                (True, calm_seq[name], 3 * BS, 0, 3, None)
            s = stream_status(server, name)
            assert (s["recoveries"], s["state"]) == (1, "synchronized")
        assert server.stop(signal.SIGINT) == 0
        log_text = server.log()
        assert "Traceback" not in log_text
        # The live path hit the capacity (a live delta, §5), not only the snapshot path.
        assert re.search(r"flood:1/dp0: unsynchronized: seq \d+: index capacity exceeded", log_text)
        assert "flood:1/dp0: unsynchronized: buffer overflow" in log_text
        assert "calm-a:1/dp0: unsynchronized" not in log_text
        assert "calm-b:1/dp0: unsynchronized" not in log_text
    finally:
        if server is not None and (server.proc.poll() is None or group_alive(server.pgid)):
            server.stop(signal.SIGKILL)
        for p in pubs:
            p.close()
