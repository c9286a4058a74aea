"""The simulated xLLM engine's native mode (§13, issue 19 item 6) over real sockets on 127.0.0.1:
requests over baidu_std and brpc's HTTP+JSON form, every token pushed with Generations over
baidu_std, ok:false cancels, Heartbeat over baidu_std, LinkInstance and the P/D hand-over.

The service side here is a small baidu_std server built on kvsvc's codec that records what the
engine sends (the real one, kvsvc's XllmRpcService, is tested end to end in
tests/e2e/test_e2e_xllm_native.py)."""

from __future__ import annotations

import socket
import threading
from typing import Callable, Optional

import pytest
import requests

from kvsvc.routing.answers import Generation
from kvsvc.rpc import codec, messages
from kvsvc.rpc.generations import generation_from_proto
from kvsvc.testbed.sim.engine import SimEngine
from kvsvc.testbed.sim.native import API_SERVICE, RpcChannel, ServiceClient, rpc_heartbeat
from kvsvc.testbed.sim.serving import ServingConfig
from tests.support.util import free_port, wait_for


class FakeService:
    """A baidu_std server answering Generations (ok per ``accept``) and Heartbeat (ok)."""

    def __init__(self, accept: Callable[[Generation], bool] = lambda g: True) -> None:
        self.accept = accept
        self.gens: list[Generation] = []
        self.heartbeats: list[tuple[str, int]] = []
        self._lock = threading.Lock()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._sock.getsockname()[1]}"
        self._stop = False
        self._threads: list[threading.Thread] = []
        t = threading.Thread(target=self._accept_loop, daemon=True)
        t.start()
        self._threads.append(t)

    def _accept_loop(self) -> None:
        self._sock.settimeout(0.1)
        while not self._stop:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                continue
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            t.start()
            self._threads.append(t)

    def _serve(self, sock: socket.socket) -> None:
        conn = codec.Connection(codec.Role.SERVER)
        sock.settimeout(0.2)
        with sock:
            while not self._stop:
                try:
                    data = sock.recv(65536)
                except socket.timeout:
                    continue
                except OSError:
                    return
                if not data:
                    return
                for ev in conn.receive_data(data):
                    assert isinstance(ev, codec.Request)
                    if ev.method == "Generations":
                        msg = messages.parse(messages.DisaggStreamGenerations, ev.message)
                        out = messages.StatusSet()
                        for g in msg.gens:
                            gen = generation_from_proto(g)
                            with self._lock:
                                self.gens.append(gen)
                            out.all_status.add(ok=self.accept(gen))
                    else:
                        hb = messages.parse(messages.HeartbeatRequest, ev.message)
                        with self._lock:
                            self.heartbeats.append((hb.name,
                                                    hb.load_metrics.waiting_requests_num))
                        out = messages.Status(ok=True)
                    sock.sendall(conn.send_response(ev.correlation_id, messages.serialize(out)))

    def of(self, sid: str) -> list[Generation]:
        with self._lock:
            return [g for g in self.gens if g.service_req_id == sid]

    def close(self) -> None:
        self._stop = True
        self._sock.close()
        for t in self._threads:
            t.join(5.0)


@pytest.fixture
def service():
    svc = FakeService()
    yield svc
    svc.close()


def _engine(native: bool = True) -> SimEngine:
    port = free_port()
    return SimEngine(f"127.0.0.1:{port}", free_port(), free_port(), http_port=port,
                     serving=ServingConfig(time_scale=50.0), native=native, kv_events=False)


def _ended(svc: FakeService, sid: str) -> bool:
    return any(g.finished and not g.finished_on_prefill_instance or g.status_code
               for g in svc.of(sid))


def test_completions_over_http_json_push_every_token(service: FakeService) -> None:
    with _engine() as eng:
        msg = {"model": "sim", "prompt": "", "token_ids": list(range(300)), "max_tokens": 5,
               "stream": True, "service_request_id": "r1",
               "routing": {"prefill_name": eng.name, "decode_name": ""},
               "source_xservice_addr": service.address}
        resp = requests.post(f"http://{eng.name}/{API_SERVICE}/Completions", json=msg,
                             timeout=5)
        assert resp.status_code == 200 and resp.json() == {}
        wait_for(lambda: _ended(service, "r1"), 10, what="the last entry")
        gens = service.of("r1")
        text = "".join(o.text for g in gens for o in g.outputs)
        assert text == " t0 t1 t2 t3 t4"
        assert sum(len(o.token_ids) for g in gens for o in g.outputs) == 5
        last = gens[-1]
        assert last.finished and last.outputs[0].finish_reason == "length"
        assert last.usage is not None and (last.usage.prompt_tokens,
                                           last.usage.generated_tokens) == (300, 5)
        assert not any(g.finished for g in gens[:-1])
        assert eng.serving is not None and eng.serving.stats().completed == 1


def test_chat_over_baidu_std_and_a_prompt_without_tokens(service: FakeService) -> None:
    with _engine() as eng:
        chan = RpcChannel(eng.name)
        try:
            req = messages.ChatRequest(model="sim", service_request_id="c1", max_tokens=2,
                                       token_ids=[1, 2, 3],
                                       source_xservice_addr=service.address)
            req.messages.add(role="user", content="hi")
            answer = chan.call(API_SERVICE, "ChatCompletions", messages.serialize(req))
            assert messages.parse(messages.ChatResponse, answer) == messages.ChatResponse()
            bad = messages.ChatRequest(service_request_id="c2",
                                       source_xservice_addr=service.address)
            chan.call(API_SERVICE, "ChatCompletions", messages.serialize(bad))
        finally:
            chan.close()
        wait_for(lambda: _ended(service, "c1") and _ended(service, "c2"), 10,
                 what="both ends")
        assert "".join(o.text for g in service.of("c1") for o in g.outputs) == " t0 t1"
        (err,) = service.of("c2")
        assert err.status_code == 3 and "token_ids" in err.status_msg


