"""The service's one clock (issue 21 item 4): the clock given to the app factory reaches every
component that applies a timer rule, so a test moves them all by advancing it, never by
waiting. Built, never started: no sockets."""

from __future__ import annotations

from kvsvc.clock import VirtualClock
from kvsvc.cluster.rejections import RejectionReason
from kvsvc.config import KvEventsConfig
from kvsvc.http.app import create_app
from kvsvc.http.extensions import EXTENSION
from kvsvc.settings import load_service_settings
from kvsvc.streams.state import StreamId

BS = 4


def test_the_app_factorys_clock_is_the_clock_of_every_timer_rule():
    clock = VirtualClock(500.0)
    kv = KvEventsConfig.model_validate({"discovery": {
        "enabled": False, "backends": [], "approximate_backends": ["xllm"], "block_size": BS,
        "approximate_ttl_s": 30}})
    app = create_app(load_service_settings(), kv, clock)
    svc = app.extensions[EXTENSION]
    assert svc.clock is clock
    # The refused-heartbeat ledger dates its episodes on it.
    svc.heartbeat_rejections.rejected("10.0.0.9:1", RejectionReason.UNKNOWN_INSTANCE)
    clock.advance(12.0)
    assert svc.heartbeat_rejections.to_json()["10.0.0.9:1"]["since_s"] == 12.0
    # The directory's approximate index expires on it (§14).
    sid = StreamId("10.0.0.1:8000", 0)
    svc.directory.add_approximate(sid, block_size=BS, hash_seed=1024)
    tokens = list(range(3 * BS))
    _, keys = svc.directory.query_prompt(tokens)
    svc.directory.record_dispatch(sid.instance_name, [(0, 0)], keys)
    assert [m.device_hit_tokens for m in svc.directory.query(tokens)] == [3 * BS]
    clock.advance(30.0)
    assert [m.device_hit_tokens for m in svc.directory.query(tokens)] == [0]
    # The in-flight ledger dates its dispatches on it.
    assert svc.router.in_flight._clock() == clock.now()
