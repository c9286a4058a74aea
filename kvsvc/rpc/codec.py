"""brpc ``baidu_std`` framing without I/O (§13), in the style of h11: a :class:`Connection`
is fed the bytes a socket received and returns the calls and answers they complete; it turns
calls and answers into the bytes to send. It never touches a socket or a clock, so every rule
is tested without one (``tests/unit/test_rpc_codec.py``, on frames captured from real brpc).

Frame (apache/brpc 1.12.1 ``src/brpc/policy/baidu_rpc_protocol.cpp``)::

    b"PRPC" | body_size: uint32 BE | meta_size: uint32 BE | RpcMeta | message | attachment

``body_size`` counts meta + message + attachment; ``RpcMeta.attachment_size`` says how many
of the last bytes are the attachment (never compressed). ``compress_type`` applies to the
message: 0 none, 2 gzip, 3 zlib are decoded and encoded; 1 snappy and 4 lz4 are refused
(:class:`BadCall` with EREQUEST on a server, ERESPONSE on a client), as is any other value.
``correlation_id`` (int64) pairs a response with its request; answers may come in any order.

Two kinds of failure:

- the stream itself is broken (wrong magic, ``body_size`` over :data:`MAX_BODY_SIZE` (64 MiB,
  brpc's ``max_body_size``), ``meta_size`` above ``body_size``, an ``RpcMeta`` that does not
  parse, a request sent to a client or an answer to a server, data after end of stream):
  :meth:`Connection.receive_data` raises :class:`~kvsvc.errors.RpcProtocolError` and the owner
  closes the connection, as brpc does. The connection object stays broken;
- one frame cannot be served but the stream is sound (a message that cannot be decompressed,
  an unsupported compression, ``attachment_size`` above the payload, a streaming or chunked
  call (brpc's ``stream_settings`` / ``chunk_info``, not implemented)): a :class:`BadCall`
  event carrying the ``correlation_id``, so a server answers it with the error and a client
  fails that call only.

Not implemented, refused as above: streaming RPC, chunked frames, snappy, lz4.
``authentication_data`` is accepted and ignored, as by a brpc server without an
authenticator (the port is unauthenticated by design, §13); ``user_fields`` are kept.
"""

from __future__ import annotations

import enum
import gzip
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any, NoReturn, Optional, Union

from kvsvc.errors import RpcMessageError, RpcProtocolError
from kvsvc.rpc import messages

MAGIC = b"PRPC"
HEADER = struct.Struct(">4sII")
#: Header length, bytes.
HEADER_SIZE = HEADER.size
#: brpc's ``max_body_size`` default: a larger body closes the connection (§13).
MAX_BODY_SIZE = 64 * 1024 * 1024

# compress_type (brpc options.proto CompressType)
COMPRESS_NONE = 0
COMPRESS_SNAPPY = 1
COMPRESS_GZIP = 2
COMPRESS_ZLIB = 3
COMPRESS_LZ4 = 4
COMPRESS_NAMES = {COMPRESS_NONE: "none", COMPRESS_SNAPPY: "snappy", COMPRESS_GZIP: "gzip",
                  COMPRESS_ZLIB: "zlib", COMPRESS_LZ4: "lz4"}
#: The compressions this codec decodes and encodes.
SUPPORTED_COMPRESS = (COMPRESS_NONE, COMPRESS_GZIP, COMPRESS_ZLIB)

# error_code (brpc errno.proto)
ENOSERVICE = 1001
ENOMETHOD = 1002
EREQUEST = 1003
ERPCTIMEDOUT = 1008
EFAILEDSOCKET = 1009
EINTERNAL = 2001
ERESPONSE = 2002
ELOGOFF = 2003


class Role(enum.Enum):
    """Which end of the connection the codec is: a server receives requests and sends
    responses, a client the other way round."""

    SERVER = "server"
    CLIENT = "client"


