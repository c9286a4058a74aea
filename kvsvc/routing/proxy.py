"""Upstream forwarding of OpenAI requests to the chosen instance (§11, issue 5).

One :class:`Proxy` per app holds a ``urllib3`` pool manager (kept-alive connections per
upstream, no environment proxies, no cookies, no redirects, no automatic retries) used by
request threads concurrently; ``requests``' session layer is not on the request path (its
request preparation cost more than the rest of the proxy). :meth:`Proxy.forward`
sends one request with ``stream=True`` and connect/read timeouts:

- an upstream that refuses the connection, fails to connect in time, or resets / closes the
  connection before any byte of a response head ("a connection failure before the first
  byte", e.g. a kept-alive connection the engine had closed) is counted as failed, logged, and
  the request is sent once more to the next candidate of the policy's ranking. An upstream
  that accepted the request and sends no head within the read timeout is counted and answered
  504, never re-sent: it may still be working on it (§15 "client going away"). After the
  response head arrived nothing is retried: the upstream's status, headers and body are passed
  through;
- while waiting for the response head, the client's own connection is watched when the
  caller hands a :class:`ClientWatch` (:meth:`Proxy.forward`): when the client closes it, the
  upstream connection is closed at once (vLLM and SGLang abort a request whose connection
  closes) and :class:`~kvsvc.errors.ClientGone` is raised (§15). The watch is a ``poll`` of
  both sockets from the request thread, in the pool's connection class
  (:class:`_WatchedConnection`), so nothing else polls and kept-alive connections stay pooled;
- a body that breaks after the head (reset, cut short of its chunked framing or
  ``Content-Length``, or no bytes within the read timeout) is logged once as a WARNING naming the upstream, the path, the bytes relayed and the error, and
  the relay raises (:meth:`UpstreamBody.__iter__`, :meth:`UpstreamBody.read_all`): the HTTP
  layer turns that into a 502/504 when nothing was sent yet, and into an SSE error event plus
  an aborted transfer when the stream had begun (:mod:`kvsvc.http.openai`). A body framed
  only by the connection's close (HTTP/1.0 without ``Content-Length``: EOF looks like a clean
  end) is judged by its content (:class:`TruncatedBody`): a 200 event stream of a
  ``/completions`` path that ends without ``data: [DONE]`` (OpenAI, vLLM and SGLang always
  end with it), or a JSON body that is no complete document, is broken the same way;
- hop-by-hop headers (RFC 9110 §7.6.1, and any named in ``Connection``) are dropped both ways,
  as are ``Host``, ``Content-Length`` and ``X-Internal-Token`` on the way up;
- the body is relayed as it arrives (:class:`UpstreamBody`), undecoded (``Content-Encoding``
  kept); when the client goes away the WSGI server closes the body, which closes the upstream
  connection at once.
- every attempt is counted in the service's :class:`~kvsvc.routing.in_flight.InFlight` (when given) from
  the moment it is sent until it ends: released at once when it fails before the first byte
  (the retry is a new dispatch to the next candidate), else when the body is closed (read to
  the end, broken, or closed by the WSGI server because the response ended or the client went
  away). :class:`UpstreamBody.close` is idempotent, so the count drops exactly once;
- upstream errors are counted by instance and kind (:data:`UPSTREAM_ERROR_KINDS`,
  :meth:`Proxy.errors`): ``refused`` (connection refused), ``reset`` (connection reset or
  closed before the response head), ``timeout`` (connect, response head or a body read past
  its bound), ``broken_body`` (the body broke after the head), ``http_5xx`` (the upstream
  answered 5xx, relayed as it is);
- :class:`UpstreamBody` notes when it relayed its first SSE ``data:`` event and how it ended
  (:class:`RelayEnd`, handed once to the callback given to :meth:`UpstreamBody.when_closed`),
  so the HTTP layer can time the answer without parsing it;
- every attempt is heard by the proxy's :class:`~kvsvc.routing.observer.RequestObserver`
  (when given, and when :meth:`Proxy.forward` is told how to describe the attempt): dispatch,
  cancel when it fails before the head, and, through a
  :class:`~kvsvc.routing.observer.RelayTracker` fed every relayed chunk, first token, each
  further token and the end (or cancel) when the body closes (§12).

Errors (module boundary: ``urllib3`` errors are translated here, ``raise ...
from exc``): :class:`~kvsvc.errors.UpstreamTimeout` when the last attempt (or a body read)
timed out, :class:`~kvsvc.errors.UpstreamUnreachable` when it was refused, reset or broken; both
are :class:`~kvsvc.errors.UpstreamError` (the HTTP layer answers 504 and 502). The body's
iterator raises the same two after the head (with :attr:`UpstreamBody.broken` set).
"""

