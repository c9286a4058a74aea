"""The request observer seam (§12) through a real Proxy and the simulated engine on 127.0.0.1:
a streamed answer is heard as dispatch, first token, one token per further SSE event, and the
end with the engine's ``usage``; a non-streamed one as dispatch and end (usage from its body);
a refused attempt as dispatch then cancel, and the retry as a new attempt; a client that
closes mid-stream as cancel; and the request-metrics ledger returns to zero after each."""

from __future__ import annotations

import json
import threading
from typing import Optional

import pytest

from kvsvc.errors import UpstreamUnreachable
from kvsvc.routing.observer import (
    CANCEL_CLIENT_GONE,
    CANCEL_UPSTREAM_FAILED,
    ObserverChain,
    RequestInfo,
)
from kvsvc.routing.proxy import Proxy, ProxySettings
from kvsvc.routing.request_metrics import NO_REQUESTS, RequestMetricsLedger
from kvsvc.testbed.sim import SimEngine
from kvsvc.testbed.sim.serving import ServingConfig
from tests.support.util import free_port, free_ports

BS = 4


class Recorder:
    """Records every observer call as ``(event, attempt_id, extra)``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, object]] = []
        self._lock = threading.Lock()

    def _add(self, event: str, info: RequestInfo, extra: object = None) -> None:
        with self._lock:
            self.calls.append((event, info.attempt_id, extra))

    def on_dispatch(self, info: RequestInfo) -> None:
        self._add("dispatch", info, info.prefill)

    def on_first_token(self, info: RequestInfo) -> None:
        self._add("first_token", info)

    def on_token(self, info: RequestInfo) -> None:
        self._add("token", info)

    def on_end(self, info: RequestInfo, usage: Optional[dict]) -> None:
        self._add("end", info, usage)

    def on_cancel(self, info: RequestInfo, reason: str) -> None:
        self._add("cancel", info, reason)

    def events(self) -> list[str]:
        return [c[0] for c in self.calls]


@pytest.fixture
def engine():
    ev, rp, http = free_ports(3)
    eng = SimEngine("sim-obs", ev, rp, block_size=BS, device_blocks=64, http_port=http,
                    serving=ServingConfig(prefill_us_per_token=100.0,
                                          decode_us_per_token=100.0, model="m"))
    eng.start()
    yield eng
    eng.close()


@pytest.fixture
def observed():
    rec, ledger = Recorder(), RequestMetricsLedger()
    proxy = Proxy(ProxySettings(read_timeout_s=10.0), observer=ObserverChain([rec, ledger]))
    yield proxy, rec, ledger
    proxy.close()


def send(proxy: Proxy, targets: list[str], doc: dict, decode: str = "D:1",
         estimate_ms: float = 7.0):
    ids = iter(range(1, 100))
    return proxy.forward(targets, "/v1/completions", lambda t: json.dumps(doc).encode(),
                         {"Content-Type": "application/json"},
                         info_for=lambda t: RequestInfo(next(ids), t, decode,
                                                        len(doc["prompt"]), estimate_ms,
                                                        "TEST"))


def test_streamed_answer_is_dispatch_first_token_tokens_end_with_usage(engine, observed):
    proxy, rec, ledger = observed
    target = f"127.0.0.1:{engine.http_port}"
    doc = {"model": "m", "prompt": list(range(1, 9)), "max_tokens": 4, "stream": True,
           "stream_options": {"include_usage": True}}
    reply = send(proxy, [target], doc)
    mid = ledger.snapshot()
    assert mid.of(target).prefill_request_num == 1
    assert mid.of(target).prefill_token_num == 8
    assert mid.of(target).estimated_prefill_ms == 7.0
    assert mid.of("D:1").decode_request_num == 1
    chunks = list(reply.body)
    reply.body.close()
    assert chunks
    # 4 generated tokens: one first token, three more, then the end with the engine's usage.
    assert rec.events() == ["dispatch", "first_token", "token", "token", "token", "end"]
    usage = rec.calls[-1][2]
    assert usage["prompt_tokens"] == 8 and usage["completion_tokens"] == 4
    snap = ledger.snapshot()
    assert snap.of(target) == NO_REQUESTS
    assert snap.of("D:1") == NO_REQUESTS


def test_non_streamed_answer_is_dispatch_then_end_with_the_body_usage(engine, observed):
    proxy, rec, ledger = observed
    target = f"127.0.0.1:{engine.http_port}"
    doc = {"model": "m", "prompt": list(range(1, 9)), "max_tokens": 3}
    reply = send(proxy, [target], doc)
    reply.body.read_all()
    assert rec.events() == ["dispatch", "end"]
    assert rec.calls[-1][2]["completion_tokens"] == 3
    assert ledger.snapshot().of(target) == NO_REQUESTS
    assert ledger.snapshot().of("D:1") == NO_REQUESTS


def test_refused_attempt_is_cancelled_and_the_retry_is_a_new_attempt(engine, observed):
    proxy, rec, ledger = observed
    target = f"127.0.0.1:{engine.http_port}"
    refused = f"127.0.0.1:{free_port()}"
    doc = {"model": "m", "prompt": list(range(1, 9)), "max_tokens": 1}
    reply = send(proxy, [refused, target], doc)
    reply.body.read_all()
    assert [(e, i) for e, i, _ in rec.calls] == [("dispatch", 1), ("cancel", 1),
                                                ("dispatch", 2), ("end", 2)]
    assert str(rec.calls[1][2]).startswith(CANCEL_UPSTREAM_FAILED)
    assert ledger.snapshot().of(refused) == NO_REQUESTS
    with pytest.raises(UpstreamUnreachable):
        send(proxy, [refused], doc)
    assert rec.events()[-2:] == ["dispatch", "cancel"]


def test_client_closing_mid_stream_is_a_cancel(engine, observed):
    proxy, rec, ledger = observed
    target = f"127.0.0.1:{engine.http_port}"
    doc = {"model": "m", "prompt": list(range(1, 9)), "max_tokens": 200, "stream": True}
    reply = send(proxy, [target], doc)
    it = iter(reply.body)
    while "first_token" not in rec.events():
        next(it)
    reply.body.close()
    assert rec.events()[-1] == "cancel" and rec.calls[-1][2] == CANCEL_CLIENT_GONE
    snap = ledger.snapshot()
    assert snap.of(target) == NO_REQUESTS and snap.of("D:1") == NO_REQUESTS


def test_tokens_of_one_chunk_are_heard_together_or_one_by_one() -> None:
    """``notify_tokens``: an observer with ``on_tokens`` hears a count, the others ``on_token``
    that many times; RelayTracker hears each chunk's token events at once."""
    from kvsvc.routing.observer import ObserverChain, RelayTracker, RequestInfo

    class One:
        def __init__(self) -> None:
            self.events: list = []

        def __getattr__(self, name: str):
            if name == "on_tokens":
                raise AttributeError(name)
            return lambda info, *a: self.events.append(name)

    class Batch(One):
        def on_tokens(self, info, n) -> None:
            self.events.append(("on_tokens", n))

    one, batch = One(), Batch()
    tracker = RelayTracker(ObserverChain([one, batch]), RequestInfo(1, "p:1", "", 4), 200, True)
    chunk = b"".join(b'data: {"choices": [{"index": 0, "text": "t"}]}\n\n' for _ in range(3))
    tracker.chunk(chunk)
    tracker.chunk(b'data: {"choices": [{"index": 0, "text": "u"}]}\n\ndata: [DONE]\n\n')
    tracker.finish(True, None)
    assert one.events == ["on_first_token", "on_token", "on_token", "on_token", "on_end"]
    assert batch.events == ["on_first_token", ("on_tokens", 2), ("on_tokens", 1), "on_end"]
    assert tracker.tokens == 4
