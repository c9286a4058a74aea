"""The kvsvc error tree. Third-party errors (pyzmq, ormsgpack, pydantic, requests) are
translated into these once, at the module boundary where they occur (``raise ... from exc``).

::

    KvsvcError
    ├── TestbedError           raised only by the testbed (``kvsvc.testbed``), never by the service
    │   ├── SimServingClosed       the simulated engine is closing: a served request is abandoned
    │   ├── SimClientDisconnected  the client of a simulated request closed its connection
    │   └── SimBadRequest          a malformed OpenAI body sent to the simulated engine
    ├── ConfigError            bad configuration; ``field`` names the offending key (§8),
    │                          ``problems`` lists every one found in the same source
    ├── StreamError            something that invalidates one stream and triggers recovery (§6)
    │   ├── DecodeError        malformed frame, batch or event (§1, §2), rank/block-size mismatch
    │   ├── IndexUpdateError   an event that cannot be applied to the index (§5)
    │   │   ├── UnknownParent      live BlockStored whose parent hash is unknown
    │   │   ├── HashConflict       engine hash already mapped to a different content key
    │   │   └── CapacityExceeded   ``max_blocks_per_stream`` exceeded ("index capacity exceeded")
    │   └── SnapshotError      a failed snapshot attempt (§7)
    │       ├── SnapshotTimeout    whole reply not received within ``replay_timeout_ms``
    │       └── BufferOverflow     live deltas buffered during recovery over ``max_buffered_bytes``
    ├── LifecycleError         a thread did not start or stop in time
    ├── EtcdError              an etcd request failed (translated once, in ``kvsvc.cluster.etcd``) (§9)
    │   └── EtcdUnavailable        etcd unreachable, timed out or answered 5xx: retry later
    ├── WaitTimeout            ``Registry.wait_for`` gave up (test helper)
    ├── MalformedRegistration  an etcd registration or load value (or key) that cannot be used (§9)
    ├── TemplateError          a chat template raised or failed to render (§11: routed with hit 0)
    ├── UpstreamError          no upstream produced a response head (§11)
    │   ├── UpstreamUnreachable    refused, reset or broken before the head (or in a read body)
    │   │   └── RpcUnreachable         a baidu_std connection refused, reset or closed (§13)
    │   └── UpstreamTimeout        connect, response head or body read timed out
    │       └── RpcTimeout             a baidu_std call not answered in time (§13)
    ├── ClientGone             the client left while its request waited upstream (§15)
    ├── RpcError               a baidu_std (brpc) call or frame failed (§13); also the base of
    │   │                      RpcUnreachable and RpcTimeout above
    │   ├── RpcProtocolError       the peer broke the framing: the connection must be closed
    │   ├── RpcMessageError        a message that does not parse as its protobuf type
    │   └── RpcCallFailed          the peer answered the call with an ``error_code``
    └── RequestError           a request the service refuses (§9-§11); ``message`` says why
        ├── BadRequest         malformed body or field; ``message`` starts with the field name
        ├── Unauthorized       missing or wrong ``X-Internal-Token`` (§10)
        ├── InvalidApiKey      missing or wrong ``Authorization: Bearer`` key on ``/v1/*``
        ├── TooManyRequests    the in-flight limit is reached (``--max_in_flight_requests``)
        ├── PayloadTooLarge    body over the endpoint's size limit
        ├── UnknownModel       ``model`` not among the served ``--model`` names (§11)
        ├── NoRegistry         a heartbeat while no registry is configured (``--etcd_addr`` empty)
        ├── NoCandidate        no instance can serve the request (§11 candidates empty)
        └── HeartbeatRejected  a heartbeat the registry refuses (§9)
            ├── InvalidHeartbeat   load values of the wrong type or out of range
            ├── UnknownInstance    no registered instance of that name
            └── StaleIncarnation   ``incarnation_id`` differs from the registered one

No class here carries an HTTP status: :mod:`kvsvc.http.errors` maps each kind to its answer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence


class KvsvcError(Exception):
    """Root of every error kvsvc raises on purpose."""


@dataclass(frozen=True)
class ConfigProblem:
    """One thing wrong with a configuration.

    :param field: dotted path of the offending key, e.g. ``streams[2].endpoint``, or the flag
        or variable it came from (``--port``, ``KVSVC_PORT``).
    :param message: what is wrong with it, with the bad value where there is one.
    """

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


class ConfigError(KvsvcError):
    """Invalid configuration; refuses start-up. Carries every problem found in one source
    (one ``kv_events_config_file``, one set of settings), so an operator fixes them in one go.

    :param field: dotted path of the (first) offending key, e.g. ``streams[2].endpoint``.
    :param message: what is wrong with it.
    :param more: the other problems found in the same source, in document order.

    :ivar problems: every problem, the first being ``(field, message)``.
    """

    def __init__(self, field: str, message: str, *, more: Sequence[ConfigProblem] = ()) -> None:
        self.field = field
        self.message = message
        self.problems: tuple[ConfigProblem, ...] = (ConfigProblem(field, message), *more)
        super().__init__("; ".join(str(p) for p in self.problems))

    @classmethod
    def of(cls, problems: Sequence[ConfigProblem]) -> "ConfigError":
        """The error listing ``problems`` (at least one), the first as ``field``/``message``."""
        first, *rest = problems
        return cls(first.field, first.message, more=rest)


class StreamError(KvsvcError):
    """An error that invalidates one stream (§6). ``str(exc)`` is the stream's ``error``."""


