"""Generations entries between protobuf and kvsvc's values (§13), on the captured real
frames: every field converts, and converting back gives the engine's bytes."""

from __future__ import annotations

from pathlib import Path

from kvsvc.routing.answers import Generation, GenOutput, GenUsage, LogProbEntry
from kvsvc.rpc import codec, messages
from kvsvc.rpc.generations import generation_from_proto, generation_to_proto

DATA = Path(__file__).resolve().parent.parent / "data" / "brpc"


def captured_entries() -> list:
    raw = bytes.fromhex("".join((DATA / "generations.request.hex").read_text().split()))
    calls = codec.Connection(codec.Role.SERVER).receive_data(raw)
    return [g for c in calls
            for g in messages.parse(messages.DisaggStreamGenerations, c.message).gens]


def test_captured_entries_convert_and_round_trip():
    protos = captured_entries()
    gens = [generation_from_proto(g) for g in protos]
    assert [g.service_req_id for g in gens] == ["svc-1", "svc-2"] * 3
    assert gens[0] == Generation("svc-1", "engine-svc-1",
                                 outputs=(GenOutput(0, "tok0 ", (1000,)),),
                                 finished_on_prefill_instance=True)
    assert gens[3] == Generation("svc-2", "engine-svc-2", outputs=(GenOutput(0, "tok1 ", (1001,)),))
    assert gens[4] == Generation("svc-1", "engine-svc-1", outputs=(GenOutput(finish_reason="stop"),),
                                 usage=GenUsage(8, 2, 10, 0), finished=True)
    for gen, proto in zip(gens, protos):
        back = generation_to_proto(gen, with_status=proto.HasField("gen_status"))
        assert messages.serialize(back) == messages.serialize(proto)


def test_logprobs_and_error_status_round_trip():
    gen = Generation("s", "r", 3, "engine error",
                     (GenOutput(1, "x", (5, 6), "length",
                                (LogProbEntry("x", 5, -0.5, (("y", 7, -1.5),)),)),),
                     GenUsage(1, 2, 3, 4), True)
    wire = messages.serialize(generation_to_proto(gen))
    assert generation_from_proto(messages.parse(messages.DisaggStreamGeneration, wire)) == gen
