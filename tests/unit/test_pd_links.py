"""P/D links of xLLM engines (§13 "PD"), by xllm-service's rules: who is called about whom when
an instance registers or goes, the rollback of a failed registration, and the exclusion of an
instance whose link failed until a later link succeeds."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

from kvsvc.cluster.model import (
    Instance,
    InstanceState,
    InstanceType,
    RegistrySnapshot,
)
from kvsvc.cluster.pd_links import (
    LINK,
    LINK_FAILED,
    UNLINK,
    LinkOp,
    PdLinkRules,
    PdLinks,
    cluster_info,
)

P, D, M, DEF = InstanceType.PREFILL, InstanceType.DECODE, InstanceType.MIX, InstanceType.DEFAULT


def inst(name: str, type_: InstanceType, role: InstanceType | None = None,
         inc: str = "1", backend: str = "xllm") -> Instance:
    return Instance(name=name, type=type_, role=role or type_, incarnation_id=inc,
                    register_ts_ms=None, dp_size=2, backend_type=backend,
                    rpc_address=f"rpc-{name}", state=InstanceState.ACTIVE, load=None)


def ops(found: list[LinkOp]) -> list[tuple[str, str, str]]:
    return [(o.method, o.target, o.peer.name) for o in found]


def test_rules_follow_xllm_service() -> None:
    p1, p2, d1, d2, m1, df = (inst("p1", P), inst("p2", P), inst("d1", D), inst("d2", D),
                              inst("m1", M, P), inst("df", DEF))
    # A new P: every D (and MIX in its decode role) is told about it, on the D's address.
    assert ops(PdLinkRules.link_ops(p1, [d1, d2, p2, df])) == [
        (LINK, "rpc-d1", "p1"), (LINK, "rpc-d2", "p1")]
    # A new D: it is told, on its own address, about every P side (DEFAULT, PREFILL, MIX as P).
    assert ops(PdLinkRules.link_ops(d1, [p1, df, m1, d2])) == [
        (LINK, "rpc-d1", "p1"), (LINK, "rpc-d1", "df"), (LINK, "rpc-d1", "m1")]
    # A new MIX: told about every other instance; DEFAULT: nothing.
    assert ops(PdLinkRules.link_ops(m1, [p1, d1])) == [(LINK, "rpc-m1", "p1"),
                                                       (LINK, "rpc-m1", "d1")]
    assert PdLinkRules.link_ops(df, [p1, d1]) == []
    # Removal: the survivors are told.
    assert ops(PdLinkRules.unlink_ops(p1, [d1, p2])) == [(UNLINK, "rpc-d1", "p1")]
    assert ops(PdLinkRules.unlink_ops(d1, [p1, d2])) == [(UNLINK, "rpc-p1", "d1")]
    assert ops(PdLinkRules.unlink_ops(m1, [p1, d1])) == [(UNLINK, "rpc-p1", "m1"),
                                                         (UNLINK, "rpc-d1", "m1")]


def test_cluster_info_from_the_registration() -> None:
    doc = cluster_info(inst("p1", P), {"cluster_ids": [7, 8], "addrs": ["10.0.0.1"],
                                       "ports": [1234], "kv_split_size": 2})
    assert doc == {"instance_name": "p1", "cluster_ids": [7, 8], "addrs": ["10.0.0.1"],
                   "ports": [1234], "dp_size": 2, "kv_split_size": 2}
    assert cluster_info(inst("p1", P))["kv_split_size"] == 1


class Registry:
    def __init__(self, *instances: Instance) -> None:
        self.instances = {i.name: i for i in instances}

    def snapshot(self) -> RegistrySnapshot:
        return RegistrySnapshot(MappingProxyType(dict(self.instances)), True, True, 1)


class Caller:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []
        self.failing: set[str] = set()

    def __call__(self, op: LinkOp) -> bool:
        self.calls.append((op.method, op.target, op.peer.name))
        return op.target not in self.failing


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_links_register_each_pair_once_and_exclude_a_failed_one_until_it_links() -> None:
    reg = Registry(inst("p1", P), inst("d1", D), inst("v1", P, backend="vllm"))
    caller, clock = Caller(), Clock()
    links = PdLinks(reg.snapshot, caller, retry_s=2.0, clock=clock)
    links.step()
    # d1 (sorted after p1) registers against p1: one call, on d1's address.
    assert caller.calls == [(LINK, "rpc-d1", "p1")]
    assert links.linked() == ("d1", "p1") and links.excluded() == {}
    links.step()
    assert len(caller.calls) == 1   # nothing new: nothing called
    # A second D whose address fails: rolled back (nothing done yet), excluded, retried later.
    caller.failing.add("rpc-d2")
    reg.instances["d2"] = inst("d2", D)
    links.step()
    assert caller.calls[-1] == (LINK, "rpc-d2", "p1")
    assert links.excluded() == {"d2": LINK_FAILED}
    n = len(caller.calls)
    links.step()
    assert len(caller.calls) == n and links.excluded() == {"d2": LINK_FAILED}
    caller.failing.clear()
    clock.now += 2.5
    links.step()
    assert caller.calls[-1] == (LINK, "rpc-d2", "p1")
    assert links.excluded() == {} and links.linked() == ("d1", "d2", "p1")


def test_partial_failure_rolls_back_and_removal_unlinks_the_survivors() -> None:
    reg = Registry(inst("d1", D), inst("d2", D))
    caller = Caller()
    links = PdLinks(reg.snapshot, caller, clock=Clock())
    links.step()
    assert caller.calls == []   # no P yet: the Ds need no link
    caller.failing.add("rpc-d2")
    reg.instances["p1"] = inst("p1", P)
    links.step()
    # p1 is linked on d1, fails on d2: the d1 link is undone and p1 is no candidate.
    assert caller.calls == [(LINK, "rpc-d1", "p1"), (LINK, "rpc-d2", "p1"),
                            (UNLINK, "rpc-d1", "p1")]
    assert links.excluded() == {"p1": LINK_FAILED}
    caller.failing.clear()
    # A new incarnation of p1 is a new registration: tried at once.
    reg.instances["p1"] = inst("p1", P, inc="2")
    links.step()
    assert links.excluded() == {} and "p1" in links.linked()
    caller.calls.clear()
    del reg.instances["p1"]
    links.step()
    assert caller.calls == [(UNLINK, "rpc-d1", "p1"), (UNLINK, "rpc-d2", "p1")]
    assert links.linked() == ("d1", "d2")
    # A replaced D: unlinked from the Ps (none left), then linked anew.
    reg.instances["p2"] = inst("p2", P)
    links.step()
    caller.calls.clear()
    reg.instances["d1"] = dataclasses.replace(reg.instances["d1"], incarnation_id="9")
    links.step()
    assert caller.calls == [(UNLINK, "rpc-p2", "d1"), (LINK, "rpc-d1", "p2")]
