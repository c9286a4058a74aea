"""The snapshot gate (kvsvc.streams.gate.SnapshotGate) and the sliced snapshot decode
inside a running directory (split_batch on its own: tests/integration/test_snapshot_split.py).

The gate bounds the snapshot attempts running at once across a directory's streams; these
tests hold engine replies (tests/support/publisher.py) so every ordering is forced, never timed.
"""

from __future__ import annotations

import os
import select
import threading
from contextlib import ExitStack
from typing import Any

import pytest
import zmq

import kvsvc.streams.snapshot_client as snapshot_module
from kvsvc.config import DEFAULT_MAX_CONCURRENT_SNAPSHOTS, parse_kv_events_config
from kvsvc.settings import ServiceSettings, load_service_settings
from kvsvc.directory import Directory
from kvsvc.errors import ConfigError, DecodeError
from kvsvc.index.tier_index import TierIndex
from kvsvc.streams.decoder import decode_batch
from kvsvc.streams.gate import GateStats, SnapshotGate
from kvsvc.streams.split import split_batch
from kvsvc.streams.state import StreamId, StreamState
from tests.support.publisher import ProtocolPublisher, encode_batch, stored
from tests.support.util import free_ports, wait_for

B4 = 4


def blk(c: int) -> list[int]:
    return [c * 100 + j for j in range(B4)]


def readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


# -- the gate on its own ---------------------------------------------------------------------

def test_gate_grants_in_order_and_wakes_the_next_ticket():
    gate = SnapshotGate(1)
    first, second, third = gate.request(), gate.request(), gate.request()
    assert (first.granted, first.fileno) == (True, None)
    assert (second.granted, third.granted) == (False, False)
    assert gate.stats() == GateStats(permits=1, in_use=1, waiting=2, max_in_use=1, granted=1,
                                     waited=2)
    assert not readable(second.fileno)
    gate.release(first)
    assert second.granted and readable(second.fileno)
    second.consume_wakeup()
    assert not readable(second.fileno)
    assert not third.granted
    gate.release(third)  # leaves the queue without ever holding a permit
    assert third.fileno is None
    gate.release(second)
    gate.release(second)  # idempotent: the permit is not returned twice
    assert second.fileno is None
    assert gate.stats() == GateStats(permits=1, in_use=0, waiting=0, max_in_use=1, granted=2,
                                     waited=2)


def test_gate_with_two_permits():
    gate = SnapshotGate(2)
    tickets = [gate.request() for _ in range(3)]
    assert [t.granted for t in tickets] == [True, True, False]
    gate.release(tickets[1])
    assert tickets[2].granted
    for t in tickets:
        gate.release(t)
    assert gate.stats() == GateStats(permits=2, in_use=0, waiting=0, max_in_use=2, granted=3,
                                     waited=1)


def test_gate_serves_recoveries_before_resyncs():
    gate = SnapshotGate(1)
    holder = gate.request()
    resync_1 = gate.request(urgent=False)
    recovery_1 = gate.request()
    resync_2 = gate.request(urgent=False)
    recovery_2 = gate.request()
    order = []
    for ticket in (holder, recovery_1, recovery_2, resync_1, resync_2):
        assert ticket.granted
        order.append(ticket)
        gate.release(ticket)
    assert order == [holder, recovery_1, recovery_2, resync_1, resync_2]
    assert gate.stats() == GateStats(permits=1, in_use=0, waiting=0, max_in_use=1, granted=5,
                                     waited=4)


@pytest.mark.parametrize("permits", [0, -1, 1.0, True])
def test_gate_refuses_bad_permit_counts(permits):
    with pytest.raises(ValueError, match="permits must be an integer >= 1"):
        SnapshotGate(permits)


def test_gate_pipes_are_closed():
    gate = SnapshotGate(1)
    holder = gate.request()
    queued = gate.request()
    fd = queued.fileno
    gate.release(queued)
    with pytest.raises(OSError):
        os.fstat(fd)
    gate.release(holder)


# -- streams of a directory behind one gate --------------------------------------------------

