"""Registry snapshots (§9) built in memory for the discovery planner's tests: :func:`inst`,
:func:`snap`, :func:`plan`, :class:`SnapshotSource` (a settable registry source) and :func:`ids`."""

from __future__ import annotations

import threading
from types import MappingProxyType
from typing import Optional

from kvsvc.cluster.discovery import Plan, plan_streams
from kvsvc.cluster.model import Instance, InstanceState, InstanceType, RegistrySnapshot
from kvsvc.config import DiscoveryConfig, KvEventsConfig

T = InstanceType
S = InstanceState
DISC = DiscoveryConfig(block_size=4, topic="kv", event_port_offset=10000,
                       replay_port_offset=30000, refresh_interval_ms=50)
LIMITS = KvEventsConfig(discovery=DISC)


def inst(name: str, type_: T = T.DEFAULT, *, role: Optional[T] = None, dp: int = 1,
         inc: Optional[str] = "inc-1", ts: Optional[int] = 1000, backend: str = "xllm",
         state: S = S.ACTIVE) -> Instance:
    return Instance(name=name, type=type_, role=type_ if role is None else role,
                    incarnation_id=inc, register_ts_ms=ts, dp_size=dp, backend_type=backend,
                    rpc_address=name, state=state, load=None)


def snap(*instances: Instance, generation: int = 1) -> RegistrySnapshot:
    return RegistrySnapshot(MappingProxyType({i.name: i for i in instances}), True, True,
                            generation)


def plan(*instances: Instance, limits: KvEventsConfig = LIMITS,
         disc: DiscoveryConfig = DISC) -> Plan:
    return plan_streams(snap(*instances), disc, limits)


def ids(p: Plan) -> list[tuple[str, int]]:
    return [(sid.instance_name, sid.dp_rank) for sid in sorted(p.streams)]


class SnapshotSource:
    """Holds the registry snapshot discovery reads (discovery only calls ``snapshot()``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._snap = snap()

    def set(self, *instances: Instance) -> None:
        with self._lock:
            self._snap = snap(*instances, generation=self._snap.generation + 1)

    def snapshot(self) -> RegistrySnapshot:
        with self._lock:
            return self._snap
