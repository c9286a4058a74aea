"""Upstream forwarding of OpenAI requests to the chosen instance (§11, issue 5).

One :class:`Proxy` per app holds a pooled ``requests.Session`` (no environment proxies, no
cookies, no automatic retries) used by request threads concurrently. :meth:`Proxy.forward`
sends one request with ``stream=True`` and connect/read timeouts:

- an upstream that refuses the connection, fails to connect in time, or sends no response
  head within the read timeout ("before the first byte") is counted as failed, logged, and the
  request is sent once more to the next candidate of the policy's ranking; after the response
  head arrived nothing is retried: the upstream's status, headers and body are passed through
  (a body broken mid-stream ends the stream);
- hop-by-hop headers (RFC 9110 §7.6.1, and any named in ``Connection``) are dropped both ways,
  as are ``Host``, ``Content-Length`` and ``X-Internal-Token`` on the way up;
- the body is relayed as it arrives (:class:`UpstreamBody`), undecoded (``Content-Encoding``
  kept); when the client goes away the WSGI server closes the body, which closes the upstream
  connection at once.
- every attempt is counted in the service's :class:`~kvsvc.routing.in_flight.InFlight` (when given) from
  the moment it is sent until it ends: released at once when it fails before the first byte
  (the retry is a new dispatch to the next candidate), else when the body is closed (read to
  the end, broken, or closed by the WSGI server because the response ended or the client went
  away). :class:`UpstreamBody.close` is idempotent, so the count drops exactly once.

Errors (module boundary: ``requests`` and ``urllib3`` errors are translated here, ``raise ...
from exc``): :class:`~kvsvc.errors.UpstreamTimeout` when the last attempt (or a body read)
timed out, :class:`~kvsvc.errors.UpstreamUnreachable` when it was refused, reset or broken; both
are :class:`~kvsvc.errors.UpstreamError` (the HTTP layer answers 504 and 502).
"""

from __future__ import annotations

import http.cookiejar
import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, Optional, Sequence

import requests
import requests.adapters
import urllib3.exceptions

from kvsvc.errors import UpstreamError, UpstreamTimeout, UpstreamUnreachable
from kvsvc.routing.in_flight import Dispatch, InFlight

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


def upstream_headers(headers: Sequence[tuple[str, str]]) -> dict[str, str]:
    """Request headers to forward: hop-by-hop, ``Host``, ``Content-Length`` and the internal
    token removed.

    :param headers: the client's headers as (name, value) pairs.
    """
    named = _connection_tokens(dict(headers))
    return {k: v for k, v in headers
            if k.lower() not in HOP_BY_HOP and k.lower() not in _DROP_UP
            and k.lower() not in named}


def downstream_headers(headers: Mapping[str, str]) -> list[tuple[str, str]]:
    """Response headers to relay: hop-by-hop and ``Content-Length`` removed."""
    named = _connection_tokens(headers)
    return [(k, v) for k, v in headers.items()
            if k.lower() not in HOP_BY_HOP and k.lower() not in _DROP_DOWN
            and k.lower() not in named]


