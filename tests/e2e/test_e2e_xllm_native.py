"""xLLM engines natively, end to end (§13, issue 19 items 3, 4, 6, 7): the real ``kvsvc serve``
(gunicorn) with ``--xllm_dispatch native`` and its baidu_std port, a real etcd, and simulated
xLLM engines in native mode (:mod:`kvsvc.testbed.sim.native`) that register in etcd, heartbeat
and push every token with ``Generations`` over baidu_std and take ``ChatCompletions`` /
``Completions`` over baidu_std or HTTP+JSON. Real sockets on 127.0.0.1 only.

Covered: streamed and non-streamed chat and completions (usage with cached tokens,
``[DONE]``), 50 concurrent streams, a client that goes away mid-stream (the engine's next entry
gets ``ok: false`` and it cancels), an engine killed mid-stream (the client gets a visible
error), an unknown ``service_req_id``, a request whose instance is replaced by a new
incarnation mid-stream, and P/D with one P and one D (kvsvc links them; the first token comes
from P, the rest from D)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, Optional

import pytest
import requests

from kvsvc.routing.answers import Generation, GenOutput
from kvsvc.testbed.ports import free_instance_port
from kvsvc.testbed.sim.engine import SimEngine
from kvsvc.testbed.sim.native import ServiceClient, rpc_heartbeat
from kvsvc.testbed.sim.registration import EtcdRegistration, Load, RegisteredType
from kvsvc.testbed.sim.serving import ServingConfig
from tests.support.gunicorn import ROOT, Server, serve_env
from tests.support.tokenizer import build_tokenizer
from tests.support.util import free_port, wait_for

pytestmark = pytest.mark.etcd

#: Bound of every wait, seconds.
BOUND_S = 30.0
PROMPT = list(range(1, 300))


def sse(resp: requests.Response) -> list:
    """The events of a streamed answer: JSON objects and ``"[DONE]"``, read to the end."""
    out = []
    for line in resp.iter_lines():
        if line.startswith(b"data: "):
            payload = line[len(b"data: "):].decode()
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def text_of(events: list) -> str:
    parts = []
    for e in events:
        if isinstance(e, dict):
            for c in e.get("choices", []):
                parts.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
    return "".join(parts)


def expected(n: int) -> str:
    return "".join(f" t{i}" for i in range(n))


class NativeEngine:
    """A native simulated xLLM engine in this process, registered in etcd, heartbeating over
    baidu_std to the master key's address."""

    def __init__(self, etcd_addr: str, kind: RegisteredType = RegisteredType.DEFAULT,
                 time_scale: float = 20.0, extra: Optional[dict] = None,
                 native: bool = True, namespace: str = "") -> None:
        port = free_port()
        self.name = f"127.0.0.1:{port}"
        self.engine = SimEngine(self.name, free_port(), free_port(), http_port=port,
                                serving=ServingConfig(time_scale=time_scale), native=native,
                                kv_events=False)
        self.native = self.engine.native   # type: ignore[assignment]
        self.reg = EtcdRegistration(
            etcd_addr, self.name, 1, lambda: Load(self.engine.waiting_requests(), 0.0),
            instance_type=kind, heartbeat_interval_s=0.3, profiling=extra, namespace=namespace,
            heartbeat=rpc_heartbeat(self.native.client) if self.native is not None else None)
        if self.native is not None:
            self.native.set_master(self.reg.master)

    def start(self) -> "NativeEngine":
        self.engine.start()
        self.reg.start()
        return self

    def close(self) -> None:
        try:
            self.reg.close()
        finally:
            self.engine.close()


def _tokenizer_dir(tmp: Path) -> Path:
    d = tmp / "tok"
    d.mkdir()
    build_tokenizer().save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
                         "{% endfor %}<|assistant|>"}))
    return d


def _serve(tmp: Path, etcd_addr: str, *extra: str, dispatch: str = "native"
           ) -> tuple[Server, int]:
    rpc_port = free_port()
    server = Server(tmp, free_port(), [
        "--etcd_addr", etcd_addr, "--model", "sim", *(("--xllm_dispatch", dispatch)
                                                     if dispatch else ()),
        "--rpc_port", str(rpc_port), "--rpc_host", "127.0.0.1",
        "--tokenizer_path", str(_tokenizer_dir(tmp)), "--upstream_read_timeout_s", "6",
        "--load_balance_policy", "RR", *extra])
    server.wait_healthy()
    return server, rpc_port


