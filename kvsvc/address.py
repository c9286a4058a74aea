"""Network addresses, one rule each: ``host:port`` (instance names, ``--etcd_addr``, the master
address, §9), ``tcp://host:port`` endpoints (§8) and the hosts allowed in them.

Every place that reads or writes one of these calls this module, so an instance name that the
registry accepts is one discovery can derive ports from (§9) and one the config accepts.
Errors are :class:`ValueError` with a message naming the value; callers wrap it into their own
:class:`~kvsvc.errors.KvsvcError` (a config field, a malformed registration).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

#: Highest TCP port.
MAX_PORT = 65535

_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                       r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")


@dataclass(frozen=True, slots=True)
class HostPort:
    """A parsed ``host:port``: ``host`` without IPv6 brackets, ``port`` in 1-65535."""

    host: str
    port: int

    def __str__(self) -> str:
        return format_host_port(self.host, self.port)


def parse_host_port(value: str) -> HostPort:
    """``host:port`` (an IPv6 host in brackets) -> :class:`HostPort`.

    :raises ValueError: not of that form (no colon, empty host, non-digit port), or the port
        outside 1-65535.
    """
    host, sep, port_text = value.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"must be host:port, got {value!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host:
        raise ValueError(f"must be host:port, got {value!r}")
    port = int(port_text)
    if not 1 <= port <= MAX_PORT:
        raise ValueError(f"port {port} out of range 1-{MAX_PORT}")
    return HostPort(host, port)


def parse_http_host_port(value: str) -> HostPort:
    """An xllm-service style address such as ``--etcd_addr``: ``host:port`` with an optional
    ``http://`` prefix and trailing ``/`` tolerated (surrounding blanks too).

    :raises ValueError: as :func:`parse_host_port`.
    """
    text = value.strip()
    text = text.removeprefix("http://").rstrip("/")
    try:
        return parse_host_port(text)
    except ValueError:
        raise ValueError(f"must be host:port, got {value!r}") from None


def format_host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets (the inverse of :func:`parse_host_port`)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def tcp_endpoint(host: str, port: int) -> str:
    """The ZMQ endpoint ``tcp://host:port`` (an IPv6 host in brackets)."""
    return f"tcp://{format_host_port(host, port)}"


def check_connect_host(host: str) -> str:
    """A host a socket can connect to: an IP address that is not unspecified, or a DNS name.

    ZMQ accepts more (``eth0;127.0.0.1`` source-address syntax, ``0`` for 0.0.0.0); none of it
    belongs in a connect address, and each would defeat the duplicate-endpoint check.

    :returns: the normalised host (lower-case name, compressed IP).
    :raises ValueError: naming the host.
    """
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        if not _HOSTNAME.match(host) or host.replace(".", "").isdigit():
            raise ValueError(f"host {host!r} is neither an IP address nor a DNS name") from None
        return host.lower()
    if ip.is_unspecified:
        raise ValueError(f"host must be connectable, not {host!r}")
    return ip.compressed


def check_bind_host(host: str) -> str:
    """A host a server can bind to: any IP address (``0.0.0.0`` and ``::`` included) or a host
    name.

    :raises ValueError: naming the host.
    """
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if not _HOSTNAME.match(host):
            raise ValueError(f"{host!r} is neither an IP address nor a host name") from None
    return host


def check_tcp_endpoint(value: str) -> str:
    """``tcp://host:port`` with a connectable host (not ``*`` / ``0.0.0.0``) and port 1-65535,
    nothing before the host or after the port (§8).

    :returns: ``value`` unchanged.
    :raises ValueError: naming what is wrong.
    """
    if not value.startswith("tcp://"):
        raise ValueError("must be tcp://host:port")
    parts = urlsplit(value)
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"bad port in {value!r}") from exc
    host = parts.hostname
    if not host or port is None:
        raise ValueError(f"must be tcp://host:port, got {value!r}")
    if host in ("*", "0.0.0.0", "::") or "*" in parts.netloc:
        raise ValueError(f"host must be connectable, not {host!r}")
    if "@" in parts.netloc:
        raise ValueError(f"must be tcp://host:port without user information, got {value!r}")
    if not 1 <= port <= MAX_PORT:
        raise ValueError(f"port {port} out of range 1-{MAX_PORT}")
    if parts.path or parts.query or parts.fragment:
        raise ValueError(f"must be tcp://host:port with nothing after the port, got {value!r}")
    check_connect_host(host)
    return value


def endpoint_key(value: str) -> tuple[str, int]:
    """``(host, port)`` of a validated ``tcp://`` endpoint, normalised for duplicate checks."""
    parts = urlsplit(value)
    return check_connect_host(parts.hostname or ""), int(parts.port or 0)


def check_ipv4(host: str, what: str = "host") -> str:
    """An IPv4 address in dotted form (``0.0.0.0`` included): the only form of a baidu_std
    address an xLLM engine accepts (§13: ``ip:port`` with exactly one ``:``).

    :raises ValueError: naming ``what`` and the value.
    """
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        raise ValueError(f"{what} must be an IPv4 address, got {host!r}") from None
    return host


def is_master_address(value: str) -> bool:
    """True for the form an xLLM engine accepts in ``XLLM:SERVICE:MASTER`` and
    ``XLLM:SERVICE:<ip:port>`` (§13): an IPv4 address that is not ``0.0.0.0``, exactly one
    ``:``, a port in 1-65535."""
    host, sep, port = value.partition(":")
    if not sep or ":" in port or not port.isdigit() or not 1 <= int(port) <= MAX_PORT:
        return False
    try:
        return not ipaddress.IPv4Address(host).is_unspecified
    except ValueError:
        return False


def advertised_ipv4(bind_host: str, advertise_host: str, self_host: str,
                    hostname_ipv4s: "list[str]") -> str:
    """The IPv4 address a baidu_std server tells engines to reach it at (§13), first of:
    ``advertise_host``; ``bind_host`` unless it is ``0.0.0.0``; ``self_host`` (the host of
    ``--self_address``) when it is an IPv4 address other than ``0.0.0.0``; the first
    non-loopback address the machine's host name resolves to, else its first loopback one.

    :param bind_host: the IPv4 the server binds (``0.0.0.0`` for every interface).
    :param advertise_host: the configured address, ``""`` when none.
    :param self_host: the host of ``--self_address``, ``""`` when none.
    :param hostname_ipv4s: the IPv4 addresses the host name resolves to (the caller resolves:
        no I/O here).
    :raises ValueError: no IPv4 address can be advertised (the message says what to set).
    """
    if advertise_host:
        return check_ipv4(advertise_host, "the advertised address")
    if not ipaddress.IPv4Address(check_ipv4(bind_host, "the bind address")).is_unspecified:
        return bind_host
    try:
        if self_host and not ipaddress.IPv4Address(self_host).is_unspecified:
            return self_host
    except ValueError:
        pass
    usable = [a for a in hostname_ipv4s if not ipaddress.IPv4Address(a).is_unspecified]
    for addr in usable:
        if not ipaddress.IPv4Address(addr).is_loopback:
            return addr
    if usable:
        return usable[0]
    raise ValueError("no IPv4 address to advertise: the bind address is 0.0.0.0 and this "
                     "machine's host name resolves to no IPv4 address")
