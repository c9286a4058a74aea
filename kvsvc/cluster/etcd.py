"""The one boundary over etcd (§9): a small client on top of etcd3gw (etcd's v3 HTTP gateway).

Every etcd3gw and requests error is translated here, once, into the kvsvc tree
(``raise ... from exc``)::

    KvsvcError
    └── EtcdError          any other failure (4xx answer, malformed reply, failed watch creation)
        └── EtcdUnavailable    connection refused/reset, timeout, 5xx: retry later

Values crossing this boundary are the dataclasses below (keys as ``str``, values as ``bytes``);
nothing of etcd3gw leaks out. Keys are plain text: the §9 schema only uses ASCII.

Threading: one :class:`EtcdClient` per thread (a ``requests.Session`` is not shared between
threads here). A watch gets its own session, because etcd3gw's ``Watcher.stop()`` closes the
session's connection pool. A watch is only an accelerator (it neither reconnects nor resumes):
callers re-list periodically and start a new watch from the listed revision + 1.
"""

from __future__ import annotations

import base64
import json
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

import requests
from etcd3gw import exceptions as etcd_exc
from etcd3gw.client import Etcd3Client
from etcd3gw.types import Event
from etcd3gw.watch import Watcher

from kvsvc.address import parse_http_host_port
from kvsvc.errors import ConfigError, EtcdError, EtcdUnavailable

log = logging.getLogger(__name__)

PUT = "PUT"
DELETE = "DELETE"


@dataclass(frozen=True, slots=True)
class KeyValue:
    """One key as etcd holds it.

    :ivar key: the full key (namespace prefix included).
    :ivar value: the raw value bytes.
    :ivar mod_revision: etcd revision of the last write to this key.
    :ivar lease: lease id holding the key, 0 when none.
    """

    key: str
    value: bytes
    mod_revision: int
    lease: int = 0