@dataclass(frozen=True, slots=True)
class Request:
    """A call received by a server.

    :param correlation_id: the caller's id, to echo in the response (int64).
    :param service: ``RpcRequestMeta.service_name`` as sent (full or short name).
    :param method: ``RpcRequestMeta.method_name``.
    :param message: the serialized request message, decompressed.
    :param attachment: the attachment bytes (``b""`` when none).
    :param compress_type: the compression the message came with.
    :param log_id: ``RpcRequestMeta.log_id`` (0 when absent).
    :param timeout_ms: the caller's timeout, ``None`` when it sent none.
    :param user_fields: ``RpcMeta.user_fields``.
    """

    correlation_id: int
    service: str
    method: str
    message: bytes
    attachment: bytes = b""
    compress_type: int = COMPRESS_NONE
    log_id: int = 0
    timeout_ms: Optional[int] = None
    user_fields: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Response:
    """An answer received by a client.

    :param correlation_id: the id of the call it answers.
    :param error_code: 0 for success, else brpc's code (``ENOMETHOD``...).
    :param error_text: the server's text for a failure (``""`` on success).
    :param message: the serialized response message, decompressed (empty on failure).
    :param attachment: the attachment bytes.
    :param compress_type: the compression the message came with.
    """

    correlation_id: int
    error_code: int = 0
    error_text: str = ""
    message: bytes = b""
    attachment: bytes = b""
    compress_type: int = COMPRESS_NONE

    @property
    def ok(self) -> bool:
        """True when the server answered without an error code."""
        return self.error_code == 0


@dataclass(frozen=True, slots=True)
class BadCall:
    """A frame of a sound stream that cannot be served (see the module docstring): a server
    answers ``error_code`` to ``correlation_id``; a client fails that call with it.

    :param correlation_id: the frame's id.
    :param error_code: ``EREQUEST`` (server side) or ``ERESPONSE`` (client side).
    :param error_text: why, in brpc's words where it has some.
    :param service: the request's service (server side; ``""`` on a client).
    :param method: the request's method (server side).
    """

    correlation_id: int
    error_code: int
    error_text: str
    service: str = ""
    method: str = ""


Event = Union[Request, Response, BadCall]


def compress(data: bytes, compress_type: int) -> bytes:
    """``data`` compressed as brpc does for ``compress_type`` (gzip: the gzip format; zlib:
    the zlib format).

    :raises ValueError: a compression this codec does not implement.
    """
    if compress_type == COMPRESS_NONE:
        return data
    if compress_type == COMPRESS_GZIP:
        return gzip.compress(data, compresslevel=6, mtime=0)
    if compress_type == COMPRESS_ZLIB:
        return zlib.compress(data)
    raise ValueError(f"compress_type {compress_type} "
                     f"({COMPRESS_NAMES.get(compress_type, 'unknown')}) is not supported "
                     f"(only none, gzip, zlib)")


def decompress(data: bytes, compress_type: int, limit: int = MAX_BODY_SIZE) -> bytes:
    """``data`` decompressed, at most ``limit`` bytes of output (a small frame must not
    inflate into gigabytes).

    :raises ValueError: an unsupported compression, corrupt data, trailing garbage, or more
        than ``limit`` bytes of output.
    """
    if compress_type == COMPRESS_NONE:
        return data
    if compress_type == COMPRESS_GZIP:
        wbits = 16 + zlib.MAX_WBITS
    elif compress_type == COMPRESS_ZLIB:
        wbits = zlib.MAX_WBITS
    else:
        raise ValueError(f"compress_type {compress_type} "
                         f"({COMPRESS_NAMES.get(compress_type, 'unknown')}) is not supported "
                         f"(only none, gzip, zlib)")
    d = zlib.decompressobj(wbits)
    try:
        out = d.decompress(data, limit + 1)
        if len(out) > limit:
            raise ValueError(f"decompressed message over {limit} bytes")
        if d.unconsumed_tail or not d.eof:
            raise ValueError("truncated compressed message")
        if d.unused_data:
            raise ValueError("bytes after the compressed message")
    except zlib.error as exc:
        raise ValueError(f"corrupt {COMPRESS_NAMES[compress_type]} data: {exc}") from exc
    return out


def encode_frame(meta: bytes, message: bytes, attachment: bytes = b"") -> bytes:
    """One frame: header, serialized ``RpcMeta``, message, attachment."""
    body = len(meta) + len(message) + len(attachment)
    return b"".join((HEADER.pack(MAGIC, body, len(meta)), meta, message, attachment))