from __future__ import annotations

import contextvars
import logging
import select
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import orjson
import urllib3
import urllib3.connection
import urllib3.connectionpool
import urllib3.exceptions
import urllib3.util

from kvsvc.errors import ClientGone, UpstreamError, UpstreamTimeout, UpstreamUnreachable
from kvsvc.routing.in_flight import Dispatch, InFlight
from kvsvc.routing.observer import (
    CANCEL_CLIENT_GONE,
    CANCEL_UPSTREAM_FAILED,
    InfoFor,
    ObserverChain,
    RelayTracker,
    RequestObserver,
    notify,
)

log = logging.getLogger(__name__)

#: RFC 9110 §7.6.1 connection-specific headers, plus the obsolete ones proxies still drop.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                        "proxy-connection", "te", "trailer", "trailers", "transfer-encoding",
                        "upgrade"})
#: Request headers never forwarded upstream besides the hop-by-hop ones.
_DROP_UP = frozenset({"host", "content-length", "x-internal-token"})
#: Response headers never relayed besides the hop-by-hop ones (the WSGI server frames the body).
_DROP_DOWN = frozenset({"content-length"})
#: Bytes asked of the upstream socket per read; ``read1`` returns what has arrived, so small
#: SSE events are relayed at once.
READ_CHUNK_BYTES = 64 * 1024
#: Kinds of upstream error counted per instance (:meth:`Proxy.errors`, the
#: ``kind`` label of ``kvsvc_proxy_upstream_errors_total``), see the module docstring.
UPSTREAM_ERROR_KINDS = ("refused", "reset", "timeout", "broken_body", "http_5xx")
#: The request header vLLM and SGLang read to run a request on one DP rank (§15).
DP_RANK_HEADER = "X-data-parallel-rank"
_DP_RANK_LOWER = DP_RANK_HEADER.lower()
#: Upstream pools :class:`Proxy` keeps by name (instances come and go).
_MAX_POOLS = 1024
#: What starts an SSE data field (WHATWG HTML "server-sent events": a line ``data:...``).
_SSE_DATA = b"data:"


#: Bytes of a stream's end kept to see whether it ended with ``data: [DONE]``.
_DONE_TAIL_BYTES = 64


class TruncatedBody(Exception):
    """An upstream body that ended (EOF) before its own end: an OpenAI event stream without
    ``data: [DONE]``, or a JSON body that is no complete document (what ``urllib3`` cannot
    see in a body framed by the connection's close). Internal: :class:`UpstreamBody` turns it
    into :class:`~kvsvc.errors.UpstreamUnreachable`."""


def _ends_with_done(tail: bytes) -> bool:
    """True when the stream's last event is ``data: [DONE]`` (``data:[DONE]`` too), followed
    by nothing but line ends and blanks."""
    last = tail.rstrip()
    return last.endswith(b"[DONE]") and last[:-len(b"[DONE]")].rstrip().endswith(_SSE_DATA)


def _parses(data: bytes) -> bool:
    try:
        orjson.loads(data)
    except orjson.JSONDecodeError:
        return False
    return True


#: Poll events that say something happened on the client's connection (data, EOF, reset).
_CLIENT_EVENTS = select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP | getattr(
    select, "POLLRDHUP", 0)


class ClientWatch:
    """The client's connection, watched while its request waits for an upstream (§15).

    :param sock: the client's socket (gunicorn puts it in the WSGI environ as
        ``gunicorn.socket``); its blocking mode and timeout are left alone (peeks use
        ``MSG_DONTWAIT``).

    :ivar gone: set once the client was seen gone.
    """

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.gone = False

    def client_gone(self) -> Optional[bool]:
        """Peek at the client's connection without consuming anything: ``True`` when it is
        closed (EOF) or broken, ``False`` when nothing is there, ``None`` when the client sent
        more bytes (a pipelined request: it is still there, and its connection cannot be
        watched further without reading them)."""
        try:
            data = self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True
        return True if not data else None

    def wait_readable(self, upstream: socket.socket, timeout_s: Optional[float]) -> None:
        """Return once ``upstream`` has bytes to read (its response head is arriving).

        :param upstream: the upstream connection's socket.
        :param timeout_s: bound of the wait, seconds; ``None`` waits without one.
        :raises ClientGone: the client closed its connection first (:attr:`gone` set).
        :raises TimeoutError: nothing arrived within ``timeout_s`` (urllib3 turns it into its
            read timeout).
        """
        poller = select.poll()
        up_fd, client_fd = upstream.fileno(), self._sock.fileno()
        poller.register(up_fd, select.POLLIN | select.POLLPRI | select.POLLERR
                        | select.POLLHUP)
        watching = client_fd >= 0
        if watching:
            poller.register(client_fd, _CLIENT_EVENTS)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left_ms = (None if deadline is None
                       else max(0, int((deadline - time.monotonic()) * 1000) + 1))
            events = poller.poll(left_ms)
            if not events:
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError("timed out waiting for the response head")
                continue
            fds = {fd for fd, _ in events}
            if up_fd in fds:
                return
            if watching and client_fd in fds:
                state = self.client_gone()
                if state:
                    self.gone = True
                    raise ClientGone("client closed its connection")
                if state is None:
                    poller.unregister(client_fd)
                    watching = False


