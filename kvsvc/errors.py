"""The kvsvc error tree. Third-party errors (pyzmq, ormsgpack, pydantic, requests) are
translated into these once, at the module boundary where they occur (``raise ... from exc``).

::

    KvsvcError
    ├── TestbedError           raised only by the testbed (``kvsvc.testbed``), never by the service
    │   ├── SimServingClosed       the simulated engine is closing: a served request is abandoned
    │   ├── SimClientDisconnected  the client of a simulated request closed its connection
    │   └── SimBadRequest          a malformed OpenAI body sent to the simulated engine
    ├── ConfigError            bad configuration; ``field`` names the offending key (§8)
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
    └── RequestError           bad HTTP input; ``status`` is the 4xx code to answer with (§10)
        └── HeartbeatRejected  a heartbeat the registry refuses (§9)
            ├── InvalidHeartbeat   400: load values of the wrong type or out of range
            ├── UnknownInstance    409: no registered instance of that name
            └── StaleIncarnation   409: ``incarnation_id`` differs from the registered one
"""

from __future__ import annotations


class KvsvcError(Exception):
    """Root of every error kvsvc raises on purpose."""


class ConfigError(KvsvcError):
    """Invalid configuration; refuses start-up.

    :param field: dotted path of the offending key, e.g. ``streams[2].endpoint``.
    :param message: what is wrong with it.
    """

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}" if field else message)


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


class BufferOverflow(SnapshotError):
    """Live deltas buffered during recovery exceeded ``max_buffered_bytes`` (§6)."""

    def __init__(self, message: str = "buffer overflow") -> None:
        super().__init__(message)


class LifecycleError(KvsvcError):
    """A background thread did not start (or stop) within its timeout."""


class RequestError(KvsvcError):
    """Bad HTTP input (§10).

    :param status: HTTP status to answer with (400, 401, 404, 413, ...).
    :param message: human-readable reason, returned as ``{"error": message}``.
    """

    def __init__(self, status: int, message: str) -> None:
        self.status = status
        self.message = message
        super().__init__(message)


class EtcdError(KvsvcError):
    """An etcd request failed for a reason other than unavailability (e.g. a 4xx answer or a
    malformed reply). Raised only by :mod:`kvsvc.cluster.etcd`, chained to the etcd3gw/requests error."""


class EtcdUnavailable(EtcdError):
    """etcd could not be reached, timed out, or answered 5xx: the caller keeps its last state and
    retries with backoff (§9)."""


class WaitTimeout(KvsvcError):
    """A bounded wait (``Registry.wait_for``) ended without its condition becoming true."""


class HeartbeatRejected(RequestError):
    """A heartbeat the registry refuses (§9). ``status`` is the HTTP answer (400 or 409)."""


class InvalidHeartbeat(HeartbeatRejected):
    """400: ``waiting_requests_num`` not an int >= 0 or ``gpu_cache_usage_perc`` not a float in
    [0, 1] (§9)."""

    def __init__(self, message: str) -> None:
        super().__init__(400, message)


class UnknownInstance(HeartbeatRejected):
    """409: the heartbeat names no instance the registry holds (§9)."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(409, f"unknown instance {name!r}")


class StaleIncarnation(HeartbeatRejected):
    """409: the heartbeat's ``incarnation_id`` differs from the registered one (§9): it comes
    from a replaced process."""

    def __init__(self, name: str, got: str, registered: str) -> None:
        self.name = name
        self.got = got
        self.registered = registered
        super().__init__(409, f"stale incarnation {got!r} for {name!r} (registered {registered!r})")


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
