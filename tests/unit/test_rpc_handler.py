"""The XllmRpcService rules without sockets (§13): what each call answers when there is no
registry or no sink, a sink that answers the wrong number of statuses, unknown services and
methods, undecodable messages and a handler that raises."""

from __future__ import annotations

import threading

from kvsvc.cluster.heartbeat import HeartbeatIntake
from kvsvc.cluster.rejections import HeartbeatRejections
from kvsvc.rpc import codec, messages
from kvsvc.rpc.codec import BadCall, Request
from kvsvc.rpc.server import SERVICE_NAME, XllmRpcHandler


class Sink:
    def __init__(self, answers):
        self.answers = answers
        self.got = []

    def deliver(self, gens):
        self.got.append([g.service_req_id for g in gens])
        return list(self.answers)


def handler(sink=None) -> XllmRpcHandler:
    return XllmRpcHandler(HeartbeatIntake(None, HeartbeatRejections()), None, sink)


def call(h: XllmRpcHandler, method: str, msg=None, service: str = SERVICE_NAME,
         raw: bytes | None = None):
    data = raw if raw is not None else (messages.serialize(msg) if msg is not None else b"")
    return h.handle(Request(1, service, method, data))


def gens(*ids: str):
    req = messages.DisaggStreamGenerations()
    for sid in ids:
        req.gens.add(service_req_id=sid)
    return req


def test_status_set_is_always_as_long_as_the_entries():
    for answers, want in (([True], [True, False, False]),             # too few: padded
                          ([True, True, True, True, True], [True] * 3),  # too many: cut
                          ([True, False, True], [True, False, True])):
        sink = Sink(answers)
        reply = call(handler(sink), "Generations", gens("a", "b", "c"))
        assert reply.error_code == 0
        got = [s.ok for s in messages.parse(messages.StatusSet, reply.message).all_status]
        assert got == want and sink.got == [["a", "b", "c"]]
    # No sink: every entry refused; no entry: an empty set, the sink not called.
    reply = call(handler(None), "Generations", gens("a", "b"))
    assert [s.ok for s in messages.parse(messages.StatusSet, reply.message).all_status] == [
        False, False]
    sink = Sink([])
    assert call(handler(sink), "Generations", gens()).message == b"" and sink.got == []


def test_without_registry():
    h = handler()
    hb = messages.HeartbeatRequest(name="127.0.0.1:1")
    assert messages.parse(messages.Status, call(h, "Heartbeat", hb).message).ok is False
    info = call(h, "GetInstanceInfo", messages.InstanceID(name="127.0.0.1:1"))
    assert info.error_code == 0 and info.message == b""
    for method in ("GetStaticDecodeList", "GetStaticPrefillList"):
        assert call(h, method, messages.InstanceID()).message == b""
    assert messages.parse(messages.Status, call(h, "Hello", messages.Empty()).message).ok
    assert h.counters()[2] == {"no_registry": 1}


def test_errors():
    h = handler()
    r = call(h, "Hello", service="other.Service")
    assert (r.error_code, r.error_text) == (codec.ENOSERVICE, "Fail to find service=other.Service")
    r = call(h, "RegisterInstance", messages.InstanceID())
    assert r.error_code == codec.ENOMETHOD and "RegisterInstance" in r.error_text
    r = call(h, "Generations", raw=b"\x0a\x05ab")
    assert r.error_code == codec.EREQUEST and "Fail to parse request message" in r.error_text
    r = h.bad_call(BadCall(3, codec.EREQUEST, "lz4 not supported", SERVICE_NAME, "Hello"))
    assert (r.error_code, r.error_text) == (codec.EREQUEST, "lz4 not supported")

    class Broken:
        def deliver(self, gens):
            raise RuntimeError("sink bug")

    r = call(handler(Broken()), "Generations", gens("a", "b"))   # still one Status per entry
    assert r.error_code == 0
    assert [s.ok for s in messages.parse(messages.StatusSet, r.message).all_status] == [
        False, False]
    calls, errors, _, _, _ = h.counters()
    assert calls["Hello"] == 2 and errors == {codec.ENOSERVICE: 1, codec.ENOMETHOD: 1,
                                              codec.EREQUEST: 2}


