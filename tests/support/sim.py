"""The simulated engine (kvsvc.testbed.sim) seen from a test: ports, a ZMQ subscriber and dealer of
its streams, :func:`recv`, :func:`nothing_within`, and block and hash helpers."""

from __future__ import annotations

import random

import zmq

from kvsvc.testbed.sim import SimEngine, chain_hash
from kvsvc.testbed.soak import listen_port_run

from tests.support.util import wait_for

BS = 4


def blocks(*starts: int) -> list[int]:
    """Token ids made of full BS-blocks starting at the given values: blocks(0, 10) ->
    [0,1,2,3,10,11,12,13]."""
    return [s + i for s in starts for i in range(BS)]


def hashes(token_ids: list[int]) -> list[int]:
    out, parent = [], None
    for i in range(len(token_ids) // BS):
        parent = chain_hash(parent, token_ids[i * BS:(i + 1) * BS])
        out.append(parent)
    return out


def consecutive_ports(n: int) -> int:
    """A base port with ``n`` consecutive free loopback ports (the soak's own search)."""
    return listen_port_run(n, random.Random())


def recv(sock: zmq.Socket, timeout_ms: int = 5000) -> list[bytes]:
    assert sock.poll(timeout_ms), "nothing received in time"
    return sock.recv_multipart()


def nothing_within(sock: zmq.Socket, timeout_ms: int = 300) -> bool:
    return sock.poll(timeout_ms) == 0


def subscriber(ctx: zmq.Context, eng: SimEngine, rank: int, topic: bytes = b"kv") -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(eng.endpoints(rank)[0])
    sub.subscribe(topic)
    wait_for(lambda: eng.subscriptions(rank) == 1, 5.0, what="subscription")
    return sub


def dealer(ctx: zmq.Context, eng: SimEngine, rank: int) -> zmq.Socket:
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(eng.endpoints(rank)[1])
    return d
