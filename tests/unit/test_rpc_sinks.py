"""The Generations sink registry (§13): unknown ids, refusing and raising sinks answer
``ok: false``; entries convert to and from ``xllm.proto.DisaggStreamGeneration``."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsvc.rpc import codec, messages
from kvsvc.rpc.sinks import (Generation, GenerationSinks, LogProb, OutputUsage, SequenceOutput,
                             TokenLogProb)


DATA = Path(__file__).resolve().parent.parent / "data" / "brpc"


def frames(name: str, direction: str) -> bytes:
    return bytes.fromhex("".join((DATA / f"{name}.{direction}.hex").read_text().split()))


class Collect:
    def __init__(self, ok: bool = True) -> None:
        self.ok = ok
        self.got: list[Generation] = []

    def on_generation(self, generation: Generation) -> bool:
        self.got.append(generation)
        return self.ok


class Raises:
    def on_generation(self, generation: Generation) -> bool:
        raise RuntimeError("bug")


def test_deliver_routes_by_service_req_id():
    sinks = GenerationSinks()
    a, b = Collect(), Collect(ok=False)
    sinks.register("a", a)
    sinks.register("b", b)
    sinks.register("c", Raises())
    assert len(sinks) == 3 and "a" in sinks
    assert sinks.deliver(Generation("a")) is True
    assert sinks.deliver(Generation("b")) is False          # client gone
    assert sinks.deliver(Generation("c")) is False          # sink bug
    assert sinks.deliver(Generation("zzz")) is False        # unknown
    assert sinks.deliver(Generation("")) is False           # xllm-service rejects it
    assert [g.service_req_id for g in a.got] == ["a"] and len(b.got) == 1
    sinks.unregister("a")
    sinks.unregister("a")
    assert sinks.deliver(Generation("a")) is False and len(a.got) == 1
    with pytest.raises(ValueError, match="already registered"):
        sinks.register("b", Collect())
    with pytest.raises(ValueError, match="empty"):
        sinks.register("", Collect())


def test_captured_entries_convert_and_round_trip():
    requests = codec.Connection(codec.Role.SERVER).receive_data(
        frames("generations", "request"))
    gens = [Generation.from_proto(g) for r in requests
            for g in messages.parse(messages.DisaggStreamGenerations, r.message).gens]
    assert [g.service_req_id for g in gens] == ["svc-1", "svc-2"] * 3
    first, last = gens[0], gens[4]
    assert first == Generation("svc-1", "engine-svc-1",
                               outputs=(SequenceOutput(0, "tok0 ", (1000,)),),
                               finished_on_prefill_instance=True)
    assert last == Generation("svc-1", "engine-svc-1", has_status=True,
                              outputs=(SequenceOutput(finish_reason="stop"),),
                              usage=OutputUsage(8, 2, 10, 0), finished=True)
    for g, r in zip(gens, [g for r in requests for g in
                           messages.parse(messages.DisaggStreamGenerations, r.message).gens]):
        assert messages.serialize(g.to_proto()) == messages.serialize(r)


def test_logprobs_and_error_status_round_trip():
    g = Generation("s", "r", status_code=3, status_msg="engine error", has_status=True,
                   outputs=(SequenceOutput(1, "x", (5, 6), "length", (
                       LogProb(TokenLogProb("x", 5, -0.5), (TokenLogProb("y", 7, -1.5),)),)),),
                   usage=OutputUsage(1, 2, 3, 4), finished=True)
    assert Generation.from_proto(messages.parse(
        messages.DisaggStreamGeneration, messages.serialize(g.to_proto()))) == g