def _candidates(server: Server, names: set[str], side: str = "P") -> bool:
    route = server.post("/v1/internal/route", json={"token_ids": [1]}).json()
    got = {c["name"] for c in route.get("candidates", []) if c.get("side") == side}
    return got >= names


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[tuple[Server, int, NativeEngine, str]]:
    from tests.support.etcd_server import EtcdServer, require_etcd_binary

    tmp = tmp_path_factory.mktemp("xllm-native")
    etcd = EtcdServer(require_etcd_binary())
    etcd.start()
    server: Optional[Server] = None
    engine: Optional[NativeEngine] = None
    try:
        server, rpc_port = _serve(tmp, etcd.addr)
        engine = NativeEngine(etcd.addr).start()
        wait_for(lambda: _candidates(server, {engine.name}), BOUND_S, 0.1,
                 "the native engine a candidate (heartbeats over baidu_std)")
        # One request first: kvsvc's baidu_std connection to the engine (and the engine's
        # thread serving it) then lives for the whole module, not from one test on.
        warm = server.post("/v1/completions", json={"model": "sim", "prompt": [1, 2],
                                                    "max_tokens": 1})
        assert warm.status_code == 200, warm.text
        yield server, rpc_port, engine, etcd.addr
    finally:
        if engine is not None:
            engine.close()
        if server is not None:
            server.stop()
        etcd.cleanup()


