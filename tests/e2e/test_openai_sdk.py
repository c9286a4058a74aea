"""The official ``openai`` SDK against the real ``kvsvc serve`` (gunicorn) (issue 20 item 8): a
real etcd, two serving simulated engines registered and heartbeating, router and engines on the
testbed's shared tokenizer. Chat and completions, streamed and not (text prompts, so the shared
tokenizer is what makes the second request hit), ``n`` and ``stop`` honoured, errors as the SDK's
exception classes (404 unknown model, 400, 401 without the API key, 429 with Retry-After),
``models.list`` / ``models.retrieve``, and the request id the SDK reads."""

from __future__ import annotations

import json
import secrets
import tempfile
from pathlib import Path
from typing import Iterator

import httpx2
import openai
import pytest

from kvsvc.routing.prompt import PromptTokenizer
from kvsvc.testbed.demo import ServiceProcess, free_instance_port, free_port_run
from kvsvc.testbed.sim.engine import SimEngine
from kvsvc.testbed.sim.registration import EtcdRegistration, Load
from kvsvc.testbed.sim.serving import ServingConfig
from kvsvc.testbed.tokenizer import write_tokenizer
from tests.support.util import wait_for

BS = 16
OFFSETS = (10000, 30000)
API_KEY = "sdk-test-key"
DISCOVERY = {"discovery": {"enabled": True, "block_size": BS, "topic": "",
                           "event_port_offset": OFFSETS[0], "replay_port_offset": OFFSETS[1],
                           "refresh_interval_ms": 100}}
LONG_TEXT = " ".join(f"the cache of block {i} holds the model prompt" for i in range(60))


class SdkCluster:
    """Two in-process serving engines in etcd and one ``kvsvc serve`` with ``--api_key``."""

    def __init__(self, etcd_addr: str) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix="kvsvc-sdk-")
        root = Path(self.tmp.name)
        self.token = secrets.token_hex(8)
        tok_dir = write_tokenizer(root / "tokenizer")
        tokenizer = PromptTokenizer.load(str(tok_dir))
        self.engines: list[SimEngine] = []
        self.regs: list[EtcdRegistration] = []
        taken: set[int] = set()
        try:
            for i in range(2):
                port = free_instance_port(1, *OFFSETS, avoid=taken)
                taken.add(port)
                eng = SimEngine(f"127.0.0.1:{port}", port + OFFSETS[0], port + OFFSETS[1],
                                block_size=BS, device_blocks=512, http_port=port, seed=i,
                                serving=ServingConfig(prefill_us_per_token=10.0,
                                                      decode_us_per_token=1000.0),
                                tokenizer=tokenizer)
                self.engines.append(eng)
                eng.start()
                reg = EtcdRegistration(etcd_addr, eng.name, 1,
                                       lambda e=eng: Load(e.waiting_requests(), e.device_usage()),
                                       token=self.token, heartbeat_interval_s=0.1)
                self.regs.append(reg)
                reg.start()
            for reg in self.regs:
                reg.wait_registered()
            cfg = root / "kv_events.json"
            cfg.write_text(json.dumps(DISCOVERY), encoding="utf-8")
            self.svc = ServiceProcess(cfg, free_port_run(1), self.token, root / "service.log",
                                      etcd_addr=etcd_addr,
                                      extra_args=["--tokenizer_path", str(tok_dir),
                                                  "--max_in_flight_requests", "8"],
                                      extra_env={"KVSVC_API_KEY": API_KEY})
            self.svc.start(30.0, {(e.name, 0) for e in self.engines})
            self.svc.wait_routable({e.name for e in self.engines}, 30.0)
        except BaseException:
            self.close()
            raise
        self.base_url = self.svc.base_url + "/v1"

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=kwargs.pop("api_key", API_KEY),
                             max_retries=0, timeout=30.0,
                             http_client=httpx2.Client(trust_env=False), **kwargs)

    def close(self) -> None:
        svc = getattr(self, "svc", None)
        try:
            if svc is not None:
                svc.close()
            for reg in self.regs:
                reg.close()
        finally:
            for eng in self.engines:
                eng.close()
            self.tmp.cleanup()


