"""The one heartbeat intake (§9), whatever carried the heartbeat: ``POST
/v1/internal/heartbeat`` (:mod:`kvsvc.http.internal`) or baidu_std
``XllmRpcService.Heartbeat`` from a real xLLM engine (:mod:`kvsvc.rpc.server`, §13).

:meth:`HeartbeatIntake.receive` applies the registry's rules (:meth:`Registry.heartbeat
<kvsvc.cluster.registry.Registry.heartbeat>`: the load is used at once; unknown instance,
stale incarnation and load values out of range are refused and record nothing) and reports
the outcome to the service's :class:`~kvsvc.cluster.rejections.HeartbeatRejections` ledger
(one WARNING per refused sender and reason, one INFO when it is accepted again), so both
transports refuse, record and log the same way. The caller maps the outcome to its answer:
HTTP 200 / 400 / 409 / 503, baidu_std ``Status{ok}`` (``ok: false`` where HTTP answers 4xx or
503).
"""

from __future__ import annotations

import enum
from typing import Optional

from kvsvc.cluster.registry import Registry
from kvsvc.cluster.rejections import HeartbeatRejections, RejectionReason
from kvsvc.errors import InvalidHeartbeat, NoRegistry, StaleIncarnation, UnknownInstance


class HeartbeatOutcome(enum.StrEnum):
    """What became of one heartbeat, over either transport: the ``outcome`` label of
    ``kvsvc_heartbeats_total`` (§9), declared once."""

    OK = "ok"
    MALFORMED = "malformed"
    INVALID_LOAD = "invalid_load"
    UNKNOWN_INSTANCE = "unknown_instance"
    STALE_INCARNATION = "stale_incarnation"
    NO_REGISTRY = "no_registry"
    UNAUTHORIZED = "unauthorized"


class HeartbeatIntake:
    """Heartbeats into the registry and the rejections ledger (module docstring).
    Thread-safe (the registry and the ledger are).

    :param registry: the instance registry, ``None`` without ``--etcd_addr``.
    :param rejections: the service's ledger of refused heartbeats.
    :param namespace: ``--etcd_namespace``, named in the ledger's hint for unknown instances.
    """

    def __init__(self, registry: Optional[Registry], rejections: HeartbeatRejections,
                 namespace: str = "") -> None:
        self.registry = registry
        self.rejections = rejections
        self._unknown_detail = (f"this kvsvc reads --etcd_namespace {namespace!r}" if namespace
                                else "this kvsvc reads no --etcd_namespace")

    def receive(self, name: str, incarnation_id: Optional[str], waiting_requests_num: int,
                gpu_cache_usage_perc: float) -> None:
        """Record one heartbeat's load (§9).

        :param name: the instance ``host:port``.
        :param incarnation_id: the sender's incarnation, ``None``/empty when it sent none.
        :param waiting_requests_num: queued requests (checked by the registry).
        :param gpu_cache_usage_perc: Device KV-cache usage, a fraction (checked there too).
        :raises NoRegistry: no registry configured.
        :raises InvalidHeartbeat: a load value of the wrong type or out of range.
        :raises UnknownInstance: no such instance registered (reported to the ledger).
        :raises StaleIncarnation: another incarnation is registered (reported to the ledger).
        """
        if self.registry is None:
            raise NoRegistry("no instance registry configured (--etcd_addr is empty)")
        try:
            self.registry.heartbeat(name, incarnation_id, waiting_requests_num,
                                    gpu_cache_usage_perc)
        except UnknownInstance:
            self.rejections.rejected(name, RejectionReason.UNKNOWN_INSTANCE,
                                     detail=self._unknown_detail)
            raise
        except StaleIncarnation as exc:
            self.rejections.rejected(name, RejectionReason.STALE_INCARNATION,
                                     detail=f"incarnation {exc.got!r}, registered "
                                            f"{exc.registered!r}")
            raise
        self.rejections.accepted(name)

    def outcome(self, name: str, incarnation_id: Optional[str], waiting_requests_num: int,
                gpu_cache_usage_perc: float) -> HeartbeatOutcome:
        """:meth:`receive`, with the refusal as an outcome instead of an exception."""
        try:
            self.receive(name, incarnation_id, waiting_requests_num, gpu_cache_usage_perc)
        except NoRegistry:
            return HeartbeatOutcome.NO_REGISTRY
        except InvalidHeartbeat:
            return HeartbeatOutcome.INVALID_LOAD
        except UnknownInstance:
            return HeartbeatOutcome.UNKNOWN_INSTANCE
        except StaleIncarnation:
            return HeartbeatOutcome.STALE_INCARNATION
        return HeartbeatOutcome.OK