def test_static_lists_are_the_schedulable_candidates():
    from types import MappingProxyType

    from kvsvc.cluster.model import Instance, InstanceState, InstanceType, RegistrySnapshot

    def inst(name, t, state=InstanceState.ACTIVE):
        return Instance(name=name, type=t, role=t, incarnation_id=None, register_ts_ms=None,
                        dp_size=1, backend_type="xllm", rpc_address=None, state=state, load=None)

    snap = RegistrySnapshot(MappingProxyType({i.name: i for i in (
        inst("d:1", InstanceType.DECODE), inst("d:2", InstanceType.DECODE),
        inst("d:3", InstanceType.DECODE, InstanceState.SUSPECT),
        inst("d:4", InstanceType.DECODE, InstanceState.LEASE_LOST),
        inst("p:1", InstanceType.PREFILL), inst("x:1", InstanceType.DEFAULT),
        inst("m:1", InstanceType.MIX))}), fresh=True, is_master=True, generation=1)

    class Registry:
        def snapshot(self):
            return snap

    h = XllmRpcHandler(HeartbeatIntake(None, HeartbeatRejections()), Registry(), None,
                       excluded=lambda: {"d:2": "link failed"})
    decode = call(h, "GetStaticDecodeList", messages.InstanceID(name="p:1"))
    prefill = call(h, "GetStaticPrefillList", messages.InstanceID(name="d:1"))
    assert list(messages.parse(messages.InstanceIDs, decode.message).names) == ["d:1", "d:4"]
    assert list(messages.parse(messages.InstanceIDs, prefill.message).names) == ["p:1", "x:1"]


def test_status_set_bytes_are_protobufs_bytes():
    import itertools

    from kvsvc.rpc.server import status_set_bytes
    for n in range(5):
        for combo in itertools.product([True, False], repeat=n):
            msg = messages.StatusSet()
            for ok in combo:
                msg.all_status.add(ok=ok)
            assert status_set_bytes(list(combo)) == messages.serialize(msg), combo


def test_deferred_wake_is_left_to_the_caller_only_when_asked():
    from kvsvc.routing.generations import PendingRequests
    reg = PendingRequests()
    req = reg.open("a", "p:1")
    h = XllmRpcHandler(HeartbeatIntake(None, HeartbeatRejections()), None, reg)
    data = messages.serialize(gens("a", "zz"))
    reply = h.handle(Request(1, SERVICE_NAME, "Generations", data), defer=True)
    assert [s.ok for s in messages.parse(messages.StatusSet, reply.message).all_status] == [
        True, False]
    assert reply.after is None   # no reader waited: nothing to wake
    assert len(req.take(0)) == 1
    reply = h.handle(Request(2, SERVICE_NAME, "Generations", data))
    assert reply.after is None and len(req.take(0)) == 1
    # A reader waiting: deferred, the wake-up is the caller's (the reader still waits until
    # ``after`` runs); not deferred, the reader is woken before ``handle`` returns.
    for deferred in (True, False):
        got: list = []
        reader = threading.Thread(target=lambda: got.append(req.take(5.0)))
        reader.start()
        try:
            _spin_until(lambda: req._waiting)
            reply = h.handle(Request(3, SERVICE_NAME, "Generations", data), defer=deferred)
            if deferred:
                assert reply.after is not None and req._waiting and not got
                reply.after()
            else:
                assert reply.after is None
        finally:
            reader.join(5.0)
        assert len(got) == 1 and len(got[0]) == 1


def _spin_until(cond, timeout_s: float = 5.0) -> None:
    """Spin until ``cond()`` (the unit tier refuses ``time.sleep``)."""
    import time
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