def encode_request(correlation_id: int, service: str, method: str, message: bytes, *,
                   attachment: bytes = b"", compress_type: int = COMPRESS_NONE,
                   timeout_ms: Optional[int] = None, log_id: Optional[int] = None) -> bytes:
    """The frame of a call.

    :param correlation_id: int64 id the response will echo.
    :param service: full service name (``xllm.proto.XllmAPIService``).
    :param method: method name (``ChatCompletions``).
    :param message: the serialized request message (compressed here).
    :param attachment: sent after the message, never compressed.
    :param compress_type: none, gzip or zlib.
    :param timeout_ms: the caller's timeout, told to the server (brpc's ``timeout_ms``).
    :param log_id: brpc's ``log_id``.
    :raises ValueError: an unsupported ``compress_type``.
    """
    meta = messages.RpcMeta(correlation_id=correlation_id, compress_type=compress_type)
    meta.request.service_name = service
    meta.request.method_name = method
    if log_id is not None:
        meta.request.log_id = log_id
    if timeout_ms is not None:
        meta.request.timeout_ms = timeout_ms
    if attachment:
        meta.attachment_size = len(attachment)
    return encode_frame(messages.serialize(meta), compress(message, compress_type), attachment)


def encode_response(correlation_id: int, message: bytes = b"", *, error_code: int = 0,
                    error_text: str = "", attachment: bytes = b"",
                    compress_type: int = COMPRESS_NONE) -> bytes:
    """The frame of an answer. A failed answer (``error_code`` != 0) carries no message, as
    brpc sends none.

    :param correlation_id: the call's id.
    :param message: the serialized response message (compressed here).
    :param error_code: 0, or brpc's code (``ENOMETHOD``...).
    :param error_text: why, for a failure.
    :param attachment: sent after the message.
    :param compress_type: none, gzip or zlib (failures are never compressed).
    :raises ValueError: an unsupported ``compress_type``.
    """
    meta = messages.RpcMeta(correlation_id=correlation_id)
    # brpc always writes response.error_code, 0 included (the captured replies have it).
    meta.response.error_code = error_code
    if error_code:
        message, attachment, compress_type = b"", b"", COMPRESS_NONE
        if error_text:
            meta.response.error_text = error_text
    meta.compress_type = compress_type
    if attachment:
        meta.attachment_size = len(attachment)
    return encode_frame(messages.serialize(meta), compress(message, compress_type), attachment)


