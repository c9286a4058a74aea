"""The one boundary over etcd (§9): a small client on top of etcd3gw (etcd's v3 HTTP gateway).

Every etcd3gw and requests error is translated here, once, into the kvsvc tree
(``raise ... from exc``)::

    KvsvcError
    └── EtcdError          any other failure (4xx answer, malformed reply, failed watch creation)
        └── EtcdUnavailable    connection refused/reset, timeout, 5xx: retry later

Values crossing this boundary are the dataclasses below (keys as ``str``, values as ``bytes``);
nothing of etcd3gw leaks out. Keys are plain text: the §9 schema only uses ASCII.

Error messages are short: ``etcd <addr> <request>: <kind>`` with the kind of failure
(:func:`error_kind`: ``connection refused``, ``timeout``, ``connection reset``,
``HTTP Service Unavailable``, ...); the full requests/urllib3 text goes to the DEBUG log only. The HTTP sessions of this
module never retry inside urllib3 (``max_retries=0`` mounted on each of them, not globally),
so urllib3 has no retry warning to log: callers retry on their own schedule.

Reachability (one outage, few lines; D25 in docs/decisions.md): the clients of one process share an
:class:`EtcdReachability` (the registry builds it and hands it to its etcd thread and to the
election). Each request reports to it; it logs one WARNING when etcd becomes unreachable
(address and kind), at most one summary line per :data:`OUTAGE_SUMMARY_INTERVAL_S` while the
outage lasts (failures so far, last kind) and one INFO line when etcd answers again (how long
it was down). Callers log an unavailability at DEBUG only.

Threading: one :class:`EtcdClient` per thread (a ``requests.Session`` is not shared between
threads here); an :class:`EtcdReachability` is thread-safe. A watch gets its own session, because etcd3gw's ``Watcher.stop()`` closes the
session's connection pool. A watch is only an accelerator (it neither reconnects nor resumes):
callers re-list periodically and start a new watch from the listed revision + 1.
"""

from __future__ import annotations

import base64
import json
import logging
import queue
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import requests
from requests.adapters import HTTPAdapter
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


#: Seconds between two "still unreachable" lines of one outage (:class:`EtcdReachability`).
OUTAGE_SUMMARY_INTERVAL_S = 60.0


def error_kind(exc: BaseException) -> str:
    """A short name of why an etcd request failed, for log lines and error messages:
    ``timeout``; the OS error of a failed connection in lower case (``connection refused``,
    ``no route to host``, ``name or service not known``, ...); ``connection reset``;
    ``HTTP <reason phrase>`` for an error status etcd3gw raised; else the exception's class name.

    :param exc: the etcd3gw or requests exception (its text and its ``__context__``, the
        requests error etcd3gw re-raised, are looked at).
    """
    parts = [e for e in (exc, exc.__cause__, exc.__context__) if e is not None]
    if any(isinstance(e, (etcd_exc.ConnectionTimeoutError, requests.Timeout)) for e in parts):
        return "timeout"
    text = " ".join(str(getattr(e, "detail_text", None) or e) for e in parts)
    errno = _ERRNO_TEXT.search(text)
    if errno:
        return errno.group(1).strip().lower()
    if "timed out" in text:
        return "timeout"
    if "reset by peer" in text or "Connection aborted" in text or "RemoteDisconnected" in text:
        return "connection reset"
    if isinstance(exc, etcd_exc.Etcd3Exception) and exc.args:
        return f"HTTP {exc.args[0]}"  # etcd3gw passes (text, reason phrase)
    return type(exc).__name__


#: ``[Errno 111] Connection refused`` inside a requests/urllib3 message.
_ERRNO_TEXT = re.compile(r"\[Errno -?\d+\] ([^'\")\]]+)")


