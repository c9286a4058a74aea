"""Engines known dead from their closed baidu_std connection (issue 19 item 1,
:mod:`kvsvc.routing.engine_loss`), without sockets: the loss tied to one incarnation, only on
a refusal, logged once, and the exclusion from routing until another incarnation registers.
The probe and the server's report: tests/integration/test_engine_loss.py."""

from __future__ import annotations

import dataclasses
import time
from types import MappingProxyType

from kvsvc.cluster.model import (
    Instance,
    InstanceState,
    InstanceType,
    LoadMetrics,
    RegistrySnapshot,
)
from kvsvc.routing.engine_loss import LostEngines

NAME = "127.0.0.1:9"


def inst(name: str, inc: str = "inc-1") -> Instance:
    return Instance(name=name, type=InstanceType.DEFAULT, role=InstanceType.DEFAULT,
                    incarnation_id=inc, register_ts_ms=None, dp_size=1, backend_type="xllm",
                    rpc_address=name, state=InstanceState.ACTIVE,
                    load=LoadMetrics(0, 0.0, time.monotonic()))


class Snap:
    def __init__(self, *instances: Instance) -> None:
        self.instances = {i.name: i for i in instances}

    def __call__(self) -> RegistrySnapshot:
        return RegistrySnapshot(MappingProxyType(dict(self.instances)), True, True, 1)


def test_a_refusing_engine_is_lost_for_its_incarnation_only(caplog) -> None:
    snap = Snap(inst(NAME), inst("127.0.0.1:10"))
    refusing = {NAME}
    lost = LostEngines(snap, refuses=lambda name: name in refusing, retry_delays_s=())
    with caplog.at_level("WARNING", "kvsvc.routing.engine_loss"):
        assert lost.connection_closed({NAME, "127.0.0.1:10", "127.0.0.1:11"}, "peer:1") == [NAME]
        assert lost.connection_closed({NAME}, "peer:2") == []   # already known: one WARNING
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and NAME in warnings[0] and "peer:1" in warnings[0]
    why = lost.problem(NAME, "inc-1")
    assert why is not None and "died" in why and "refuses connections" in why
    assert lost.problem(NAME) == why                    # the registered incarnation
    assert lost.problem(NAME, "inc-0") is None          # a request of another incarnation
    assert lost.problem("127.0.0.1:10", "inc-1") is None   # its port accepted: not lost
    assert dict(lost.excluded()) == {NAME: why}
    # The engine comes back as a new process: a candidate again, its requests not failed.
    snap.instances[NAME] = dataclasses.replace(snap.instances[NAME], incarnation_id="inc-2")
    assert dict(lost.excluded()) == {}
    assert lost.problem(NAME) is None and lost.problem(NAME, "inc-1") is None


def test_an_unregistered_or_accepting_engine_is_not_lost() -> None:
    probed: list[str] = []
    lost = LostEngines(Snap(inst("127.0.0.1:10")),
                       refuses=lambda name: probed.append(name) or False, retry_delays_s=())
    assert lost.connection_closed({NAME, "127.0.0.1:10"}, "peer") == []
    assert probed == ["127.0.0.1:10"]          # a name the registry does not know: no probe
    assert dict(lost.excluded()) == {}


def test_a_connection_without_heartbeat_probes_the_instances_on_its_host() -> None:
    """Generations may come on a new connection before its first heartbeat: the instances on
    the peer's host are probed, the dead one is lost, the live ones are not."""
    dead, live, other = "10.0.0.1:9000", "10.0.0.1:9001", "10.0.0.2:9000"
    probed: list[str] = []

    def refuses(name: str) -> bool:
        probed.append(name)
        return name == dead
    lost = LostEngines(Snap(inst(dead), inst(live), inst(other)), refuses=refuses,
                       retry_delays_s=())
    assert lost.connection_closed(frozenset(), "10.0.0.1:51000") == [dead]
    assert probed == [dead, live]
    assert set(lost.excluded()) == {dead}


def test_a_port_still_accepting_is_probed_again_before_nothing_is_concluded() -> None:
    """A killed process's kernel may close its connections before its listening socket: the
    first probe accepted, a later one refused is still a loss; a port that keeps accepting
    is probed once per delay and never marked."""
    answers = {NAME: [False, False, True], "127.0.0.1:10": [False] * 10}
    probed: list[str] = []

    def refuses(name: str) -> bool:
        probed.append(name)
        return answers[name].pop(0)
    waits: list[float] = []
    lost = LostEngines(Snap(inst(NAME), inst("127.0.0.1:10")), refuses=refuses,
                       retry_delays_s=(0.1, 0.2, 0.4), sleep=waits.append)
    assert lost.connection_closed({NAME, "127.0.0.1:10"}, "peer") == [NAME]
    assert waits == [0.1, 0.2, 0.4]
    assert probed.count(NAME) == 3 and probed.count("127.0.0.1:10") == 4
    assert set(lost.excluded()) == {NAME}