@dataclass(frozen=True, slots=True)
class ListResult:
    """A consistent range read.

    :ivar revision: the store revision the read saw (watch from ``revision + 1`` to miss nothing).
    :ivar kvs: the keys under the prefix, in key order.
    """

    revision: int
    kvs: tuple[KeyValue, ...]


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change seen by a watch.

    :ivar kind: :data:`PUT` or :data:`DELETE`.
    :ivar key: the full key.
    :ivar value: new value for a PUT, ``b""`` for a DELETE.
    :ivar mod_revision: revision of this change (for a DELETE, the deletion's revision).
    """

    kind: str
    key: str
    value: bytes
    mod_revision: int


def parse_addr(etcd_addr: str) -> tuple[str, int]:
    """Split an xllm-service style ``--etcd_addr`` (``host:port``, an optional ``http://`` is
    tolerated) into host and port (:func:`kvsvc.address.parse_http_host_port`).

    :raises ConfigError: (field ``etcd_addr``) when it is not ``host:port`` with port 1-65535.
    """
    try:
        addr = parse_http_host_port(etcd_addr)
    except ValueError as exc:
        raise ConfigError("etcd_addr", str(exc)) from None
    return addr.host, addr.port


def _b64(data: str | bytes) -> str:
    raw = data.encode("utf-8") if isinstance(data, str) else data
    return base64.b64encode(raw).decode("ascii")


def _prefix_end(prefix: str) -> str:
    """The range end covering every key that starts with ``prefix`` (last byte + 1)."""
    raw = bytearray(prefix.encode("utf-8"))
    raw[-1] += 1
    return bytes(raw).decode("utf-8")


class EtcdClient:
    """Blocking etcd v3 client for one thread. Every call is bounded by ``timeout_s``.

    :param etcd_addr: ``host:port`` of an etcd client URL (plain HTTP).
    :param timeout_s: per-request timeout in seconds.
    :raises ConfigError: on a malformed ``etcd_addr``.
    """

    def __init__(self, etcd_addr: str, timeout_s: float = 2.0) -> None:
        self._host, self._port = parse_addr(etcd_addr)
        self._timeout_s = timeout_s
        # etcd >= 3.4 serves /v3/; fixing the path skips the extra /version round trip.
        self._client = Etcd3Client(host=self._host, port=self._port, timeout=timeout_s,
                                   api_path="/v3/")

    @property
    def addr(self) -> str:
        """``host:port`` this client talks to."""
        return f"{self._host}:{self._port}"

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run one etcd3gw call, translating its errors (the single translation point)."""
        try:
            return fn()
        except (etcd_exc.ConnectionFailedError, etcd_exc.ConnectionTimeoutError,
                etcd_exc.InternalServerError) as exc:
            raise EtcdUnavailable(f"etcd {self.addr} {what}: {type(exc).__name__}: "
                                  f"{exc.detail_text or exc}") from exc
        except etcd_exc.Etcd3Exception as exc:
            raise EtcdError(f"etcd {self.addr} {what}: {type(exc).__name__}: "
                            f"{exc.detail_text or exc}") from exc
        except requests.RequestException as exc:
            raise EtcdUnavailable(f"etcd {self.addr} {what}: {type(exc).__name__}: {exc}") from exc
        except (KeyError, ValueError, TypeError) as exc:
            # A reply without the fields the v3 API promises (or not JSON at all).
            raise EtcdError(f"etcd {self.addr} {what}: malformed reply: {exc!r}") from exc

    def list_prefix(self, prefix: str) -> ListResult:
        """All keys starting with ``prefix``, with the store revision of the read.

        :raises EtcdUnavailable: etcd unreachable / timed out / 5xx.
        :raises EtcdError: any other failure.
        """
        def do() -> ListResult:
            payload = {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix))}
            # Called through post() rather than get_prefix() because the header revision is
            # needed to start the watch exactly after this read.
            reply = self._client.post(self._client.get_url("/kv/range"), json=payload)
            revision = int(reply["header"]["revision"])
            kvs = tuple(
                KeyValue(key=base64.b64decode(kv["key"]).decode("utf-8", "replace"),
                         value=base64.b64decode(kv.get("value", "")),
                         mod_revision=int(kv.get("mod_revision", 0)),
                         lease=int(kv.get("lease", 0)))
                for kv in reply.get("kvs", ()))
            return ListResult(revision=revision, kvs=kvs)
        return self._call(f"list {prefix!r}", do)

    def get(self, key: str) -> Optional[KeyValue]:
        """The key's current value, or None when absent.

        :raises EtcdUnavailable: / :raises EtcdError: as :meth:`list_prefix`.
        """
        def do() -> Optional[KeyValue]:
            items = self._client.get(key, metadata=True)
            if not items:
                return None
            value, meta = items[0]
            return KeyValue(key=key, value=value, mod_revision=int(meta.get("mod_revision", 0)),
                            lease=int(meta.get("lease", 0)))
        return self._call(f"get {key!r}", do)

    def put(self, key: str, value: bytes | str, lease_id: Optional[int] = None) -> None:
        """Write ``key`` (attached to ``lease_id`` when given).

        :raises EtcdUnavailable: / :raises EtcdError: as :meth:`list_prefix`.
        """
        def do() -> None:
            payload: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
            if lease_id:
                payload["lease"] = lease_id
            self._client.post(self._client.get_url("/kv/put"), json=payload)
        self._call(f"put {key!r}", do)

    def create(self, key: str, value: bytes | str, lease_id: Optional[int] = None) -> bool:
        """Put ``key`` only if it does not exist (one transaction).

        :returns: True when this call created the key, False when it already existed.
        :raises EtcdUnavailable: / :raises EtcdError: as :meth:`list_prefix`.
        """
        def do() -> bool:
            put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
            if lease_id:
                put["lease"] = lease_id
            txn = {"compare": [{"key": _b64(key), "result": "EQUAL", "target": "CREATE",
                                "create_revision": 0}],
                   "success": [{"request_put": put}], "failure": []}
            reply = self._client.post(self._client.get_url("/kv/txn"), data=json.dumps(txn))
            return bool(reply.get("succeeded", False))
        return self._call(f"create {key!r}", do)

    def delete(self, key: str) -> bool:
        """Delete ``key``.

        :returns: True when a key was deleted.
        :raises EtcdUnavailable: / :raises EtcdError: as :meth:`list_prefix`.
        """
        def do() -> bool:
            reply = self._client.post(self._client.get_url("/kv/deleterange"),
                                      json={"key": _b64(key)})
            return int(reply.get("deleted", 0)) > 0
        return self._call(f"delete {key!r}", do)

    def grant_lease(self, ttl_s: int) -> int:
        """Grant a lease of ``ttl_s`` seconds.

        :returns: the lease id.
        :raises EtcdUnavailable: / :raises EtcdError: as :meth:`list_prefix`.
        """
        return self._call(f"grant lease ttl={ttl_s}s",
                          lambda: self._client.lease(ttl=int(ttl_s)).id)

    def keepalive(self, lease_id: int) -> int:
        """Refresh a lease once.

        :returns: the remaining TTL in seconds, or -1 when the lease has already expired.
        :raises EtcdUnavailable: / :raises EtcdError: as :meth:`list_prefix`.
        """
        def do() -> int:
            reply = self._client.post(self._client.get_url("/lease/keepalive"),
                                      json={"ID": lease_id})
            return int(reply["result"].get("TTL", -1))
        return self._call(f"keepalive lease {lease_id:x}", do)

    def revoke(self, lease_id: int) -> None:
        """Revoke a lease: every key it holds is deleted at once.

        :raises EtcdUnavailable: / :raises EtcdError: as :meth:`list_prefix`.
        """
        self._call(f"revoke lease {lease_id:x}",
                   lambda: self._client.post(self._client.get_url("/kv/lease/revoke"),
                                             json={"ID": lease_id}))

    def watch_prefix(self, prefix: str, start_revision: int,
                     on_event: Callable[[WatchEvent], None]) -> "WatchHandle":
        """Start a watch of every key under ``prefix`` from ``start_revision`` on.

        ``on_event`` runs on etcd3gw's watch thread: it must only hand the event over (e.g.
        ``queue.put``). When the connection drops the watch ends silently; callers re-list.

        :returns: the handle whose :meth:`WatchHandle.cancel` stops the watch.
        :raises EtcdUnavailable: / :raises EtcdError: when the watch cannot be created.
        """
        return WatchHandle(self.addr, self._timeout_s, prefix, start_revision, on_event)

    def close(self) -> None:
        """Close the client's HTTP session (idempotent)."""
        self._client.session.close()


