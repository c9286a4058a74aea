"""Native dispatch to xLLM engines (§13) without sockets: the request messages, the retry of a
failed dispatch, the streamed and non-streamed answers from Generations delivered by another
thread, the client going away, an instance that fails, is replaced or goes silent, and the
request metrics heard on the observer seam (§12); the OpenAI fields handed to the engine (every
field xLLM's messages have, a 400 naming any other, the engine's ``param`` carried: issue 19
items 3 and 4)."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional

import pytest
from google.protobuf import json_format

from kvsvc.cluster.model import (
    Instance,
    InstanceState,
    InstanceType,
    LoadMetrics,
    RegistrySnapshot,
)
from kvsvc.errors import BadRequest, ClientGone, UpstreamTimeout, UpstreamUnreachable
from kvsvc.routing.answers import (
    GenOutput,
    GenUsage,
    Generation,
    StreamAssembler,
    WholeAssembler,
    answer_spec,
    engine_param,
)
from kvsvc.routing.engine_loss import LostEngines
from kvsvc.routing.generations import PendingRequests
from kvsvc.routing.in_flight import InFlight
from kvsvc.routing.observer import RequestInfo
from kvsvc.routing.policy import Decision
from kvsvc.routing.request_metrics import RequestMetricsLedger
from kvsvc.routing.xllm_dispatch import (
    CHAT_METHOD,
    BaiduStdHeartbeats,
    COMPLETIONS_METHOD,
    NEEDS_TOKENS,
    XllmDispatcher,
    chat_request,
    check_xllm_fields,
    completion_request,
)
from kvsvc.rpc import messages

P1, P2, D1 = "10.0.0.1:9000", "10.0.0.2:9000", "10.0.0.3:9000"
TOKENS = list(range(40))


def inst(name: str, type_: InstanceType = InstanceType.DEFAULT, inc: str = "") -> Instance:
    return Instance(name=name, type=type_, role=type_, incarnation_id=inc or f"inc-{name}",
                    register_ts_ms=None, dp_size=1, backend_type="xllm", rpc_address=name,
                    state=InstanceState.ACTIVE, load=LoadMetrics(0, 0.0, time.monotonic()))


class Registry:
    """A registry snapshot a test can change."""

    def __init__(self, *instances: Instance) -> None:
        self.instances = {i.name: i for i in instances}

    def snapshot(self) -> RegistrySnapshot:
        return RegistrySnapshot(MappingProxyType(dict(self.instances)), True, True, 1)


class Recorder:
    """A request observer that records its calls (and feeds the ledger)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.ledger = RequestMetricsLedger()

    def __getattr__(self, name: str) -> Callable[..., None]:
        def hear(info: RequestInfo, *args: Any) -> None:
            if name == "on_tokens":   # n tokens at once: recorded as n GENERATE events
                self.calls.extend([("on_token", None)] * args[0])
            else:
                self.calls.append((name, args[0] if args else None))
            getattr(self.ledger, name)(info, *args)
        return hear

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


class Engine:
    """An :class:`EngineCaller` that answers from a script: failing targets raise, the others
    get their entries delivered from a thread, like an engine's Generations."""

    def __init__(self, pending: PendingRequests, fail: Mapping[str, Exception] = {},
                 script: Optional[Callable[[str], list[Generation]]] = None,
                 gap_s: float = 0.0, spin_s: float = 0.0) -> None:
        self.pending = pending
        self.spin_s = spin_s  # a pause per entry without sleeping (the unit tier refuses it)
        self.fail = dict(fail)
        self.script = script
        self.gap_s = gap_s
        self.calls: list[tuple[str, str, dict]] = []
        self.answers: list[bool] = []
        self.threads: list[threading.Thread] = []
        self.release = threading.Event()
        self.release.set()

    def call(self, target: str, method: str, message: Mapping[str, Any]) -> None:
        self.calls.append((target, method, dict(message)))
        if target in self.fail:
            raise self.fail[target]
        if self.script is None:
            return
        gens = self.script(message["service_request_id"])

        def push() -> None:
            for gen in gens:
                self.release.wait(5.0)
                self.answers.extend(self.pending.deliver([gen]))
                if self.gap_s:
                    time.sleep(self.gap_s)
                if self.spin_s:
                    if self.answers and self.answers[-1] is False:
                        break   # cancelled: an engine stops generating
                    until = time.perf_counter() + self.spin_s
                    while time.perf_counter() < until:
                        pass
        t = threading.Thread(target=push, daemon=True)
        t.start()
        self.threads.append(t)

    def join(self) -> None:
        for t in self.threads:
            t.join(5.0)

    def close(self) -> None:
        pass