def test_ok_false_cancels_the_request() -> None:
    refused = FakeService(accept=lambda g: not any(" t2" in o.text for o in g.outputs))
    try:
        with _engine() as eng:
            msg = {"token_ids": list(range(64)), "max_tokens": 50, "stream": True,
                   "service_request_id": "x1", "source_xservice_addr": refused.address}
            requests.post(f"http://{eng.name}/{API_SERVICE}/Completions", json=msg, timeout=5)
            assert eng.serving is not None and eng.native is not None
            wait_for(lambda: eng.serving.stats().cancelled == 1, 10, what="the cancel")
            assert eng.native.counts["refused"] == 1
            texts = [o.text for g in refused.of("x1") for o in g.outputs]
            # The engine pushes each decode step without waiting for the answer to the last
            # (as xLLM's response processor does), so one step generated before the refusal
            # was read may still go out; nothing after it.
            assert texts[2].endswith(" t2") and len(texts) in (3, 4), texts
    finally:
        refused.close()


def test_heartbeat_over_baidu_std(service: FakeService) -> None:
    client = ServiceClient()
    try:
        beat = rpc_heartbeat(client)
        assert beat(service.address, {"name": "a:1", "incarnation_id": "i",
                                      "load_metrics": {"waiting_requests_num": 3,
                                                       "gpu_cache_usage_perc": 0.5}}) == 200
        assert service.heartbeats == [("a:1", 3)]
        assert beat(f"127.0.0.1:{free_port()}", {"name": "a:1"}) is None
    finally:
        client.close()


def test_pd_first_token_from_p_rest_from_a_linked_d(service: FakeService) -> None:
    with _engine() as p, _engine() as d:
        msg = {"token_ids": list(range(200)), "max_tokens": 4, "stream": True,
               "source_xservice_addr": service.address,
               "routing": {"prefill_name": p.name, "decode_name": d.name}}
        # Not linked yet: D refuses the hand-over, P ends the request with an error entry.
        requests.post(f"http://{p.name}/{API_SERVICE}/Completions",
                      json={**msg, "service_request_id": "pd0"}, timeout=5)
        wait_for(lambda: _ended(service, "pd0"), 10, what="the refused hand-over")
        assert service.of("pd0")[0].finished_on_prefill_instance
        assert service.of("pd0")[-1].status_code == 7
        link = requests.post(f"http://{d.name}/xllm.proto.DisaggPDService/LinkInstance",
                             json={"instance_name": p.name, "dp_size": 1}, timeout=5)
        assert link.json() == {"ok": True}
        assert d.native is not None and d.native.linked == {p.name}
        requests.post(f"http://{p.name}/{API_SERVICE}/Completions",
                      json={**msg, "service_request_id": "pd1"}, timeout=5)
        wait_for(lambda: _ended(service, "pd1"), 10, what="D's last entry")
        gens = service.of("pd1")
        assert gens[0].finished_on_prefill_instance and gens[0].outputs[0].text == " t0"
        assert not any(g.finished_on_prefill_instance for g in gens[1:])
        assert "".join(o.text for g in gens for o in g.outputs) == " t0 t1 t2 t3"
        assert gens[-1].usage is not None and gens[-1].usage.generated_tokens == 4
        assert p.native is not None and p.native.counts["handovers"] == 1
        unlink = requests.post(f"http://{d.name}/xllm.proto.DisaggPDService/UnlinkInstance",
                               json={"instance_name": p.name}, timeout=5)
        assert unlink.json() == {"ok": True} and d.native.linked == set()


def test_native_needs_an_xllm_serving_engine() -> None:
    with pytest.raises(ValueError, match="native"):
        SimEngine("127.0.0.1:1", free_port(), free_port(), native=True)


@pytest.mark.parametrize("kind", ["baidu_std", "http_json"])
def test_kvsvc_dispatch_callers_reach_the_engine(service: FakeService, kind: str) -> None:
    """kvsvc's two forms of the dispatch call (§13): baidu_std (the service's) and brpc's
    HTTP+JSON form; a refused connection is an UpstreamError (retried by the dispatcher)."""
    from kvsvc.errors import UpstreamError
    from kvsvc.routing.xllm_dispatch import HttpJsonCaller, completion_request
    from kvsvc.rpc.engines import BaiduStdCaller

    caller = BaiduStdCaller() if kind == "baidu_std" else HttpJsonCaller()
    try:
        with _engine() as eng:
            msg = completion_request({"model": "sim", "prompt": [5, 6], "max_tokens": 3,
                                      "stream": True}, [5, 6], f"k-{kind}", eng.name, "",
                                     service.address)
            caller.call(eng.name, "Completions", msg)
            wait_for(lambda: _ended(service, f"k-{kind}"), 10, what="the last entry")
            assert "".join(o.text for g in service.of(f"k-{kind}")
                           for o in g.outputs) == " t0 t1 t2"
        with pytest.raises(UpstreamError):
            caller.call(f"127.0.0.1:{free_port()}", "Completions", msg)
    finally:
        caller.close()