#: The watch of the request whose upstream attempt runs on this thread (set around the
#: ``urllib3`` call by :meth:`Proxy.forward`, read by :class:`_WatchedConnection`).
_CLIENT_WATCH: contextvars.ContextVar[Optional[ClientWatch]] = contextvars.ContextVar(
    "kvsvc_client_watch", default=None)


def _ip_family(host: str) -> Optional[socket.AddressFamily]:
    """``AF_INET`` / ``AF_INET6`` when ``host`` is an IP literal (brackets allowed), else
    ``None`` (a name: resolved by urllib3)."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
        except (OSError, ValueError):
            continue
        return family
    return None


class _WatchedConnection(urllib3.connection.HTTPConnection):
    """urllib3's connection, whose wait for the response head also watches the client
    (:class:`ClientWatch`) when one is set for this thread, and which connects to an IP
    literal (every registered instance name, §9) without a resolver call."""

    def _new_conn(self) -> socket.socket:
        # urllib3's create_connection resolves even an IP literal (getaddrinfo, a syscall per
        # request to an engine that closes its connections); the errors are urllib3's own.
        host = self._dns_host.strip("[]")
        family = _ip_family(host)
        if family is None or self.source_address:
            return super()._new_conn()
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            for opt in self.socket_options or ():
                sock.setsockopt(*opt)
            timeout = self.timeout
            if timeout is None or isinstance(timeout, (int, float)):  # else urllib3's "unset"
                sock.settimeout(timeout)
            sock.connect((host, self.port))
        except socket.timeout as exc:
            sock.close()
            raise urllib3.exceptions.ConnectTimeoutError(
                self, f"Connection to {self.host} timed out. (connect timeout={self.timeout})",
            ) from exc
        except OSError as exc:
            sock.close()
            raise urllib3.exceptions.NewConnectionError(
                self, f"Failed to establish a new connection: {exc}") from exc
        except BaseException:
            sock.close()
            raise
        sys.audit("http.client.connect", self, self.host, self.port)
        return sock

    #: The next send() is the request head: keep it for the body's send (see request()).
    _hold_head = False
    _held_head: Optional[bytes] = None

    def request(self, method: str, url: str, body: Any = None,  # type: ignore[override]
                headers: Optional[Mapping[str, str]] = None, **kwargs: Any) -> None:
        # urllib3 sends the head and then the body (two syscalls, two segments with
        # TCP_NODELAY); a body of bytes goes out with its head in one send instead.
        self._hold_head = isinstance(body, bytes) and bool(body) and not kwargs.get("chunked")
        try:
            super().request(method, url, body=body, headers=headers, **kwargs)
        finally:
            self._hold_head = False
            self._held_head = None  # only left when the body's send never came (it raised)

    def send(self, data: Any) -> None:
        if self._hold_head:
            self._hold_head = False
            self._held_head = bytes(data)
            return
        held = self._held_head
        if held is not None:
            self._held_head = None
            if isinstance(data, bytes):
                data = held + data
            else:
                super().send(held)
        super().send(data)

    def getresponse(self) -> urllib3.response.HTTPResponse:  # type: ignore[override]
        watch = _CLIENT_WATCH.get()
        sock = self.sock
        if watch is not None and sock is not None:
            # The read timeout urllib3 set on the connection (the socket still has the connect
            # timeout: urllib3 applies the read one in getresponse, after this wait).
            timeout = self.timeout
            watch.wait_readable(sock, float(timeout) if isinstance(timeout, (int, float))
                                else None)
        return super().getresponse()


class _WatchedPool(urllib3.connectionpool.HTTPConnectionPool):
    ConnectionCls = _WatchedConnection


@dataclass(frozen=True)
class ProxySettings:
    """Upstream timeouts and pool size.

    :ivar connect_timeout_s: TCP connect bound per attempt, seconds (> 0).
    :ivar read_timeout_s: bound of the wait for the response head and between body reads,
        seconds (> 0); a long prefill must fit in it.
    :ivar pool_maxsize: kept-alive connections per upstream.
    """

    connect_timeout_s: float = 2.0
    read_timeout_s: float = 600.0
    pool_maxsize: int = 64


def _connection_tokens(headers: Mapping[str, str]) -> set[str]:
    value = headers.get("Connection") or headers.get("connection") or ""
    return {t.strip().lower() for t in value.split(",") if t.strip()}


#: Lowercase names never forwarded upstream / never relayed down (besides those the
#: ``Connection`` header names).
_NOT_UP = HOP_BY_HOP | _DROP_UP
_NOT_DOWN = HOP_BY_HOP | _DROP_DOWN


def upstream_headers(headers: Sequence[tuple[str, str]]) -> dict[str, str]:
    """Request headers to forward: hop-by-hop, ``Host``, ``Content-Length`` and the internal
    token removed.

    :param headers: the client's headers as (name, value) pairs.
    """
    out: dict[str, str] = {}
    connection: dict[str, str] = {}
    for k, v in headers:
        if k == "Connection" or k == "connection":
            connection[k] = v  # the last of each spelling, as a dict of the pairs keeps it
        if k.lower() not in _NOT_UP:
            out[k] = v
    named = _connection_tokens(connection) if connection else set()
    if named:
        out = {k: v for k, v in out.items() if k.lower() not in named}
    return out


def downstream_headers(headers: Mapping[str, str]) -> list[tuple[str, str]]:
    """Response headers to relay: hop-by-hop and ``Content-Length`` removed."""
    named = _connection_tokens(headers)
    if not named:
        return [(k, v) for k, v in headers.items() if k.lower() not in _NOT_DOWN]
    return [(k, v) for k, v in headers.items()
            if k.lower() not in _NOT_DOWN and k.lower() not in named]


def _no_error(target: str, kind: str) -> None:
    """The error counter of a body built without a :class:`Proxy` (counts nothing)."""


@dataclass(frozen=True)
class RelayEnd:
    """How the relay of one upstream body ended (:meth:`UpstreamBody.when_closed`).

    :ivar target: the upstream ``host:port``.
    :ivar bytes_relayed: body bytes handed on, undecoded.
    :ivar first_data_at: ``time.monotonic()`` seconds when the first chunk holding an SSE
        ``data:`` line was handed on; ``None`` when there was none (or the body is no event
        stream).
    :ivar ended_at: ``time.monotonic()`` seconds of the close (after the last byte relayed).
    :ivar complete: the body was read to its end (False: it broke, or was closed before the
        end because the client went away).
    :ivar broken: the error that broke the body (as logged), ``None`` when it did not break.
    """

    target: str
    bytes_relayed: int
    first_data_at: Optional[float]
    ended_at: float
    complete: bool
    broken: Optional[str]


class UpstreamBody:
    """The upstream body as a WSGI iterable: chunks as they arrive, the upstream connection
    closed by :meth:`close` (called by the WSGI server when the response ends or the client
    goes away, even before the first chunk was read).

    :param response: a ``urllib3`` response opened with ``preload_content=False``.
    :param target: the upstream ``host:port`` (for logs).
    :param dispatch: the request's in-flight count, released by :meth:`close`; ``None``: not
        counted.
    :param path: the request path (for logs).
    :param count_error: called with ``(target, kind)`` when the body breaks (kind
        ``broken_body`` or ``timeout``, :data:`UPSTREAM_ERROR_KINDS`).
    :param tracker: fed every chunk handed on and, from :meth:`close`, how the relay ended
        (the request observer's events, §12); ``None``: not observed.

    :ivar bytes_relayed: body bytes handed on so far.
    :ivar broken: the error that broke the body, ``None`` while it has not.
    """

    def __init__(self, response: urllib3.response.BaseHTTPResponse, target: str,
                 dispatch: Optional[Dispatch] = None, path: str = "",
                 count_error: Callable[[str, str], None] = _no_error,
                 tracker: Optional[RelayTracker] = None) -> None:
        self._response = response
        self._tracker = tracker
        self.target = target
        self.path = path
        self._dispatch = dispatch
        self._count_error = count_error
        self._lock = threading.Lock()
        self._closed = False
        self._complete = False
        self._on_close: Optional[Callable[[RelayEnd], None]] = None
        self._event_stream = (response.headers.get("Content-Type", "").split(";")[0].strip()
                              .lower() == "text/event-stream")
        self._tail = b"\n"  # what precedes the next chunk: the stream starts a line
        # An OpenAI completions stream ends with "data: [DONE]"; one that ends without it was
        # cut (an engine answering HTTP/1.0 without Content-Length frames its body by EOF).
        self._expect_done = (self._event_stream and response.status == 200
                             and path.split("?", 1)[0].endswith("/completions"))
        self._last = b""   # the stream's last bytes, while _expect_done
        self.first_data_at: Optional[float] = None
        self.bytes_relayed = 0
        self.broken: Optional[str] = None

    def when_closed(self, callback: Callable[[RelayEnd], None]) -> None:
        """Call ``callback`` once, from :meth:`close`, with how the relay ended (replaces an
        earlier callback). It runs on the thread that closes the body (the WSGI server's),
        outside any request context; an exception from it is logged, never raised."""
        self._on_close = callback

    def __iter__(self) -> Iterator[bytes]:
        """Chunks as they arrive, undecoded, until the body ends or :meth:`close`.

        :raises UpstreamTimeout: no bytes within the read timeout (after the head; logged,
            counted as ``timeout``).
        :raises UpstreamUnreachable: the body broke: reset, or cut short of its framing
            (logged, counted as ``broken_body``).
        """
        raw = self._response
        while True:
            with self._lock:
                if self._closed:
                    return
            try:
                chunk = raw.read1(READ_CHUNK_BYTES, decode_content=False)
            except urllib3.exceptions.ReadTimeoutError as exc:
                raise self._broke(exc, "timeout") from exc
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                raise self._broke(exc, "broken_body") from exc
            if not chunk:
                if self._expect_done and not _ends_with_done(self._last):
                    raise self._broke(TruncatedBody(
                        "the event stream ended without its final DONE event"), "broken_body")
                self._complete = True
                return
            if self._expect_done:
                self._last = (chunk[-_DONE_TAIL_BYTES:] if len(chunk) >= _DONE_TAIL_BYTES
                              else (self._last + chunk)[-_DONE_TAIL_BYTES:])
            self.bytes_relayed += len(chunk)
            if self._event_stream and self.first_data_at is None:
                self._note_data(chunk)
            if self._tracker is not None:
                self._tracker.chunk(chunk)
            yield chunk

    def _note_data(self, chunk: bytes) -> None:
        # A data line starts the stream or follows a line end; the tail of the previous chunk
        # covers a "data:" split across two reads.
        seen = self._tail + chunk
        at = seen.find(_SSE_DATA)
        while at >= 0:
            if at > 0 and seen[at - 1:at] in (b"\n", b"\r"):
                self.first_data_at = time.monotonic()
                return
            at = seen.find(_SSE_DATA, at + 1)
        self._tail = seen[-len(_SSE_DATA):]

    def _broke(self, exc: BaseException, kind: str) -> UpstreamError:
        """Record, count and log (one WARNING) a body that broke; the error to raise."""
        # urllib3's ProtocolError repeats its cause in its args: name the first one only.
        args = exc.args
        reason = args[0] if args and isinstance(args[0], str) else str(exc)
        self.broken = f"{type(exc).__name__}: {reason}"
        self._count_error(self.target, kind)
        log.warning("upstream %s: %s body broken after %d bytes relayed (%s)", self.target,
                    self.path or "-", self.bytes_relayed, self.broken)
        if kind == "timeout":
            return UpstreamTimeout(f"upstream {self.target} timed out in the body after "
                                   f"{self.bytes_relayed} bytes")
        return UpstreamUnreachable(f"upstream {self.target} broke the body after "
                                   f"{self.bytes_relayed} bytes: {self.broken}")

    def read_all(self) -> bytes:
        """The whole remaining body (non-streamed answers); the body is closed afterwards.

        :raises UpstreamTimeout: a read timed out (nothing was sent to the client yet; logged,
            counted as ``timeout``).
        :raises UpstreamUnreachable: the body broke (nothing was sent to the client yet;
            logged, counted as ``broken_body``).
        """
        try:
            data = b"".join(self)
            if data and self._eof_framed and self._is_json and not _parses(data):
                # Read to EOF, yet no JSON document: cut short by an engine that frames its
                # body by closing the connection (no Content-Length, not chunked).
                self._complete = False
                raise self._broke(TruncatedBody(f"the JSON body ended after {len(data)} "
                                                "bytes, incomplete"), "broken_body")
            return data
        finally:
            self.close()

    @property
    def _eof_framed(self) -> bool:
        """True when only the connection's close ends the body (no chunked framing, no
        ``Content-Length``): urllib3 raises on a body short of either framing itself."""
        return not self._response.chunked and self._response.length_remaining is None

    @property
    def _is_json(self) -> bool:
        ctype = self._response.headers.get("Content-Type", "")
        return ctype.split(";")[0].strip().lower() == "application/json"

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        with self._lock:
            return self._closed

    def close(self) -> None:
        """Close the upstream response (and its connection when unfinished), release its
        in-flight count, then hand the :class:`RelayEnd` to the :meth:`when_closed` callback.
        Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            if not self._complete:
                self._response.close()  # unfinished: the connection cannot be reused
            self._response.release_conn()
        finally:
            if self._dispatch is not None:
                self._dispatch.release()
            if self._tracker is not None:
                try:
                    self._tracker.finish(self._complete, self.broken)
                except Exception:  # noqa: BLE001 - the WSGI server's close must not fail
                    log.exception("upstream %s: request observer failed", self.target)
            callback = self._on_close
            if callback is not None:
                end = RelayEnd(self.target, self.bytes_relayed, self.first_data_at,
                               time.monotonic(), self._complete, self.broken)
                try:
                    callback(end)
                except Exception:  # noqa: BLE001 - the WSGI server's close must not fail
                    log.exception("upstream %s: relay end callback failed", self.target)


@dataclass
class UpstreamReply:
    """A response head from an upstream plus its body.

    :ivar target: the upstream that answered (``host:port``).
    :ivar status: its HTTP status.
    :ivar headers: relayable headers (see :func:`downstream_headers`).
    :ivar body: the body; the caller must relay or close it.
    :ivar attempts: upstreams tried, in order, the last one being ``target``.
    """

    target: str
    status: int
    headers: list[tuple[str, str]]
    body: UpstreamBody
    attempts: list[str] = field(default_factory=list)

    @property
    def is_event_stream(self) -> bool:
        """True for ``text/event-stream`` (SSE) answers."""
        return any(k.lower() == "content-type" and v.split(";")[0].strip().lower()
                   == "text/event-stream" for k, v in self.headers)


def _refused(exc: BaseException) -> bool:
    """True when a connection error comes from a refused connect (urllib3's
    ``NewConnectionError``: nothing listens), False for a reset or a close before the head."""
    seen: set[int] = set()
    stack: list[object] = [exc]
    while stack:
        err = stack.pop()
        if id(err) in seen or not isinstance(err, BaseException):
            continue
        seen.add(id(err))
        if isinstance(err, (urllib3.exceptions.NewConnectionError, ConnectionRefusedError)):
            return True
        stack.extend((*err.args, getattr(err, "reason", None), err.__cause__,
                      err.__context__))
    return False


class Proxy:
    """Forwards requests to instances over pooled connections. Thread-safe.

    :param settings: timeouts and pool size.
    :param in_flight: where each attempt is counted while in flight (``None``: not counted).
    :param observer: hears every attempt's lifecycle (§12, :mod:`kvsvc.routing.observer`);
        ``None``: nobody.
    """

    def __init__(self, settings: ProxySettings, in_flight: Optional[InFlight] = None,
                 observer: Optional[RequestObserver] = None) -> None:
        self.settings = settings
        self.in_flight = in_flight
        self.observer = observer
        # Connections kept per upstream: one per request thread (block=False: a burst beyond
        # it opens more and drops the surplus afterwards).
        self._pools = urllib3.PoolManager(num_pools=256, maxsize=settings.pool_maxsize,
                                          block=False, retries=False)
        self._pools.pool_classes_by_scheme = {**self._pools.pool_classes_by_scheme,
                                              "http": _WatchedPool}
        self._timeout = urllib3.Timeout(connect=settings.connect_timeout_s,
                                        read=settings.read_timeout_s)
        #: ``host:port`` -> its pool in the manager, kept (looking it up builds a pool key,
        #: ~10 us); bounded: cleared when full.
        self._pool_of: dict[str, urllib3.connectionpool.HTTPConnectionPool] = {}
        self._lock = threading.Lock()
        self._failures: dict[str, int] = {}
        self._errors: dict[tuple[str, str], int] = {}
        self._retries = 0
        self._client_gone = 0

    def add_observer(self, observer: RequestObserver) -> None:
        """Hear every attempt with ``observer`` too, after the ones given so far (e.g. the HTTP
        layer's token metrics). Call before serving."""
        current = self.observer
        if current is None:
            self.observer = observer
        elif isinstance(current, ObserverChain):  # one flat chain: its observers, then this
            self.observer = ObserverChain([*current.observers, observer])
        else:
            self.observer = ObserverChain([current, observer])

    def client_gone(self) -> int:
        """Attempts cancelled because their client went away before the response head."""
        with self._lock:
            return self._client_gone

    def failures(self) -> dict[str, int]:
        """Upstream ``host:port`` -> attempts that failed before the first byte."""
        with self._lock:
            return dict(self._failures)

    def errors(self) -> dict[tuple[str, str], int]:
        """``(host:port, kind)`` -> upstream errors counted (kinds :data:`UPSTREAM_ERROR_KINDS`,
        see the module docstring); pairs that never happened are absent."""
        with self._lock:
            return dict(self._errors)

    def count_error(self, target: str, kind: str) -> None:
        """Count one upstream error of ``kind`` (one of :data:`UPSTREAM_ERROR_KINDS`) at
        ``target``."""
        with self._lock:
            self._errors[(target, kind)] = self._errors.get((target, kind), 0) + 1

    def retries(self) -> int:
        """Attempts made on a next candidate after one failed before the first byte."""
        with self._lock:
            return self._retries

    def _mark(self, target: str, retrying: bool, kind: str) -> None:
        with self._lock:
            self._failures[target] = self._failures.get(target, 0) + 1
            self._errors[(target, kind)] = self._errors.get((target, kind), 0) + 1
            self._retries += retrying

    def forward(self, targets: Sequence[str], path: str, body_for: Callable[[str], bytes],
                headers: Mapping[str, str], max_attempts: int = 2,
                companions: Sequence[str] = (),
                info_for: Optional[InfoFor] = None,
                dp_ranks: Mapping[str, int] = MappingProxyType({}),
                client: Optional[ClientWatch] = None) -> UpstreamReply:
        """POST ``path`` to ``targets[0]``; on a connection failure before any byte of the
        response head (refused, connect timeout, reset), once more to ``targets[1]`` (at most
        ``max_attempts`` upstreams in all). A read timeout is not retried: the upstream
        accepted the request.

        :param targets: upstream ``host:port`` names, best first (at least one).
        :param path: request path with query string, e.g. ``/v1/completions``.
        :param body_for: the body to send to a given target (P/D bodies name the prefill).
        :param headers: headers to send (already filtered, :func:`upstream_headers`).
        :param max_attempts: upstreams tried at most.
        :param companions: instances counted in flight along with each attempt's target (the
            D named in a P/D body).
        :param info_for: describes the attempt sent to a target for the proxy's observer
            (``None``: the attempt is not observed).
        :param dp_ranks: target -> the DP rank to run on there (§15): sent as
            :data:`DP_RANK_HEADER` (replacing the client's) and counted in flight per rank.
        :param client: the client's connection, watched while waiting for the head
            (``None``: not watched).
        :returns: the reply; its body holds the attempt's in-flight count until closed.
        :raises ClientGone: the client went away before the head; the upstream connection
            was closed (counted in :meth:`client_gone`, the attempt cancelled, not retried).
        :raises UpstreamTimeout: no head within the read timeout (not retried), or every
            attempt failed, the last one by a connect timeout.
        :raises UpstreamUnreachable: every attempt failed, the last one refused or reset.
        """
        tried: list[str] = []
        last: Optional[UpstreamError] = None
        for target in list(targets)[:max_attempts]:
            tried.append(target)
            data = body_for(target)
            rank = dp_ranks.get(target)
            sent: Mapping[str, str] = headers
            if rank is not None:
                ranked = {k: v for k, v in headers.items() if k.lower() != _DP_RANK_LOWER}
                ranked[DP_RANK_HEADER] = str(rank)
                sent = ranked
            dispatch = (self.in_flight.begin((target, *companions),
                                             None if rank is None else (target, rank))
                        if self.in_flight is not None else None)
            info = (info_for(target) if info_for is not None and self.observer is not None
                    else None)
            if info is not None:
                notify(self.observer, "on_dispatch", info)
            try:
                response = self._post(target, path, data, sent, client)
            except ClientGone as exc:
                if dispatch is not None:
                    dispatch.release()
                if info is not None:
                    notify(self.observer, "on_cancel", info, CANCEL_CLIENT_GONE)
                with self._lock:
                    self._client_gone += 1
                log.info("upstream %s: %s cancelled, the client went away before the response "
                         "head", target, path)
                raise ClientGone(f"upstream {target}: cancelled, the client went away") from exc
            except urllib3.exceptions.NewConnectionError as exc:  # a ConnectTimeoutError too
                last = UpstreamUnreachable(f"upstream {target}: connection failed")
                kind = "refused" if _refused(exc) else "reset"
                why = ("connection refused" if kind == "refused"
                       else "connection reset or closed before the response head")
                cause: Exception = exc
            except urllib3.exceptions.ConnectTimeoutError as exc:
                last = UpstreamTimeout(f"upstream {target}: connect timed out")
                why, kind = "connect timeout", "timeout"
                cause = exc
            except urllib3.exceptions.ReadTimeoutError as exc:
                # The upstream accepted the request: never re-sent to a second one (§15).
                if dispatch is not None:
                    dispatch.release()
                if info is not None:
                    notify(self.observer, "on_cancel", info,
                           f"{CANCEL_UPSTREAM_FAILED}: read timeout")
                self._mark(target, False, "timeout")
                log.warning("upstream %s: no response head within %s s; not re-sent (it "
                            "accepted the request)", target, self.settings.read_timeout_s)
                tried_text = ", ".join(tried)
                raise UpstreamTimeout(f"upstream {target}: no response within "
                                      f"{self.settings.read_timeout_s} s (tried {tried_text})"
                                      ) from exc
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                last = UpstreamUnreachable(f"upstream {target}: connection failed")
                kind = "refused" if _refused(exc) else "reset"
                why = ("connection refused" if kind == "refused"
                       else "connection reset or closed before the response head")
                cause = exc
            except BaseException as exc:
                if dispatch is not None:
                    dispatch.release()
                if info is not None:
                    notify(self.observer, "on_cancel", info,
                           f"{CANCEL_UPSTREAM_FAILED}: {type(exc).__name__}")
                raise
            else:
                tracker = None
                if info is not None and self.observer is not None:
                    event_stream = (response.headers.get("Content-Type", "").split(";")[0]
                                    .strip().lower() == "text/event-stream")
                    tracker = RelayTracker(self.observer, info, response.status,
                                           event_stream)
                body = UpstreamBody(response, target, dispatch, path, self.count_error,
                                    tracker)
                if response.status >= 500:
                    self.count_error(target, "http_5xx")
                try:
                    reply = UpstreamReply(target, response.status,
                                          downstream_headers(response.headers), body, tried)
                except BaseException:
                    body.close()
                    raise
                if len(tried) > 1:
                    log.info("upstream %s answered %d after retry (tried %s)", target,
                             response.status, ", ".join(tried))
                return reply
            # Failed before the first byte: this attempt is over (a retry is a new dispatch).
            if dispatch is not None:
                dispatch.release()
            if info is not None:
                notify(self.observer, "on_cancel", info, f"{CANCEL_UPSTREAM_FAILED}: {why}")
            retrying = len(tried) < min(max_attempts, len(targets))
            self._mark(target, retrying, kind)
            log.warning("upstream %s failed before the first byte (%s: %s)%s", target, why,
                        type(cause).__name__, "; retrying on the next candidate" if retrying
                        else "")
            last.__cause__ = cause
        assert last is not None, "forward() needs at least one target"
        raise type(last)(f"{last.message} (tried {', '.join(tried)})") from last.__cause__

    def _post(self, target: str, path: str, data: bytes, headers: Mapping[str, str],
              client: Optional[ClientWatch]) -> urllib3.response.BaseHTTPResponse:
        """One upstream POST of ``path`` to ``target`` (``host:port``) up to its response
        head, the client watched meanwhile; on ``target``'s pool (what the pool manager's
        ``urlopen`` does without redirects, minus parsing the URL again per request)."""
        pool = self._pool_of.get(target)
        if pool is None or pool.pool is None:  # not yet, or closed
            url = urllib3.util.parse_url(f"http://{target}")
            pool = self._pools.connection_from_host(url.host or "", url.port or 80,
                                                    scheme="http")
            if len(self._pool_of) >= _MAX_POOLS:
                self._pool_of = {}  # forgotten, not closed: requests may be using them
            self._pool_of[target] = pool
        watched = _CLIENT_WATCH.set(client)
        try:
            return pool.urlopen("POST", path, body=data, headers=headers,
                                preload_content=False, decode_content=False,
                                redirect=False, retries=False, assert_same_host=False,
                                timeout=self._timeout)
        finally:
            _CLIENT_WATCH.reset(watched)

    def close(self) -> None:
        """Close the pooled connections. Idempotent."""
        # urllib3 2.x's PoolManager.clear() only forgets its pools (no dispose function), so
        # close each pool's kept-alive connections explicitly.
        kept, self._pool_of = list(self._pool_of.values()), {}
        for kept_pool in kept:  # one the manager evicted is no longer among its pools
            kept_pool.close()
        pools = self._pools.pools
        for key in list(pools.keys()):
            pool = pools.get(key)
            if pool is not None:
                pool.close()
        self._pools.clear()