class Engines:
    """Engines (tests/support/publisher.py) whose replies are held, and their §8 stream entries."""

    def __init__(self, ctx, stack: ExitStack, names: list[str]) -> None:
        self.ctx = ctx
        self.stack = stack
        self.by_name: dict[str, ProtocolPublisher] = {}
        self.streams: list[dict[str, Any]] = []
        for i, name in enumerate(names):
            event_port, replay_port = free_ports(2)
            pub = ProtocolPublisher(ctx, event_port, replay_port)
            pub.set_snapshot([stored([i + 1], None, blk(i + 1), B4)], watermark=None)
            pub.hold_replies()
            pub.start()
            stack.callback(pub.close)
            self.by_name[name] = pub
            self.streams.append({"instance_name": name, "block_size": B4,
                                 "endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint})

    def directory(self, permits: int, **limits: Any) -> Directory:
        config = parse_kv_events_config({"streams": self.streams, "replay_timeout_ms": 10_000,
                                         **limits})
        d = Directory(config, self.ctx, max_concurrent_snapshots=permits)
        d.start(timeout_s=5.0)
        self.stack.callback(d.close, 5.0)
        return d

    def requested(self) -> list[str]:
        """Engines that received a snapshot request, in name order."""
        return [n for n, pub in sorted(self.by_name.items()) if pub.requests]


def state(d: Directory, name: str) -> StreamState:
    return next(st.state for st in d.statuses() if st.stream.instance_name == name)


def test_one_permit_one_attempt_at_a_time(zmq_ctx, monkeypatch):
    """4 streams recover at once behind 1 permit: exactly one has its request out at any
    moment, the others queue (no request sent), and each release admits exactly the next."""
    active = [0]
    most = [0]
    lock = threading.Lock()
    original = TierIndex.apply

    def counting(self, events, *, snapshot=False):
        if not snapshot:
            return original(self, events, snapshot=snapshot)
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        try:
            return original(self, events, snapshot=snapshot)
        finally:
            with lock:
                active[0] -= 1

    # Counts the snapshot builds running at once (every snapshot event goes through apply).
    monkeypatch.setattr(TierIndex, "apply", counting)
    names = ["a:1", "b:1", "c:1", "d:1"]
    with ExitStack() as stack:
        engines = Engines(zmq_ctx, stack, names)
        d = engines.directory(permits=1)
        done: list[str] = []
        for step in range(4):
            wait_for(lambda: d.snapshot_gate().waiting == 3 - step, what=f"{3 - step} queued")
            wait_for(lambda: len(engines.requested()) == step + 1, what="one more request")
            stats = d.snapshot_gate()
            assert (stats.in_use, stats.waiting) == (1, 3 - step)
            (holder,) = [n for n in engines.requested() if n not in done]
            for name in names:
                if name not in done:
                    # Queued streams and the holder all recover (§6: not synchronized).
                    assert state(d, name) is StreamState.RECOVERING
            engines.by_name[holder].release_replies()
            wait_for(lambda: state(d, holder) is StreamState.SYNCHRONIZED, what=f"{holder} synced")
            done.append(holder)
        assert sorted(done) == names
        stats = d.snapshot_gate()
        assert stats == GateStats(permits=1, in_use=0, waiting=0, max_in_use=1, granted=4,
                                  waited=3)
        assert most[0] == 1
        assert {m.instance_name: m.device_hit_tokens for m in d.query(blk(1))} == {
            "a:1": 4, "b:1": 0, "c:1": 0, "d:1": 0}


def test_a_queued_stream_is_closed_promptly(zmq_ctx):
    with ExitStack() as stack:
        engines = Engines(zmq_ctx, stack, ["a:1", "b:1"])
        d = engines.directory(permits=1)
        wait_for(lambda: d.snapshot_gate().waiting == 1, what="one stream queued")
        wait_for(lambda: len(engines.requested()) == 1, what="the holder's request")
        (holder,) = engines.requested()
        queued = "b:1" if holder == "a:1" else "a:1"
        sub = d.subscriber(StreamId(queued, 0))
        assert sub is not None and sub.running
        assert d.remove_stream(StreamId(queued, 0), timeout_s=2.0) is True  # raises if slow
        assert not sub.running
        assert d.snapshot_gate() == GateStats(permits=1, in_use=1, waiting=0, max_in_use=1,
                                              granted=1, waited=1)
        assert engines.by_name[queued].requests == []  # it never sent a request
        # The holder is closed while its request is open: its permit comes back too.
        d.close()
        assert d.snapshot_gate().in_use == 0


def test_permit_returned_after_a_timeout(zmq_ctx):
    """A stream whose engine never answers times out, releases, and retries; meanwhile the
    other stream gets the permit and synchronizes."""
    with ExitStack() as stack:
        engines = Engines(zmq_ctx, stack, ["a:1", "b:1"])
        engines.by_name["b:1"].release_replies()
        d = engines.directory(permits=1, replay_timeout_ms=100)
        wait_for(lambda: state(d, "b:1") is StreamState.SYNCHRONIZED, what="b:1 synced")
        sub = d.subscriber(StreamId("a:1", 0))
        wait_for(lambda: sub.counters().snapshot_attempts["timeout"] >= 2, what="2 timeouts")
        stats = d.snapshot_gate()
        assert stats.max_in_use == 1 and stats.granted >= 3
        engines.by_name["a:1"].release_replies()
        wait_for(lambda: state(d, "a:1") is StreamState.SYNCHRONIZED, what="a:1 synced")
        wait_for(lambda: d.snapshot_gate().in_use == 0, what="permit back")


def test_permit_returned_after_a_malformed_reply(zmq_ctx):
    with ExitStack() as stack:
        engines = Engines(zmq_ctx, stack, ["a:1", "b:1"])
        bad = engines.by_name["a:1"]
        bad.set_snapshot([{"type": "NoSuchEvent"}], watermark=None)
        bad.release_replies()
        engines.by_name["b:1"].release_replies()
        d = engines.directory(permits=1)
        wait_for(lambda: state(d, "b:1") is StreamState.SYNCHRONIZED, what="b:1 synced")
        sub = d.subscriber(StreamId("a:1", 0))
        wait_for(lambda: sub.counters().snapshot_attempts["error"] >= 1, what="a failed attempt")
        assert sub.status().error == "snapshot reply: event 0: unknown event type 'NoSuchEvent'"
        bad.set_snapshot([stored([7], None, blk(7), B4)], watermark=None)
        wait_for(lambda: state(d, "a:1") is StreamState.SYNCHRONIZED, what="a:1 synced")
        wait_for(lambda: d.snapshot_gate().in_use == 0, what="permit back")
        assert d.snapshot_gate().max_in_use == 1


def test_directory_default_permits():
    d = Directory(parse_kv_events_config({"streams": []}))
    assert d.snapshot_gate().permits == DEFAULT_MAX_CONCURRENT_SNAPSHOTS
    with pytest.raises(ValueError):
        Directory(parse_kv_events_config({"streams": []}), max_concurrent_snapshots=0)


# -- the sliced decode -----------------------------------------------------------------------

def _events(n: int) -> list[dict]:
    return [stored([i + 1], i or None, blk(i + 1), B4) for i in range(n)]


def test_sliced_decode_error_text_is_decode_batch_s(zmq_ctx, monkeypatch):
    """An attempt decodes event by event, but a bad event fails with decode_batch's text."""
    monkeypatch.setattr(snapshot_module, "SPLIT_MIN_BYTES", 0)  # split even a small payload
    split_calls = []
    original_split = snapshot_module.split_batch
    monkeypatch.setattr(snapshot_module, "split_batch",
                        lambda *a: split_calls.append(1) or original_split(*a))
    events = _events(3) + [{"type": "BlockStored", "block_hashes": [9]}]
    payload = encode_batch(events, 0)
    with pytest.raises(DecodeError) as whole:
        decode_batch(payload, 0)
    assert str(whole.value) == "event 3: BlockStored: missing field parent_block_hash"
    assert split_batch(payload, 0, lambda: None) is not None  # it does split
    with ExitStack() as stack:
        engines = Engines(zmq_ctx, stack, ["a:1"])
        pub = engines.by_name["a:1"]
        pub.set_snapshot(events, watermark=None)
        pub.release_replies()
        d = engines.directory(permits=1)
        sub = d.subscriber(StreamId("a:1", 0))
        wait_for(lambda: sub.counters().snapshot_attempts["error"] >= 1, what="failed attempt")
        assert sub.status().error == f"snapshot reply: {whole.value}"
        assert split_calls  # the sliced path ran


def test_setting_is_validated(monkeypatch):
    assert ServiceSettings().max_concurrent_snapshots == DEFAULT_MAX_CONCURRENT_SNAPSHOTS
    assert load_service_settings(max_concurrent_snapshots=4).max_concurrent_snapshots == 4
    monkeypatch.setenv("KVSVC_MAX_CONCURRENT_SNAPSHOTS", "2")
    assert load_service_settings().max_concurrent_snapshots == 2
    for bad in (0, 129):
        with pytest.raises(ConfigError, match="max_concurrent_snapshots"):
            load_service_settings(max_concurrent_snapshots=bad)


def test_an_unreachable_engine_never_takes_a_permit(zmq_ctx):
    """Nothing listens on a's replay port: its attempts time out while still connecting,
    without a permit, so b's recovery never waits for them."""
    with ExitStack() as stack:
        engines = Engines(zmq_ctx, stack, ["b:1"])
        engines.by_name["b:1"].release_replies()
        event_port, replay_port = free_ports(2)
        # a's live channel is up (snapshots are only requested once it is connected).
        xpub = zmq_ctx.socket(zmq.XPUB)
        xpub.setsockopt(zmq.LINGER, 0)
        stack.callback(xpub.close, 0)
        xpub.bind(f"tcp://127.0.0.1:{event_port}")
        engines.streams.append({"instance_name": "a:1", "block_size": B4,
                                "endpoint": f"tcp://127.0.0.1:{event_port}",
                                "replay_endpoint": f"tcp://127.0.0.1:{replay_port}"})
        d = engines.directory(permits=1, replay_timeout_ms=100)
        sub = d.subscriber(StreamId("a:1", 0))
        wait_for(lambda: sub.counters().snapshot_attempts["timeout"] >= 2, what="2 timeouts")
        wait_for(lambda: state(d, "b:1") is StreamState.SYNCHRONIZED, what="b:1 synced")
        assert d.snapshot_gate() == GateStats(permits=1, in_use=0, waiting=0, max_in_use=1,
                                              granted=1, waited=0)
        assert sub.status().error == ("snapshot timeout: no complete reply within "
                                      "replay_timeout_ms=100")


def test_a_large_reply_message_is_split_and_indexed_exactly(zmq_ctx, monkeypatch):
    """One ~170 kB reply message (above SPLIT_MIN_BYTES) goes through the sliced decode, and
    the index answers exactly what the engine holds."""
    splits = []
    original_split = snapshot_module.split_batch

    def spy(*args):
        raw = original_split(*args)
        splits.append((len(args[0]), raw is not None))
        return raw

    monkeypatch.setattr(snapshot_module, "split_batch", spy)
    blocks = 2400
    # Token values of every MessagePack int width (fixint, uint8, uint16, uint32).
    tokens = [(i * 7919) % (1 << 31) if i % 4 == 3 else (i * 31) % (1 << (8 * (i % 4) + 7))
              for i in range(blocks * B4)]
    events = [stored([1000 + b], 1000 + b - 1 if b else None, tokens[b * B4:(b + 1) * B4], B4)
              for b in range(blocks)]
    with ExitStack() as stack:
        engines = Engines(zmq_ctx, stack, ["a:1"])
        pub = engines.by_name["a:1"]
        pub.events_per_message = blocks
        pub.set_snapshot(events, watermark=None)
        pub.release_replies()
        d = engines.directory(permits=1)
        wait_for(lambda: state(d, "a:1") is StreamState.SYNCHRONIZED, what="a:1 synced")
        ((size, split),) = splits
        assert split and size >= snapshot_module.SPLIT_MIN_BYTES
        assert d.query(tokens)[0].device_hit_tokens == blocks * B4
        assert d.query(tokens[:B4 * 100] + [1, 2, 3, 4])[0].device_hit_tokens == 100 * B4