class WatchHandle:
    """A running etcd3gw watch on its own HTTP session. Use :meth:`cancel` to stop it.

    :raises EtcdUnavailable: / :raises EtcdError: from the constructor when creation fails.
    """

    def __init__(self, addr: str, timeout_s: float, prefix: str, start_revision: int,
                 on_event: Callable[[WatchEvent], None]) -> None:
        host, port = parse_addr(addr)
        self._client = Etcd3Client(host=host, port=port, timeout=timeout_s, api_path="/v3/")
        self._cancelled = threading.Event()

        def deliver(raw: Event) -> None:
            if self._cancelled.is_set():
                return
            kv = raw.get("kv", {})
            kind = DELETE if raw.get("type") == "DELETE" else PUT
            on_event(WatchEvent(kind=kind, key=bytes(kv.get("key", b"")).decode("utf-8", "replace"),
                                value=bytes(kv.get("value", b"")) if kind == PUT else b"",
                                mod_revision=int(kv.get("mod_revision", 0))))

        try:
            self._watcher: Optional[Watcher] = Watcher(
                self._client, prefix, deliver, start_revision=start_revision,
                range_end=_prefix_end(prefix))
        except requests.RequestException as exc:
            self._client.session.close()
            raise EtcdUnavailable(f"etcd {addr} watch {prefix!r}: {type(exc).__name__}: {exc}") \
                from exc
        except Exception as exc:  # noqa: BLE001 - etcd3gw raises bare Exception on a refused watch
            self._client.session.close()
            raise EtcdError(f"etcd {addr} watch {prefix!r}: {exc!r}") from exc

    def cancel(self) -> None:
        """Stop the watch: shuts its connection down so etcd3gw's thread ends (idempotent)."""
        if self._cancelled.is_set():
            return
        self._cancelled.set()
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.stop()
        self._client.session.close()


def drain(q: "queue.Queue[Any]", first_timeout_s: float) -> list[Any]:
    """Wait up to ``first_timeout_s`` for one item of ``q``, then take every item already there.

    :returns: the items, possibly none.
    """
    items: list[Any] = []
    try:
        items.append(q.get(timeout=max(0.0, first_timeout_s)))
    except queue.Empty:
        return items
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items
