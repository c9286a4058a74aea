"""Registry snapshots and stream matches for the routing-policy unit tests (§11): :func:`inst`,
:func:`snap`, :func:`match`, :func:`scores`, :func:`names`, and a fixed ``NOW``. No sockets."""

from __future__ import annotations

from types import MappingProxyType
from typing import Optional

from kvsvc.cluster.model import (
    Instance,
    InstanceState,
    InstanceType,
    LoadMetrics,
    RegistrySnapshot,
)
from kvsvc.streams.state import StreamMatch

D, P, DEC, MIX = InstanceType.DEFAULT, InstanceType.PREFILL, InstanceType.DECODE, InstanceType.MIX
TOKENS = list(range(100))  # 100 input tokens: hit tokens / 100 is the ratio
REPORTED_AT = 1.0  # inst()'s LoadMetrics.received_at
NOW = REPORTED_AT + 4.0  # the requests' time: every inst() load is current (max age 10 s)


def inst(name: str, type_: InstanceType = D, *, role: Optional[InstanceType] = None,
         waiting: int = 0, usage: float = 0.0, dp: int = 1, inc: Optional[str] = None,
         ts: Optional[int] = None, state: InstanceState = InstanceState.ACTIVE,
         load: bool = True) -> Instance:
    return Instance(name=name, type=type_, role=role if role is not None else type_,
                    incarnation_id=inc if inc is not None else (None if ts else f"inc-{name}"),
                    register_ts_ms=ts, dp_size=dp, backend_type="xllm", rpc_address=None,
                    state=state, load=LoadMetrics(waiting, usage, REPORTED_AT) if load else None)


def snap(*instances: Instance) -> RegistrySnapshot:
    return RegistrySnapshot(MappingProxyType({i.name: i for i in instances}), True, False, 1)


def match(name: str, dev: int = 0, host: int = 0, rank: int = 0,
          sync: bool = True) -> StreamMatch:
    return StreamMatch(name, rank, sync, 7 if sync else None, dev, host, 10, 5,
                       None if sync else "no snapshot yet")


def scores(decision) -> dict[tuple[str, str], float]:
    return {(c.side, c.name): c.score for c in decision.candidates}


def names(decisions) -> list[str]:
    return [d.prefill.name for d in decisions]