class EtcdReachability:
    """Whether one etcd address answers, as every client sharing this object sees it, and the
    log lines of an outage (module docstring): one WARNING when it starts, at most one
    WARNING summary per ``summary_interval_s`` while it lasts, one INFO when it ends.
    Thread-safe; starts as reachable.

    :param addr: the etcd ``host:port`` named in the lines.
    :param summary_interval_s: seconds between two summary lines of one outage.
    :param clock: monotonic seconds (a test may pass its own).
    """

    def __init__(self, addr: str, summary_interval_s: float = OUTAGE_SUMMARY_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.addr = addr
        self._summary_interval_s = summary_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        # Under _lock:
        self._reachable = True
        self._down_since = 0.0
        self._last_line = 0.0
        self._failures = 0
        self._last_kind = ""

    @property
    def reachable(self) -> bool:
        """False from the first failed request of an outage until a request succeeds."""
        with self._lock:
            return self._reachable

    def failed(self, kind: str) -> None:
        """One request found etcd unreachable (:class:`~kvsvc.errors.EtcdUnavailable`).

        :param kind: :func:`error_kind` of the failure.
        """
        now = self._clock()
        with self._lock:
            self._failures += 1
            self._last_kind = kind
            if self._reachable:
                self._reachable = False
                self._down_since = self._last_line = now
                log.warning("etcd %s unreachable (%s); the registry keeps its last view and "
                            "retries", self.addr, kind)
            elif now - self._last_line >= self._summary_interval_s:
                self._last_line = now
                log.warning("etcd %s still unreachable after %.0f s (%d failed requests, "
                            "last: %s)", self.addr, now - self._down_since, self._failures,
                            kind)

    def succeeded(self) -> None:
        """One request got an answer from etcd (an error answer counts: etcd is there)."""
        with self._lock:
            if self._reachable:
                return
            now = self._clock()
            log.info("etcd %s reachable again after %.1f s down (%d failed requests, last: "
                     "%s)", self.addr, now - self._down_since, self._failures, self._last_kind)
            self._reachable = True
            self._failures = 0


def _no_retries(session: requests.Session) -> requests.Session:
    """Mount adapters that never retry inside urllib3 on ``session`` (this session only): a
    failure reaches the caller at once, and urllib3 logs no "Retrying" warning."""
    for scheme in ("http://", "https://"):
        session.mount(scheme, HTTPAdapter(max_retries=0))
    return session


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
    :param reachability: where every request reports whether etcd answered (shared by the
        clients of one process); ``None``: a tracker of its own.
    :raises ConfigError: on a malformed ``etcd_addr``.
    """

    def __init__(self, etcd_addr: str, timeout_s: float = 2.0,
                 reachability: Optional[EtcdReachability] = None) -> None:
        self._host, self._port = parse_addr(etcd_addr)
        self._timeout_s = timeout_s
        self._reachability = reachability or EtcdReachability(self.addr)
        # etcd >= 3.4 serves /v3/; fixing the path skips the extra /version round trip.
        self._client = Etcd3Client(host=self._host, port=self._port, timeout=timeout_s,
                                   api_path="/v3/", session=_no_retries(requests.Session()))

    @property
    def addr(self) -> str:
        """``host:port`` this client talks to."""
        return f"{self._host}:{self._port}"

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run one etcd3gw call, translating its errors (the single translation point) and
        reporting to the reachability tracker."""
        try:
            result = fn()
        except (etcd_exc.ConnectionFailedError, etcd_exc.ConnectionTimeoutError,
                etcd_exc.InternalServerError, requests.RequestException) as exc:
            raise self._unavailable(what, exc) from exc
        except etcd_exc.Etcd3Exception as exc:
            self._reachability.succeeded()
            raise EtcdError(f"etcd {self.addr} {what}: {type(exc).__name__}: "
                            f"{exc.detail_text or exc}") from exc
        except (KeyError, ValueError, TypeError) as exc:
            # A reply without the fields the v3 API promises (or not JSON at all).
            self._reachability.succeeded()
            raise EtcdError(f"etcd {self.addr} {what}: malformed reply: {exc!r}") from exc
        self._reachability.succeeded()
        return result

    def _unavailable(self, what: str, exc: BaseException) -> EtcdUnavailable:
        kind = error_kind(exc)
        log.debug("etcd %s %s: %s: %s", self.addr, what, type(exc).__name__,
                  getattr(exc, "detail_text", None) or exc)
        self._reachability.failed(kind)
        return EtcdUnavailable(f"etcd {self.addr} {what}: {kind}")

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
        try:
            handle = WatchHandle(self.addr, self._timeout_s, prefix, start_revision, on_event)
        except EtcdUnavailable as exc:
            self._reachability.failed(error_kind(exc.__cause__ or exc))
            raise
        self._reachability.succeeded()
        return handle

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
        self._client = Etcd3Client(host=host, port=port, timeout=timeout_s, api_path="/v3/",
                                   session=_no_retries(requests.Session()))
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
            log.debug("etcd %s watch %r: %s: %s", addr, prefix, type(exc).__name__, exc)
            raise EtcdUnavailable(f"etcd {addr} watch {prefix!r}: {error_kind(exc)}") from exc
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