def tokens_script(n: int = 3, usage: GenUsage = GenUsage(40, 3, 43, 32)
                  ) -> Callable[[str], list[Generation]]:
    def script(sid: str) -> list[Generation]:
        return [Generation(sid, "e", outputs=(GenOutput(0, f" t{i}", (i,),
                                                        "length" if i == n - 1 else ""),),
                           usage=usage if i == n - 1 else None, finished=i == n - 1)
                for i in range(n)]
    return script


def decision(*prefill: Instance, decode: Optional[Instance] = None) -> Decision:
    return Decision("RR", prefill[0], decode, (), tuple(prefill), len(TOKENS))


def dispatcher(engine_factory: Callable[[PendingRequests], Engine], registry: Registry,
               timeout_s: float = 5.0) -> tuple[XllmDispatcher, Engine, Recorder, InFlight]:
    pending = PendingRequests()
    engine = engine_factory(pending)
    rec = Recorder()
    in_flight = InFlight()
    disp = XllmDispatcher(engine, pending, registry.snapshot, in_flight, rec, timeout_s,
                          lambda: "127.0.0.1:8889")
    return disp, engine, rec, in_flight


def sse_events(data: bytes) -> list[str]:
    return [b[len("data: "):] for b in data.decode().split("\n\n") if b]


def test_messages_carry_the_section_13_fields() -> None:
    doc = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}],
        "max_completion_tokens": 5, "max_tokens": 9, "stream": True, "stop": "x",
        "stream_options": {"include_usage": True}, "temperature": 0.5, "tools": [{}]}
    msg = chat_request(doc, [1, 2], "sid", P1, D1, "127.0.0.1:8889", "xr")
    assert msg["service_request_id"] == "sid" and msg["token_ids"] == [1, 2]
    assert msg["routing"] == {"prefill_name": P1, "decode_name": D1}
    assert msg["source_xservice_addr"] == "127.0.0.1:8889" and msg["x_request_id"] == "xr"
    assert msg["messages"] == [{"role": "user", "content": "hi there"}]
    assert msg["max_tokens"] == 5 and msg["stop"] == ["x"] and msg["temperature"] == 0.5
    assert msg["stream_options"] == {"include_usage": True}
    assert "tools" not in msg and "max_completion_tokens" not in msg
    comp = completion_request({"model": "m", "prompt": [[5, 6]], "max_tokens": 3, "echo": False},
                              [5, 6], "sid", P1)
    assert comp["prompt"] == "" and comp["token_ids"] == [5, 6] and comp["max_tokens"] == 3
    assert comp["routing"] == {"prefill_name": P1, "decode_name": ""}
    assert "source_xservice_addr" not in comp and comp["echo"] is False


def test_no_token_ids_is_a_clear_400() -> None:
    reg = Registry(inst(P1))
    disp, engine, _, _ = dispatcher(lambda p: Engine(p), reg)
    with pytest.raises(BadRequest, match="tokenizer_path") as err:
        disp.forward(decision(inst(P1)), "/v1/completions", {"prompt": "hi"}, None)
    assert err.value.message == NEEDS_TOKENS
    assert engine.calls == []


