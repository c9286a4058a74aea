"""The simulated engine serving OpenAI requests (kvsvc.testbed.sim.serving): exact usage and cached
tokens from its own prefix cache, the waiting queue heartbeated as ``waiting_requests_num``,
SSE streams, cancellation on disconnect, text tokenization, P/D bodies, limits and errors.
Real loopback HTTP against a real engine; no mocks."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Optional

import pytest
import requests

from kvsvc.testbed.sim import SimEngine
from kvsvc.testbed.sim.serving import DEFAULT_MAX_TOKENS, ServingConfig, byte_tokens, chatml
from tests.support.util import free_ports, wait_for

BS = 4


def make_engine(**serving: object) -> SimEngine:
    ev, rp, http = free_ports(3)
    # Linear terms only unless a test asks (exact numbers below); the full model has its tests.
    cfg = {"prefill_us_per_token": 100.0, "decode_us_per_token": 100.0, "prefill_base_us": 0.0,
           "prefill_us_per_token_sq": 0.0, "decode_us_per_seq": 0.0,
           "decode_us_per_context_token": 0.0, **serving}
    return SimEngine("sim-a", ev, rp, block_size=BS, device_blocks=64, http_port=http,
                     serving=ServingConfig(**cfg))


def url(engine: SimEngine, path: str = "/v1/completions") -> str:
    return f"http://127.0.0.1:{engine.http_port}{path}"


def raw_request(engine: SimEngine, body: dict, path: str = "/v1/completions") -> socket.socket:
    """Send a POST on a raw socket (so the test can close it mid-request); returns it."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", engine.http_port), timeout=5.0)
    sock.sendall(f"POST {path} HTTP/1.0\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def read_until(sock: socket.socket, marker: bytes, limit: int = 1 << 20) -> bytes:
    buf = b""
    while marker not in buf and len(buf) < limit:
        chunk = sock.recv(65536)
        if not chunk:
            break
        buf += chunk
    return buf


@pytest.fixture
def engine():
    eng = make_engine()
    eng.start()
    yield eng
    eng.close()


def test_repeated_prompt_reports_exact_cached_tokens_and_publishes(engine):
    body = {"model": "sim", "prompt": list(range(100, 110)), "max_tokens": 3}
    r1 = requests.post(url(engine), json=body, timeout=10)
    assert r1.status_code == 200
    doc = r1.json()
    assert doc["object"] == "text_completion" and doc["model"] == "sim"
    assert doc["choices"] == [{"index": 0, "finish_reason": "length", "logprobs": None,
                               "text": " t0 t1 t2"}]
    assert doc["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                            "prompt_tokens_details": {"cached_tokens": 0}}
    # Two full blocks stored and published as one batch (seq 0); the partial block is not.
    assert engine.last_seq(0) == 0
    assert len(engine.resident(0)) == 2
    assert r1.headers["x-sim-prefill-ms"] == "1.000"  # 10 uncached tokens x 100 us
    r2 = requests.post(url(engine), json={**body, "prompt": list(range(100, 111))}, timeout=10)
    assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 8
    assert r2.json()["usage"]["prompt_tokens"] == 11
    assert r2.headers["x-sim-prefill-ms"] == "0.300"  # 3 uncached tokens
    assert r2.headers["x-sim-rank"] == "0"
    # The sim counts a request completed after its last byte is written: the client can see
    # the answer first.
    wait_for(lambda: engine.serving.stats().completed == 2, 5.0, what="both counted")
    st = engine.serving.stats()
    assert (st.requests, st.completed, st.cancelled, st.prompt_tokens, st.cached_tokens) == \
        (2, 2, 0, 21, 8)


def test_queueing_is_waiting_requests_num_and_cancel_frees_the_slot():
    eng = make_engine(max_num_seqs=1, decode_us_per_token=50_000.0)
    eng.start()
    holder: Optional[socket.socket] = None
    results: list[requests.Response] = []
    threads: list[threading.Thread] = []
    try:
        # A long stream holds the only slot (1000 tokens x 50 ms).
        holder = raw_request(eng, {"prompt": [1, 2, 3, 4], "max_tokens": 1000, "stream": True})
        assert b"data: " in read_until(holder, b"\n\n")
        assert eng.waiting_requests() == 0
        for i in range(2):
            t = threading.Thread(target=lambda i=i: results.append(requests.post(
                url(eng), json={"prompt": [10 + i] * 8, "max_tokens": 1}, timeout=10)))
            threads.append(t)
            t.start()
        wait_for(lambda: eng.waiting_requests() == 2, 5.0, what="two queued requests")
        assert eng.serving.stats().running == 1
        holder.close()  # the client goes away: the stream is cancelled, its slot freed
        holder = None
        for t in threads:
            t.join(10)
        assert [r.status_code for r in results] == [200, 200]
        assert all(float(r.headers["x-sim-queue-ms"]) > 0 for r in results)

        def counts():
            st = eng.serving.stats()
            return (st.requests, st.completed, st.cancelled, st.waiting, st.running)
        # A request counts as completed after its last byte is written: the client may have
        # read the answer first.
        wait_for(lambda: counts() == (3, 2, 1, 0, 0), 5.0, what="counts (3, 2, 1, 0, 0)")
    finally:
        if holder is not None:
            holder.close()
        for t in threads:
            t.join(10)
        eng.close()


def one_running_one_queued(eng, socks: list[socket.socket]) -> None:
    """With ``max_num_seqs`` 1: a long streamed request running (its first chunk read) and a
    second one queued behind it; both client sockets go into ``socks`` as they are opened
    (the caller closes them, also when this fails half-way)."""
    socks.append(raw_request(eng, {"prompt": [1, 2, 3, 4], "max_tokens": 1000,
                                   "stream": True}))
    read_until(socks[-1], b"\n\n")
    socks.append(raw_request(eng, {"prompt": [5, 6, 7, 8], "max_tokens": 1}))
    wait_for(lambda: eng.waiting_requests() == 1, 5.0, what="one queued request")


def test_client_leaving_while_queued_is_removed_from_the_queue():
    eng = make_engine(max_num_seqs=1, decode_us_per_token=50_000.0)
    eng.start()
    socks: list[socket.socket] = []
    try:
        one_running_one_queued(eng, socks)
        socks[1].close()
        wait_for(lambda: eng.waiting_requests() == 0, 5.0, what="queue emptied by the cancel")
        wait_for(lambda: eng.serving.stats().cancelled == 1, 5.0, what="cancel counted")
        assert eng.serving.stats().running == 1
    finally:
        for s in socks:
            s.close()
        eng.close()


@pytest.mark.parametrize("chat", [False, True])
def test_streaming_sse_chunks_end_with_done(engine, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict = {"model": "sim", "max_tokens": 4, "stream": True,
                  "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": "hello"}]
    else:
        body["prompt"] = list(range(9))
    r = requests.post(url(engine, path), json=body, stream=True, timeout=10)
    assert r.status_code == 200
    assert r.headers["Content-Type"] == "text/event-stream"
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert len(chunks) == 5  # 4 tokens + the usage chunk
    if chat:
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": " t0"}
        assert [c["choices"][0]["delta"]["content"] for c in chunks[:4]] == \
            [" t0", " t1", " t2", " t3"]
        assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
        prompt = len(byte_tokens(chatml(body["messages"])))
    else:
        assert [c["choices"][0]["text"] for c in chunks[:4]] == [" t0", " t1", " t2", " t3"]
        prompt = 9
    assert [c["choices"][0]["finish_reason"] for c in chunks[:4]] == [None, None, None, "length"]
    assert chunks[4]["choices"] == []
    assert chunks[4]["usage"] == {"prompt_tokens": prompt, "completion_tokens": 4,
                                  "total_tokens": prompt + 4,
                                  "prompt_tokens_details": {"cached_tokens": 0}}


def test_stream_without_include_usage_has_no_usage_chunk(engine):
    r = requests.post(url(engine), json={"prompt": [1, 2], "max_tokens": 2, "stream": True},
                      timeout=10)
    events = [e for e in r.text.split("\n\n") if e]
    assert len(events) == 3 and events[-1] == "data: [DONE]"
    assert all("usage" not in json.loads(e[6:]) for e in events[:-1])


def test_text_prompts_use_the_byte_scheme_and_hit_the_cache(engine):
    text = "abcdefghij"  # 10 bytes: 2 full blocks of 4
    r1 = requests.post(url(engine), json={"prompt": text, "max_tokens": 1}, timeout=10)
    assert r1.json()["usage"]["prompt_tokens"] == 10
    r2 = requests.post(url(engine), json={"prompt": [text], "max_tokens": 1}, timeout=10)
    assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 8
    # The same text given as its byte ids is the same prompt.
    r3 = requests.post(url(engine), json={"prompt": list(text.encode()), "max_tokens": 1},
                       timeout=10)
    assert r3.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 8
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert chatml(msgs) == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi"
                            "<|im_end|>\n<|im_start|>assistant\n")
    c = requests.post(url(engine, "/v1/chat/completions"),
                      json={"messages": msgs, "max_completion_tokens": 2}, timeout=10).json()
    assert c["object"] == "chat.completion"
    assert c["choices"][0]["message"] == {"role": "assistant", "content": " t0 t1"}
    assert c["usage"]["prompt_tokens"] == len(chatml(msgs).encode())


def test_pd_routing_field_is_noted_and_served_as_prefill(engine):
    body = {"prompt": [1, 2, 3, 4], "max_tokens": 1,
            "routing": {"prefill_name": "sim-a", "decode_name": "d:1"}}
    r = requests.post(url(engine), json=body, timeout=10)
    assert r.status_code == 200 and r.headers["x-sim-decode-name"] == "d:1"
    assert engine.serving.stats().pd_requests == 1


@pytest.mark.parametrize("body,field", [
    (b"{", "JSON"), (b"[1]", "object"), (b'{"prompt": []}', "prompt"),
    (b'{"prompt": [-1]}', "prompt"), (b'{"prompt": [1], "max_tokens": 0}', "max_tokens"),
    (b'{"prompt": [1], "stream": "yes"}', "stream"), (b'{"prompt": [[1], [2]]}', "prompt")])
def test_bad_bodies_get_400_naming_the_field(engine, body, field):
    r = requests.post(url(engine), data=body, timeout=10)
    assert r.status_code == 400
    assert field in r.json()["error"]["message"]
    assert engine.serving.stats().rejected == 1


def test_null_max_tokens_is_the_default_as_in_openai(engine):
    r = requests.post(url(engine), json={"prompt": [1, 2, 3], "max_tokens": None}, timeout=10)
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == DEFAULT_MAX_TOKENS


def test_unknown_path_is_404_and_health_still_answers(engine):
    assert requests.post(url(engine, "/v1/rerank"), json={}, timeout=10).status_code == 404
    assert requests.get(url(engine, "/health"), timeout=10).json() == {"status": "ok"}


def test_embeddings_are_answered_with_deterministic_vectors(engine):
    """``POST /v1/embeddings`` (kvsvc.testbed.sim.embeddings): OpenAI's shape, the same input
    the same vector, 404 for another model, 400 naming the field for a bad input."""
    body = {"model": "sim", "input": ["Hello!", "Hello!", "other"]}
    r = requests.post(url(engine, "/v1/embeddings"), json=body, timeout=10)
    assert r.status_code == 200, r.text
    doc = r.json()
    vectors = [d["embedding"] for d in doc["data"]]
    assert vectors[0] == vectors[1] != vectors[2] and len(vectors[0]) == 16
    assert doc["usage"]["prompt_tokens"] == len(byte_tokens("Hello!")) * 2 + len("other")
    again = requests.post(url(engine, "/v1/embeddings"), json=body, timeout=10).json()
    assert [d["embedding"] for d in again["data"]] == vectors
    r = requests.post(url(engine, "/v1/embeddings"), json={"model": "x", "input": "a"},
                      timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = requests.post(url(engine, "/v1/embeddings"), json={"model": "sim", "input": 3},
                      timeout=10)
    assert r.status_code == 400 and "'input'" in r.json()["error"]["message"]


def test_time_scale_compresses_wall_time_not_reported_time():
    """At 10x a 2 s prefill takes 0.2 s of wall time and still reports 2 s. The bounds leave
    the HTTP round trip 1.8 s (an upper bound of 0.2 s around one raced a loaded machine): the
    wall time is at least the scaled time and less than the unscaled one."""
    eng = make_engine(prefill_us_per_token=10_000.0, time_scale=10.0)
    eng.start()
    try:
        t0 = time.monotonic()
        r = requests.post(url(eng), json={"prompt": list(range(200)), "max_tokens": 1},
                          timeout=10)
        wall = time.monotonic() - t0
        assert r.headers["x-sim-prefill-ms"] == "2000.000"  # 200 tokens x 10 ms, simulated
        assert 0.2 <= wall < 2.0  # 0.2 s of wall at 10x, plus HTTP; unscaled it would be 2 s
    finally:
        eng.close()


def test_connection_limit_answers_503_and_close_ends_queued_requests():
    eng = make_engine(max_num_seqs=1, max_connections=2, decode_us_per_token=50_000.0)
    eng.start()
    socks: list[socket.socket] = []
    try:
        one_running_one_queued(eng, socks)
        r = requests.post(url(eng), json={"prompt": [9], "max_tokens": 1}, timeout=10)
        assert r.status_code == 503 and "too many connections" in r.text
        eng.close()  # ends the stream and answers the queued request 503
        assert read_until(socks[1], b"}}").startswith(b"HTTP/1.0 503")
        st = eng.serving.stats()
        assert (st.waiting, st.running, st.rejected, st.completed) == (0, 0, 2, 0)
    finally:
        for s in socks:
            s.close()
        eng.close()


def test_serving_needs_http_port_and_sane_config():
    with pytest.raises(ValueError):
        SimEngine("x", 1, 2, serving=ServingConfig())
    with pytest.raises(ValueError):
        ServingConfig(max_num_seqs=0)
    with pytest.raises(ValueError):
        ServingConfig(prefill_us_per_token=0)


def test_load_listeners_hear_every_queue_change(engine):
    calls: list[int] = []
    engine.serving.add_load_listener(lambda: calls.append(engine.waiting_requests()))
    requests.post(url(engine), json={"prompt": [1, 2, 3, 4], "max_tokens": 1}, timeout=10)
    # Joined the queue (1 waiting), then left it for prefill (0 waiting).
    assert calls == [1, 0]


def test_registration_heartbeats_early_on_load_change(etcd_server):
    import http.server

    from kvsvc.cluster.etcd import EtcdClient
    from kvsvc.testbed.sim.registration import MASTER_KEY, EtcdRegistration, Load

    bodies: list[dict] = []

    class Master(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Master)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    client = EtcdClient(etcd_server.addr)
    waiting = [0]
    reg = EtcdRegistration(etcd_server.addr, "127.0.0.1:1", 1, lambda: Load(waiting[0], 0.25),
                           heartbeat_interval_s=60.0, min_heartbeat_gap_s=0.05,
                           master_refresh_s=60.0)
    try:
        client.put(MASTER_KEY, f"127.0.0.1:{server.server_address[1]}")
        reg.start()
        wait_for(lambda: len(bodies) == 1, 5.0, what="the first heartbeat")
        waiting[0] = 3
        reg.load_changed()
        reg.load_changed()  # coalesced with the first: one early heartbeat
        wait_for(lambda: len(bodies) == 2, 5.0, what="the early heartbeat")
        assert bodies[1]["load_metrics"] == {"waiting_requests_num": 3,
                                             "gpu_cache_usage_perc": 0.25}
        # The counter moves once the answer is back, just after the master saw the body.
        wait_for(lambda: reg.stats().heartbeats_ok == 2, 5.0, what="two heartbeats counted")
        reg.load_changed()
        wait_for(lambda: len(bodies) == 3, 5.0, what="a later early heartbeat")
        wait_for(lambda: reg.stats().heartbeats_ok == 3, 5.0, what="three heartbeats counted")
        assert len(bodies) == 3
    finally:
        reg.close()
        client.close()
        server.shutdown()
        thread.join(5)
        server.server_close()


# ---- the latency model (issue 14): nonlinear prefill, batch-dependent TPOT, metrics -------

MODEL = {"prefill_base_us": 1000.0, "prefill_us_per_token": 100.0,
         "prefill_us_per_token_sq": 0.5, "decode_us_per_token": 1000.0,
         "decode_us_per_seq": 500.0, "decode_us_per_context_token": 10.0}


@pytest.mark.parametrize("stream, coalesce_ms", [(False, 0.0), (True, 0.0), (True, 1000.0)])
def test_prefill_and_tpot_follow_the_model_exactly(stream, coalesce_ms):
    eng = make_engine(**MODEL, stream_coalesce_ms=coalesce_ms)
    eng.start()
    try:
        body: dict = {"prompt": list(range(1000, 1010)), "max_tokens": 5, "stream": stream,
                      "stream_options": {"include_usage": True}}
        r = requests.post(url(eng), json=body, timeout=10)
        assert r.status_code == 200
        # Prefill of 10 uncached tokens: 1000 + 100 x 10 + 0.5 x 100 = 2050 us.
        # Four decode steps alone (B = 1) at contexts 11..14: 1000 + 500 + 10 x (L - 1)
        # = 1600, 1610, 1620, 1630 us: TPOT 1.615 ms.
        if stream:
            events = [e for e in r.text.split("\n\n") if e]
            # One event per token (coalesced writes too), the usage chunk, [DONE].
            assert len(events) == 5 + 2
            last = json.loads(events[-2][len("data: "):])
            timing = last["sim_timing"]
            assert (timing["prefill_ms"], timing["tpot_ms"], timing["rank"]) == (2.05, 1.615, 0)
            assert timing["instance"] == eng.name  # which engine served, seen behind a router
            assert timing["ttft_ms"] == pytest.approx(timing["queue_ms"] + 2.05, abs=1e-3)
        else:
            assert r.headers["x-sim-prefill-ms"] == "2.050"
            assert r.headers["x-sim-tpot-ms"] == "1.615"
        wait_for(lambda: eng.serving.stats().completed == 1, 5.0, what="request counted")
        st = eng.serving.stats()
        assert (st.ttft_count, st.tpot_count, st.decoding) == (1, 1, 0)
        assert st.tpot_ms_sum == pytest.approx(1.615)
        assert st.ttft_ms_sum >= 2.05
    finally:
        eng.close()


def test_tpot_grows_with_the_batch_decoding_beside_it():
    eng = make_engine(**{**MODEL, "decode_us_per_context_token": 0.0,
                         "decode_us_per_token": 20_000.0})
    eng.start()
    holder: Optional[socket.socket] = None
    try:
        # A long stream decodes during the whole second request: every step has B = 2.
        holder = raw_request(eng, {"prompt": [1, 2, 3, 4], "max_tokens": 1000, "stream": True})
        read_until(holder, b"\n\n")
        wait_for(lambda: eng.serving.stats().decoding == 1, 5.0, what="holder decoding")
        r = requests.post(url(eng), json={"prompt": [9] * 8, "max_tokens": 4}, timeout=10)
        assert r.headers["x-sim-tpot-ms"] == "21.000"  # 20 ms + 2 x 0.5 ms
    finally:
        if holder is not None:
            holder.close()
        eng.close()
    eng = make_engine(**{**MODEL, "decode_us_per_context_token": 0.0,
                         "decode_us_per_token": 20_000.0})
    eng.start()
    try:
        r = requests.post(url(eng), json={"prompt": [9] * 8, "max_tokens": 4}, timeout=10)
        assert r.headers["x-sim-tpot-ms"] == "20.500"  # alone: B = 1
    finally:
        eng.close()


def test_metrics_endpoint_has_ttft_and_tpot_histograms():
    eng = make_engine(**MODEL)
    eng.start()
    try:
        for _ in range(2):
            requests.post(url(eng), json={"prompt": list(range(10)), "max_tokens": 5},
                          timeout=10)
        wait_for(lambda: eng.serving.stats().completed == 2, 5.0, what="both counted")
        r = requests.get(url(eng, "/metrics"), timeout=10)
        assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/plain")
        lines = dict(line.rsplit(" ", 1) for line in r.text.splitlines()
                     if line and not line.startswith("#"))
        assert float(lines["kvsvc_sim_time_to_first_token_seconds_count"]) == 2.0
        assert float(lines["kvsvc_sim_time_per_output_token_seconds_count"]) == 2.0
        # Both TPOTs are 1.615 ms: under the first bucket (5 ms).
        assert float(lines['kvsvc_sim_time_per_output_token_seconds_bucket{le="0.005"}']) == 2.0
        assert float(lines["kvsvc_sim_time_per_output_token_seconds_sum"]) == \
            pytest.approx(2 * 0.001615)
        assert float(lines["kvsvc_sim_requests_total"]) == 2.0
        # The second prompt hit the first's two full blocks (BS 4): 8 of 20 tokens cached.
        assert float(lines["kvsvc_sim_prompt_tokens_total"]) == 20.0
        assert float(lines["kvsvc_sim_cached_tokens_total"]) == 8.0
        assert float(lines["kvsvc_sim_waiting_requests"]) == 0.0
    finally:
        eng.close()


def test_registration_carries_the_profiling_data_of_the_model():
    from kvsvc.testbed.sim.registration import EtcdRegistration, Load
    from kvsvc.testbed.sim.serving import profiling_data

    cfg = ServingConfig(**MODEL)
    reg = EtcdRegistration("127.0.0.1:1", "127.0.0.1:8000", 1, lambda: Load(0, 0.0),
                           profiling=profiling_data(cfg))
    value = reg.value()
    assert value["backend_type"] == "xllm"
    assert value["ttft_profiling_data"][:3] == [[1, 1.101], [128, 21.992], [256, 59.368]]
    assert value["tpot_profiling_data"][0] == [128, 1, 2.77]
    assert "ttft_profiling_data" not in EtcdRegistration(
        "127.0.0.1:1", "127.0.0.1:8000", 1, lambda: Load(0, 0.0)).value()


# -- n, stop, the context and the model (issue 20 item 7) -------------------------------------

def test_n_choices_each_with_its_index_and_usage_counts_them(engine):
    body = {"model": "sim", "prompt": [1, 2, 3, 4, 5], "max_tokens": 3, "n": 2}
    doc = requests.post(url(engine), json=body, timeout=10).json()
    assert [c["index"] for c in doc["choices"]] == [0, 1]
    assert {c["text"] for c in doc["choices"]} == {" t0 t1 t2"}
    assert doc["usage"]["completion_tokens"] == 6
    r = requests.post(url(engine), json={**body, "stream": True,
                                         "stream_options": {"include_usage": True}},
                      timeout=10)
    events = [json.loads(line[6:]) for line in r.text.split("\n\n")
              if line.startswith("data: {")]
    by_index: dict[int, str] = {}
    for e in events:
        for c in e["choices"]:
            by_index[c["index"]] = by_index.get(c["index"], "") + c["text"]
    assert by_index == {0: " t0 t1 t2", 1: " t0 t1 t2"}
    assert events[-1]["usage"]["completion_tokens"] == 6
    for bad in (0, 129, "2", True):
        assert requests.post(url(engine), json={**body, "n": bad}, timeout=10).status_code == 400


def test_stop_strings_end_the_text_before_them(engine):
    body = {"model": "sim", "prompt": [1, 2, 3, 4, 5], "max_tokens": 10, "stop": [" t3", "zz"]}
    doc = requests.post(url(engine), json=body, timeout=10).json()
    (choice,) = doc["choices"]
    assert (choice["text"], choice["finish_reason"]) == (" t0 t1 t2", "stop")
    assert doc["usage"]["completion_tokens"] == 4  # the token that completed the stop string
    chat = requests.post(url(engine, "/v1/chat/completions"), timeout=10, json={
        "model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10,
        "stop": "t1", "stream": True}).text
    texts = "".join(c["delta"].get("content", "")
                    for line in chat.split("\n\n") if line.startswith("data: {")
                    for c in json.loads(line[6:])["choices"])
    assert texts == " t0 "
    assert '"finish_reason": "stop"' in chat
    # No stop string generated: the length ends it.
    doc = requests.post(url(engine), json={**body, "stop": "never"}, timeout=10).json()
    assert doc["choices"][0]["finish_reason"] == "length"
    assert requests.post(url(engine), json={**body, "stop": ["a"] * 5},
                         timeout=10).status_code == 400


def test_prompt_plus_max_tokens_beyond_the_context_is_refused():
    eng = make_engine(max_model_len=16)
    eng.start()
    try:
        ok = requests.post(url(eng), json={"model": "sim", "prompt": list(range(10)),
                                           "max_tokens": 6}, timeout=10)
        assert ok.status_code == 200
        r = requests.post(url(eng), json={"model": "sim", "prompt": list(range(10)),
                                          "max_tokens": 7}, timeout=10)
        assert r.status_code == 400
        assert "maximum context length is 16 tokens" in r.json()["error"]["message"]
        assert "17 tokens (10 in the messages, 7 in the completion)" in r.json()["error"]["message"]
        # Without max_tokens: what is left of the context, at most the default.
        doc = requests.post(url(eng), json={"model": "sim", "prompt": list(range(13))},
                            timeout=10).json()
        assert doc["usage"]["completion_tokens"] == 3
        r = requests.post(url(eng), json={"model": "sim", "prompt": list(range(16))},
                          timeout=10)
        assert r.status_code == 400
    finally:
        eng.close()


def test_a_model_it_does_not_serve_is_404(engine):
    r = requests.post(url(engine), json={"model": "llama", "prompt": [1, 2], "max_tokens": 1},
                      timeout=10)
    assert r.status_code == 404
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("model_not_found", "model")
    assert "llama" in err["message"]
    assert engine.serving.stats().rejected == 1
