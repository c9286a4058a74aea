"""xLLM engines known dead because their baidu_std connection closed and their port refuses
connections (§13 "Dispatch": an instance that dies fails its requests visibly).

An xLLM engine keeps one baidu_std connection to its service for all its calls (brpc
``connection_type`` single: Heartbeat twice a second, every Generations). When the process
dies its kernel closes that connection at once, seconds before its etcd lease expires
(``--etcd_ttl``, 3 s by default) and the registry turns it ``SUSPECT``. So when an engine's
connection closes (:meth:`LostEngines.connection_closed`, called by
:class:`~kvsvc.rpc.server.RpcServer` on the closing connection's own thread), every
registered instance that heartbeated on it, and every one on the connection's host (a
connection may carry Generations before its first heartbeat, e.g. after a reconnect; one
host may run several engines), is probed with one TCP connect to its ``host:port``:

- refused (nothing listens there any more): the instance's current incarnation is **lost**.
  Every request it is generating fails at its next check (within
  :data:`~kvsvc.routing.xllm_dispatch.CHECK_INTERVAL_S`, :func:`problem`), and it is no
  routing candidate (:meth:`LostEngines.excluded`) until the registry shows another
  incarnation under that name or forgets it. One WARNING per lost incarnation.
- accepted, timed out or any other error: probed again after 0.1, 0.3 and 0.7 s
  (:data:`RETRY_DELAYS_S`: a killed process's kernel may close its connections before its
  listening socket, so the first probe can still be accepted); still not refused: nothing is
  concluded (a connection may close for other reasons; the lease and
  ``--upstream_read_timeout_s`` still apply). Only a refusal is proof.

The other two ways a dead engine shows are handled where they are seen: its lease expiring
(the registry: ``SUSPECT``) and its silence (no entry for ``--upstream_read_timeout_s``).
Thread-safe; no thread of its own.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from types import MappingProxyType
from typing import Callable, Iterable, Mapping, Optional, Sequence

from kvsvc.address import parse_host_port
from kvsvc.cluster.model import RegistrySnapshot, instance_identity

log = logging.getLogger(__name__)

#: Bound of the TCP connect probe, seconds.
PROBE_TIMEOUT_S = 0.5
#: Waits before the probes after the first of the instances not refused yet, seconds.
RETRY_DELAYS_S = (0.1, 0.2, 0.4)


def port_refuses(name: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """True when a TCP connect to ``name`` (``host:port``) is refused (nothing listens); False
    when it is accepted, times out, or fails otherwise (unknown is not dead), or ``name`` is
    no ``host:port``."""
    try:
        hp = parse_host_port(name)
    except ValueError:
        return False
    try:
        with socket.create_connection((hp.host, hp.port), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def _host(address: str) -> str:
    """The host of ``host:port`` (``""`` when there is no port)."""
    try:
        return parse_host_port(address).host
    except ValueError:
        return ""


class LostEngines:
    """The instances whose current incarnation is known dead (module docstring).

    :param snapshot: the registry's current snapshot (the incarnation a loss is tied to).
    :param refuses: the probe (:func:`port_refuses`; replaceable in tests).
    :param retry_delays_s: the waits before the probes after the first
        (:data:`RETRY_DELAYS_S`).
    :param sleep: waits that long (``time.sleep``; replaceable in tests).
    """

    def __init__(self, snapshot: Callable[[], RegistrySnapshot],
                 refuses: Callable[[str], bool] = port_refuses,
                 retry_delays_s: Sequence[float] = RETRY_DELAYS_S,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self._sleep = sleep
        self._snapshot = snapshot
        self._refuses = refuses
        self._delays = tuple(retry_delays_s)
        self._lock = threading.Lock()
        self._lost: dict[str, tuple[str, str]] = {}   # name -> (identity, why)

    def connection_closed(self, names: Iterable[str], peer: str) -> list[str]:
        """A baidu_std connection from ``peer`` (``ip:port``) on which ``names`` heartbeated
        closed: probe each registered one and each registered on ``peer``'s host; those whose
        port refuses are marked lost (logged once). Blocks for the retries (about 0.7 s) and
        up to :data:`PROBE_TIMEOUT_S` per probe (call it off the request path).

        :returns: the names marked lost by this call.
        """
        marked = []
        instances = self._snapshot().instances
        host = _host(peer)
        left = sorted(n for n in set(names) | {n for n in instances if host and _host(n) == host}
                      if n in instances)
        for delay in (0.0, *self._delays):
            if not left:
                break
            if delay:
                self._sleep(delay)
            refused = [n for n in left if self._refuses(n)]
            left = [n for n in left if n not in refused]
            marked += self._mark(refused, peer)
        return marked

    def _mark(self, names: list[str], peer: str) -> list[str]:
        marked = []
        for name in names:
            inst = self._snapshot().instances.get(name)
            if inst is None:
                continue
            identity = instance_identity(inst)
            why = (f"instance {name} died (its baidu_std connection from {peer} closed and "
                   f"its port refuses connections)")
            with self._lock:
                if self._lost.get(name, ("", ""))[0] == identity:
                    continue
                self._lost[name] = (identity, why)
            log.warning("%s: failing its requests, no candidate until it registers again", why)
            marked.append(name)
        return marked

    def problem(self, name: str, incarnation: Optional[str] = None) -> Optional[str]:
        """Why ``name`` cannot answer, ``None`` while it is not known lost. ``incarnation``:
        the identity (:func:`~kvsvc.cluster.model.instance_identity`) a request was
        dispatched to; ``None``: whichever is registered now."""
        with self._lock:
            entry = self._lost.get(name)
        if entry is None:
            return None
        if incarnation is None:
            inst = self._snapshot().instances.get(name)
            incarnation = instance_identity(inst) if inst is not None else None
        return entry[1] if incarnation == entry[0] else None

    def excluded(self) -> Mapping[str, str]:
        """Name -> why of every lost instance whose lost incarnation is still the registered
        one (no routing candidate); entries of instances since replaced or forgotten are
        dropped."""
        with self._lock:
            if not self._lost:
                return MappingProxyType({})
            lost = dict(self._lost)
        instances = self._snapshot().instances
        out: dict[str, str] = {}
        stale = []
        for name, (identity, why) in lost.items():
            inst = instances.get(name)
            if inst is not None and instance_identity(inst) == identity:
                out[name] = why
            else:
                stale.append((name, identity))
        if stale:
            with self._lock:
                for name, identity in stale:
                    if self._lost.get(name, ("", ""))[0] == identity:
                        del self._lost[name]
        return MappingProxyType(out)