def test_streamed_chat_answer_and_request_metrics() -> None:
    p = inst(P1)
    reg = Registry(p)
    disp, engine, rec, in_flight = dispatcher(lambda q: Engine(q, script=tokens_script()), reg)
    reply = disp.forward(decision(p), "/v1/chat/completions",
                         {"model": "m", "stream": True, "messages": [{"role": "user",
                                                                      "content": "x"}]},
                         TOKENS)
    assert reply.status == 200 and reply.is_event_stream and reply.target == P1
    ends: list = []
    reply.body.when_closed(ends.append)
    data = b"".join(reply.body)
    reply.body.close()
    events = sse_events(data)
    assert events[-1] == "[DONE]" and len(events) == 4
    assert engine.calls[0][1] == CHAT_METHOD
    assert rec.names() == ["on_dispatch", "on_first_token", "on_token", "on_token", "on_end"]
    assert rec.calls[-1][1]["prompt_tokens_details"]["cached_tokens"] == 32
    assert in_flight.snapshot().total(P1) == 0
    assert ends[0].complete and ends[0].first_data_at is not None
    assert disp.pending.stats().open == 0
    assert rec.ledger.snapshot().of(P1).prefill_request_num == 0


def test_non_streamed_completion_waits_for_the_last_entry() -> None:
    p = inst(P1)
    reg = Registry(p)
    disp, engine, rec, _ = dispatcher(lambda q: Engine(q, script=tokens_script(4)), reg)
    reply = disp.forward(decision(p), "/v1/completions", {"model": "m", "prompt": TOKENS},
                         TOKENS)
    import json
    doc = json.loads(reply.body.read_all())
    assert reply.status == 200 and not reply.is_event_stream
    assert doc["object"] == "text_completion"
    assert doc["choices"][0]["text"] == " t0 t1 t2 t3"
    assert doc["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert engine.calls[0][1] == COMPLETIONS_METHOD
    assert rec.names()[0] == "on_dispatch" and rec.names()[-1] == "on_end"


def test_engine_error_status_non_streamed_gets_its_http_status() -> None:
    p = inst(P1)
    reg = Registry(p)

    def script(sid: str) -> list[Generation]:
        return [Generation(sid, status_code=5, status_msg="no KV blocks left")]
    disp, _, rec, _ = dispatcher(lambda q: Engine(q, script=script), reg)
    reply = disp.forward(decision(p), "/v1/completions", {"prompt": TOKENS}, TOKENS)
    assert reply.status == 429
    assert b"no KV blocks left" in reply.body.read_all()
    assert rec.names()[-1] == "on_cancel"


def test_dispatch_failure_is_retried_on_the_next_candidate() -> None:
    p1, p2 = inst(P1), inst(P2)
    reg = Registry(p1, p2)
    disp, engine, rec, in_flight = dispatcher(
        lambda q: Engine(q, fail={P1: UpstreamUnreachable("refused")}, script=tokens_script()),
        reg)
    reply = disp.forward(decision(p1, p2), "/v1/completions", {"prompt": TOKENS,
                                                               "stream": True}, TOKENS)
    assert reply.target == P2 and reply.attempts == [P1, P2]
    b"".join(reply.body)
    reply.body.close()
    assert disp.failures() == {P1: 1}
    assert rec.names()[:2] == ["on_dispatch", "on_cancel"]
    assert in_flight.snapshot().total(P1) == 0 and in_flight.snapshot().total(P2) == 0
    # Every attempt failed: the last error, naming the instances tried.
    disp2, _, _, _ = dispatcher(lambda q: Engine(q, fail={P1: UpstreamTimeout("slow"),
                                                          P2: UpstreamTimeout("slow")}), reg)
    with pytest.raises(UpstreamTimeout, match="tried"):
        disp2.forward(decision(p1, p2), "/v1/completions", {"prompt": TOKENS}, TOKENS)
    assert disp2.pending.stats().open == 0


def test_client_gone_makes_the_next_entry_false() -> None:
    p = inst(P1)
    reg = Registry(p)
    disp, engine, rec, in_flight = dispatcher(lambda q: Engine(q, script=tokens_script(6)), reg)
    engine.release.clear()   # the engine holds its entries until the test lets them go
    reply = disp.forward(decision(p), "/v1/completions", {"prompt": TOKENS, "stream": True},
                         TOKENS)
    sid = engine.calls[0][2]["service_request_id"]
    it = iter(reply.body)
    assert disp.pending.deliver([Generation(sid, outputs=(GenOutput(0, " first", (9,)),))]) \
        == [True]
    assert b" first" in next(it)
    reply.body.close()          # the WSGI server's close: the client went away
    engine.release.set()
    engine.join()
    assert engine.answers and not any(engine.answers)
    assert rec.calls[-1] == ("on_cancel", "client went away")
    assert in_flight.snapshot().total(P1) == 0


#: Entries of the flowing engine, one per 0.2 ms: seconds of entries, many check intervals
#: (0.25 s), fewer unread at any time than a request's queue bound.
N_FLOWING = 20_000


class GoneClient:
    """A client connection (:class:`~kvsvc.routing.proxy.ClientWatch`'s two members) that is
    there for the first ``checks`` peeks and closed after."""

    def __init__(self, checks: int) -> None:
        self.checks = checks
        self.gone = False

    def client_gone(self) -> bool:
        self.checks -= 1
        return self.checks < 0


def test_non_streamed_client_gone_is_cancelled_while_entries_flow() -> None:
    """The walkthrough's case: entries arrive without a pause (the scripted engine delivers
    as fast as it can, for seconds) while the client of a non-streamed request has left: the
    request is cancelled at the next check (``ClientGone``, the engine's next entries
    answered ``ok: false``, ``on_cancel``), not generated to the end and counted 200."""
    p = inst(P1)
    reg = Registry(p)
    disp, engine, rec, in_flight = dispatcher(
        lambda q: Engine(q, script=tokens_script(N_FLOWING), spin_s=0.0002), reg)
    client = GoneClient(checks=1)
    with pytest.raises(ClientGone):   # the non-streamed answer is awaited inside forward
        disp.forward(decision(p), "/v1/completions", {"prompt": TOKENS}, TOKENS,
                     client=client).body.read_all()
    engine.join()
    assert client.gone
    assert False in engine.answers and disp.pending.stats().open == 0
    assert rec.names()[-1] == "on_cancel"
    assert in_flight.snapshot().total(P1) == 0


@pytest.mark.parametrize("change", ["suspect", "removed", "replaced", "lost"])
def test_instance_failing_mid_stream_fails_the_request_visibly(change: str) -> None:
    p = inst(P1)
    reg = Registry(p)

    def script(sid: str) -> list[Generation]:
        return [Generation(sid, outputs=(GenOutput(0, " t0", (0,)),))]
    disp, engine, rec, _ = dispatcher(lambda q: Engine(q, script=script), reg)
    disp.lost = LostEngines(reg.snapshot, refuses=lambda name: True)
    reply = disp.forward(decision(p), "/v1/completions", {"prompt": TOKENS, "stream": True},
                         TOKENS)
    it = iter(reply.body)
    assert b" t0" in next(it)
    if change == "lost":   # its baidu_std connection closed and its port refuses
        assert disp.lost.connection_closed({P1}, "10.0.0.1:40000") == [P1]
    elif change == "suspect":
        reg.instances[P1] = dataclasses.replace(p, state=InstanceState.SUSPECT)
    elif change == "removed":
        del reg.instances[P1]
    else:
        reg.instances[P1] = dataclasses.replace(p, incarnation_id="inc-new")
    with pytest.raises(UpstreamUnreachable, match={"suspect": "SUSPECT", "removed": "removed",
                                                   "replaced": "replaced",
                                                   "lost": "died"}[change]):
        next(it)
    reply.body.close()
    assert rec.names()[-1] == "on_cancel" and "broke" in rec.calls[-1][1]


def test_silent_engine_times_out_non_streamed() -> None:
    p = inst(P1)
    reg = Registry(p)
    disp, _, rec, _ = dispatcher(lambda q: Engine(q), reg, timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(UpstreamTimeout, match="no Generations"):
        disp.forward(decision(p), "/v1/completions", {"prompt": TOKENS}, TOKENS)
    assert time.monotonic() - started < 5
    assert rec.names() == ["on_dispatch", "on_cancel"]
    assert disp.pending.stats().open == 0


def test_engine_lost_fails_a_non_streamed_request_at_once_counted_broken() -> None:
    p = inst(P1)
    reg = Registry(p)
    disp, _, rec, _ = dispatcher(lambda q: Engine(q), reg, timeout_s=30.0)
    disp.lost = LostEngines(reg.snapshot, refuses=lambda name: True)
    closer = threading.Timer(0.2, disp.lost.connection_closed, ({P1}, "10.0.0.1:40000"))
    closer.start()
    started = time.monotonic()
    try:
        with pytest.raises(UpstreamUnreachable, match=f"{P1} died .* while generating request"):
            disp.forward(decision(p), "/v1/completions", {"prompt": TOKENS}, TOKENS)
    finally:
        closer.cancel()
        closer.join(5.0)
    assert time.monotonic() - started < 5          # not the 30 s read timeout
    assert rec.names() == ["on_dispatch", "on_cancel"] and "broke" in rec.calls[-1][1]
    assert disp.pending.stats().open == 0


def test_pd_first_token_from_p_rest_from_d_and_d_is_watched_after_it() -> None:
    p, d = inst(P1, InstanceType.PREFILL), inst(D1, InstanceType.DECODE)
    reg = Registry(p, d)

    def script(sid: str) -> list[Generation]:
        return [Generation(sid, outputs=(GenOutput(0, " a", (1,)),), finished=True,
                           finished_on_prefill_instance=True),
                Generation(sid, outputs=(GenOutput(0, " b", (2,)),)),
                Generation(sid, outputs=(GenOutput(0, " c", (3,), "stop"),), finished=True,
                           usage=GenUsage(40, 3, 43, 0))]
    disp, engine, rec, in_flight = dispatcher(lambda q: Engine(q, script=script), reg)
    reply = disp.forward(decision(p, decode=d), "/v1/chat/completions",
                         {"messages": [{"role": "user", "content": "x"}], "stream": True},
                         TOKENS)
    assert engine.calls[0][2]["routing"] == {"prefill_name": P1, "decode_name": D1}
    events = sse_events(b"".join(reply.body))
    reply.body.close()
    assert events[-1] == "[DONE]" and len(events) == 4
    assert rec.names() == ["on_dispatch", "on_first_token", "on_token", "on_token", "on_end"]
    snap = rec.ledger.snapshot()
    assert snap.of(D1).decode_request_num == 0 and snap.of(P1).prefill_request_num == 0
    assert in_flight.snapshot().total(D1) == 0


def test_startup_warns_about_native_dispatch_that_cannot_work(monkeypatch) -> None:
    from kvsvc.service import startup_warnings
    from kvsvc.settings import load_service_settings

    for key in [k for k in __import__("os").environ if k.startswith("KVSVC_")]:
        monkeypatch.delenv(key)
    lines = startup_warnings(load_service_settings(
        xllm_dispatch="native", etcd_addr="127.0.0.1:2379", rpc_port=0), None)
    assert any("rpc_port is 0" in line for line in lines)
    assert any("without tokenizer_path" in line for line in lines)
    quiet = startup_warnings(load_service_settings(etcd_addr="127.0.0.1:2379", rpc_port=0),
                             None)
    assert not any("xllm_dispatch" in line for line in quiet)


def test_auto_dispatch_is_native_unless_heard_over_http() -> None:
    """``--xllm_dispatch auto`` (issue 19 item 6): an xLLM instance is dispatched natively
    unless its current incarnation's last heartbeat here came over HTTP (an xLLM engine that
    registers in etcd heartbeats over baidu_std; a replica hears no heartbeat); vLLM/SGLang
    never."""
    heard = BaiduStdHeartbeats()
    p, other = inst(P1, inc="inc-a"), inst(P2)
    disp, _, _, _ = dispatcher(lambda q: Engine(q), Registry(p, other))
    disp.native_for = heard.native
    assert disp.handles(p) and disp.handles(other)          # nothing heard: native
    heard.heard_http(P1, "inc-a")
    assert not disp.handles(p) and disp.handles(other)      # HTTP heartbeats: relayed
    assert disp.handles(dataclasses.replace(p, incarnation_id="inc-b"))   # a new process
    heard.heard(P1, "inc-a")                                # then baidu_std: native
    assert disp.handles(p)
    heard.heard_http(P2, None)                              # no incarnation: its name
    assert not disp.handles(other)
    assert not disp.handles(dataclasses.replace(p, backend_type="vllm"))
    disp.native_for = None                   # --xllm_dispatch native: every xLLM instance
    assert disp.handles(other)


# -- the fields sent (issue 19 items 3, 4) ----------------------------------------------

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def proto_dict(msg: dict, chat: bool) -> dict:
    """The message as the engine gets it: through xLLM's protobuf message (unknown fields
    would be dropped here), back to JSON."""
    pb = json_format.ParseDict(msg, messages.ChatRequest() if chat
                               else messages.CompletionRequest(), ignore_unknown_fields=True)
    return json_format.MessageToDict(pb, preserving_proto_field_name=True)


def test_every_openai_field_xllm_has_reaches_the_engine() -> None:
    doc = {**CHAT, "n": 3, "stop": "END", "logprobs": True, "top_logprobs": 2,
           "presence_penalty": 0.5, "frequency_penalty": -0.25, "max_completion_tokens": 7,
           "max_tokens": 99, "stream": True, "stream_options": {"include_usage": True},
           "user": "u-1", "temperature": 0.0, "top_p": 0.9, "top_k": 4,
           "repetition_penalty": 1.1, "ignore_eos": True, "stop_token_ids": [7],
           "response_format": {"type": "text"}, "seed": None, "metadata": {"a": "b"}}
    check_xllm_fields(doc, chat=True)
    got = proto_dict(chat_request(doc, [1, 2], "sid", P1), chat=True)
    assert got["n"] == 3 and got["stop"] == ["END"] and got["logprobs"] is True
    assert got["top_logprobs"] == 2 and got["presence_penalty"] == 0.5
    assert got["frequency_penalty"] == -0.25 and got["max_tokens"] == 7
    assert got["stream_options"] == {"include_usage": True} and got["user"] == "u-1"
    assert got["top_k"] == "4" and got["ignore_eos"] is True and got["stop_token_ids"] == [7]
    assert got["response_format"] == {"type": "text"} and got["temperature"] == 0.0
    assert "metadata" not in got and "seed" not in got
    comp = {"model": "m", "prompt": [5, 6], "n": 2, "stop": ["a", "b"], "logprobs": 3,
            "echo": True, "best_of": 2, "max_tokens": 4, "user": "u"}
    check_xllm_fields(comp, chat=False)
    got = proto_dict(completion_request(comp, [5, 6], "sid", P1), chat=False)
    assert (got["n"], got["stop"], got["logprobs"], got["echo"], got["best_of"],
            got["max_tokens"], got["user"]) == (2, ["a", "b"], 3, True, 2, 4, "u")


@pytest.mark.parametrize("chat, extra, param", [
    (True, {"seed": 42}, "seed"),
    (False, {"seed": 0}, "seed"),
    (True, {"logit_bias": {"5": 1.0}}, "logit_bias"),
    (False, {"suffix": "x"}, "suffix"),
    (True, {"echo": True}, "echo"),                      # completions-only in xLLM
    (False, {"top_logprobs": 2}, "top_logprobs"),        # chat-only in xLLM
    (False, {"response_format": {"type": "json_object"}}, "response_format"),
    (True, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    (True, {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    (True, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "u"}}]}]},
     "messages[0].content[1].type"),
    (True, {"service_request_id": "mine"}, "service_request_id"),
    (True, {"guided_json": {"type": "object"}}, "guided_json"),
])
def test_a_field_without_an_xllm_form_is_a_400_naming_it(chat, extra, param) -> None:
    doc = {**(CHAT if chat else {"model": "m", "prompt": [1]}), **extra}
    with pytest.raises(BadRequest) as err:
        check_xllm_fields(doc, chat)
    assert err.value.param == param
    assert err.value.message.startswith(f"{param}: ")
    if param in ("seed", "logit_bias", "suffix", "guided_json"):
        assert "xLLM engines have no such option" in err.value.message