class UpstreamBody:
    """The upstream body as a WSGI iterable: chunks as they arrive, the upstream connection
    closed by :meth:`close` (called by the WSGI server when the response ends or the client
    goes away, even before the first chunk was read).

    :param response: a ``requests`` response opened with ``stream=True``.
    :param target: the upstream ``host:port`` (for logs).
    :param dispatch: the request's in-flight count, released by :meth:`close`; ``None``: not
        counted.
    """

    def __init__(self, response: requests.Response, target: str,
                 dispatch: Optional[Dispatch] = None) -> None:
        self._response = response
        self.target = target
        self._dispatch = dispatch
        self._lock = threading.Lock()
        self._closed = False
        self.bytes_relayed = 0

    def __iter__(self) -> Iterator[bytes]:
        raw = self._response.raw
        while True:
            with self._lock:
                if self._closed:
                    return
            try:
                chunk = raw.read1(READ_CHUNK_BYTES, decode_content=False)
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                # After the first byte errors are passed through: the stream just ends.
                log.warning("upstream %s: body broken after %d bytes: %s", self.target,
                            self.bytes_relayed, exc)
                return
            if not chunk:
                return
            self.bytes_relayed += len(chunk)
            yield chunk

    def read_all(self) -> bytes:
        """The whole remaining body (non-streamed answers).

        :raises UpstreamTimeout: a read timed out (nothing was sent to the client yet).
        :raises UpstreamUnreachable: the body broke (nothing was sent to the client yet).
        """
        parts: list[bytes] = []
        raw = self._response.raw
        try:
            while True:
                chunk = raw.read1(READ_CHUNK_BYTES, decode_content=False)
                if not chunk:
                    return b"".join(parts)
                parts.append(chunk)
        except urllib3.exceptions.ReadTimeoutError as exc:
            raise UpstreamTimeout(f"upstream {self.target} timed out in the body") from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise UpstreamUnreachable(f"upstream {self.target} broke the body: {exc}") from exc
        finally:
            self.close()

    def close(self) -> None:
        """Close the upstream response (and its connection when unfinished) and release its
        in-flight count. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._response.close()
        finally:
            if self._dispatch is not None:
                self._dispatch.release()


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


class Proxy:
    """Forwards requests to instances over a pooled session. Thread-safe.

    :param settings: timeouts and pool size.
    :param in_flight: where each attempt is counted while in flight (``None``: not counted).
    """

    def __init__(self, settings: ProxySettings, in_flight: Optional[InFlight] = None) -> None:
        self.settings = settings
        self.in_flight = in_flight
        self._session = requests.Session()
        self._session.trust_env = False        # never an environment HTTP proxy, never .netrc
        self._session.headers.clear()          # only what the client sent goes up
        self._session.cookies.set_policy(http.cookiejar.DefaultCookiePolicy(allowed_domains=[]))
        adapter = requests.adapters.HTTPAdapter(pool_connections=16,
                                                pool_maxsize=settings.pool_maxsize,
                                                max_retries=0)
        self._session.mount("http://", adapter)
        self._adapter = adapter
        self._lock = threading.Lock()
        self._failures: dict[str, int] = {}
        self._retries = 0

    def failures(self) -> dict[str, int]:
        """Upstream ``host:port`` -> attempts that failed before the first byte."""
        with self._lock:
            return dict(self._failures)

    def retries(self) -> int:
        """Attempts made on a next candidate after one failed before the first byte."""
        with self._lock:
            return self._retries

    def _mark(self, target: str, retrying: bool) -> None:
        with self._lock:
            self._failures[target] = self._failures.get(target, 0) + 1
            self._retries += retrying

    def forward(self, targets: Sequence[str], path: str, body_for: Callable[[str], bytes],
                headers: Mapping[str, str], max_attempts: int = 2,
                companions: Sequence[str] = ()) -> UpstreamReply:
        """POST ``path`` to ``targets[0]``; on a refusal or timeout before the response head,
        once more to ``targets[1]`` (at most ``max_attempts`` upstreams in all).

        :param targets: upstream ``host:port`` names, best first (at least one).
        :param path: request path with query string, e.g. ``/v1/completions``.
        :param body_for: the body to send to a given target (P/D bodies name the prefill).
        :param headers: headers to send (already filtered, :func:`upstream_headers`).
        :param max_attempts: upstreams tried at most.
        :param companions: instances counted in flight along with each attempt's target (the
            D named in a P/D body).
        :returns: the reply; its body holds the attempt's in-flight count until closed.
        :raises UpstreamTimeout: every attempt failed, the last one by a timeout.
        :raises UpstreamUnreachable: every attempt failed, the last one refused or reset.
        """
        tried: list[str] = []
        last: Optional[UpstreamError] = None
        for target in list(targets)[:max_attempts]:
            tried.append(target)
            data = body_for(target)
            dispatch = (self.in_flight.begin((target, *companions))
                        if self.in_flight is not None else None)
            try:
                response = self._session.post(
                    f"http://{target}{path}", data=data, headers=dict(headers),
                    stream=True, allow_redirects=False,
                    timeout=(self.settings.connect_timeout_s, self.settings.read_timeout_s))
            except requests.exceptions.ConnectTimeout as exc:
                last = UpstreamTimeout(f"upstream {target}: connect timed out")
                why = "connect timeout"
                cause: Exception = exc
            except requests.exceptions.ReadTimeout as exc:
                last = UpstreamTimeout(f"upstream {target}: no response within "
                                       f"{self.settings.read_timeout_s} s")
                why = "read timeout before the first byte"
                cause = exc
            except requests.exceptions.ConnectionError as exc:
                last = UpstreamUnreachable(f"upstream {target}: connection failed")
                why = "connection refused or reset"
                cause = exc
            except BaseException:
                if dispatch is not None:
                    dispatch.release()
                raise
            else:
                body = UpstreamBody(response, target, dispatch)
                try:
                    reply = UpstreamReply(target, response.status_code,
                                          downstream_headers(response.headers), body, tried)
                except BaseException:
                    body.close()
                    raise
                if len(tried) > 1:
                    log.info("upstream %s answered %d after retry (tried %s)", target,
                             response.status_code, ", ".join(tried))
                return reply
            # Failed before the first byte: this attempt is over (a retry is a new dispatch).
            if dispatch is not None:
                dispatch.release()
            retrying = len(tried) < min(max_attempts, len(targets))
            self._mark(target, retrying)
            log.warning("upstream %s failed before the first byte (%s: %s)%s", target, why,
                        type(cause).__name__, "; retrying on the next candidate" if retrying
                        else "")
            last.__cause__ = cause
        assert last is not None, "forward() needs at least one target"
        raise type(last)(f"{last.message} (tried {', '.join(tried)})") from last.__cause__

    def close(self) -> None:
        """Close the pooled connections. Idempotent."""
        # urllib3 2.x's PoolManager.clear() only forgets its pools (no dispose function), so
        # close each pool's kept-alive connections explicitly.
        pools = self._adapter.poolmanager.pools
        for key in list(pools.keys()):
            pool = pools.get(key)
            if pool is not None:
                pool.close()
        self._session.close()
