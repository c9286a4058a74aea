"""``kvsvc up``: a whole local cluster in the foreground; it serves completions through the
router, answers the KV-cache query with a hit, exits 0 on SIGINT, SIGTERM and SIGHUP (a
closed terminal) with every child process and its temporary directory gone, and refuses a
router port in use at once."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import requests

from kvsvc.testbed.ports import ephemeral_ports, free_port_run, instance_ports
from tests.support.util import wait_for

pytestmark = pytest.mark.etcd  # kvsvc up starts its own etcd


def _children(pid: int) -> set[int]:
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.add(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _start_up(tmp_path, port: int, *args: str) -> tuple[subprocess.Popen, list[str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSVC_")}
    proc = subprocess.Popen([sys.executable, "-m", "kvsvc", "up", "--port", str(port), *args],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
    lines: list[str] = []
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "Add your own engine" in line:
            lines.append(proc.stdout.readline())
            return proc, lines
    proc.kill()
    raise AssertionError("kvsvc up not ready:\n" + "".join(lines))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_up_serves_and_stops_cleanly(tmp_path, sig):
    port = free_port_run(1)
    proc, lines = _start_up(tmp_path, port, "--engines", "2")
    try:
        text = "".join(lines)
        assert f"kvsvc up: ready: router http://127.0.0.1:{port}, 2 engines" in text
        for needed in ("curl -s $URL/health", "/v1/internal/kv-cache/query",
                       "/v1/internal/route", "/v1/chat/completions", '"stream": true'):
            assert needed in text
        engines = re.findall(r"engine   http://127\.0\.0\.1:(\d+)", text)
        assert len(engines) == 2
        eph = ephemeral_ports()
        for p in engines:  # every derived port outside the ephemeral range (§9 rule)
            assert not any(eph.collides(q) for q in instance_ports(int(p), 1, 10000, 30000))
        tmp_dir = re.search(r"(/tmp/kvsvc-up-\w+)/router\.log", text).group(1)
        token = (tmp_path / "kvsvc.token").read_text().strip()
        assert oct((tmp_path / "kvsvc.token").stat().st_mode & 0o777) == "0o600"
        url = f"http://127.0.0.1:{port}"
        prompt = list(range(1, 1025))
        with requests.Session() as http:
            http.trust_env = False
            r = http.post(url + "/v1/completions", json={"model": "sim", "prompt": prompt,
                                                         "max_tokens": 2}, timeout=30)
            assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 1024
            served = r.headers["x-kvsvc-prefill"]
            r = http.post(url + "/v1/chat/completions", json={
                "model": "sim", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2, "stream": True}, timeout=30)
            assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
            http.headers["X-Internal-Token"] = token

            def hit() -> bool:
                ms = http.post(url + "/v1/internal/kv-cache/query", json={"token_ids": prompt},
                               timeout=10).json()["matches"]
                return any(m["instance_name"] == served and m["device_hit_tokens"] == 1024
                           for m in ms)

            wait_for(hit, 10, what="the served prompt indexed")

            def models() -> list:
                return [m["id"] for m in http.get(url + "/v1/models", timeout=10).json()["data"]]

            # --model is unset under up: the router lists the engines' own model ("sim").
            assert wait_for(lambda: models() == ["sim"], 15, what="the engines' model listed")

            # Text prompts hit: engines and router share one tokenizer (issue 20 item 5).
            text = " ".join(f"word{i} of the cache" for i in range(200))
            body = {"model": "sim", "prompt": text, "max_tokens": 1}
            first = http.post(url + "/v1/completions", json=body, timeout=30)
            assert first.status_code == 200
            tokens = first.json()["usage"]["prompt_tokens"]
            assert tokens < len(text.encode())  # the BPE, not one token per byte

            def text_hit() -> bool:
                r = http.post(url + "/v1/completions", json=body, timeout=30)
                cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                predicted = int(r.headers.get("x-kvsvc-predicted-cached-tokens", "0"))
                return (r.headers["x-kvsvc-prefill"] == first.headers["x-kvsvc-prefill"]
                        and cached > tokens // 2 and predicted == cached)
            wait_for(text_hit, 15, what="a repeated text prompt routed on its hit")
        kids = _children(proc.pid)
        assert len(kids) == 4, kids  # etcd, two engines, the router (gunicorn's arbiter)
        grandkids = set().union(*(_children(k) for k in kids))  # gunicorn's worker
        proc.send_signal(sig)
        assert proc.wait(40) == 0
        rest = proc.stdout.read()
        assert "everything it started is gone" in rest
        wait_for(lambda: not [p for p in kids | grandkids if _alive(p)], 10,
                 what="every child gone")
        assert not os.path.exists(tmp_dir)
        assert (tmp_path / "kvsvc.token").read_text().strip() == token  # kept
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_up_refuses_a_router_port_in_use_at_once(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "kvsvc", "up", "--port", str(port)],
                              cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert f"--port: cannot listen on 127.0.0.1:{port}: already in use" in proc.stderr
    assert time.monotonic() - t0 < 10
    assert not (tmp_path / "kvsvc.token").exists()  # nothing started, nothing written


def test_up_flavor_vllm_with_two_dp_ranks_routes_to_the_rank_that_holds_the_prompt(tmp_path):
    """``kvsvc up --flavor vllm --dp 2``: vLLM-style engines (history replay, load from their
    /metrics) with two DP ranks each; a prompt is answered on a rank (``x-sim-rank``), indexed
    on that rank's stream only, and the router then picks that same (engine, rank) pair and
    sends the repeat there with ``X-data-parallel-rank``. Embeddings are relayed too, and
    there is no ``x-kvsvc-decode`` header without a decode instance."""
    port = free_port_run(1)
    proc, lines = _start_up(tmp_path, port, "--engines", "1", "--dp", "2",
                            "--flavor", "vllm")
    try:
        text = "".join(lines)
        assert "vllm, 2 DP ranks, events tcp://" in text and "history tcp://" in text, text
        assert "X-data-parallel-rank" in text and "--flavor vllm --dp 2" in text
        (engine,) = re.findall(r"engine   http://(127\.0\.0\.1:\d+)", text)
        token = (tmp_path / "kvsvc.token").read_text().strip()
        url = f"http://127.0.0.1:{port}"
        prompt = list(range(5000, 5000 + 1024))
        with requests.Session() as http:
            http.trust_env = False
            auth = {"X-Internal-Token": token}
            r = http.post(url + "/v1/completions", json={"model": "sim", "prompt": prompt,
                                                         "max_tokens": 2}, timeout=30)
            assert r.status_code == 200, r.text
            assert r.headers["x-kvsvc-prefill"] == engine
            assert "x-kvsvc-decode" not in r.headers
            rank = int(r.headers["x-sim-rank"])

            def ranks_hit() -> dict:
                ms = http.post(url + "/v1/internal/kv-cache/query", json={"token_ids": prompt},
                               headers=auth, timeout=10).json()["matches"]
                return {m["dp_rank"]: m["device_hit_tokens"] for m in ms
                        if m["instance_name"] == engine}

            wait_for(lambda: ranks_hit() == {rank: 1024, 1 - rank: 0}, 15,
                     what="the prompt indexed on the rank that served it only")
            route = http.post(url + "/v1/internal/route", json={"token_ids": prompt},
                              headers=auth, timeout=10).json()
            assert (route["prefill"], route["prefill_dp_rank"]) == (engine, rank), route
            again = http.post(url + "/v1/completions", json={
                "model": "sim", "prompt": prompt, "max_tokens": 2}, timeout=30)
            assert again.status_code == 200 and int(again.headers["x-sim-rank"]) == rank
            assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 1024 - 128
            emb = http.post(url + "/v1/embeddings", json={"model": "sim", "input": ["a", "b"]},
                            timeout=30)
            assert emb.status_code == 200, emb.text
            vectors = [d["embedding"] for d in emb.json()["data"]]
            assert len(vectors) == 2 and vectors[0] != vectors[1] and len(vectors[0]) == 16
        proc.send_signal(signal.SIGINT)
        assert proc.wait(40) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
