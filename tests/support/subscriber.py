"""A harness of real :class:`~kvsvc.streams.subscriber.StreamSubscriber` objects fed by
:mod:`tests.support.publisher` engines (block size 4, seed 1024; block contents named by small
integers, :func:`blk`) and :func:`hits` (what a prompt matches). A harness given a
:class:`~kvsvc.clock.VirtualClock` runs its subscribers' timers on it: the test moves time with
``clock.advance`` instead of waiting for a resync interval or a grace period."""

from __future__ import annotations

from typing import Optional

from kvsvc.clock import MONOTONIC, Clock
from kvsvc.config import KvEventsConfig, StreamConfig
from kvsvc.index.keys import prompt_keys
from kvsvc.streams.subscriber import StreamSubscriber

from tests.support.publisher import ProtocolPublisher
from tests.support.util import free_ports

BS = 4
SEED = 1024


def blk(*contents: int) -> list[int]:
    """Tokens of consecutive blocks; block content ``c`` is ``[c*100, c*100+1, ...]``."""
    return [c * 100 + j for c in contents for j in range(BS)]


class Harness:
    """Publishers and subscribers of one test, closed in reverse order. Subclasses change
    the publisher class and the streams' extra config (history mode, test_history.py)."""

    publisher_class: type = ProtocolPublisher
    stream_options: dict = {}

    def __init__(self, ctx, clock: Clock = MONOTONIC):
        self.ctx = ctx
        self.clock = clock
        self.objs: list = []

    def publisher(self, ports: Optional[tuple[int, int]] = None, **kw):
        event_port, replay_port = ports or free_ports(2)
        pub = self.publisher_class(self.ctx, event_port, replay_port, **kw)
        self.objs.append(pub)
        return pub.start()

    def subscriber(self, pub, *, topic: str = "", start: bool = True,
                   **limits) -> StreamSubscriber:
        cfg = StreamConfig(instance_name="10.0.0.1:8000", dp_rank=pub.dp_rank, block_size=BS,
                           endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint,
                           topic=topic, hash_seed=SEED, **self.stream_options)
        sub = StreamSubscriber(cfg, KvEventsConfig(**limits), self.ctx, clock=self.clock)
        self.objs.append(sub)
        if start:
            sub.start()
        return sub

    def close(self):
        for obj in reversed(self.objs):
            obj.close()


def hits(sub: StreamSubscriber, *contents: int) -> tuple[bool, int, int]:
    """(synchronized, device hit tokens, host-only hit tokens) of the prompt ``blk(*contents)``."""
    m = sub.match(prompt_keys(blk(*contents), BS, SEED))
    return m.synchronized, m.device_hit_tokens, m.host_only_hit_tokens
