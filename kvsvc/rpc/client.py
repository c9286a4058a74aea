"""A pooled brpc ``baidu_std`` caller (§13): how kvsvc calls an xLLM engine's
``xllm.proto.XllmAPIService.ChatCompletions`` / ``Completions`` (and how tests and the
simulated engine call ``XllmRpcService``).

One connection per target ``host:port``, shared by every calling thread, as brpc's
``connection_type`` "single": each call gets its correlation id from the connection's codec
(:class:`~kvsvc.rpc.codec.Connection`), is written under the connection's send lock, and
waits for the answer with that id, so answers may come in any order. Each connection has one
reader thread (``kvsvc-rpc-client``) that decodes answers and wakes their callers.

Errors, translated once here (the :mod:`kvsvc.errors` tree):

- :class:`~kvsvc.errors.RpcUnreachable` (an ``UpstreamUnreachable``): connect refused or
  failed, the connection reset or closed before the answer (every call waiting on it fails at
  once, and the next call connects again);
- :class:`~kvsvc.errors.RpcTimeout` (an ``UpstreamTimeout``): no connection within
  ``connect_timeout_s``, or no answer within the call's ``timeout_s`` (a late answer is
  dropped);
- :class:`~kvsvc.errors.RpcCallFailed`: the server answered with an ``error_code``
  (ENOSERVICE, ENOMETHOD, EREQUEST, ...), or an answer the codec refused (ERESPONSE);
- :class:`~kvsvc.errors.RpcMessageError`: the answer does not parse as the expected message.

A stream the codec finds broken closes the connection and fails its calls as unreachable.
:meth:`RpcClient.close` closes every connection and joins every reader thread.
"""

from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass
from typing import Any, Optional

from kvsvc.address import parse_host_port
from kvsvc.errors import (
    LifecycleError,
    RpcCallFailed,
    RpcProtocolError,
    RpcTimeout,
    RpcUnreachable,
)
from kvsvc.rpc import codec, messages
from kvsvc.rpc.codec import BadCall, Response

log = logging.getLogger(__name__)

_RECV_BYTES = 256 * 1024


class _Waiter:
    """One call waiting for its answer."""

    __slots__ = ("event", "response", "error")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.response: Optional[Response] = None
        self.error: Optional[Exception] = None


class _Channel:
    """One connection to one target and its reader thread."""

    def __init__(self, target: str, sock: socket.socket, max_body_size: int) -> None:
        self.target = target
        self._sock = sock
        self._codec = codec.Connection(codec.Role.CLIENT, max_body_size)
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._waiting: dict[int, _Waiter] = {}
        self._closed: Optional[str] = None
        self._thread = threading.Thread(target=self._read, name="kvsvc-rpc-client",
                                        daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._closed is not None

    def call(self, service: str, method: str, message: bytes, attachment: bytes,
             compress_type: int, timeout_s: float) -> Response:
        waiter = _Waiter()
        with self._send_lock:
            if self._closed is not None:
                raise RpcUnreachable(f"baidu_std {self.target}: {self._closed}")
            cid, frame = self._codec.send_request(
                service, method, message, attachment=attachment, compress_type=compress_type,
                timeout_ms=max(1, int(timeout_s * 1000)))
            with self._lock:
                self._waiting[cid] = waiter
            try:
                self._sock.sendall(frame)
            except OSError as exc:
                self._fail(f"send failed: {exc}")
        if not waiter.event.wait(timeout_s):
            with self._lock:
                self._waiting.pop(cid, None)
            if not waiter.event.is_set():
                raise RpcTimeout(f"baidu_std {self.target} {service}.{method}: no answer "
                                 f"within {timeout_s:g} s")
        if waiter.error is not None:
            raise waiter.error
        assert waiter.response is not None
        return waiter.response

    def _read(self) -> None:
        why = "connection closed by the peer"
        try:
            while True:
                try:
                    data = self._sock.recv(_RECV_BYTES)
                except OSError as exc:
                    why = f"connection broken: {exc}"
                    return
                try:
                    events = self._codec.receive_data(data)
                except RpcProtocolError as exc:
                    why = f"broken stream: {exc}"
                    log.warning("baidu_std %s: %s; closing", self.target, exc)
                    return
                for event in events:
                    with self._lock:
                        waiter = self._waiting.pop(event.correlation_id, None)
                    if waiter is None:
                        continue  # its caller gave up (timeout)
                    if isinstance(event, BadCall):
                        waiter.error = RpcCallFailed(event.error_code, event.error_text)
                    elif isinstance(event, Response):
                        waiter.response = event
                    waiter.event.set()
                if self._codec.broken is not None:
                    why = f"broken stream: {self._codec.broken}"
                    log.warning("baidu_std %s: %s; closing", self.target, self._codec.broken)
                    return
                if not data:
                    return
        finally:
            self._fail(why)

    def _fail(self, why: str) -> None:
        with self._lock:
            if self._closed is None:
                self._closed = why
            waiting, self._waiting = self._waiting, {}
        for waiter in waiting.values():
            waiter.error = RpcUnreachable(f"baidu_std {self.target}: {why}")
            waiter.event.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self, timeout_s: float) -> bool:
        """Close the connection, fail its calls, join the reader; True when it stopped."""
        self._fail("client closed")
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        self._sock.close()
        return not self._thread.is_alive()