def test_streamed_completions_and_chat(cluster) -> None:
    server, _, engine, _ = cluster
    r = requests.post(server.base + "/v1/completions", stream=True, timeout=BOUND_S, json={
        "model": "sim", "prompt": PROMPT, "max_tokens": 6, "stream": True,
        "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["x-kvsvc-prefill"] == engine.name
    events = sse(r)
    assert events[-1] == "[DONE]"
    assert text_of(events) == expected(6)
    assert events[-2]["choices"] == [] and events[-2]["usage"]["prompt_tokens"] == len(PROMPT)
    assert events[-2]["usage"]["completion_tokens"] == 6
    finish = [c["finish_reason"] for e in events[:-2] for c in e["choices"]]
    assert finish[-1] == "length" and set(finish[:-1]) == {None}
    r = requests.post(server.base + "/v1/chat/completions", stream=True, timeout=BOUND_S, json={
        "model": "sim", "messages": [{"role": "user", "content": "hello world"}],
        "max_tokens": 3, "stream": True})
    events = sse(r)
    assert events[-1] == "[DONE]" and text_of(events) == expected(3)
    assert events[0]["object"] == "chat.completion.chunk"
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"


def test_non_streamed_completions_and_chat(cluster) -> None:
    server, _, _, _ = cluster
    r = server.post("/v1/completions", json={"model": "sim", "prompt": PROMPT,
                                             "max_tokens": 4})
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["object"] == "text_completion" and doc["choices"][0]["text"] == expected(4)
    assert doc["choices"][0]["finish_reason"] == "length"
    assert doc["usage"]["completion_tokens"] == 4 and "cached_tokens" in doc["usage"][
        "prompt_tokens_details"]
    # The same prompt again: its blocks are cached on the engine now.
    again = server.post("/v1/completions", json={"model": "sim", "prompt": PROMPT,
                                                 "max_tokens": 4}).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256
    r = server.post("/v1/chat/completions", json={
        "model": "sim", "messages": [{"role": "user", "content": "how are you"}],
        "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": expected(2)}


def test_openai_fields_reach_the_engine_or_are_a_400_naming_them(cluster) -> None:
    """Issue 19 items 3-5: ``n``, ``stop`` and the other fields xLLM has arrive in the
    engine's ChatRequest / CompletionRequest over baidu_std; a field xLLM has no form for and a
    bad value are 400s whose ``param`` is the field's name, and nothing is dispatched."""
    server, _, engine, _ = cluster
    r = server.post("/v1/chat/completions", json={
        "model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "n": 2, "stop": "zz", "presence_penalty": 0.5, "frequency_penalty": 0.25,
        "logprobs": True, "top_logprobs": 1, "user": "u-7"})
    assert r.status_code == 200, r.text
    got = engine.native.received[-1]
    assert (got["n"], got["stop"], got["presence_penalty"], got["frequency_penalty"],
            got["logprobs"], got["top_logprobs"], got["user"]) == (
        2, ["zz"], 0.5, 0.25, True, 1, "u-7")
    r = server.post("/v1/completions", json={"model": "sim", "prompt": PROMPT, "stop": ["a", "b"],
                                             "max_tokens": 2, "logprobs": 2, "n": 1})
    assert r.status_code == 200, r.text
    got = engine.native.received[-1]
    assert (got["stop"], got["logprobs"], got["max_tokens"], got["n"]) == (["a", "b"], 2, 2, 1)
    accepted = engine.native.counts["accepted"]
    for body, param in [
            ({"seed": 3}, "seed"), ({"logit_bias": {"5": 1}}, "logit_bias"),
            ({"temperature": "hot"}, "temperature"), ({"top_p": 2}, "top_p"),
            ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
            ({"max_tokens": -1}, "max_tokens")]:
        r = server.post("/v1/chat/completions", json={
            "model": "sim", "messages": [{"role": "user", "content": "hi"}], **body})
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, r.text
    assert engine.native.counts["accepted"] == accepted


def test_embeddings_are_relayed_and_a_batch_prompt_is_a_400_saying_one_prompt(cluster) -> None:
    """Only the generation paths go natively (``NATIVE_PATHS``): ``/v1/embeddings`` to an xLLM
    engine is relayed over its HTTP API, not checked against ChatRequest's fields; a batch
    of prompts is a 400 naming ``prompt`` that says an xLLM request carries one prompt (not
    the tokenizer message), and nothing is dispatched."""
    server, _, engine, _ = cluster
    r = server.post("/v1/embeddings", json={"model": "sim", "input": "hi there"})
    assert r.status_code == 200, r.text
    assert r.json()["data"][0]["embedding"], r.text
    accepted = engine.native.counts["accepted"]
    for prompt in ([PROMPT, PROMPT], ["a", "b"]):
        r = server.post("/v1/completions", json={"model": "sim", "prompt": prompt,
                                                 "max_tokens": 2})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "prompt" and "one prompt per request" in err["message"], r.text
    assert engine.native.counts["accepted"] == accepted


def test_text_prompt_without_tokenizer_is_a_clear_400(tmp_path, etcd_server) -> None:
    server = Server(tmp_path, free_port(), [
        "--etcd_addr", etcd_server.addr, "--xllm_dispatch", "native",
        "--rpc_port", str(free_port()), "--rpc_host", "127.0.0.1"])
    engine = NativeEngine(etcd_server.addr)
    try:
        server.wait_healthy()
        engine.start()
        wait_for(lambda: _candidates(server, {engine.name}), BOUND_S, 0.1, "candidate")
        r = server.post("/v1/completions", json={"model": "sim", "prompt": "hello"})
        assert r.status_code == 400
        assert "--tokenizer_path" in r.json()["error"]["message"]
        assert engine.native.counts["accepted"] == 0
    finally:
        engine.close()
        server.stop()


def test_fifty_concurrent_streams(cluster) -> None:
    server, _, _, _ = cluster
    results: list[Optional[str]] = [None] * 50

    def one(i: int) -> None:
        r = requests.post(server.base + "/v1/completions", stream=True, timeout=BOUND_S, json={
            "model": "sim", "prompt": [i + 1] * 64, "max_tokens": 8, "stream": True})
        events = sse(r)
        results[i] = text_of(events) if events and events[-1] == "[DONE]" else None

    threads = [threading.Thread(target=one, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND_S * 2)
    assert results == [expected(8)] * 50


def _open_stream(port: int, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=BOUND_S)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: kvsvc\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(data), data))
    return sock


def _read_until(sock: socket.socket, marker: bytes) -> bytes:
    got = b""
    deadline = time.monotonic() + BOUND_S
    while marker not in got:
        assert time.monotonic() < deadline, got
        chunk = sock.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


def test_client_gone_mid_stream_cancels_on_the_engine(cluster) -> None:
    server, _, engine, _ = cluster
    serving = engine.engine.serving
    assert serving is not None
    cancelled = serving.stats().cancelled
    refused = engine.native.counts["refused"]
    sock = _open_stream(server.port, {"model": "sim", "prompt": PROMPT, "max_tokens": 5000,
                                      "stream": True})
    assert b" t1" in _read_until(sock, b" t1")
    sock.close()
    wait_for(lambda: serving.stats().cancelled > cancelled, BOUND_S, 0.05,
             "the engine cancelled the request")
    assert engine.native.counts["refused"] > refused   # it was told ok: false


def test_unknown_service_req_id_is_answered_false(cluster) -> None:
    _, rpc_port, _, _ = cluster
    client = ServiceClient()
    try:
        answers = client.generations(f"127.0.0.1:{rpc_port}", [
            Generation("never-dispatched", outputs=(GenOutput(0, " x", (1,)),)),
            Generation("neither", finished=True)])
        assert answers == [False, False]
    finally:
        client.close()


def test_instance_replaced_mid_stream_fails_the_request_visibly(cluster) -> None:
    server, _, engine, etcd_addr = cluster
    sock = _open_stream(server.port, {"model": "sim", "prompt": PROMPT, "max_tokens": 5000,
                                      "stream": True})
    try:
        assert b" t1" in _read_until(sock, b" t1")
        engine.reg.reincarnate()   # the same address, a new process: the old one's requests fail
        body = _read_until(sock, b"upstream_broken")
        assert b'"error"' in body and b"replaced" in body
        assert b"[DONE]" not in body
    finally:
        sock.close()
    wait_for(lambda: _candidates(server, {engine.name}), BOUND_S, 0.1, "candidate again")


def _sim_process(etcd_addr: str, log_path: Path, *extra: str
                 ) -> tuple[subprocess.Popen, str]:
    """A native simulated xLLM engine as its own process (to be killed), and its name."""
    port = free_instance_port(1, 10000, 30000)   # the sim's §9 event/replay ports fit too
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvsvc", "sim", "--serve", "--native", "--kv-events", "off",
             "--host", "127.0.0.1", "--port", str(port), "--etcd", etcd_addr, "--type",
             "DEFAULT", "--heartbeat-interval-s", "0.3", "--log-level", "warning", *extra],
            env=serve_env(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
    return proc, f"127.0.0.1:{port}"


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def test_engine_killed_mid_stream_gives_a_visible_error(cluster, tmp_path) -> None:
    """Killed mid-stream: the client gets the OpenAI error event (no ``[DONE]``) once kvsvc
    sees the engine's baidu_std connection close and its port refuse, well before its lease
    expires; a WARNING names the instance and the request; counted ``upstream_broken``."""
    server, _, _, etcd_addr = cluster
    proc, name = _sim_process(etcd_addr, tmp_path / "sim.log")
    try:
        wait_for(lambda: _candidates(server, {name}), BOUND_S, 0.1, "the sim process candidate")
        # Route to it alone: a prompt both engines could take goes where RR says; retry until
        # this one is chosen.
        for _ in range(10):
            r = requests.post(server.base + "/v1/completions", stream=True, timeout=BOUND_S,
                              json={"model": "sim", "prompt": PROMPT, "max_tokens": 5000,
                                    "stream": True})
            if r.headers.get("x-kvsvc-prefill") == name:
                break
            r.close()
        else:
            pytest.fail("the killed engine was never chosen")
        lines = r.iter_lines()
        for line in lines:
            if b" t1" in line:
                break
        os.killpg(proc.pid, signal.SIGKILL)
        rest = b"\n".join(l for l in _drain(lines))
        assert b'"error"' in rest and b"upstream_broken" in rest
        assert b"[DONE]" not in rest
        # The connection-close path (not the lease): "died ... refuses connections".
        event = json.loads(rest[rest.index(b'{"error"'):].split(b"\n")[0])
        message = event["error"]["message"]
        assert f"instance {name} died" in message and "refuses connections" in message
        sid = message.rsplit(" ", 1)[-1]
        wait_for(lambda: any(f'"WARNING"' in line and name in line and sid in line
                             for line in server.log().splitlines()), BOUND_S, 0.1,
                 "a WARNING naming the instance and the request")
        metrics = server.get("/metrics").text
        assert 'kvsvc_proxy_requests_total{endpoint="completions",status="upstream_broken"}' \
            in metrics
    finally:
        _kill(proc)


def _entries_ok(server) -> int:
    """The Generations entries the server answered ``ok: true`` so far."""
    for line in server.get("/metrics").text.splitlines():
        if line.startswith('kvsvc_rpc_generation_entries_total{ok="true"}'):
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


def test_engine_killed_the_openai_sdk_raises_and_non_streamed_is_502(tmp_path,
                                                                    etcd_server) -> None:
    """What the official ``openai`` SDK shows when the engine dies: streamed, the error event
    raises ``openai.APIError`` (the SDK raises on an event whose data has ``error``; it would
    stop silently at a ``[DONE]``, so none is sent); not streamed, a 502 JSON error
    (``InternalServerError``). Counted as ``upstream_broken`` and 502 in the metrics."""
    import openai

    # A namespace of its own: this server sees the one engine the test kills.
    server, _ = _serve(tmp_path, etcd_server.addr, "--etcd_namespace", "killed")
    procs: list[subprocess.Popen] = []
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0,
                           timeout=BOUND_S)
    try:
        for streamed in (True, False):
            proc, name = _sim_process(etcd_server.addr, tmp_path / f"sim-{streamed}.log",
                                      "--etcd-namespace", "killed")
            procs.append(proc)
            wait_for(lambda: _candidates(server, {name}), BOUND_S, 0.1, "the sim a candidate")
            if streamed:
                stream = client.completions.create(model="sim", prompt=PROMPT,
                                                   max_tokens=5000, stream=True)
                texts = []
                with pytest.raises(openai.APIError) as err:
                    for chunk in stream:
                        texts.append(chunk.choices[0].text)
                        if len(texts) == 2:
                            os.killpg(proc.pid, signal.SIGKILL)
                assert texts[:2] == [" t0", " t1"]
                assert isinstance(err.value.body, dict)
                assert err.value.body["code"] == "upstream_broken"
                assert f"instance {name} died" in err.value.message
            else:
                # Killed once its tokens flow (entries answered ok), not after a fixed time.
                before = _entries_ok(server)
                raised: list[BaseException] = []

                def call() -> None:
                    try:
                        client.completions.create(model="sim", prompt=PROMPT, max_tokens=5000)
                    except BaseException as exc:  # noqa: BLE001 - judged below
                        raised.append(exc)
                caller = threading.Thread(target=call)
                caller.start()
                try:
                    wait_for(lambda: _entries_ok(server) >= before + 2, BOUND_S, 0.05,
                             "the engine generating the non-streamed request")
                    os.killpg(proc.pid, signal.SIGKILL)
                finally:
                    caller.join(BOUND_S)
                assert len(raised) == 1 and isinstance(raised[0], openai.InternalServerError), \
                    raised
                bad = raised[0]
                assert bad.status_code == 502
                assert f"instance {name} died" in bad.message
            _kill(proc)
            wait_for(lambda: not _candidates(server, {name}), BOUND_S, 0.1, "no candidate")
        metrics = server.get("/metrics").text
        for status in ("upstream_broken", "502"):
            assert (f'kvsvc_proxy_requests_total{{endpoint="completions",status="{status}"}} '
                    "1.0") in metrics
    finally:
        client.close()
        for proc in procs:
            _kill(proc)
        server.stop()


def test_default_auto_dispatch_is_native_for_baidu_std_heartbeats_http_for_the_others(
        tmp_path, etcd_server) -> None:
    """``--xllm_dispatch`` unset (``auto``): the engine that heartbeats over baidu_std (a real
    xLLM engine with service routing) is served natively, the one that heartbeats over HTTP
    (the simulated engine's HTTP mode) by the HTTP relay; both answer right."""
    server, _ = _serve(tmp_path, etcd_server.addr, "--etcd_namespace", "auto", dispatch="")
    native = http = None
    try:
        native = NativeEngine(etcd_server.addr, namespace="auto")
        http = NativeEngine(etcd_server.addr, native=False, namespace="auto")
        native.start()
        http.start()
        wait_for(lambda: _candidates(server, {native.name, http.name}), BOUND_S, 0.1,
                 "both engines candidates")
        assert native.native is not None
        served: dict[str, str] = {}
        for _ in range(8):   # RR alternates between the two
            before = len(native.native.received)
            doc = server.post("/v1/completions", json={"model": "sim", "prompt": PROMPT,
                                                       "max_tokens": 3})
            assert doc.status_code == 200, doc.text
            assert doc.json()["choices"][0]["text"] == expected(3)
            target = doc.headers["x-kvsvc-prefill"]
            served[target] = "native" if len(native.native.received) > before else "http"
            if len(served) == 2:
                break
        assert served == {native.name: "native", http.name: "http"}
        assert "heartbeats over baidu_std: dispatched natively" in server.log()
    finally:
        for engine in (native, http):
            if engine is not None:
                engine.close()
        server.stop()


def _drain(lines: Iterator[bytes]) -> Iterator[bytes]:
    try:
        yield from lines
    except (requests.exceptions.ChunkedEncodingError, requests.exceptions.ConnectionError):
        return   # the aborted transfer after the error event


def test_pd_one_prefill_one_decode(tmp_path, etcd_server) -> None:
    server, _ = _serve(tmp_path, etcd_server.addr)
    p = NativeEngine(etcd_server.addr, RegisteredType.PREFILL,
                     extra={"cluster_ids": [7, 8], "addrs": ["127.0.0.1"], "ports": [7001],
                            "kv_split_size": 2})
    d = NativeEngine(etcd_server.addr, RegisteredType.DECODE)
    try:
        p.start()
        d.start()
        # kvsvc links them: D is told about P (LinkInstance on D's address).
        wait_for(lambda: d.native.linked == {p.name}, BOUND_S, 0.1, "D linked to P")
        # The peer's InstanceClusterInfo, from its registration.
        assert d.native.link_infos[p.name] == {
            "instance_name": p.name, "cluster_ids": [7, 8], "addrs": ["127.0.0.1"], "ports": [7001], "dp_size": 1, "kv_split_size": 2}
        wait_for(lambda: _candidates(server, {p.name}) and _candidates(server, {d.name}, "D"),
                 BOUND_S, 0.1, "P and D candidates")
        r = requests.post(server.base + "/v1/completions", stream=True, timeout=BOUND_S, json={
            "model": "sim", "prompt": PROMPT, "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}})
        assert r.headers["x-kvsvc-prefill"] == p.name and r.headers["x-kvsvc-decode"] == d.name
        events = sse(r)
        assert events[-1] == "[DONE]" and text_of(events) == expected(5)
        assert events[-2]["usage"]["completion_tokens"] == 5
        assert p.native.counts["handovers"] == 1
        # Non-streamed too.
        doc = server.post("/v1/completions", json={"model": "sim", "prompt": PROMPT,
                                                   "max_tokens": 3}).json()
        assert doc["choices"][0]["text"] == expected(3)
    finally:
        d.close()
        p.close()
        server.stop()


def test_the_official_openai_sdk(cluster) -> None:
    """The official ``openai`` SDK through kvsvc to a native xLLM engine: completions and a
    streamed chat with usage."""
    import openai

    server, _, _, _ = cluster
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0,
                           timeout=BOUND_S)
    try:
        done = client.completions.create(model="sim", prompt=PROMPT, max_tokens=4)
        assert done.choices[0].text == expected(4)
        assert done.choices[0].finish_reason == "length"
        assert done.usage is not None and done.usage.completion_tokens == 4
        parts: list[str] = []
        usage = None
        for chunk in client.chat.completions.create(
                model="sim", messages=[{"role": "user", "content": "hello world"}],
                max_tokens=3, stream=True, stream_options={"include_usage": True}):
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                parts.append(choice.delta.content or "")
        assert "".join(parts) == expected(3)
        assert usage is not None and usage.completion_tokens == 3
    finally:
        client.close()


def test_pd_instance_whose_link_fails_is_no_candidate_until_linked(tmp_path,
                                                                   etcd_server) -> None:
    """D refuses LinkInstance: the instance whose registration needed that link (whichever
    of the two kvsvc registered second) is no candidate until a later link succeeds."""
    server, _ = _serve(tmp_path, etcd_server.addr)
    p = NativeEngine(etcd_server.addr, RegisteredType.PREFILL)
    d = NativeEngine(etcd_server.addr, RegisteredType.DECODE)
    d.native.refuse_links = True   # D answers LinkInstance ok: false
    try:
        p.start()
        d.start()

        def failed() -> set[str]:
            out = server.get("/ready").json().get("not_candidates", {})
            return {n for n, why in out.items() if why == "P/D link failed"}
        got = wait_for(lambda: failed() & {p.name, d.name}, BOUND_S, 0.1,
                       "an instance excluded for its failed link")
        assert len(got) == 1 and d.native.linked == set()
        (victim,) = got
        side = "P" if victim == p.name else "D"
        assert not _candidates(server, {victim}, side)
        d.native.refuse_links = False
        wait_for(lambda: d.native.linked == {p.name}, BOUND_S, 0.1, "a later link succeeded")
        wait_for(lambda: _candidates(server, {victim}, side), BOUND_S, 0.1, "a candidate again")
        assert not failed()
    finally:
        d.close()
        p.close()
        server.stop()