class DecodeError(StreamError):
    """Malformed frame, batch or event (§1, §2)."""


class IndexUpdateError(StreamError):
    """An event that cannot be applied to the per-stream index (§5)."""


class UnknownParent(IndexUpdateError):
    """A live ``BlockStored`` names a parent hash the engine map does not hold (§5)."""


class HashConflict(IndexUpdateError):
    """An engine hash is already mapped to a different content key (§5)."""


class CapacityExceeded(IndexUpdateError):
    """``max_blocks_per_stream`` would be exceeded (§5): error ``index capacity exceeded``."""

    def __init__(self, message: str = "index capacity exceeded") -> None:
        super().__init__(message)


class SnapshotError(StreamError):
    """A snapshot attempt failed (§7); retried with backoff (§6)."""


class SnapshotTimeout(SnapshotError):
    """The whole snapshot reply did not arrive within ``replay_timeout_ms`` (§7)."""


class ReplayUnanswered(SnapshotTimeout):
    """A history-mode rebuild got no reply message at all within ``replay_timeout_ms``
    (§7h "No replay answer": no replay endpoint, or one that never answers); the stream then
    serves a live-only subset."""


class BufferOverflow(SnapshotError):
    """Live deltas buffered during recovery exceeded ``max_buffered_bytes`` (§6)."""

    def __init__(self, message: str = "buffer overflow") -> None:
        super().__init__(message)


class LifecycleError(KvsvcError):
    """A background thread did not start (or stop) within its timeout."""




class EtcdError(KvsvcError):
    """An etcd request failed for a reason other than unavailability (e.g. a 4xx answer or a
    malformed reply). Raised only by :mod:`kvsvc.cluster.etcd`, chained to the etcd3gw/requests error."""


class EtcdUnavailable(EtcdError):
    """etcd could not be reached, timed out, or answered 5xx: the caller keeps its last state and
    retries with backoff (§9)."""


class WaitTimeout(KvsvcError):
    """A bounded wait (``Registry.wait_for``) ended without its condition becoming true."""


class MalformedRegistration(KvsvcError):
    """A value the registry reads from etcd that cannot be used (§9): an ``XLLM:<TYPE>:<name>``
    registration (not a JSON object, a field of the wrong type, ``name``/``type`` disagreeing
    with the key, a name that is not ``host:port``) or an ``XLLM:LOADMETRICS:<name>`` load out
    of range. ``str(exc)`` names the field. The registry logs it once per key revision and
    skips the key; :func:`kvsvc.cluster.model.check_load` raises it for a heartbeat's load too,
    which the registry turns into :class:`InvalidHeartbeat`."""


class MalformedMetrics(KvsvcError):
    """An engine's ``/metrics`` text that gives no load (§15): not Prometheus text, a load
    metric missing, or a value that is not a finite number >= 0. ``str(exc)`` names the
    metric. Raised by :func:`kvsvc.cluster.load_scrape.parse_engine_load`; the scraper logs
    it and reports no load for that scrape."""


class TemplateError(KvsvcError):
    """A chat template raised (``raise_exception``) or failed to render (§11). Raised by
    :mod:`kvsvc.routing.prompt` and turned into unknown tokens there (the request routes with
    hit ratio 0); it never reaches a client."""


class UpstreamError(KvsvcError):
    """No upstream produced a response head, or a non-streamed body broke before anything was
    sent to the client (§11). Raised by :mod:`kvsvc.routing.proxy`, chained to the ``requests``
    or ``urllib3`` error.

    :param message: what happened, naming the upstreams tried.
    """

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(message)


class UpstreamUnreachable(UpstreamError):
    """The connection was refused, reset or broken."""


class UpstreamTimeout(UpstreamError):
    """The connect, the wait for the response head, or a body read timed out."""


class ClientGone(KvsvcError):
    """The client closed its connection while its request waited for the upstream's response
    head (§15 "client going away"): the upstream connection was closed to cancel the request
    there, and nothing is answered (the HTTP layer counts it as ``client_closed``, status 499).

    :param message: what was cancelled, naming the upstream.
    """

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(message)


class RpcError(KvsvcError):
    """A brpc ``baidu_std`` frame or call failed (§13). Raised by :mod:`kvsvc.rpc`, chained to
    the ``OSError`` or protobuf error where there is one.

    :param message: what happened, naming the peer where one is known.
    """

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(message)


class RpcProtocolError(RpcError):
    """The byte stream is not ``baidu_std`` (bad magic, a body over the 64 MiB bound, a meta
    that does not parse, sizes that contradict each other): no later frame can be trusted, so
    the owner of the connection closes it (§13)."""


class RpcMessageError(RpcError):
    """A request or response message that does not parse as its protobuf type (a server
    answers ``EREQUEST``)."""


