"""P/D links of xLLM engines (§13 "PD"): as an instance registers, the service tells the
engines of the other side about it, as xllm-service does (``InstanceMgr::register_instance`` /
``deregister_instance``, ``gather_link_operations``, ``gather_unlink_operations``,
``run_link_operations`` in ``scheduler/managers/instance_mgr.cpp`` @73d5e00).

The rules (:class:`PdLinkRules`, no I/O; the ops of one instance, in order):

- a new **PREFILL** instance X: ``LinkInstance`` on every linked D's ``rpc_address``, peer X;
- a new **DECODE** instance X: ``LinkInstance`` on X's ``rpc_address``, peer every linked P
  (DEFAULT, PREFILL, and MIX in its prefill role: xllm-service's prefill index);
- a new **MIX** instance X: ``LinkInstance`` on X's ``rpc_address``, peer every other linked
  instance; a **DEFAULT** instance needs no link;
- when one of X's calls fails, the calls already made for X are undone (``UnlinkInstance``,
  same target and peer) and X is **no candidate** (:meth:`PdLinks.excluded`) until a later
  attempt (every ``retry_s``) links it; an instance not linked yet is no candidate either;
- a removed instance X (gone from the registry, or replaced by a new incarnation, which then
  registers as new): ``UnlinkInstance`` to the survivors: PREFILL X on every linked D's
  ``rpc_address``, DECODE X on every linked P's, MIX X on every other linked instance's, peer X
  each time (xllm-service's order; a DECODE's own address is not called: it is gone).

A call is brpc's HTTP+JSON form of ``xllm.proto.DisaggPDService``: ``POST
http://<rpc_address>/xllm.proto.DisaggPDService/LinkInstance`` (or ``UnlinkInstance``) with
the JSON of the peer's ``InstanceClusterInfo`` (``instance_name``, ``cluster_ids``, ``addrs``,
``ports``, ``dp_size``, ``kv_split_size``: from its registration); success is a 2xx answer
whose ``xllm.proto.Status`` has ``ok`` true. (§13 says "the peer's InstanceMetaInfo";
xllm-service sends these ``InstanceClusterInfo`` fields of it, which is what the engine's
method takes.)

Only instances of ``backend_type`` ``"xllm"`` are linked. Every replica links, as every
xllm-service replica's ``InstanceMgr`` does. The calls run on :class:`PdLinks`'s own thread,
never on a request thread; request threads read :meth:`PdLinks.excluded` (a copy under a
lock).

Errors: none raised from the thread (failures are logged once per state change and retried);
:class:`~kvsvc.errors.LifecycleError` from :meth:`PdLinks.start` / :meth:`PdLinks.close`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

import requests

from kvsvc.cluster.model import Instance, InstanceType, RegistrySnapshot
from kvsvc.lifecycle import BackgroundThread

log = logging.getLogger(__name__)

PD_SERVICE = "xllm.proto.DisaggPDService"
LINK = "LinkInstance"
UNLINK = "UnlinkInstance"
#: Why an instance is no candidate (:meth:`PdLinks.excluded`).
LINK_FAILED = "P/D link failed"


@dataclass(frozen=True, slots=True)
class LinkOp:
    """One call: ``method`` on ``target`` (an ``rpc_address``) about ``peer``.

    :ivar method: :data:`LINK` or :data:`UNLINK`.
    :ivar target: the engine called, its ``rpc_address`` (``host:port``).
    :ivar peer: the instance it is told about.
    """

    method: str
    target: str
    peer: Instance


def _is_p(inst: Instance) -> bool:
    """In xllm-service's prefill index: DEFAULT, PREFILL, MIX in its prefill role."""
    return inst.type in (InstanceType.DEFAULT, InstanceType.PREFILL) or (
        inst.type is InstanceType.MIX and inst.role is not InstanceType.DECODE)


def _is_d(inst: Instance) -> bool:
    """In xllm-service's decode index: DECODE, MIX in its decode role."""
    return inst.type is InstanceType.DECODE or (
        inst.type is InstanceType.MIX and inst.role is InstanceType.DECODE)


def _rpc(inst: Instance) -> str:
    return inst.rpc_address or inst.name


