"""The simulated xLLM engine's native mode (§13): the control plane of an xLLM engine started
with ``--enable_service_routing``, so kvsvc's baidu_std server, native dispatch, answer assembly
and P/D links run end to end without a real engine.

- **Requests** arrive as ``xllm.proto.XllmAPIService.ChatCompletions`` / ``.Completions``, over
  baidu_std or brpc's HTTP+JSON form on the engine's own port (brpc serves both on one port;
  :class:`~kvsvc.testbed.sim.health.HealthServer` tells them apart by the ``PRPC`` magic).
  The engine answers at once with an empty response and serves the request on a thread of its
  own with the serving sim's latency model (:meth:`~kvsvc.testbed.sim.serving.Serving.generate`):
  the prompt is ``token_ids`` as given (required, as the real engine: a request without them
  gets ``gen_status`` INVALID_ARGUMENT), ``max_tokens`` output tokens (16 by default).
- **Answers**: every output token goes to the service with
  ``xllm_service.proto.XllmRpcService.Generations`` over baidu_std (one entry per request and
  decode step, the step's tokens), to the request's ``source_xservice_addr`` or, without one,
  to the address in ``XLLM:SERVICE:MASTER``, from one sending thread shaped as xLLM's
  (:class:`GenerationsPusher`): each call carries the oldest unsent entry of every request
  that has one (a decode step of every running request), and the decode steps do not wait
  for the answers (xLLM's step loop does not); the first token's entry is waited for (P/D:
  D's entries must not overtake P's). The last entry carries ``finish_reason``
  ``"length"``, ``usage`` (prompt, generated, total, cached tokens) and ``finished``. An entry
  answered ``ok: false`` (unknown request, client gone) cancels the request at its next
  step, as the engine does; a push the service does not answer cancels it too.
- **Heartbeats** (:func:`rpc_heartbeat`): ``XllmRpcService.Heartbeat`` over baidu_std to the
  master key's address (the registration thread calls it instead of the HTTP heartbeat).
- **P/D** (``routing.decode_name`` set to another instance): this engine is P: it prefills,
  sends the first token (``finished_on_prefill_instance`` true), then hands the request to D
  with ``xllm.proto.DisaggPDService/AddNewRequests`` (HTTP+JSON; the sim moves no KV), which
  D accepts only from a P it was linked to (``LinkInstance``); D sends the further tokens under
  the same ``service_req_id``. A refused hand-over ends the request with an error entry from P.
  ``LinkInstance`` / ``UnlinkInstance`` (``InstanceClusterInfo``) keep the linked peers;
  :attr:`NativeFront.refuse_links` makes them fail (tests).

Errors inside: :class:`~kvsvc.errors.RpcUnreachable` / :class:`~kvsvc.errors.RpcTimeout` /
:class:`~kvsvc.errors.RpcCallFailed` from :class:`RpcChannel`; a request thread logs and ends.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import socket
import threading
import time
from typing import Any, Callable, Mapping, Optional, Sequence

import requests
from google.protobuf import json_format

from kvsvc.errors import (
    RpcCallFailed,
    RpcError,
    RpcTimeout,
    RpcUnreachable,
    SimClientDisconnected,
    SimServingClosed,
)
from kvsvc.lifecycle import BackgroundThread
from kvsvc.routing.answers import GenOutput, GenUsage, Generation
from kvsvc.rpc import codec, messages
from kvsvc.rpc.generations import generation_to_proto
from kvsvc.testbed.sim.serving import (
    DEFAULT_MAX_TOKENS,
    CancelFlag,
    Prefilled,
    Serving,
    SimRequest,
)

log = logging.getLogger(__name__)

API_SERVICE = "xllm.proto.XllmAPIService"
PD_SERVICE = "xllm.proto.DisaggPDService"
SERVICE_RPC = "xllm_service.proto.XllmRpcService"
#: xLLM ``StatusCode`` values the sim sends.
INVALID_ARGUMENT = 3
UNAVAILABLE = 7
#: Token id of output token ``i`` (its text is ``" t<i>"``, as in the HTTP mode).
TOKEN_ID_BASE = 1000
_RECV_BYTES = 64 * 1024


def token_text(i: int) -> str:
    """Text of output token ``i`` (the HTTP mode's too)."""
    return f" t{i}"


def entry_bytes(gen: Generation) -> bytes:
    """One ``DisaggStreamGeneration`` serialized (the last entry with its ``gen_status``)."""
    return messages.serialize(generation_to_proto(gen, with_status=gen.finished))


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def generations_message(entries: Sequence[bytes]) -> bytes:
    """The serialized ``DisaggStreamGenerations`` of serialized entries: each as field 1
    (``gens``), length-delimited, in order (the bytes protobuf writes for the message)."""
    return b"".join([b"\x0a" + _varint(len(e)) + e for e in entries])


class RpcChannel:
    """A blocking baidu_std client to one address: one call at a time (a lock), the
    connection opened on first use and again after a failure. Thread-safe.

    :param address: ``host:port``.
    :param timeout_s: bound of connect and of each call's answer, seconds.
    """

    def __init__(self, address: str, timeout_s: float = 2.0) -> None:
        self.address = address
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._sock: Optional[socket.socket] = None
        self._conn: Optional[codec.Connection] = None

    def call(self, service: str, method: str, payload: bytes) -> bytes:
        """Send one call, wait for its answer; the answer's message bytes.

        :raises RpcUnreachable: connect failed, or the connection broke.
        :raises RpcTimeout: no answer within the timeout.
        :raises RpcCallFailed: the server answered an ``error_code``.
        """
        with self._lock:
            try:
                if self._sock is None:
                    host, _, port = self.address.rpartition(":")
                    self._sock = socket.create_connection((host, int(port)), self._timeout_s)
                    self._sock.settimeout(self._timeout_s)
                    self._conn = codec.Connection(codec.Role.CLIENT)
                assert self._conn is not None
                cid, frame = self._conn.send_request(service, method, payload,
                                                     timeout_ms=int(self._timeout_s * 1000))
                self._sock.sendall(frame)
                while True:
                    data = self._sock.recv(_RECV_BYTES)
                    if not data:
                        raise ConnectionResetError("closed by the server")
                    for event in self._conn.receive_data(data):
                        if isinstance(event, codec.Response) and event.correlation_id == cid:
                            if not event.ok:
                                raise RpcCallFailed(event.error_code, event.error_text)
                            return event.message
            except socket.timeout as exc:
                self._drop()
                raise RpcTimeout(f"{self.address}: {method} not answered in time") from exc
            except (OSError, RpcError) as exc:
                if isinstance(exc, RpcCallFailed):
                    raise
                self._drop()
                raise RpcUnreachable(f"{self.address}: {method} failed: {exc}") from exc

    def _drop(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock = None
        self._conn = None

    def close(self) -> None:
        """Close the connection. Idempotent."""
        with self._lock:
            self._drop()


class ServiceClient:
    """The engine's baidu_std calls to service replicas, one :class:`RpcChannel` per address.
    Thread-safe.

    :param timeout_s: bound of each call, seconds.
    """

    def __init__(self, timeout_s: float = 2.0) -> None:
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._channels: dict[str, RpcChannel] = {}

    def channel(self, address: str) -> RpcChannel:
        """The channel to ``address`` (created on first use)."""
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                ch = self._channels[address] = RpcChannel(address, self._timeout_s)
            return ch

    def generations(self, address: str, gens: Sequence[Generation]) -> list[bool]:
        """One ``Generations`` call; the ``ok`` of each entry.

        :raises RpcError: the call failed (see :meth:`RpcChannel.call`).
        """
        return self.generations_encoded(address, [entry_bytes(gen) for gen in gens])

    def generations_encoded(self, address: str, entries: Sequence[bytes]) -> list[bool]:
        """One ``Generations`` call of entries already serialized (:func:`entry_bytes`); the
        ``ok`` of each entry.

        :raises RpcError: the call failed (see :meth:`RpcChannel.call`).
        """
        answer = messages.parse(messages.StatusSet, self.channel(address).call(
            SERVICE_RPC, "Generations", generations_message(entries)))
        return [s.ok for s in answer.all_status]

    def heartbeat(self, address: str, name: str, incarnation_id: str, waiting: int,
                  usage: float) -> bool:
        """One ``Heartbeat`` call; the answer's ``ok``.

        :raises RpcError: the call failed.
        """
        msg = messages.HeartbeatRequest(name=name, incarnation_id=incarnation_id)
        msg.load_metrics.waiting_requests_num = waiting
        msg.load_metrics.gpu_cache_usage_perc = usage
        answer = messages.parse(messages.Status, self.channel(address).call(
            SERVICE_RPC, "Heartbeat", messages.serialize(msg)))
        return bool(answer.ok)

    def close(self) -> None:
        """Close every channel."""
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            ch.close()


def rpc_heartbeat(client: ServiceClient) -> Callable[[str, dict], Optional[int]]:
    """A heartbeat function for :class:`~kvsvc.testbed.sim.registration.EtcdRegistration`:
    the HTTP heartbeat's body sent as ``Heartbeat`` over baidu_std to the master's address;
    200 when answered ``ok: true``, 409 for ``ok: false``, ``None`` when the call failed."""
    def beat(address: str, body: dict) -> Optional[int]:
        load = body.get("load_metrics") or {}
        try:
            ok = client.heartbeat(address, body["name"], body.get("incarnation_id", ""),
                                  int(load.get("waiting_requests_num", 0)),
                                  float(load.get("gpu_cache_usage_perc", 0.0)))
        except RpcError:
            return None
        return 200 if ok else 409
    return beat


class _Item:
    __slots__ = ("address", "gen", "data", "done", "ok", "on_answer")

    def __init__(self, address: str, gen: Generation,
                 on_answer: Optional[Callable[[Optional[bool]], None]] = None) -> None:
        self.address = address
        self.gen = gen
        # Serialized by the request's thread: the sending thread only joins the bytes, so a
        # call follows the previous answer at once, as from a C++ engine.
        self.data = entry_bytes(gen)
        self.done = threading.Event() if on_answer is None else None
        self.ok: Optional[bool] = None
        self.on_answer = on_answer

    def answer(self, ok: Optional[bool]) -> None:
        self.ok = ok
        if self.done is not None:
            self.done.set()
        elif self.on_answer is not None:
            try:
                self.on_answer(ok)
            except Exception:  # noqa: BLE001 - the sending thread must go on
                log.exception("sim: Generations answer callback failed")


class GenerationsPusher(BackgroundThread):
    """The engine's one sending thread (``sim-native-push-<name>``), shaped as xLLM's
    (``AsyncResponseProcessor::batch_process_stream_requests``: after every decode step one
    ``Generations`` call per service address carrying the step's entry of every running
    request, sent from one RPC thread that waits for each answer, §13):

    - each call carries, per service address, the oldest unsent entry of every request that
      has one, in the order the requests first queued; a request's further entries (later
      steps) go in the following calls, in order, as xLLM's queued per-step calls do;
    - :meth:`send` queues an entry without waiting (xLLM's step loop does not wait for the
      service's answer: a request answered ``ok: false`` is cancelled when the answer comes,
      :meth:`send`'s callback); :meth:`push` queues one and waits for its ``ok``;
    - at most :data:`MAX_UNSENT` entries wait unsent; :meth:`send` then blocks until calls
      drain them (the sim's bound: a real engine's step time keeps its backlog short).

    :param client: the baidu_std calls.
    :param name: the instance name (thread name, logs).
    """

    #: Unsent entries at most before :meth:`send` blocks.
    MAX_UNSENT = 65536

    def __init__(self, client: ServiceClient, name: str) -> None:
        super().__init__(f"sim-native-push-{name}")
        self._client = client
        self._cond = threading.Condition()
        # (address, service_req_id) -> that request's unsent entries, oldest first.
        self._queues: dict[tuple[str, str], collections.deque[_Item]] = {}
        self._unsent = 0
        #: Generations calls made; entries they carried.
        self.calls = 0
        self.entries = 0

    def _queue(self, item: _Item) -> None:
        with self._cond:
            while self._unsent >= self.MAX_UNSENT and not self.stopping:
                self._cond.wait(0.2)
            if self.stopping:
                item.answer(None)
                return
            key = (item.address, item.gen.service_req_id)
            q = self._queues.get(key)
            if q is None:
                q = self._queues[key] = collections.deque()
            q.append(item)
            self._unsent += 1
            self._cond.notify_all()

    def push(self, address: str, gen: Generation, timeout_s: float = 10.0) -> Optional[bool]:
        """Queue one entry and wait for its answer: its ``ok``, ``None`` when the call failed
        or was not made within ``timeout_s`` (or the pusher stopped)."""
        item = _Item(address, gen)
        self._queue(item)
        assert item.done is not None
        item.done.wait(timeout_s)
        return item.ok

    def send(self, address: str, gen: Generation,
             on_answer: Callable[[Optional[bool]], None]) -> None:
        """Queue one entry without waiting; ``on_answer(ok)`` is called on the sending thread
        with its ``ok``, ``None`` when the call failed or the pusher stopped."""
        self._queue(_Item(address, gen, on_answer))

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _next_calls(self) -> dict[str, list[_Item]]:
        """One step's calls: the oldest unsent entry of each request, per address (under
        ``_cond``)."""
        by_address: dict[str, list[_Item]] = {}
        emptied = []
        for key, q in self._queues.items():
            by_address.setdefault(key[0], []).append(q.popleft())
            if not q:
                emptied.append(key)
        for key in emptied:
            del self._queues[key]
        self._unsent -= sum(len(items) for items in by_address.values())
        self._cond.notify_all()
        return by_address

    def _loop(self) -> None:
        while not self.stopping:
            with self._cond:
                while not self._queues and not self.stopping:
                    self._cond.wait(0.2)
                by_address = self._next_calls()
            for address, items in by_address.items():
                self.calls += 1
                self.entries += len(items)
                try:
                    answers = self._client.generations_encoded(address,
                                                               [i.data for i in items])
                except RpcError as exc:
                    log.warning("sim: Generations to %s failed: %s", address, exc)
                    answers = []
                for i, item in enumerate(items):
                    item.answer(answers[i] if i < len(answers) else None)

    def _teardown(self) -> None:
        with self._cond:
            queues, self._queues = list(self._queues.values()), {}
            self._unsent = 0
            self._cond.notify_all()
        for q in queues:
            for item in q:
                item.answer(None)


class NativeFront:
    """The native API of one simulated xLLM engine (module docstring). Thread-safe: each
    accepted request runs on its own thread.

    :param name: the instance name ``host:port``.
    :param serving: the latency model that serves the requests.
    :param client: the baidu_std calls to the service.
    :param master: the master's baidu_std address from etcd, ``None`` when unknown (used when
        a request names no ``source_xservice_addr``).
    :param http_timeout_s: bound of the P -> D hand-over call, seconds.
    """

    def __init__(self, name: str, serving: Serving, client: ServiceClient,
                 master: Callable[[], Optional[str]] = lambda: None,
                 http_timeout_s: float = 5.0) -> None:
        self.name = name
        self.serving = serving
        self.client = client
        self._master = master
        self._http_timeout_s = http_timeout_s
        self._http = requests.Session()
        self._http.trust_env = False
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()
        self._ids = itertools.count(1)
        self.linked: set[str] = set()
        #: The last ``InstanceClusterInfo`` received per linked peer (JSON form).
        self.link_infos: dict[str, dict] = {}
        self.refuse_links = False
        self._stopping = threading.Event()
        self.pusher = GenerationsPusher(client, name)
        #: Counters: accepted requests, entries pushed, entries answered ok: false, failed
        #: pushes, links and unlinks received.
        self.counts = {"accepted": 0, "pushed": 0, "refused": 0, "push_failed": 0,
                       "links": 0, "unlinks": 0, "handovers": 0}
        #: The last requests accepted (JSON form of the message as received, newest last):
        #: what a test checks the router sent.
        self.received: collections.deque[dict] = collections.deque(maxlen=32)

    def set_master(self, master: Callable[[], Optional[str]]) -> None:
        """Where the master's baidu_std address comes from (the registration thread's read of
        ``XLLM:SERVICE:MASTER``)."""
        self._master = master

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[key] += n

    # -- entry points ----------------------------------------------------------------------

    def handle_json(self, path: str, body: bytes) -> tuple[int, dict]:
        """brpc's HTTP+JSON form: ``POST /<service>/<method>``; ``(status, JSON answer)``."""
        parts = path.strip("/").split("/")
        if len(parts) != 2:
            return 404, {"error": f"no method {path}"}
        try:
            doc = json.loads(body or b"{}")
        except ValueError:
            return 400, {"error": "body is not JSON"}
        if not isinstance(doc, dict):
            return 400, {"error": "body is not a JSON object"}
        answer = self._call(parts[0], parts[1], doc)
        if answer is None:
            return 404, {"error": f"no method {path}"}
        return 200, answer

    def handle_rpc(self, request: codec.Request) -> tuple[int, str, bytes]:
        """One baidu_std call: ``(error_code, error_text, answer bytes)``."""
        kinds = {("XllmAPIService", "ChatCompletions"): messages.ChatRequest,
                 ("XllmAPIService", "Completions"): messages.CompletionRequest,
                 ("DisaggPDService", "LinkInstance"): messages.InstanceClusterInfo,
                 ("DisaggPDService", "UnlinkInstance"): messages.InstanceClusterInfo}
        short = request.service.rsplit(".", 1)[-1]
        cls = kinds.get((short, request.method))
        if cls is None:
            return codec.ENOMETHOD, f"no method {request.service}.{request.method}", b""
        try:
            msg = messages.parse(cls, request.message)
        except RpcError as exc:
            return codec.EREQUEST, str(exc), b""
        doc = json_format.MessageToDict(msg, preserving_proto_field_name=True)
        answer = self._call(short, request.method, doc) or {}
        if short == "DisaggPDService":
            return 0, "", messages.serialize(messages.XllmStatus(ok=bool(answer.get("ok"))))
        empty = (messages.ChatResponse() if request.method == "ChatCompletions"
                 else messages.CompletionResponse())
        return 0, "", messages.serialize(empty)

    def serve_connection(self, sock: socket.socket) -> None:
        """Serve baidu_std calls on ``sock`` until the peer closes it (one thread)."""
        conn = codec.Connection(codec.Role.SERVER)
        sock.settimeout(0.2)   # to see join() (the engine closing) between calls
        try:
            while not self._stopping.is_set():
                try:
                    data = sock.recv(_RECV_BYTES)
                except socket.timeout:
                    continue
                if not data:
                    return
                for event in conn.receive_data(data):
                    if isinstance(event, codec.Request):
                        code, text, out = self.handle_rpc(event)
                        sock.sendall(conn.send_response(event.correlation_id, out,
                                                        error_code=code, error_text=text))
                    elif isinstance(event, codec.BadCall):
                        sock.sendall(conn.send_response(event.correlation_id,
                                                        error_code=event.error_code,
                                                        error_text=event.error_text))
        except (OSError, RpcError) as exc:
            log.debug("sim %s: baidu_std connection ended: %s", self.name, exc)

    def _call(self, service: str, method: str, doc: Mapping[str, Any]) -> Optional[dict]:
        short = service.rsplit(".", 1)[-1]
        if short == "XllmAPIService" and method in ("ChatCompletions", "Completions"):
            self._accept(method == "ChatCompletions", doc)
            return {}
        if short == "DisaggPDService" and method in ("LinkInstance", "UnlinkInstance"):
            peer = str(doc.get("instance_name", ""))
            if self.refuse_links:
                return {"ok": False}
            with self._lock:
                if method == "LinkInstance":
                    self.linked.add(peer)
                    self.link_infos[peer] = dict(doc)
                    self.counts["links"] += 1
                else:
                    self.linked.discard(peer)
                    self.link_infos.pop(peer, None)
                    self.counts["unlinks"] += 1
            log.info("sim %s: %s %s", self.name, method, peer)
            return {"ok": True}
        if short == "DisaggPDService" and method == "AddNewRequests":
            return self._take_handover(doc)
        return None

    # -- requests --------------------------------------------------------------------------

    def _start(self, target: Callable[[], None], label: str) -> None:
        def run() -> None:
            try:
                target()
            except Exception:  # noqa: BLE001 - a request thread must log, not vanish
                log.exception("sim %s: %s failed", self.name, label)
            finally:
                with self._lock:
                    self._threads.discard(threading.current_thread())
        t = threading.Thread(target=run, name=f"sim-native-{label}", daemon=True)
        with self._lock:
            self._threads.add(t)
        t.start()

    def _accept(self, chat: bool, doc: Mapping[str, Any]) -> None:
        sid = str(doc.get("service_request_id", ""))
        addr = str(doc.get("source_xservice_addr") or "") or self._master() or ""
        rid = f"sim-{self.name}-{next(self._ids)}"
        self._count("accepted")
        self.received.append(dict(doc))
        tokens = [int(t) for t in doc.get("token_ids") or []]
        max_tokens = doc.get("max_tokens")
        max_tokens = int(max_tokens) if max_tokens else DEFAULT_MAX_TOKENS
        routing = doc.get("routing") or {}
        decode = str(routing.get("decode_name") or "")
        options = doc.get("stream_options") or {}
        req = SimRequest(chat, tokens, max_tokens, bool(doc.get("stream")),
                         options.get("include_usage") is True, str(doc.get("model") or ""),
                         decode if decode and decode != self.name else None)
        self._start(lambda: self._serve(sid, rid, addr, req), sid[:12] or rid)

    def _push(self, addr: str, gen: Generation, cancel: CancelFlag) -> bool:
        """Send one entry and wait for its answer; False (and ``cancel`` set) when it was
        refused or not delivered."""
        if not addr:
            return self._settle(addr, gen.service_req_id, cancel, None, counted=False)
        return self._settle(addr, gen.service_req_id, cancel, self.pusher.push(addr, gen))

    def _send(self, addr: str, gen: Generation, cancel: CancelFlag) -> bool:
        """Queue one decode step's entry without waiting for its answer (xLLM's step loop does
        not wait); an answer ``ok: false``, or none, cancels the request then. False (and
        ``cancel`` set) when the request is already cancelled or has no address."""
        if cancel.is_set():
            return False
        if not addr:
            return self._settle(addr, gen.service_req_id, cancel, None, counted=False)
        sid = gen.service_req_id

        def answered(ok: Optional[bool]) -> None:
            self._settle(addr, sid, cancel, ok)
        self.pusher.send(addr, gen, answered)
        return True

    def _settle(self, addr: str, sid: str, cancel: CancelFlag, ok: Optional[bool],
                counted: bool = True) -> bool:
        """One entry's answer: ``None`` (not delivered, or no address when not ``counted``)
        and ``False`` (refused) cancel the request, logged once; the answer's truth."""
        if ok is None:
            if counted and not cancel.is_set():
                log.warning("sim %s: Generations to %s failed: request %s cancelled",
                            self.name, addr, sid)
            self._count("push_failed")
            cancel.set()
            return False
        self._count("pushed")
        if not ok:
            self._count("refused")
            if not cancel.is_set():
                log.info("sim %s: request %s answered ok: false: cancelled", self.name, sid)
            cancel.set()
        return ok

    @staticmethod
    def _tokens(first: int, last: int) -> GenOutput:
        return GenOutput(0, "".join(token_text(i) for i in range(first, last + 1)),
                         tuple(TOKEN_ID_BASE + i for i in range(first, last + 1)))

    def _serve(self, sid: str, rid: str, addr: str, req: SimRequest) -> None:
        cancel = CancelFlag()
        if not req.token_ids:
            self._push(addr, Generation(sid, rid, INVALID_ARGUMENT,
                                        "token_ids: the prompt's token ids are required",
                                        finished=True), cancel)
            return
        n = req.max_tokens
        pd = req.decode_name is not None
        cached = [0]

        def usage(generated: int) -> GenUsage:
            prompt = len(req.token_ids)
            return GenUsage(prompt, generated, prompt + generated, cached[0])

        def last_entry(first: int, last: int, on_prefill: bool = False) -> Generation:
            out = self._tokens(first, last)
            done = last == n - 1
            if done:
                out = GenOutput(0, out.text, out.token_ids, "length")
            return Generation(sid, rid, outputs=(out,), usage=usage(last + 1) if done else None,
                              finished=done or on_prefill,
                              finished_on_prefill_instance=on_prefill)

        def first(pre: Prefilled) -> None:
            cached[0] = pre.cached_tokens
            if not self._push(addr, last_entry(0, 0, on_prefill=pd), cancel):
                raise SimClientDisconnected("refused")

        def emit(lo: int, hi: int) -> None:
            if not self._send(addr, last_entry(lo, hi), cancel):
                raise SimClientDisconnected("refused")

        try:
            self.serving.generate(req, cancel, first, emit, decode=not pd)
        except (SimClientDisconnected, SimServingClosed) as exc:
            log.info("sim %s: request %s ended early (%s)", self.name, sid, exc)
            return
        if pd and n > 1:
            self._hand_over(sid, rid, addr, req, cached[0])

    def _hand_over(self, sid: str, rid: str, addr: str, req: SimRequest, cached: int) -> None:
        """P's side of P/D: give the request to D; an error entry when D refuses."""
        assert req.decode_name is not None
        body: dict[str, Any] = {"prefill_name": self.name, "reqs": [{
            "req_id": rid, "service_req_id": sid, "prompt_tokens": req.token_ids,
            "max_tokens": req.max_tokens, "stream": req.stream, "source_xservice_addr": addr,
            "num_cached_tokens": cached}]}
        why = ""
        try:
            resp = self._http.post(f"http://{req.decode_name}/{PD_SERVICE}/AddNewRequests",
                                   json=body, timeout=self._http_timeout_s)
            doc = resp.json() if resp.status_code == 200 else {}
            status = (doc.get("resps") or [{}])[0].get("status_code", 500)
            if resp.status_code != 200 or status != 200:
                why = f"decode instance {req.decode_name} refused the request ({status})"
        except (requests.RequestException, ValueError) as exc:
            why = f"decode instance {req.decode_name} unreachable ({type(exc).__name__})"
        if why:
            log.warning("sim %s: %s", self.name, why)
            self._push(addr, Generation(sid, rid, UNAVAILABLE, why, finished=True), CancelFlag())
            return
        self._count("handovers")

    def _take_handover(self, doc: Mapping[str, Any]) -> dict:
        """D's side of P/D: decode requests from a linked P."""
        prefill = str(doc.get("prefill_name", ""))
        with self._lock:
            linked = prefill in self.linked
        resps = []
        for r in doc.get("reqs") or []:
            rid = str(r.get("req_id", ""))
            if not linked:
                resps.append({"req_id": rid, "status_code": 403})
                continue
            resps.append({"req_id": rid, "status_code": 200})
            sid = str(r.get("service_req_id", ""))
            tokens = [int(t) for t in r.get("prompt_tokens") or []]
            req = SimRequest(False, tokens, int(r.get("max_tokens") or DEFAULT_MAX_TOKENS),
                             bool(r.get("stream")), False, "", self.name)
            addr = str(r.get("source_xservice_addr") or "") or self._master() or ""
            cached = int(r.get("num_cached_tokens") or 0)
            self._start(lambda: self._decode(sid, rid, addr, req, cached), f"d-{sid[:10]}")
        if not linked:
            log.warning("sim %s: hand-over from %s refused: not linked", self.name, prefill)
        return {"resps": resps}

    def _decode(self, sid: str, rid: str, addr: str, req: SimRequest, cached: int) -> None:
        cancel = CancelFlag()
        n = req.max_tokens
        prompt = len(req.token_ids)

        def emit(lo: int, hi: int) -> None:
            out = self._tokens(lo, hi)
            done = hi == n - 1
            gen = Generation(sid, rid, outputs=(GenOutput(0, out.text, out.token_ids,
                                                          "length" if done else ""),),
                             usage=GenUsage(prompt, hi + 1, prompt + hi + 1, cached)
                             if done else None, finished=done)
            if not self._send(addr, gen, cancel):
                raise SimClientDisconnected("refused")

        try:
            self.serving.decode_only(req, cancel, emit)
        except (SimClientDisconnected, SimServingClosed) as exc:
            log.info("sim %s: decode of %s ended early (%s)", self.name, sid, exc)

    def join(self, timeout_s: float = 5.0) -> int:
        """Join the request threads (the serving sim must be closing) and end the baidu_std
        connections; how many request threads are left."""
        self._stopping.set()
        deadline = time.monotonic() + timeout_s
        self.pusher.close()
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return sum(1 for t in threads if t.is_alive())

    def open(self) -> None:
        """Start the sending thread; serve baidu_std connections."""
        self._stopping.clear()
        if not self.pusher.running:
            self.pusher.start()

    def close(self) -> None:
        """Close the connections (after :meth:`join`)."""
        self.client.close()
        self._http.close()
