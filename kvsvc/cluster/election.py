"""Master election among kvsvc replicas and the master's ``XLLM:LOADMETRICS`` writes (§9).

The master holds ``XLLM:SERVICE:MASTER`` under a lease of
``master_lease_ttl_s``. Every refresh period (``ttl / 3``) the election thread either keeps the
lease alive (master) or tries a put-if-absent of the key under its own lease (candidate). When
the master dies, etcd deletes the key when its lease expires (at most one TTL after the last
keep-alive) and a candidate creates it at its next attempt: failover takes at most one TTL plus
one refresh period. A master that has had no successful keep-alive for a whole TTL stops
claiming mastership (another replica may hold the key by then). ``close()`` revokes the lease
on the election thread, so a graceful hand-over takes one refresh.

The key's value is ``self_address``: the replica's baidu_std ``ip:port`` when it serves
``XllmRpcService`` (§13: an xLLM engine heartbeats and pushes Generations there, and exits on
any other form), else its HTTP ``host:port`` (HTTP heartbeats, §9). With a baidu_std address
(``service_address``) every replica, master or not, also keeps ``XLLM:SERVICE:<ip:port>`` →
``ip:port`` under the same lease, as xllm-service does: engines connect to every replica, so
Generations reach the one that dispatched the request. It is put again whenever the lease is
new and disappears with it. The master also writes its HTTP ``host:port`` (``http_address``)
to kvsvc's own ``KVSVC:SERVICE:MASTER:HTTP`` under the master lease: the address of ``POST
/v1/internal/heartbeat`` for senders that find the master in etcd (the simulated engine; the
master key names the baidu_std port then).

While master, the same thread writes ``XLLM:LOADMETRICS:<name>`` →
``{"waiting_requests_num": int, "gpu_cache_usage_perc": float}`` every ``loadmetrics_interval_s``
for each instance whose load changed since the last write (xllm-service's
``upload_load_metrics``), with two rules of kvsvc's so that no process ever inherits a stale
value (§11, D23 in docs/decisions.md; xllm-service writes without a lease and keeps every
value):

- the keys are written under the **master's lease**: they disappear with the master (at once on
  a graceful close, which revokes the lease; one TTL after a crash), so a replica or master
  started later never reads a dead master's last loads as new reports;
- only a **current** load is written (``max_load_age_s``,
  :meth:`~kvsvc.cluster.model.LoadMetrics.is_current`); the key of an instance whose load is no longer current (no heartbeat accepted within
  ``max_load_age_s``, every heartbeat refused, or none since this replica became master) is
  deleted, like the key of an instance no longer in the registry.

A replica reading the keys dates each new revision when it receives it and ages it by the same
rule; the master itself routes only on heartbeats it accepted (the registry drops the values it
read from etcd when this replica becomes master).

Thread: ``kvsvc-election``, a :class:`~kvsvc.lifecycle.BackgroundThread` (the one start/close
contract). It owns its :class:`~kvsvc.cluster.etcd.EtcdClient` (built in its setup, closed in
its teardown after the lease is revoked). etcd errors are retried at the next turn; etcd being
unreachable is logged by the :class:`~kvsvc.cluster.etcd.EtcdReachability` shared with the
registry (one line per outage, not one per turn), other etcd errors here.

Errors: :class:`~kvsvc.errors.LifecycleError` from ``start()`` (already started, not running in
time) and ``close()`` (the thread, e.g. blocked on an etcd request or the revoke, did not stop
in time).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Callable, Optional

from kvsvc.cluster.etcd import EtcdClient, EtcdReachability
from kvsvc.cluster.model import RegistrySettings, RegistrySnapshot
from kvsvc.errors import EtcdError, EtcdUnavailable
from kvsvc.lifecycle import BackgroundThread

log = logging.getLogger(__name__)

MASTER_KEY = "XLLM:SERVICE:MASTER"
#: Prefix of every replica's own key, ``XLLM:SERVICE:<ip:port>`` (§13).
SERVICE_PREFIX = "XLLM:SERVICE:"
#: The master's HTTP ``host:port`` for HTTP heartbeat senders (kvsvc's own key, outside the
#: ``XLLM:SERVICE:`` prefix that engines connect to).
MASTER_HTTP_KEY = "KVSVC:SERVICE:MASTER:HTTP"
LOADMETRICS_PREFIX = "XLLM:LOADMETRICS:"


class MasterElection(BackgroundThread):
    """The election thread ``kvsvc-election`` (owned by
    :class:`kvsvc.cluster.registry.Registry`); see the module docstring for the rules.

    :param settings: ``etcd_addr``, ``namespace``, ``master_lease_ttl_s`` (whole seconds),
        ``loadmetrics_interval_s``, ``self_address``.
    :param get_snapshot: returns the registry's current snapshot (for the loads to write).
    :param on_change: called with the new ``is_master`` value (on the election thread) each
        time mastership is won or lost, the loss on close included; it runs after
        :attr:`is_master` changed.
    :param reachability: the etcd reachability tracker shared with the registry; ``None``: one
        of its own.
    """

    def __init__(self, settings: RegistrySettings,
                 get_snapshot: Callable[[], RegistrySnapshot],
                 on_change: Callable[[bool], None],
                 reachability: Optional[EtcdReachability] = None) -> None:
        super().__init__("kvsvc-election")
        self._settings = settings
        self._reachability = reachability or EtcdReachability(settings.etcd_addr)
        self._get_snapshot = get_snapshot
        self._on_change = on_change
        self._prefix = settings.key_prefix
        self._master_key = self._prefix + MASTER_KEY
        self._refresh_s = max(0.1, settings.master_lease_ttl_s / 3.0)
        self._is_master = False
        self._master_address: Optional[str] = None
        # Election thread only: its etcd client and the lease state.
        self._client: Optional[EtcdClient] = None
        self._lease_id: Optional[int] = None
        self._service_key_lease: Optional[int] = None  # lease XLLM:SERVICE:<addr> was put under
        self._last_keepalive = 0.0
        # name -> received_at of the load last written; names whose key exists in etcd.
        self._written: dict[str, float] = {}
        self._next_loads = 0.0

    @property
    def is_master(self) -> bool:
        """True while this process holds the master key (as of the last refresh)."""
        return self._is_master

    @property
    def master_address(self) -> Optional[str]:
        """The current master's address as last read from etcd (ours when master), or None."""
        return self._master_address

    @property
    def refresh_s(self) -> float:
        """Seconds between two election turns (``master_lease_ttl_s / 3``)."""
        return self._refresh_s

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the election thread; returns once it runs (its first turn may still be going).

        :param timeout_s: bound of the wait for the thread to run, seconds.
        :raises LifecycleError: already started, or the thread did not run within
            ``timeout_s``.
        """
        super().start(timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread: it revokes its lease (releasing mastership at once), reports the
        loss through ``on_change`` and closes its etcd client. Idempotent; a no-op before
        :meth:`start`.

        :param timeout_s: join bound, seconds.
        :raises LifecycleError: the thread did not stop within ``timeout_s`` (an etcd request
            or the revoke still blocked; it finishes its teardown when that request ends).
        """
        super().close(timeout_s)

    # -- election thread ------------------------------------------------------------------

    def _setup(self) -> None:
        # Short per-request timeout: one turn must fit in a refresh period, or a live master
        # could miss its keep-alive window.
        self._client = EtcdClient(self._settings.etcd_addr, timeout_s=min(1.0, self._refresh_s),
                                  reachability=self._reachability)

    def _loop(self) -> None:
        client = self._client
        assert client is not None
        while not self.stopping:
            started = time.monotonic()
            self._turn(client)
            self._sleep(self._refresh_s - (time.monotonic() - started))

    def _teardown(self) -> None:
        client, self._client = self._client, None
        if client is None:
            return
        try:
            self._resign(client)
        finally:
            client.close()

    def _turn(self, client: EtcdClient) -> None:
        now = time.monotonic()
        try:
            if self._is_master:
                self._keep(client, now)
            else:
                self._campaign(client, now)
            if self._is_master and now >= self._next_loads:
                self._write_loads(client, now)
                self._next_loads = now + self._settings.loadmetrics_interval_s
        except EtcdError as exc:
            if isinstance(exc, EtcdUnavailable):
                log.debug("election: %s", exc)   # the reachability tracker logs the outage
            else:
                log.warning("election: etcd error: %s", exc)
            # Without a successful keep-alive for a whole TTL the lease has surely expired in
            # etcd and another replica may hold the key: stop claiming mastership.
            if self._is_master and now - self._last_keepalive >= self._settings.master_lease_ttl_s:
                self._lease_id = None
                self._set_master(False, None, "no keep-alive for a whole lease TTL")

    def _keep(self, client: EtcdClient, now: float) -> None:
        assert self._lease_id is not None
        ttl = client.keepalive(self._lease_id)
        if ttl <= 0:
            self._lease_id = None
            self._set_master(False, None, "master lease expired")
            return
        self._last_keepalive = now
        current = client.get(self._master_key)
        if current is None or current.lease != self._lease_id:
            # Deleted by hand or taken over: the key, not the lease, says who is master.
            holder = current.value.decode("utf-8", "replace") if current else None
            self._set_master(False, holder, "master key no longer held by our lease")

    def _campaign(self, client: EtcdClient, now: float) -> None:
        if self._lease_id is not None and client.keepalive(self._lease_id) <= 0:
            self._lease_id = None
        if self._lease_id is None:
            self._lease_id = client.grant_lease(self._settings.master_lease_ttl_s)
        self._last_keepalive = now
        self._put_service_key(client)
        if client.create(self._master_key, self._settings.self_address, self._lease_id):
            if self._settings.http_address:
                client.put(self._prefix + MASTER_HTTP_KEY, self._settings.http_address,
                           lease_id=self._lease_id)
            self._written.clear()
            # Learn which LOADMETRICS keys exist, so those of instances gone meanwhile are
            # deleted by the first write.
            listed = client.list_prefix(self._prefix + LOADMETRICS_PREFIX)
            for kv in listed.kvs:
                self._written[kv.key[len(self._prefix + LOADMETRICS_PREFIX):]] = -1.0
            self._next_loads = 0.0
            self._set_master(True, self._settings.self_address, "created the master key")
            return
        current = client.get(self._master_key)
        holder = current.value.decode("utf-8", "replace") if current else None
        if holder != self._master_address:
            log.info("election: master is %s", holder)
            self._master_address = holder

    def _put_service_key(self, client: EtcdClient) -> None:
        """``XLLM:SERVICE:<ip:port>`` under the current lease, once per lease (module
        docstring)."""
        address = self._settings.service_address
        if not address or self._lease_id is None or self._service_key_lease == self._lease_id:
            return
        client.put(self._prefix + SERVICE_PREFIX + address, address, lease_id=self._lease_id)
        self._service_key_lease = self._lease_id
        log.info("election: %s%s kept under lease %x", SERVICE_PREFIX, address, self._lease_id)

    def _set_master(self, is_master: bool, holder: Optional[str], why: str) -> None:
        self._master_address = holder
        if is_master == self._is_master:
            return
        self._is_master = is_master
        log.info("election: %s is %s master (%s)", self._settings.self_address or "this service",
                 "now" if is_master else "no longer", why)
        self._on_change(is_master)

    def _write_loads(self, client: EtcdClient, now: float) -> None:
        """Write the current loads that changed under the master lease, delete the keys of
        instances without a current load or gone (module docstring).

        :param now: ``time.monotonic()`` seconds of this turn.
        """
        snapshot = self._get_snapshot()
        prefix = self._prefix + LOADMETRICS_PREFIX
        max_age = self._settings.max_load_age_s
        for name, inst in snapshot.instances.items():
            load = inst.load
            if load is None or not load.is_current(now, max_age):
                if name in self._written:
                    client.delete(prefix + name)
                    del self._written[name]
                continue
            if self._written.get(name) == load.received_at:
                continue
            value = json.dumps({"waiting_requests_num": load.waiting_requests_num,
                                "gpu_cache_usage_perc": load.gpu_cache_usage_perc})
            client.put(prefix + name, value, lease_id=self._lease_id)
            self._written[name] = load.received_at
        for name in [n for n in self._written if n not in snapshot.instances]:
            client.delete(prefix + name)
            del self._written[name]

    def _resign(self, client: EtcdClient) -> None:
        lease_id, self._lease_id = self._lease_id, None
        if lease_id is not None:
            try:
                client.revoke(lease_id)
            except EtcdError as exc:
                log.warning("election: could not revoke lease on close: %s", exc)
        self._set_master(False, None, "closed")
