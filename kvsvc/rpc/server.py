"""``xllm_service.proto.XllmRpcService`` over brpc ``baidu_std`` (§13): what a real xLLM engine
started with ``--enable_service_routing`` calls on its service.

Two parts, the rules apart from the sockets:

- :class:`XllmRpcHandler` answers one decoded call (:class:`~kvsvc.rpc.codec.Request`) with
  the reply's message bytes or a brpc error, without I/O:

  - ``Heartbeat(HeartbeatRequest)`` -> ``Status{ok}``: the HTTP heartbeat's rules and registry
    effects through the one intake (:class:`~kvsvc.cluster.heartbeat.HeartbeatIntake`);
    ``ok: false`` where HTTP answers 4xx or 503 (unknown instance, stale incarnation, a load
    out of range, no name, no registry);
  - ``Generations(DisaggStreamGenerations)`` -> ``StatusSet``: the entries go to the
    :class:`~kvsvc.rpc.generations.GenerationSink` in one call and are answered at once (the
    ``StatusSet`` is written as bytes; with a sink that defers, the entries are converted by
    their requests' readers, which are woken once the answer was sent),
    **exactly one Status per entry, in order** whatever the sink returns (an engine aborts on
    another count); ``ok: false`` for an unknown ``service_req_id`` and whatever the sink
    refuses; without a sink, or when the sink raises (logged), every entry is ``ok: false``;
  - ``GetInstanceInfo(InstanceID)`` -> ``InstanceMetaInfo`` from the instance's registration
    (name, rpc_address, type, cluster_ids, dp_size, addrs, ports, incarnation_id,
    register_ts_ms, kv_split_size); an unknown name gives an empty one;
  - ``GetStaticDecodeList`` / ``GetStaticPrefillList(InstanceID)`` -> ``InstanceIDs``: the
    schedulable (``ACTIVE`` or ``LEASE_LOST``) instances registered DECODE, resp. PREFILL or
    DEFAULT, in name order (xllm-service's ``InstanceMgr``), less those whose P/D link failed
    (no candidate, §13);
  - ``Hello(Empty)`` -> ``Status{ok: true}``;
  - the service by its full name or the short ``XllmRpcService`` (brpc accepts both); another
    service: ENOSERVICE ``Fail to find service=<name>``; another method (``RegisterInstance``
    included: registration goes through etcd): ENOMETHOD; a message that does not parse:
    EREQUEST; a handler that raises: EINTERNAL (logged).

- :class:`RpcServer` owns the listening socket and the threads: ``kvsvc-rpc-accept`` accepts
  (at most ``max_connections``), and one ``kvsvc-rpc-conn`` thread per connection reads,
  decodes (:class:`~kvsvc.rpc.codec.Connection`), answers each call as soon as its frame is
  complete and writes the answers of one read together. An engine uses one connection for
  all its calls (brpc ``connection_type`` single); every method is answered without waiting
  on I/O, so per-connection order costs nothing and the answers of pipelined calls carry their
  own correlation ids. A broken stream (wrong magic, a body over 64 MiB, a meta that does not
  parse) closes that connection, logged once; nothing else is affected. A connection that
  carried calls and closes (not by :meth:`RpcServer.close`) is reported, with the names that
  heartbeated on it, to ``on_connection_closed`` (an engine that died: its requests fail at
  once, not when its lease expires; :mod:`kvsvc.routing.engine_loss`).

The port is unauthenticated (xLLM engines send no credential): bind it to the engines'
network (docs/xllm.md). Thread-safe counters: :meth:`RpcServer.stats`.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

from kvsvc.cluster.heartbeat import HeartbeatIntake, HeartbeatOutcome
from kvsvc.cluster.model import InstanceState, InstanceType, RegistrySnapshot
from kvsvc.cluster.registry import Registry
from kvsvc.errors import LifecycleError, RpcMessageError, RpcProtocolError
from kvsvc.lifecycle import BackgroundThread
from kvsvc.rpc import codec, messages
from kvsvc.rpc.codec import BadCall, Request
from kvsvc.rpc.generations import GenerationSink, generation_from_proto

log = logging.getLogger(__name__)

SERVICE_NAME = f"{messages.SERVICE_PACKAGE}.XllmRpcService"
SERVICE_SHORT_NAME = "XllmRpcService"
#: States in which an instance is listed by GetStatic*List (xllm-service: schedulable).
_SCHEDULABLE = (InstanceState.ACTIVE, InstanceState.LEASE_LOST)
#: How long the accept thread waits in one poll before it looks at the stop flag, seconds.
_POLL_S = 0.2
_RECV_BYTES = 256 * 1024


@dataclass(frozen=True, slots=True)
class Reply:
    """The answer to one call: ``message`` bytes on success, else ``error_code`` and
    ``error_text`` (brpc's codes, :mod:`kvsvc.rpc.codec`); ``after`` what is left to do once
    it was sent."""

    message: bytes = b""
    error_code: int = 0
    error_text: str = ""
    #: Called once the answer was sent (``handle(..., defer=True)``): wakes the readers of
    #: the delivered entries; ``None``: nothing to do.
    after: Optional[Callable[[], None]] = None


@dataclass(frozen=True, slots=True)
class RpcStats:
    """Counters since start.

    :ivar calls: answered calls per method name (unknown ones under their own name).
    :ivar errors: error answers per brpc ``error_code``.
    :ivar heartbeats: heartbeats per :class:`~kvsvc.cluster.heartbeat.HeartbeatOutcome` value.
    :ivar entries_ok: Generations entries answered ``ok: true``.
    :ivar entries_refused: Generations entries answered ``ok: false``.
    :ivar connections: connections open now.
    :ivar connections_total: connections accepted.
    :ivar broken_streams: connections closed for a broken stream.
    """

    calls: dict[str, int]
    errors: dict[int, int]
    heartbeats: dict[str, int]
    entries_ok: int
    entries_refused: int
    connections: int
    connections_total: int
    broken_streams: int


#: ``StatusSet.all_status`` entries as bytes: field 1, length-delimited, holding a ``Status``
#: whose ``ok`` (field 1, varint) is true, or an empty ``Status`` (proto3: ``ok`` false is
#: not written).
_STATUS_OK = b"\x0a\x02\x08\x01"
_STATUS_REFUSED = b"\x0a\x00"


def status_set_bytes(answers: Sequence[bool]) -> bytes:
    """The serialized ``xllm.proto.StatusSet`` with one ``Status{ok}`` per answer, in order:
    the bytes protobuf writes for it (a Generations answer is built per call, so without a
    message object per entry)."""
    if all(answers):
        return _STATUS_OK * len(answers)
    return b"".join([_STATUS_OK if ok else _STATUS_REFUSED for ok in answers])


class XllmRpcHandler:
    """The rules of ``XllmRpcService`` without sockets (module docstring). Thread-safe.

    :param heartbeats: the service's heartbeat intake.
    :param registry: where GetInstanceInfo and the static lists read, ``None`` without one.
    :param sink: where Generations entries go (``Service.generations``), ``None``: refused.
    :param excluded: the instances that are no candidate (a failed P/D link, §13:
        :meth:`~kvsvc.cluster.pd_links.PdLinks.excluded`), left out of the static lists;
        ``None``: none.
    :param on_heartbeat: called as ``(name, incarnation_id)`` for every accepted Heartbeat
        (:meth:`kvsvc.routing.xllm_dispatch.BaiduStdHeartbeats.heard`, ``--xllm_dispatch
        auto``); ``None``: nobody.
    """

    def __init__(self, heartbeats: HeartbeatIntake, registry: Optional[Registry],
                 sink: Optional[GenerationSink],
                 excluded: Optional[Callable[[], Mapping[str, str]]] = None,
                 on_heartbeat: Optional[Callable[[str, str], None]] = None) -> None:
        self._heartbeats = heartbeats
        self._on_heartbeat = on_heartbeat
        self._registry = registry
        self._sink = sink
        # Looked up once: a sink that defers its wake-ups (kvsvc's) or one that only delivers.
        self._deliver_deferred = getattr(sink, "deliver_deferred", None)
        self._excluded = excluded
        self._lock = threading.Lock()
        self._calls: Counter[str] = Counter()
        self._errors: Counter[int] = Counter()
        self._hb: Counter[str] = Counter()
        self._entries_ok = 0
        self._entries_refused = 0
        self._methods: dict[str, tuple[Any, Callable[[Any], Any]]] = {
            "Heartbeat": (messages.HeartbeatRequest, self._heartbeat),
            "Generations": (messages.DisaggStreamGenerations, self._generations),
            "GetInstanceInfo": (messages.InstanceID, self._instance_info),
            "GetStaticDecodeList": (messages.InstanceID, self._decode_list),
            "GetStaticPrefillList": (messages.InstanceID, self._prefill_list),
            "Hello": (messages.Empty, self._hello),
        }

    def handle(self, request: Request, defer: bool = False,
               heard: Optional[set[str]] = None) -> Reply:
        """Answer one call (module docstring); never raises.

        :param defer: leave the wake-up of the delivered entries' readers to the caller
            (``reply.after``, to call once the answer was sent: the engine waits on the
            answer, the readers can wait the few microseconds); False: done before the
            return, ``reply.after`` is ``None``.
        :param heard: the instance names heard on the call's connection: a Heartbeat's
            ``name`` is added (:class:`RpcServer`'s ``on_connection_closed``); ``None``: not
            collected.
        """
        reply = self._dispatch(request, heard)
        with self._lock:
            self._calls[request.method] += 1
            if reply.error_code:
                self._errors[reply.error_code] += 1
        if reply.after is not None and not defer:
            reply.after()
            reply = Reply(reply.message, reply.error_code, reply.error_text)
        return reply

    def bad_call(self, call: BadCall) -> Reply:
        """The error answer to a frame the codec could not serve (compression, attachment
        size, streaming)."""
        with self._lock:
            self._calls[call.method] += 1
            self._errors[call.error_code] += 1
        return Reply(error_code=call.error_code, error_text=call.error_text)

    def counters(self) -> tuple[dict[str, int], dict[int, int], dict[str, int], int, int]:
        """(calls, errors, heartbeats, entries ok, entries refused), copies."""
        with self._lock:
            return (dict(self._calls), dict(self._errors), dict(self._hb), self._entries_ok,
                    self._entries_refused)

    def _dispatch(self, request: Request, heard: Optional[set[str]] = None) -> Reply:
        if request.service not in (SERVICE_NAME, SERVICE_SHORT_NAME):
            return Reply(error_code=codec.ENOSERVICE,
                         error_text=f"Fail to find service={request.service}")
        method = self._methods.get(request.method)
        if method is None:
            return Reply(error_code=codec.ENOMETHOD,
                         error_text=f"Fail to find method={request.service}/{request.method}")
        cls, fn = method
        try:
            msg = messages.parse(cls, request.message)
        except RpcMessageError as exc:
            return Reply(error_code=codec.EREQUEST, error_text=(
                f"Fail to parse request message, CompressType="
                f"{codec.COMPRESS_NAMES.get(request.compress_type, request.compress_type)}, "
                f"request_size={len(request.message)}: {exc}"))
        if heard is not None and request.method == "Heartbeat" and msg.name:
            heard.add(msg.name)
        try:
            out = fn(msg)
            if isinstance(out, Reply):   # an answer with what runs after it is sent
                return out
            return Reply(messages.serialize(out))
        except Exception as exc:  # noqa: BLE001 - one call's bug is that call's EINTERNAL
            log.exception("rpc %s.%s failed", SERVICE_SHORT_NAME, request.method)
            return Reply(error_code=codec.EINTERNAL, error_text=f"{type(exc).__name__}: {exc}")

    def _heartbeat(self, req: Any) -> Any:
        if not req.name:
            outcome = HeartbeatOutcome.MALFORMED
        else:
            outcome = self._heartbeats.outcome(
                req.name, req.incarnation_id or None, int(req.load_metrics.waiting_requests_num),
                float(req.load_metrics.gpu_cache_usage_perc))
        with self._lock:
            self._hb[outcome.value] += 1
        ok = outcome is HeartbeatOutcome.OK
        if ok and self._on_heartbeat is not None:
            self._on_heartbeat(req.name, req.incarnation_id)
        return messages.Status(ok=ok)

    def _generations(self, req: Any) -> Reply:
        entries = req.gens
        n = len(entries)
        answers: list[bool] = []
        wake: Optional[Callable[[], None]] = None
        sink = self._sink
        if sink is not None and n:
            try:
                deferred = self._deliver_deferred
                if deferred is not None:
                    # Converted by each request's reader, only for requests kvsvc holds.
                    answers, wake = deferred(entries, generation_from_proto)
                    answers = list(answers)
                else:
                    answers = list(sink.deliver([generation_from_proto(g) for g in entries]))
            except Exception:  # noqa: BLE001 - still one Status per entry (ok: false)
                log.exception("generation sink failed on %d entries; answering ok: false", n)
                answers = []
            if answers and len(answers) != n:
                log.error("generation sink answered %d statuses for %d entries; the missing "
                          "ones are ok: false", len(answers), n)
        answers = (answers + [False] * n)[:n]
        good = sum(1 for ok in answers if ok)
        with self._lock:
            self._entries_ok += good
            self._entries_refused += n - good
        return Reply(status_set_bytes(answers), after=wake)

    def _instance_info(self, req: Any) -> Any:
        info = messages.InstanceMetaInfo()
        if self._registry is None:
            return info
        inst = self._registry.snapshot().instances.get(req.name)
        reg = self._registry.registration(req.name)
        if inst is None or reg is None:
            return info
        info.name = inst.name
        info.rpc_address = reg.rpc_address or ""
        info.type = int(reg.type)
        info.cluster_ids.extend(reg.cluster_ids)
        info.dp_size = reg.registered_dp_size or reg.dp_size
        info.addrs.extend(reg.addrs)
        info.ports.extend(reg.ports)
        info.incarnation_id = reg.incarnation_id or ""
        info.register_ts_ms = reg.register_ts_ms or 0
        info.kv_split_size = reg.kv_split_size
        return info

    def _names(self, types: tuple[InstanceType, ...]) -> Any:
        out = messages.InstanceIDs()
        if self._registry is not None:
            snap: RegistrySnapshot = self._registry.snapshot()
            excluded = self._excluded() if self._excluded is not None else {}
            out.names.extend(sorted(n for n, i in snap.instances.items()
                                    if i.type in types and i.state in _SCHEDULABLE
                                    and n not in excluded))
        return out

    def _decode_list(self, req: Any) -> Any:
        return self._names((InstanceType.DECODE,))

    def _prefill_list(self, req: Any) -> Any:
        return self._names((InstanceType.PREFILL, InstanceType.DEFAULT))

    def _hello(self, req: Any) -> Any:
        return messages.Status(ok=True)


class RpcServer(BackgroundThread):
    """The baidu_std server's threads and sockets (module docstring).

    :param handler: answers the calls.
    :param host: IPv4 bind address (``0.0.0.0``: every interface).
    :param port: TCP port; 0 picks a free one (tests), see :attr:`port`.
    :param max_connections: connections served at once; more are closed at accept (logged).
    :param max_body_size: the codec's body bound, bytes (64 MiB, brpc's).
    :param on_connection_closed: called as ``(names, peer)`` on the connection's own thread
        when a connection that carried calls closes other than by :meth:`close` (the engine
        died or dropped it: :meth:`kvsvc.routing.engine_loss.LostEngines.connection_closed`);
        ``names``: the Heartbeat ``name`` of every instance that heartbeated on it (may be
        empty: an engine may send Generations on a connection before its next heartbeat),
        ``peer``: its ``ip:port``; ``None``: nobody.
    """

    def __init__(self, handler: XllmRpcHandler, host: str, port: int,
                 max_connections: int = 1024,
                 max_body_size: int = codec.MAX_BODY_SIZE,
                 on_connection_closed: Optional[Callable[[frozenset[str], str], Any]] = None
                 ) -> None:
        super().__init__("kvsvc-rpc-accept")
        self._on_connection_closed = on_connection_closed
        self.handler = handler
        self.host = host
        self._port = port
        self._max_connections = max_connections
        self._max_body_size = max_body_size
        self._listener: Optional[socket.socket] = None
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._accepted = 0
        self._broken = 0

    @property
    def port(self) -> int:
        """The bound port once started (the given one, or the one picked for 0)."""
        return self._port

    def start(self, timeout_s: float = 5.0) -> None:
        """Bind, listen and start accepting; returns once the port accepts connections.

        :raises LifecycleError: already started, or the port cannot be bound (in use,
            address not local: the message names ``host:port`` and the reason).
        """
        super().start(timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, close every connection (a call being answered finishes first) and
        join every thread. Idempotent.

        :raises LifecycleError: a thread did not stop within ``timeout_s``.
        """
        super().close(timeout_s)

    def stats(self) -> RpcStats:
        """Counters since start (:class:`RpcStats`)."""
        calls, errors, hb, ok, refused = self.handler.counters()
        with self._lock:
            return RpcStats(calls, errors, hb, ok, refused, len(self._conns), self._accepted,
                            self._broken)

    # -- the accept thread ------------------------------------------------------------------

    def _setup(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self._port))
            sock.listen(128)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            raise LifecycleError(f"baidu_std port {self.host}:{self._port}: cannot listen: "
                                 f"{exc.strerror or exc}") from exc
        self._listener = sock
        self._port = sock.getsockname()[1]
        log.info("baidu_std server (%s) listening on %s:%d", SERVICE_NAME, self.host, self._port)

    def _loop(self) -> None:
        listener = self._listener
        assert listener is not None
        poller = select.poll()
        poller.register(listener, select.POLLIN)
        while not self.stopping:
            if not poller.poll(_POLL_S * 1000):
                continue
            try:
                sock, peer = listener.accept()
            except (BlockingIOError, InterruptedError):
                continue
            except OSError as exc:
                log.warning("baidu_std accept failed: %s", exc)
                self._sleep(_POLL_S)
                continue
            self._admit(sock, f"{peer[0]}:{peer[1]}")

    def _admit(self, sock: socket.socket, peer: str) -> None:
        with self._lock:
            full = len(self._conns) >= self._max_connections
            if not full:
                self._accepted += 1
        if full or self.stopping:
            log.warning("baidu_std connection from %s refused: %d connections open", peer,
                        self._max_connections)
            sock.close()
            return
        sock.setblocking(True)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        thread = threading.Thread(target=self._serve, args=(sock, peer),
                                  name="kvsvc-rpc-conn", daemon=True)
        with self._lock:
            self._conns[sock] = thread
        thread.start()
        if self.stopping:   # close() may have shut the others down before this one was listed
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _teardown(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        with self._lock:
            conns = dict(self._conns)
        for sock in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)   # wakes a thread blocked in send
            except OSError:
                pass
        deadline = time.monotonic() + 3.0
        for thread in conns.values():
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = [t for t in conns.values() if t.is_alive()]
        if alive:
            log.error("baidu_std: %d connection threads did not stop", len(alive))

    # -- a connection thread ----------------------------------------------------------------

    def _serve(self, sock: socket.socket, peer: str) -> None:
        # Blocking reads: close() shuts the socket down, which ends a blocked recv with b"".
        conn = codec.Connection(codec.Role.SERVER, self._max_body_size)
        handler = self.handler
        heard: set[str] = set()   # the instances that heartbeated on this connection
        called = False            # any call came on it (an engine's connection)
        log.debug("baidu_std connection from %s", peer)
        try:
            while not self.stopping:
                try:
                    data = sock.recv(_RECV_BYTES)
                except OSError:
                    return
                try:
                    events = conn.receive_data(data)
                except RpcProtocolError as exc:
                    with self._lock:
                        self._broken += 1
                    log.warning("baidu_std connection from %s closed: %s", peer, exc)
                    return
                if not data:
                    return
                out = []
                after = []
                for event in events:
                    if isinstance(event, Request):
                        called = True
                        reply = handler.handle(event, defer=True, heard=heard)
                        if reply.after is not None:
                            after.append(reply.after)
                    elif isinstance(event, BadCall):
                        reply = handler.bad_call(event)
                    else:  # pragma: no cover - a server's codec yields no Response
                        continue
                    out.append(conn.send_response(event.correlation_id, reply.message,
                                                  error_code=reply.error_code,
                                                  error_text=reply.error_text))
                try:
                    if out:
                        sock.sendall(b"".join(out))
                except OSError:
                    return
                finally:
                    # The answers went out first (the engine waits on them); then the
                    # entries' readers are woken, even when the send failed.
                    for wake in after:
                        wake()
                if conn.broken is not None:   # the calls before the break were answered
                    with self._lock:
                        self._broken += 1
                    log.warning("baidu_std connection from %s closed: %s", peer, conn.broken)
                    return
        finally:
            with self._lock:
                self._conns.pop(sock, None)
            sock.close()
            if called:
                self._closed(heard, peer)

    def _closed(self, heard: set[str], peer: str) -> None:
        """Tell ``on_connection_closed`` that a connection that carried calls is gone (not
        when this server closes it)."""
        callback = self._on_connection_closed
        if callback is None or self.stopping:
            return
        log.info("baidu_std connection from %s (%s) closed", peer,
                 ", ".join(sorted(heard)) or "no heartbeat on it")
        try:
            callback(frozenset(heard), peer)
        except Exception:  # noqa: BLE001 - a connection thread's end must not fail
            log.exception("baidu_std connection from %s: close callback failed", peer)
