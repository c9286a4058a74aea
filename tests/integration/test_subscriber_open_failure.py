"""A snapshot attempt the stream thread cannot open (``SnapshotAttempt.open`` raises
``SnapshotError``: no file descriptor left, a terminated context), against a real publisher on
127.0.0.1 (tests/support/publisher.py). The failure is forced by wrapping ``SnapshotAttempt.open``: a
rare error path, the one place a mock is used (PROTOCOL.md §6, §7)."""

from __future__ import annotations

import logging

from kvsvc.config import KvEventsConfig, StreamConfig
from kvsvc.errors import SnapshotError
from kvsvc.streams import subscriber as subscriber_module
from kvsvc.streams.snapshot_client import SnapshotAttempt
from kvsvc.streams.state import StreamState
from kvsvc.streams.subscriber import StreamSubscriber
from tests.support.publisher import ProtocolPublisher, stored
from tests.support.util import free_ports, wait_for

BS = 4
SEED = 1024


def test_an_attempt_that_cannot_be_opened_leaves_the_stream_unsynchronized(
        zmq_ctx, monkeypatch, caplog):
    real_open = SnapshotAttempt.open
    states_at_open: list[StreamState] = []

    def open_failing_once(*args, **kwargs):
        # Runs on the stream thread: the state the stream shows while it opens an attempt.
        states_at_open.append(sub.status().state)
        if len(states_at_open) == 1:
            raise SnapshotError("snapshot socket: Too many open files")
        return real_open(*args, **kwargs)

    monkeypatch.setattr(subscriber_module.SnapshotAttempt, "open", open_failing_once)
    event_port, replay_port = free_ports(2)
    pub = ProtocolPublisher(zmq_ctx, event_port, replay_port).start()
    pub.set_snapshot([stored([1], None, [100, 101, 102, 103], BS)], 0)
    pub.next_seq = 1
    cfg = StreamConfig(instance_name="10.0.0.1:8000", block_size=BS, endpoint=pub.endpoint,
                       replay_endpoint=pub.replay_endpoint, hash_seed=SEED)
    sub = StreamSubscriber(cfg, KvEventsConfig(), zmq_ctx)
    try:
        with caplog.at_level(logging.INFO, logger="kvsvc.streams.recovery"):
            sub.start()
            wait_for(lambda: sub.status().state is StreamState.SYNCHRONIZED, 5.0,
                     what="synchronized after the retry")
        # Neither open ran while RECOVERING: the state changes only once one succeeded.
        assert states_at_open == [StreamState.UNSYNCHRONIZED, StreamState.UNSYNCHRONIZED]
        lines = [r.getMessage() for r in caplog.records if r.name == "kvsvc.streams.recovery"]
        name = "stream 10.0.0.1:8000/dp0"
        assert lines == [
            f"{name}: unsynchronized: snapshot socket: Too many open files; retry in 0.1s",
            f"{name}: recovering: snapshot requested (start_seq 0)",
            f"{name}: synchronized (snapshot watermark 0, 1 messages, tail to seq 0): 1 device, "
            f"0 host blocks"]
        assert pub.requests == [0]
        c = sub.counters()
        assert (c.snapshot_attempts["error"], c.snapshot_attempts["ok"]) == (1, 1)
    finally:
        sub.close()
        pub.close()