class PdLinkRules:
    """The ops of the module docstring, from the instances already linked (pure)."""

    @staticmethod
    def link_ops(new: Instance, linked: Sequence[Instance]) -> list[LinkOp]:
        """The ``LinkInstance`` calls that register ``new`` against ``linked`` (in order)."""
        peers = [i for i in linked if i.name != new.name]
        if new.type is InstanceType.PREFILL:
            return [LinkOp(LINK, _rpc(d), new) for d in peers if _is_d(d)]
        if new.type is InstanceType.DECODE:
            return [LinkOp(LINK, _rpc(new), p) for p in peers if _is_p(p)]
        if new.type is InstanceType.MIX:
            return [LinkOp(LINK, _rpc(new), p) for p in peers]
        return []

    @staticmethod
    def unlink_ops(gone: Instance, linked: Sequence[Instance]) -> list[LinkOp]:
        """The ``UnlinkInstance`` calls that deregister ``gone`` from the survivors."""
        peers = [i for i in linked if i.name != gone.name]
        if gone.type is InstanceType.PREFILL:
            return [LinkOp(UNLINK, _rpc(d), gone) for d in peers if _is_d(d)]
        if gone.type is InstanceType.DECODE:
            return [LinkOp(UNLINK, _rpc(p), gone) for p in peers if _is_p(p)]
        if gone.type is InstanceType.MIX:
            return [LinkOp(UNLINK, _rpc(p), gone) for p in peers]
        return []

    @staticmethod
    def rollback(done: Sequence[LinkOp]) -> list[LinkOp]:
        """The ``UnlinkInstance`` calls undoing the ``LinkInstance`` calls ``done``."""
        return [LinkOp(UNLINK, op.target, op.peer) for op in done]


def cluster_info(inst: Instance, registration: Optional[Mapping[str, Any]] = None) -> dict:
    """The JSON of ``inst``'s ``xllm.proto.InstanceClusterInfo``: ``instance_name``, and
    ``cluster_ids``, ``addrs``, ``ports``, ``kv_split_size`` from its registration JSON (or the
    :class:`Instance` attributes of those names; absent: empty, ``kv_split_size`` 1),
    ``dp_size``."""
    reg = registration or {}

    def pick(name: str, default: Any) -> Any:
        value = reg.get(name, getattr(inst, name, default))
        return list(value) if isinstance(value, (list, tuple)) else value

    return {"instance_name": inst.name, "cluster_ids": pick("cluster_ids", ()),
            "addrs": pick("addrs", ()), "ports": pick("ports", ()),
            "dp_size": reg.get("dp_size") or inst.dp_size,
            "kv_split_size": pick("kv_split_size", 1)}


def registration_fields(reg: Any) -> Optional[dict]:
    """The PD fields of a :class:`~kvsvc.cluster.model.Registration` for :func:`cluster_info`
    (``dp_size`` as registered), ``None`` for ``None``."""
    if reg is None:
        return None
    return {"cluster_ids": list(reg.cluster_ids), "addrs": list(reg.addrs),
            "ports": list(reg.ports), "kv_split_size": reg.kv_split_size,
            "dp_size": getattr(reg, "registered_dp_size", 0) or reg.dp_size}


class LinkCaller(Protocol):
    """Makes one :class:`LinkOp` call; True when the engine answered ``ok: true``."""

    def __call__(self, op: LinkOp) -> bool: ...


class HttpLinkCaller:
    """:class:`LinkCaller` over brpc's HTTP+JSON form (module docstring). Used by the link
    thread only.

    :param timeout_s: bound of one call (connect and answer), seconds.
    :param registration: the registration JSON of an instance name (the PD fields), ``None``
        when unknown.
    """

    def __init__(self, timeout_s: float = 3.0,
                 registration: Callable[[str], Optional[Mapping[str, Any]]] = lambda n: None
                 ) -> None:
        self._timeout_s = timeout_s
        self._registration = registration
        self._session = requests.Session()
        self._session.trust_env = False

    def __call__(self, op: LinkOp) -> bool:
        url = f"http://{op.target}/{PD_SERVICE}/{op.method}"
        body = cluster_info(op.peer, self._registration(op.peer.name))
        try:
            resp = self._session.post(url, data=json.dumps(body), timeout=self._timeout_s,
                                      headers={"Content-Type": "application/json"})
        except requests.RequestException as exc:
            log.debug("%s %s (peer %s) failed: %s", op.method, op.target, op.peer.name, exc)
            return False
        with resp:
            if not 200 <= resp.status_code < 300:
                return False
            try:
                doc = resp.json()
            except ValueError:
                return False
        return isinstance(doc, dict) and doc.get("ok") is True

    def close(self) -> None:
        """Close the session."""
        self._session.close()