def test_the_dispatcher_refuses_before_sending_anything() -> None:
    reg = Registry(inst(P1))
    disp, engine, rec, in_flight = dispatcher(lambda p: Engine(p), reg)
    with pytest.raises(BadRequest) as err:
        disp.forward(decision(inst(P1)), "/v1/chat/completions", {**CHAT, "seed": 1}, TOKENS)
    assert err.value.param == "seed"
    assert engine.calls == [] and rec.calls == [] and in_flight.snapshot().total(P1) == 0


def test_engine_param_is_the_engines_own_or_the_field_it_names() -> None:
    fields = ("model", "max_tokens", "max_completion_tokens", "n")
    assert engine_param('{"error": {"message": "bad", "param": "top_k"}}', fields) == "top_k"
    assert engine_param('{"param": "n", "message": "x"}', fields) == "n"
    assert engine_param("max_completion_tokens exceeds the context", fields) == \
        "max_completion_tokens"
    assert engine_param("invalid max_tokens: 0", fields) == "max_tokens"
    assert engine_param("no KV blocks left", fields) is None
    assert engine_param("{not json", fields) is None
    assert engine_param("maximum n_tokens", ("n",)) is None   # a word, not a substring


def test_an_engine_error_status_carries_the_field_it_names() -> None:
    """gen_status INVALID_ARGUMENT (3): the answer's ``param`` is the request's field that the
    engine's message names, streamed and not."""
    doc = {"model": "m", "prompt": [1], "max_tokens": 5, "stream": True}
    gen = Generation("sid", status_code=3, status_msg="max_tokens is larger than the model's "
                                                      "context")
    stream = StreamAssembler(answer_spec(False, doc, "sid", 1))
    event = json.loads(stream.feed(gen)[len(b"data: "):])
    assert event["error"]["param"] == "max_tokens"
    assert event["error"]["type"] == "invalid_request_error"
    reg = Registry(inst(P1))
    disp, _, _, _ = dispatcher(lambda q: Engine(q, script=lambda sid: [
        Generation(sid, status_code=3, status_msg="n must be 1 for beam search")]), reg)
    reply = disp.forward(decision(inst(P1)), "/v1/completions",
                         {"model": "m", "prompt": TOKENS, "n": 2}, TOKENS)
    assert reply.status == 400
    assert json.loads(reply.body.read_all())["error"]["param"] == "n"
    whole = WholeAssembler(answer_spec(True, CHAT, "sid", 1))
    assert whole.feed(Generation("sid", status_code=3, status_msg="oops")) is True


def test_a_protobuf_parse_failure_names_the_field() -> None:
    from kvsvc.rpc.engines import BaiduStdCaller

    caller = BaiduStdCaller()
    try:
        with pytest.raises(BadRequest) as err:   # refused before any connection is made
            caller.call("127.0.0.1:1", "Completions", {"model": "m", "max_tokens": -1})
    finally:
        caller.close()
    assert err.value.param == "max_tokens"
    assert "a field has no xLLM form" not in err.value.message
