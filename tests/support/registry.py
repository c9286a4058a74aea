"""Registry settings of the registry and discovery tests (§9): the grace, probe and removal times
they share (:func:`settings`)."""

from __future__ import annotations

from kvsvc.cluster.model import RegistrySettings

GRACE_S = 0.5
REMOVAL_S = 1.0
PROBE_TIMEOUT_S = 0.3


def settings(addr: str, **kw) -> RegistrySettings:
    base = dict(etcd_addr=addr, namespace="t", relist_interval_s=1.0, lease_lost_grace_s=GRACE_S,
                suspect_removal_s=REMOVAL_S, health_probe_timeout_s=PROBE_TIMEOUT_S,
                loadmetrics_interval_s=0.3, master_lease_ttl_s=1, self_address="svc-a:1")
    base.update(kw)
    return RegistrySettings(**base)
