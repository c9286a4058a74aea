"""Loopback port picking of the testbed (``kvsvc up``, the demo, the soak, the benchmarks, the
local etcd): ports that are free now *and* outside Linux's ephemeral range, so that no
outgoing connection can take them between the pick and the bind.

Why: the kernel hands every outgoing TCP connection (etcd clients, HTTP sessions, ZMQ
connects) a local port from ``net.ipv4.ip_local_port_range`` (32768-60999 by default). A
listening port in that range is free when probed and may be some connection's local port a
moment later; ``bind`` then fails with ``Address already in use``. The §9 port rule makes this
likely for engines: instance port ``p`` serves snapshots on ``p + 30000 + r``, inside the range
for every ``p`` from 2768 to 30999. A port listed in ``net.ipv4.ip_local_reserved_ports`` is
never handed out, so it counts as safe.

With the default offsets (10000 / 30000) and range, the safe instance ports are 1024-2767
(``p``, ``p + 10000 + r`` and ``p + 30000 + r`` all below 32768). When the host's range leaves
no safe port, the pickers fall back to any free port (and log it once per call).

Errors: :class:`~kvsvc.errors.LifecycleError` when no port is found.
"""

from __future__ import annotations

import logging
import random
import socket
from dataclasses import dataclass
from typing import Iterable, Optional

from kvsvc.errors import LifecycleError

log = logging.getLogger(__name__)

PORT_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
RESERVED_PORTS_FILE = "/proc/sys/net/ipv4/ip_local_reserved_ports"
#: Linux's default ``ip_local_port_range``.
DEFAULT_EPHEMERAL = (32768, 60999)
#: Lowest port picked: below it binding needs privileges.
LOWEST_PORT = 1024


@dataclass(frozen=True)
class EphemeralPorts:
    """The host's ephemeral port rule.

    :param low: first port of ``ip_local_port_range``.
    :param high: last port of it (inclusive).
    :param reserved: ports of ``ip_local_reserved_ports`` (never handed out).
    """

    low: int = DEFAULT_EPHEMERAL[0]
    high: int = DEFAULT_EPHEMERAL[1]
    reserved: frozenset[int] = frozenset()

    def collides(self, port: int) -> bool:
        """True when an outgoing connection may be given ``port`` as its local port."""
        return self.low <= port <= self.high and port not in self.reserved

    def describe(self) -> str:
        """``32768-60999`` (the range as ``sysctl`` writes it)."""
        return f"{self.low}-{self.high}"


def parse_port_list(text: str) -> frozenset[int]:
    """Ports of a ``ip_local_reserved_ports`` value: ``8000,38000-38007`` (empty: none).

    :raises ValueError: not that syntax.
    """
    ports: set[int] = set()
    for part in text.replace("\n", "").split(","):
        part = part.strip()
        if not part:
            continue
        low, _, high = part.partition("-")
        ports.update(range(int(low), int(high or low) + 1))
    return frozenset(ports)


def ephemeral_ports(range_file: str = PORT_RANGE_FILE,
                    reserved_file: str = RESERVED_PORTS_FILE) -> EphemeralPorts:
    """The host's rule, read from ``/proc`` (Linux's defaults where it cannot be read)."""
    try:
        with open(range_file, encoding="ascii") as f:
            low, high = (int(v) for v in f.read().split())
    except (OSError, ValueError):
        low, high = DEFAULT_EPHEMERAL
    try:
        with open(reserved_file, encoding="ascii") as f:
            reserved = parse_port_list(f.read())
    except (OSError, ValueError):
        reserved = frozenset()
    return EphemeralPorts(low, high, reserved)


def instance_ports(port: int, dp_size: int, event_port_offset: int,
                   replay_port_offset: int) -> set[int]:
    """Every port of instance ``port`` by the §9 rule: itself and ``port + offset + r``."""
    return {port} | {port + off + r for off in (event_port_offset, replay_port_offset)
                     for r in range(dp_size)}