@dataclass(frozen=True, slots=True)
class ClientSettings:
    """Bounds of an :class:`RpcClient`.

    :param connect_timeout_s: TCP connect bound, seconds.
    :param timeout_s: default bound of one call's answer, seconds.
    :param max_body_size: the codec's body bound, bytes.
    """

    connect_timeout_s: float = 2.0
    timeout_s: float = 5.0
    max_body_size: int = codec.MAX_BODY_SIZE


class RpcClient:
    """Pooled baidu_std caller (module docstring). Thread-safe. Nothing starts before the
    first call; :meth:`close` stops everything (a later call raises
    :class:`~kvsvc.errors.RpcUnreachable`)."""

    def __init__(self, settings: ClientSettings = ClientSettings()) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._channels: dict[str, _Channel] = {}
        self._connecting: dict[str, threading.Lock] = {}
        self._closed = False

    def call(self, target: str, service: str, method: str, message: bytes, *,
             attachment: bytes = b"", compress_type: int = codec.COMPRESS_NONE,
             timeout_s: Optional[float] = None) -> Response:
        """Call ``service.method`` on ``target`` and wait for its answer.

        :param target: ``host:port`` of the baidu_std server.
        :param service: full service name (``xllm.proto.XllmAPIService``).
        :param method: method name.
        :param message: the serialized request message.
        :param attachment: bytes sent after the message.
        :param compress_type: none, gzip or zlib.
        :param timeout_s: answer bound, seconds (default ``settings.timeout_s``).
        :returns: the successful answer (``error_code`` 0).
        :raises RpcUnreachable: cannot connect, or the connection broke before the answer.
        :raises RpcTimeout: connect or answer not in time.
        :raises RpcCallFailed: the server answered with an error code.
        """
        timeout = self.settings.timeout_s if timeout_s is None else timeout_s
        channel = self._channel(target)
        response = channel.call(service, method, message, attachment, compress_type, timeout)
        if response.error_code:
            raise RpcCallFailed(response.error_code, response.error_text)
        return response

    def call_message(self, target: str, service: str, method: str, request: Any,
                     response_cls: Any, *, timeout_s: Optional[float] = None) -> Any:
        """:meth:`call` with a request message (:mod:`kvsvc.rpc.messages`) and the answer
        parsed as ``response_cls``.

        :raises RpcMessageError: the answer does not parse as ``response_cls``; otherwise as
            :meth:`call`.
        """
        response = self.call(target, service, method, messages.serialize(request),
                             timeout_s=timeout_s)
        return messages.parse(response_cls, response.message)

    def drop(self, target: str) -> None:
        """Close the connection to ``target`` (its calls fail unreachable); the next call
        connects again."""
        with self._lock:
            channel = self._channels.pop(target, None)
        if channel is not None:
            channel.close(1.0)

    def close(self, timeout_s: float = 5.0) -> None:
        """Close every connection and join every reader thread. Idempotent.

        :raises LifecycleError: a reader did not stop within ``timeout_s``.
        """
        with self._lock:
            self._closed = True
            channels, self._channels = list(self._channels.values()), {}
        stuck = [c.target for c in channels if not c.close(timeout_s)]
        if stuck:
            raise LifecycleError(f"baidu_std client: readers of {stuck} did not stop")

    def _channel(self, target: str) -> _Channel:
        with self._lock:
            if self._closed:
                raise RpcUnreachable(f"baidu_std {target}: client closed")
            channel = self._channels.get(target)
            if channel is not None and not channel.closed:
                return channel
            gate = self._connecting.setdefault(target, threading.Lock())
        with gate:   # one connect per target at a time; the others use its result
            with self._lock:
                channel = self._channels.get(target)
                if channel is not None and not channel.closed:
                    return channel
            channel = self._connect(target)
            with self._lock:
                old = self._channels.get(target)
                if self._closed:
                    channel.close(1.0)
                    raise RpcUnreachable(f"baidu_std {target}: client closed")
                self._channels[target] = channel
        if old is not None:
            old.close(1.0)
        return channel

    def _connect(self, target: str) -> _Channel:
        try:
            hp = parse_host_port(target)
        except ValueError as exc:
            raise RpcUnreachable(f"baidu_std target {target!r}: {exc}") from None
        try:
            sock = socket.create_connection((hp.host, hp.port),
                                            timeout=self.settings.connect_timeout_s)
        except socket.timeout as exc:
            raise RpcTimeout(f"baidu_std {target}: no connection within "
                             f"{self.settings.connect_timeout_s:g} s") from exc
        except OSError as exc:
            raise RpcUnreachable(f"baidu_std {target}: cannot connect: "
                                 f"{exc.strerror or exc}") from exc
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return _Channel(target, sock, self.settings.max_body_size)
