"""The simulated xLLM engine's Generations sender is shaped as xLLM's (§13): each call carries
one step of every request with unsent entries (the oldest), later steps in later calls, in
order; decode steps do not wait for the answers; a refused entry is reported back."""

from __future__ import annotations

import threading

from kvsvc.routing.answers import GenOutput, Generation
from kvsvc.rpc import messages
from kvsvc.testbed.sim.native import GenerationsPusher, entry_bytes, generations_message


class Client:
    """Records each call's entries (service_req_id, text); refuses ids in ``refuse``."""

    def __init__(self, refuse: frozenset = frozenset()) -> None:
        self.calls: list[tuple[str, list[tuple[str, str]]]] = []
        self.refuse = refuse
        self.done = threading.Event()

    def generations_encoded(self, address: str, entries: list[bytes]) -> list[bool]:
        msg = messages.parse(messages.DisaggStreamGenerations, generations_message(entries))
        got = [(g.service_req_id, g.outputs[0].text) for g in msg.gens]
        self.calls.append((address, got))
        return [sid not in self.refuse for sid, _ in got]


def _gen(sid: str, text: str) -> Generation:
    return Generation(sid, outputs=(GenOutput(0, text, (1,)),))


def test_one_step_of_every_request_per_call_in_order() -> None:
    client = Client(refuse=frozenset({"b"}))
    pusher = GenerationsPusher(client, "e:1")  # type: ignore[arg-type]
    answers: list = []
    done = threading.Semaphore(0)

    def answered(sid: str):
        def cb(ok):
            answers.append((sid, ok))
            done.release()
        return cb

    # Queued before the thread runs: a's three steps, b's one, c's two at another address.
    for sid, text, addr in (("a", "1", "s:1"), ("a", "2", "s:1"), ("b", "1", "s:1"),
                            ("a", "3", "s:1"), ("c", "1", "s:2"), ("c", "2", "s:2")):
        pusher.send(addr, _gen(sid, text), answered(sid))
    pusher.start()
    try:
        for _ in range(6):
            assert done.acquire(timeout=5.0)
    finally:
        pusher.close()
    s1 = [entries for addr, entries in client.calls if addr == "s:1"]
    s2 = [entries for addr, entries in client.calls if addr == "s:2"]
    assert s1 == [[("a", "1"), ("b", "1")], [("a", "2")], [("a", "3")]]
    assert s2 == [[("c", "1")], [("c", "2")]]
    assert ("b", False) in answers and answers.count(("a", True)) == 3
    assert (pusher.calls, pusher.entries) == (5, 6)


def test_generations_message_is_protobufs_bytes() -> None:
    gens = [Generation("s" * i, "r", outputs=(GenOutput(0, "x" * (9 * i), (1,) * i),),
                       finished=i % 2 == 0) for i in range(1, 40)]
    msg = messages.DisaggStreamGenerations()
    from kvsvc.rpc.generations import generation_to_proto
    for g in gens:
        msg.gens.append(generation_to_proto(g, with_status=g.finished))
    assert generations_message([entry_bytes(g) for g in gens]) == messages.serialize(msg)
