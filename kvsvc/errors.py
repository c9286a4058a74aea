"""The kvsvc error tree. Third-party errors (pyzmq, ormsgpack, pydantic, requests) are
translated into these once, at the module boundary where they occur (``raise ... from exc``).

::

    KvsvcError
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
    └── RequestError           bad HTTP input; ``status`` is the 4xx code to answer with (§10)
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