@pytest.fixture
def cluster(etcd_server) -> Iterator[SdkCluster]:
    c = SdkCluster(etcd_server.addr)
    try:
        yield c
    finally:
        c.close()


def test_completions_and_chat_streamed_and_not_with_text_hits(cluster):
    client = cluster.client()
    first = client.completions.with_raw_response.create(model="sim", prompt=LONG_TEXT,
                                                        max_tokens=3)
    done = first.parse()
    assert done.choices[0].text == " t0 t1 t2" and done.choices[0].finish_reason == "length"
    assert done.usage.prompt_tokens > 100
    served = first.headers["x-kvsvc-prefill"]
    assert len(first.headers["x-request-id"]) == 32

    def hit() -> bool:
        again = client.completions.with_raw_response.create(model="sim", prompt=LONG_TEXT,
                                                            max_tokens=1)
        usage = again.parse().usage
        return (again.headers["x-kvsvc-prefill"] == served
                and usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens - BS)
    wait_for(hit, 15.0, interval_s=0.1, what="the repeated text prompt routed on its hit")

    chunks = list(client.completions.create(model="sim", prompt="hello", max_tokens=4,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == " t0 t1 t2 t3"
    assert chunks[-1].choices[0].finish_reason == "length"

    chat = client.chat.completions.create(
        model="sim", messages=[{"role": "user", "content": LONG_TEXT}], max_tokens=2, n=2,
        stop=["t1"])
    assert [c.index for c in chat.choices] == [0, 1]
    assert {c.message.content for c in chat.choices} == {" t0 "}
    assert {c.finish_reason for c in chat.choices} == {"stop"}
    stream = client.chat.completions.create(
        model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True,
        stream_options={"include_usage": True})
    parts = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
    assert text == " t0 t1 t2"
    assert parts[-1].usage is not None and parts[-1].usage.completion_tokens == 3


def test_embeddings_with_the_sdks_defaults(cluster):
    """``client.embeddings.create`` as written: the SDK asks for base64 and decodes it; the
    same vectors as the float form."""
    client = cluster.client()
    packed = client.embeddings.create(model="sim", input="Hello!")
    plain = client.embeddings.create(model="sim", input="Hello!", encoding_format="float")
    assert len(packed.data) == 1 and packed.data[0].embedding
    assert packed.data[0].embedding == pytest.approx(plain.data[0].embedding, rel=1e-6)


def test_models_and_errors_through_the_sdk(cluster):
    client = cluster.client()
    assert [m.id for m in client.models.list()] == ["sim"]
    assert client.models.retrieve("sim").id == "sim"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("llama")
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="llama", prompt="hi", max_tokens=1)
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="sim", prompt="hi", max_tokens=0)
    assert bad.value.param == "max_tokens"
    with pytest.raises(openai.AuthenticationError):
        cluster.client(api_key="wrong").completions.create(model="sim", prompt="hi",
                                                           max_tokens=1)
    with pytest.raises(openai.AuthenticationError):
        cluster.client(api_key="wrong").models.list()


def test_in_flight_limit_is_a_rate_limit_error_with_retry_after(cluster):
    client = cluster.client()
    streams = [client.completions.create(model="sim", prompt="hold", max_tokens=400,
                                         stream=True) for _ in range(8)]
    try:
        for s in streams:  # each holds its slot while its relay is open
            next(iter(s))
        with pytest.raises(openai.RateLimitError) as err:
            client.completions.create(model="sim", prompt="one more", max_tokens=1)
        assert err.value.response.headers["retry-after"] == "1"
    finally:
        for s in streams:
            s.close()

    def admitted() -> bool:
        try:
            client.completions.create(model="sim", prompt="after", max_tokens=1)
        except openai.RateLimitError:
            return False
        return True
    wait_for(admitted, 15.0, interval_s=0.1, what="slots freed by the closed streams")