class PdLinks(BackgroundThread):
    """Keeps the P/D links of the registry's xLLM instances (module docstring) on the thread
    ``kvsvc-pd-links``.

    :param snapshot: the registry's current snapshot.
    :param caller: makes the calls (on this thread).
    :param interval_s: period of the registry reads, seconds.
    :param retry_s: an instance whose link failed is tried again after this long, seconds.
    :param clock: monotonic seconds of the retry rule (the service's clock, :mod:`kvsvc.clock`).
    """

    def __init__(self, snapshot: Callable[[], RegistrySnapshot], caller: LinkCaller,
                 interval_s: float = 0.5, retry_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__("kvsvc-pd-links")
        self._snapshot = snapshot
        self._caller = caller
        self._interval_s = interval_s
        self._retry_s = retry_s
        self._clock = clock
        self._lock = threading.Lock()
        # Thread-only state: name -> the instance as linked; name -> (incarnation, retry at).
        self._linked: dict[str, Instance] = {}
        self._failed: dict[str, tuple[Optional[str], float]] = {}
        self._excluded: Mapping[str, str] = MappingProxyType({})
        self._linked_names: tuple[str, ...] = ()
        self.calls = 0

    def excluded(self) -> Mapping[str, str]:
        """Instance name -> why it is no candidate (:data:`LINK_FAILED`); an immutable
        mapping replaced after each pass."""
        with self._lock:
            return self._excluded

    def linked(self) -> tuple[str, ...]:
        """Names of the instances linked after the last pass (sorted)."""
        with self._lock:
            return self._linked_names

    def _loop(self) -> None:
        while not self.stopping:
            try:
                self.step()
            except Exception:  # noqa: BLE001 - one bad pass must not end the links
                log.exception("P/D links: pass failed")
            self._sleep(self._interval_s)

    def _teardown(self) -> None:
        close = getattr(self._caller, "close", None)
        if close is not None:
            close()

    def _run(self, ops: Sequence[LinkOp]) -> Optional[int]:
        """Make ``ops`` in order; the index of the first that failed, ``None`` when all
        succeeded."""
        for i, op in enumerate(ops):
            self.calls += 1
            if not self._caller(op):
                log.warning("P/D links: %s on %s (peer %s) failed", op.method, op.target,
                            op.peer.name)
                return i
        return None

    def step(self) -> None:
        """One pass (module docstring): unlink the instances gone or replaced, then link the
        new ones (by name). Runs on the thread; a test may call it directly instead."""
        snap = self._snapshot()
        current = {n: i for n, i in snap.instances.items() if i.backend_type == "xllm"}
        now = self._clock()
        for name, old in sorted(self._linked.items()):
            inst = current.get(name)
            if inst is not None and inst.incarnation_id == old.incarnation_id:
                continue
            del self._linked[name]
            ops = PdLinkRules.unlink_ops(old, list(self._linked.values()))
            for op in ops:
                self.calls += 1
                if not self._caller(op):
                    log.warning("P/D links: %s on %s (peer %s) failed", op.method, op.target,
                                op.peer.name)
            log.info("P/D links: %s deregistered (%d unlink calls)", name, len(ops))
        for name in list(self._failed):
            if name not in current:
                del self._failed[name]
        excluded: dict[str, str] = {}
        for name, inst in sorted(current.items()):
            if name in self._linked:
                # A MIX role change or a refresh with the same incarnation keeps the links.
                self._linked[name] = inst
                continue
            failed = self._failed.get(name)
            if failed is not None and failed[0] == inst.incarnation_id and now < failed[1]:
                excluded[name] = LINK_FAILED
                continue
            ops = PdLinkRules.link_ops(inst, list(self._linked.values()))
            bad = self._run(ops)
            if bad is None:
                self._linked[name] = inst
                if failed is not None:
                    log.info("P/D links: %s linked after an earlier failure", name)
                    del self._failed[name]
                elif ops:
                    log.info("P/D links: %s linked (%d calls)", name, len(ops))
                continue
            for op in PdLinkRules.rollback(ops[:bad]):
                self.calls += 1
                self._caller(op)
            if failed is None:
                log.warning("P/D links: %s is no candidate until a link succeeds", name)
            self._failed[name] = (inst.incarnation_id, now + self._retry_s)
            excluded[name] = LINK_FAILED
        with self._lock:
            self._excluded = MappingProxyType(excluded)
            self._linked_names = tuple(sorted(self._linked))