def _all_bind(ports: Iterable[int], host: str) -> bool:
    """True when every port can be bound on ``host`` now (held together while probing).

    No ``SO_REUSEADDR``: a port with connections in TIME_WAIT is skipped too, so that a picked
    port is free by the strictest rule (engines, etcd and gunicorn bind with it)."""
    socks: list[socket.socket] = []
    try:
        for port in sorted(ports):
            s = socket.socket()
            socks.append(s)
            s.bind((host, port))
        return True
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()


def free_instance_port(dp_size: int, event_port_offset: int, replay_port_offset: int,
                       host: str = "127.0.0.1", attempts: int = 500,
                       rng: Optional[random.Random] = None,
                       avoid: Optional[set[int]] = None,
                       ephemeral: Optional[EphemeralPorts] = None) -> int:
    """An instance HTTP port ``p`` for the §9 port rule: ``p``, ``p + event_port_offset + r``
    and ``p + replay_port_offset + r`` for every rank ``r < dp_size`` are free on ``host``
    right now, within 65535, and outside the ephemeral range (see the module docstring;
    any free ones when the range leaves none).

    :param avoid: ports already promised to other instances; none of ``p``'s ports is one of
        them, and the chosen ones are added to it (so instances never collide, §9).
    :param ephemeral: the host's rule (default: read from ``/proc``).
    :raises LifecycleError: none found in ``attempts`` tries.
    """
    rng = rng or random.Random()
    eph = ephemeral or ephemeral_ports()
    top = 65535 - max(event_port_offset, replay_port_offset) - (dp_size - 1)
    if top < LOWEST_PORT:
        raise LifecycleError(f"offsets {event_port_offset}/{replay_port_offset} leave no port")
    candidates = [p for p in range(LOWEST_PORT, top + 1)
                  if not any(eph.collides(q) for q in instance_ports(
                      p, dp_size, event_port_offset, replay_port_offset))]
    if not candidates:
        log.warning("ports: offsets %d/%d and the ephemeral range %s leave no safe instance "
                    "port; picking any free one", event_port_offset, replay_port_offset,
                    eph.describe())
        candidates = list(range(LOWEST_PORT, top + 1))
    for _ in range(attempts):
        p = rng.choice(candidates)
        wanted = instance_ports(p, dp_size, event_port_offset, replay_port_offset)
        if avoid is not None and wanted & avoid:
            continue
        if _all_bind(wanted, host):
            if avoid is not None:
                avoid.update(wanted)
            return p
    raise LifecycleError(f"no free instance port for dp_size {dp_size} on {host}")


def free_port_run(n: int, host: str = "127.0.0.1", attempts: int = 500,
                  rng: Optional[random.Random] = None,
                  avoid: Optional[set[int]] = None,
                  ephemeral: Optional[EphemeralPorts] = None) -> int:
    """A base port ``p`` such that ``p .. p + n - 1`` are free on ``host`` right now and
    outside the ephemeral range (any free ones when the range leaves none).

    :param avoid: ports already promised; the run avoids them and is added to it.
    :raises LifecycleError: none found in ``attempts`` tries.
    """
    rng = rng or random.Random()
    eph = ephemeral or ephemeral_ports()
    top = 65535 - n + 1
    # Runs below the range, then above it: both are safe (reserved ports inside are rare and
    # not worth enumerating).
    spans = [(LOWEST_PORT, min(eph.low - n, top)), (eph.high + 1, top)]
    spans = [(a, b) for a, b in spans if a <= b]
    if not spans:
        log.warning("ports: the ephemeral range %s leaves no safe port; picking any free one",
                    eph.describe())
        spans = [(LOWEST_PORT, top)]
    weights = [b - a + 1 for a, b in spans]
    for _ in range(attempts):
        a, b = rng.choices(spans, weights)[0]
        base = rng.randint(a, b)
        wanted = set(range(base, base + n))
        if avoid is not None and wanted & avoid:
            continue
        if _all_bind(wanted, host):
            if avoid is not None:
                avoid.update(wanted)
            return base
    raise LifecycleError(f"no run of {n} free ports on {host}")


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct free ports outside the ephemeral range (not necessarily consecutive)."""
    taken: set[int] = set()
    return [free_port_run(1, host, avoid=taken) for _ in range(n)]