class Connection:
    """One end of a ``baidu_std`` connection (see the module docstring).

    A client's correlation ids come from :meth:`send_request` (1, 2, ...; unique on the
    connection); a server echoes the caller's in :meth:`send_response`. The codec keeps no
    record of calls in flight: pairing answers with calls (and dropping an answer to a call
    given up) is the owner's, which knows its timeouts.

    Not thread-safe: one thread feeds :meth:`receive_data`; the ``send_*`` methods touch only
    the id counter, which a client's sending threads serialize with their socket lock.

    :param role: :attr:`Role.SERVER` or :attr:`Role.CLIENT`.
    :param max_body_size: bound of ``body_size``, bytes (:data:`MAX_BODY_SIZE`).
    """

    def __init__(self, role: Role, max_body_size: int = MAX_BODY_SIZE) -> None:
        self.role = role
        self.max_body_size = max_body_size
        self._buffer = bytearray()
        self._next_id = 1
        self._broken: Optional[str] = None
        self._eof = False

    @property
    def broken(self) -> Optional[str]:
        """Why the stream is broken (the owner closes the connection), ``None`` while sound.
        Set when :meth:`receive_data` raised, or when it returned the frames that came
        before the break (it raises on the next call)."""
        return self._broken

    @property
    def buffered(self) -> int:
        """Bytes received and not yet part of a whole frame."""
        return len(self._buffer)

    def receive_data(self, data: bytes) -> list[Event]:
        """Feed bytes read from the socket; ``b""`` means the peer closed its side.

        :returns: the events completed by ``data``, in wire order (possibly none). When the
            stream breaks after some whole frames, those are returned and :attr:`broken` is
            set; the next call raises.
        :raises RpcProtocolError: the stream is broken (module docstring); every later call
            raises it again. End of stream inside a frame raises it too.
        """
        if self._broken is not None:
            raise RpcProtocolError(self._broken)
        if not data:
            self._eof = True
            if self._buffer:
                self._fail(f"connection closed inside a frame ({len(self._buffer)} bytes "
                           "buffered)")
            return []
        if self._eof:
            self._fail("data received after end of stream")
        self._buffer += data
        events: list[Event] = []
        while True:
            try:
                event = self._next_frame()
            except RpcProtocolError:
                if events:
                    return events   # the frames before the break are whole: serve them first
                raise
            if event is None:
                return events
            events.append(event)

    def send_request(self, service: str, method: str, message: bytes, *,
                     attachment: bytes = b"", compress_type: int = COMPRESS_NONE,
                     timeout_ms: Optional[int] = None) -> tuple[int, bytes]:
        """A call's frame with the next correlation id (client role).

        :returns: ``(correlation_id, frame bytes)``.
        :raises RpcProtocolError: called on a server's connection.
        :raises ValueError: an unsupported ``compress_type``.
        """
        if self.role is not Role.CLIENT:
            raise RpcProtocolError("a server connection sends no requests")
        cid = self._next_id
        self._next_id += 1
        return cid, encode_request(cid, service, method, message, attachment=attachment,
                                   compress_type=compress_type, timeout_ms=timeout_ms)

    def send_response(self, correlation_id: int, message: bytes = b"", *, error_code: int = 0,
                      error_text: str = "", attachment: bytes = b"",
                      compress_type: int = COMPRESS_NONE) -> bytes:
        """An answer's frame (server role); see :func:`encode_response`.

        :raises RpcProtocolError: called on a client's connection.
        """
        if self.role is not Role.SERVER:
            raise RpcProtocolError("a client connection sends no responses")
        return encode_response(correlation_id, message, error_code=error_code,
                               error_text=error_text, attachment=attachment,
                               compress_type=compress_type)

    # -- parsing ----------------------------------------------------------------------------

    def _fail(self, why: str) -> NoReturn:
        self._broken = why
        self._buffer.clear()
        raise RpcProtocolError(why)

    def _next_frame(self) -> Optional[Event]:
        buf = self._buffer
        have = len(buf)
        if have < HEADER_SIZE:
            if bytes(buf[:4]) != MAGIC[:min(have, 4)]:
                self._fail(f"not baidu_std: the stream starts with {bytes(buf[:4])!r}, "
                           f"not {MAGIC!r}")
            return None
        magic, body_size, meta_size = HEADER.unpack_from(buf)
        if magic != MAGIC:
            self._fail(f"not baidu_std: the stream starts with {magic!r}, not {MAGIC!r}")
        if body_size > self.max_body_size:
            self._fail(f"body_size={body_size} is over the limit of {self.max_body_size} bytes")
        if meta_size > body_size:
            self._fail(f"meta_size={meta_size} is bigger than body_size={body_size}")
        end = HEADER_SIZE + body_size
        if have < end:
            return None
        meta_bytes = bytes(buf[HEADER_SIZE:HEADER_SIZE + meta_size])
        payload = bytes(buf[HEADER_SIZE + meta_size:end])
        del buf[:end]
        try:
            meta = messages.parse(messages.RpcMeta, meta_bytes, "RpcMeta")
        except RpcMessageError as exc:
            self._fail(f"Fail to parse RpcMeta: {exc}")
        return self._event(meta, payload)

    def _event(self, m: Any, payload: bytes) -> Event:
        cid = int(m.correlation_id)
        is_request = m.HasField("request")
        if self.role is Role.SERVER and not is_request:
            self._fail(f"a frame without a request meta sent to a server (correlation_id {cid})")
        if self.role is Role.CLIENT and is_request:
            self._fail(f"a request frame sent to a client (correlation_id {cid})")
        service = m.request.service_name if is_request else ""
        method = m.request.method_name if is_request else ""
        bad_code = EREQUEST if is_request else ERESPONSE

        def bad(text: str) -> BadCall:
            return BadCall(cid, bad_code, text, service, method)

        attachment_size = int(m.attachment_size)
        if attachment_size < 0 or attachment_size > len(payload):
            return bad(f"attachment_size={attachment_size} is larger than "
                       f"{'request' if is_request else 'response'}_size={len(payload)}")
        if m.HasField("stream_settings"):
            return bad("streaming RPC (stream_settings) is not supported by this server")
        if m.HasField("chunk_info"):
            return bad("chunked frames (chunk_info) are not supported")
        split = len(payload) - attachment_size
        body, attachment = payload[:split], payload[split:]
        ctype = int(m.compress_type)
        if is_request or not m.response.error_code:
            try:
                body = decompress(body, ctype, self.max_body_size)
            except ValueError as exc:
                return bad(f"Fail to parse {'request' if is_request else 'response'} message, "
                           f"CompressType={COMPRESS_NAMES.get(ctype, str(ctype))}: {exc}")
        if is_request:
            return Request(cid, service, method, body, attachment, ctype,
                           int(m.request.log_id),
                           int(m.request.timeout_ms) if m.request.HasField("timeout_ms")
                           else None, dict(m.user_fields))
        return Response(cid, int(m.response.error_code), m.response.error_text, body,
                        attachment, ctype)