class RpcCallFailed(RpcError):
    """The peer answered a call with a non-zero ``error_code`` (brpc's codes: ENOSERVICE 1001,
    ENOMETHOD 1002, EREQUEST 1003, EINTERNAL 2001, ...).

    :param code: the answer's ``error_code``.
    :param text: the answer's ``error_text``.
    """

    def __init__(self, code: int, text: str) -> None:
        self.code = code
        self.text = text
        super().__init__(f"error_code {code}: {text}")


class RpcUnreachable(UpstreamUnreachable, RpcError):
    """A ``baidu_std`` connection to an engine was refused, reset or closed before the call's
    answer (§13): an :class:`UpstreamUnreachable`, so dispatch retries it as an HTTP one."""


class RpcTimeout(UpstreamTimeout, RpcError):
    """A ``baidu_std`` connect or call was not answered within its timeout (§13)."""


class RequestError(KvsvcError):
    """A request the service refuses (§9-§11). Each subclass is one kind of refusal; the HTTP
    layer answers ``{"error": message}`` (or OpenAI's shape) with the kind's status.

    :param message: human-readable reason, returned to the client as is.
    """

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(message)


class BadRequest(RequestError):
    """Malformed input: not JSON, a missing field, a field of the wrong JSON type, token ids that
    are not integers in range, too many tokens (§10, §11). The message starts with the field
    (``token_ids: ...``, ``messages[0].role: ...``) when one is to blame.

    :param message: human-readable reason.
    :param param: the request field at fault (OpenAI's ``param``), when it is not the
        message's leading field path (an engine's refusal); ``None``: the leading field path
        of the message, if it has one (:func:`field_of`).
    """

    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.param = param if param is not None else field_of(message)


#: A field path as messages lead with it: ``n``, ``messages[1].role``, ``stream_options.x``.
_FIELD_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\[\d+\]|\.[A-Za-z_][A-Za-z0-9_]*)*")


def field_of(message: str) -> Optional[str]:
    """The field path a message leads with (``"messages[1].role: must be ..."`` ->
    ``"messages[1].role"``), ``None`` when the text before the first ``": "`` is no field
    path (a sentence)."""
    head, sep, _ = message.partition(":")
    return head if sep and _FIELD_PATH.fullmatch(head) else None


class Unauthorized(RequestError):
    """The request lacks the configured ``X-Internal-Token`` or carries another one (§10)."""


class InvalidApiKey(RequestError):
    """A ``/v1/*`` request (not ``/v1/internal/*``) without ``Authorization: Bearer <key>``
    equal to ``--api_key`` (vLLM's ``--api-key`` rule)."""


class TooManyRequests(RequestError):
    """The OpenAI requests in flight reached ``--max_in_flight_requests``: retry later."""


class PayloadTooLarge(RequestError):
    """The body is larger than the endpoint accepts (read no further)."""


class UnknownModel(RequestError):
    """The request names a model outside the served ``--model`` names (§11)."""


class NoRegistry(RequestError):
    """A heartbeat arrived but no instance registry is configured (``--etcd_addr`` empty)."""


class NoCandidate(RequestError):
    """No instance can serve the request (§11: no candidate).

    :param reason: the policy's reason (:attr:`kvsvc.routing.policy.Decision.reason`).
    """

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"no instance available: {reason}")


class HeartbeatRejected(RequestError):
    """A heartbeat the registry refuses (§9); nothing of it is recorded."""


class InvalidHeartbeat(HeartbeatRejected):
    """``waiting_requests_num`` not an int in ``[0, 2**31 - 1]`` or ``gpu_cache_usage_perc`` not a
    finite number >= 0 (§9; a value above 1 is clamped to 1, not refused). The message is the registry's (:func:`kvsvc.cluster.model.check_load`)."""


class UnknownInstance(HeartbeatRejected):
    """The heartbeat names no instance the registry holds (§9).

    :param name: the instance ``host:port`` named.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"unknown instance {name!r}")


class StaleIncarnation(HeartbeatRejected):
    """The heartbeat's ``incarnation_id`` differs from the registered one (§9): it comes from a
    replaced process.

    :param name: the instance ``host:port``.
    :param got: the heartbeat's incarnation.
    :param registered: the registration's incarnation.
    """

    def __init__(self, name: str, got: str, registered: str) -> None:
        self.name = name
        self.got = got
        self.registered = registered
        super().__init__(f"stale incarnation {got!r} for {name!r} (registered {registered!r})")


class TestbedError(KvsvcError):
    """Raised inside the testbed (:mod:`kvsvc.testbed`), never by the service itself."""

    __test__ = False  # a class named Test* is not a pytest test class


class SimServingClosed(TestbedError):
    """The simulated engine is closing (``Serving.close``): a queued or running request is
    abandoned (answered 503 or its stream cut)."""


class SimClientDisconnected(TestbedError):
    """The client of a simulated request closed its connection: the request is cancelled."""


class SimBadRequest(TestbedError):
    """A malformed OpenAI body sent to the simulated engine (answered 400); the message names
    the offending field."""
