"""Master election and LOADMETRICS (§9) between Registry replicas on a real etcd: election,
the master's LOADMETRICS writes and deletes, a non-master reading loads, graceful hand-over and
failover after the master process is killed (measured), and the election thread's start/close
contract (close() raises while the thread hangs on a paused etcd)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from types import MappingProxyType

import pytest

from kvsvc.cluster.election import MasterElection
from kvsvc.cluster.etcd import EtcdClient
from kvsvc.cluster.model import RegistrySettings, RegistrySnapshot
from kvsvc.cluster.registry import Registry
from kvsvc.errors import LifecycleError
from tests.support.util import free_port, wait_for

TTL_S = 1
REFRESH_S = TTL_S / 3


def settings(addr: str, me: str, **kw) -> RegistrySettings:
    base = dict(etcd_addr=addr, relist_interval_s=1.0, lease_lost_grace_s=0.5,
                suspect_removal_s=0.5, health_probe_timeout_s=0.3, loadmetrics_interval_s=0.3,
                master_lease_ttl_s=TTL_S, self_address=me)
    base.update(kw)
    return RegistrySettings(**base)


def master_value(etcd: EtcdClient):
    kv = etcd.get("XLLM:SERVICE:MASTER")
    return kv.value.decode() if kv else None


def test_election_loadmetrics_and_non_master_reads(etcd_server, etcd):
    a = Registry(settings(etcd_server.addr, "10.1.0.1:9000"))
    b = Registry(settings(etcd_server.addr, "10.1.0.2:9000"))
    a.start()
    try:
        a.wait_for(lambda s: s.is_master, 5)
        b.start()
        wait_for(lambda: b.master_address == "10.1.0.1:9000", 5, what="b sees a as master")
        assert (a.snapshot().is_master, b.snapshot().is_master) == (True, False)
        assert master_value(etcd) == "10.1.0.1:9000"

        name = "10.0.0.1:8000"
        gone = f"127.0.0.1:{free_port()}"     # nothing listens: its probe fails
        for n in (name, gone):
            etcd.put(f"XLLM:PREFILL:{n}", json.dumps({"name": n, "type": 1,
                                                      "incarnation_id": "i"}))
        for r in (a, b):
            r.wait_for(lambda s: name in s.instances and gone in s.instances, 5)
        a.heartbeat(name, "i", 6, 0.75)
        a.heartbeat(gone, "i", 1, 0.5)
        assert a.snapshot().instances[name].load.waiting_requests_num == 6   # at once
        wait_for(lambda: etcd.get(f"XLLM:LOADMETRICS:{name}"), 5, what="LOADMETRICS written")
        assert json.loads(etcd.get(f"XLLM:LOADMETRICS:{name}").value) == {
            "waiting_requests_num": 6, "gpu_cache_usage_perc": 0.75}
        snap = b.wait_for(lambda s: s.instances[name].load is not None, 5)
        load = snap.instances[name].load
        assert (load.waiting_requests_num, load.gpu_cache_usage_perc) == (6, 0.75)

        # A new load is written and read again.
        a.heartbeat(name, "i", 2, 0.125)
        snap = b.wait_for(lambda s: s.instances[name].load.waiting_requests_num == 2, 5)
        assert snap.instances[name].load.gpu_cache_usage_perc == 0.125

        # A removed instance's LOADMETRICS key is deleted by the master.
        wait_for(lambda: etcd.get(f"XLLM:LOADMETRICS:{gone}"), 5, what="gone's load written")
        etcd.delete(f"XLLM:PREFILL:{gone}")
        a.wait_for(lambda s: gone not in s.instances, 5)
        wait_for(lambda: etcd.get(f"XLLM:LOADMETRICS:{gone}") is None, 5,
                 what="gone's LOADMETRICS deleted")
        assert etcd.get(f"XLLM:LOADMETRICS:{name}") is not None

        # Graceful hand-over: closing the master revokes its lease.
        t0 = time.monotonic()
        a.close()
        b.wait_for(lambda s: s.is_master, 5)
        handover = time.monotonic() - t0
        print(f"graceful hand-over {handover:.3f}s (refresh {REFRESH_S:.3f}s)")
        assert handover <= REFRESH_S + 0.5
        assert master_value(etcd) == "10.1.0.2:9000"
    finally:
        a.close()
        b.close()
    assert master_value(etcd) is None    # b resigned on close


_CHILD = """
import sys, threading
from kvsvc.cluster.model import RegistrySettings
from kvsvc.cluster.registry import Registry
reg = Registry(RegistrySettings(etcd_addr=sys.argv[1], self_address="child:1",
                                master_lease_ttl_s={ttl}, relist_interval_s=1.0))
reg.start()
reg.wait_for(lambda s: s.is_master, 10)
print("master", flush=True)
threading.Event().wait(60)
"""


def test_failover_after_master_killed(etcd_server, etcd):
    child = subprocess.Popen([sys.executable, "-c", _CHILD.format(ttl=TTL_S), etcd_server.addr],
                             stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": os.getcwd()})
    b = None
    try:
        line = child.stdout.readline()
        assert line == b"master\n"
        assert master_value(etcd) == "child:1"
        b = Registry(settings(etcd_server.addr, "10.1.0.2:9000"))
        b.start()
        wait_for(lambda: b.master_address == "child:1", 5, what="b sees the child as master")
        assert b.snapshot().is_master is False
        child.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        child.wait(5)
        b.wait_for(lambda s: s.is_master, 10)
        failover = time.monotonic() - t0
        print(f"failover after SIGKILL {failover:.3f}s (lease TTL {TTL_S}s, refresh "
              f"{REFRESH_S:.3f}s; etcd's minimum lease TTL and 0.5 s expiry check apply)")
        # One TTL plus one refresh, plus etcd's own lease granularity (minimum TTL is rounded
        # up from 1.5 s, expiry checked every 0.5 s).
        assert failover <= 2.0 + REFRESH_S + 0.5 + 0.2
        assert master_value(etcd) == "10.1.0.2:9000"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(5)
        child.stdout.close()
        if b is not None:
            b.close()


EMPTY = RegistrySnapshot(MappingProxyType({}), True, False, 0)


@pytest.mark.etcd_fresh
def test_election_start_close_contract_and_close_raises_while_etcd_hangs(etcd_server, etcd):
    changes: list[bool] = []
    # TTL 3 s: every election request times out after 1 s.
    election = MasterElection(settings(etcd_server.addr, "10.1.0.1:9000", master_lease_ttl_s=3),
                              lambda: EMPTY, changes.append)
    election.close()                 # never started: nothing to do
    assert not election.running
    election.start()
    try:
        with pytest.raises(LifecycleError, match="kvsvc-election: already started"):
            election.start()
        wait_for(lambda: election.is_master, 5, what="mastership")
        assert master_value(etcd) == "10.1.0.1:9000"
        with etcd_server.paused():
            # Its teardown revokes the lease; with etcd stopped that request hangs.
            with pytest.raises(LifecycleError, match="kvsvc-election: did not stop"):
                election.close(timeout_s=0.3)
            assert election.running
    finally:
        election.close(timeout_s=5.0)
    assert not election.running
    assert changes == [True, False] and election.is_master is False
    election.close()                 # closed already: nothing to do
