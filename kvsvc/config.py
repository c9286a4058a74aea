"""Validated configuration: the ``kv_events_config_file`` JSON (§8) and the service settings.

Both are checked before any thread starts; every failure raises :class:`~kvsvc.errors.ConfigError`
naming the field (``streams[2].endpoint``, ``max_streams``, ``--port``). Unknown keys, wrong types
(no string-to-number coercion) and out-of-range values are rejected.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path
from typing import Annotated, Any, List, Optional

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvsvc.address import (
    check_bind_host,
    check_tcp_endpoint,
    endpoint_key,
    parse_host_port,
    parse_http_host_port,
)
from kvsvc.errors import ConfigError

log = logging.getLogger(__name__)

MAX_U64 = 2**64 - 1
#: Accepted ``--log_level`` and ``--log_format`` values.
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMATS = ("json", "text")
#: Default of ``max_concurrent_snapshots`` (the directory's snapshot gate).
DEFAULT_MAX_CONCURRENT_SNAPSHOTS = 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class StreamConfig(_Strict):
    """One static stream: one (instance, DP rank) KV-event channel (§8 ``streams[]``)."""

    instance_name: Annotated[StrictStr, Field(min_length=1)]
    """Instance identity, normally its HTTP ``host:port`` as registered."""
    dp_rank: Annotated[StrictInt, Field(ge=0, le=65535)] = 0
    """DP rank of this stream; must equal the rank carried by its batches (§2)."""
    block_size: Annotated[StrictInt, Field(ge=1, le=1 << 20)] = 128
    """Tokens per block; must equal ``block_size`` of its ``BlockStored`` events (§5)."""
    endpoint: StrictStr
    """Live event endpoint ``tcp://host:port`` (§1)."""
    replay_endpoint: StrictStr
    """Snapshot (replay) endpoint ``tcp://host:port`` (§7)."""
    topic: StrictStr = ""
    """ZMQ topic, equal to the engine's exactly (§1)."""
    hash_seed: Annotated[StrictInt, Field(ge=0, le=MAX_U64)] = 1024
    """XXH3 seed of the content keys (§4); internal to kvsvc."""

    _endpoint_rule = field_validator("endpoint", "replay_endpoint")(check_tcp_endpoint)


class DiscoveryConfig(_Strict):
    """Discovery rule block (§8, §9)."""

    enabled: StrictBool = True
    block_size: Annotated[StrictInt, Field(ge=1, le=1 << 20)] = 128
    topic: StrictStr = ""
    event_port_offset: Annotated[StrictInt, Field(ge=0, le=65535)] = 10000
    replay_port_offset: Annotated[StrictInt, Field(ge=0, le=65535)] = 30000
    refresh_interval_ms: Annotated[StrictInt, Field(ge=50, le=60000)] = 1000
    hash_seed: Annotated[StrictInt, Field(ge=0, le=MAX_U64)] = 1024


class KvEventsConfig(_Strict):
    """The ``kv_events_config_file`` document (§8)."""

    discovery: Optional[DiscoveryConfig] = None
    streams: List[StreamConfig] = Field(default_factory=list)
    max_streams: Annotated[StrictInt, Field(ge=1, le=128)] = 128
    """Streams kept; beyond it whole instances are skipped in name order."""
    max_blocks_per_stream: Annotated[StrictInt, Field(ge=1)] = 262144
    """Indexed blocks plus EXCLUDED/ORPHAN markers per stream (§5)."""
    max_message_bytes: Annotated[StrictInt, Field(ge=1024)] = 8 * 1024 * 1024
    """One live message or one snapshot reply message, all frames (§1, §7)."""
    max_buffered_bytes: Annotated[StrictInt, Field(ge=1024)] = 16 * 1024 * 1024
    """Live deltas buffered during one recovery, wire bytes plus record overhead (§6)."""
    replay_timeout_ms: Annotated[StrictInt, Field(ge=1)] = 2000
    """Deadline of one complete snapshot reply (§7)."""
    resync_interval_ms: Annotated[StrictInt, Field(ge=1000)] = 30000
    """Period of the background calibration snapshot of a synchronized stream (§6)."""

    @model_validator(mode="after")
    def _sources_and_uniqueness(self) -> "KvEventsConfig":
        if self.streams and self.discovery is not None and self.discovery.enabled:
            raise ValueError("streams: non-empty streams and enabled discovery are mutually exclusive")
        seen_pairs: dict[tuple[str, int], int] = {}
        # Compared as (normalised host, port): "tcp://127.0.0.1:018100" is "tcp://127.0.0.1:18100".
        # Names are not resolved (no DNS at start-up), so "localhost" and "127.0.0.1" differ.
        seen_endpoints: dict[tuple[str, int], str] = {}
        for i, s in enumerate(self.streams):
            pair = (s.instance_name, s.dp_rank)
            if pair in seen_pairs:
                raise ValueError(
                    f"streams[{i}]: duplicate instance_name/dp_rank {pair[0]!r}/{pair[1]} "
                    f"(also streams[{seen_pairs[pair]}])"
                )
            seen_pairs[pair] = i
            for name in ("endpoint", "replay_endpoint"):
                ep = getattr(s, name)
                key = endpoint_key(ep)
                if key in seen_endpoints:
                    raise ValueError(
                        f"streams[{i}].{name}: endpoint {ep} already used by {seen_endpoints[key]}"
                    )
                seen_endpoints[key] = f"streams[{i}].{name}"
        return self

    def kept_streams(self) -> List[StreamConfig]:
        """Static streams after ``max_streams`` (§8): whole instances in name order, never part of
        an instance's DP ranks. Skipped instances are logged once here."""
        by_name: dict[str, list[StreamConfig]] = {}
        for s in self.streams:
            by_name.setdefault(s.instance_name, []).append(s)
        kept: list[StreamConfig] = []
        for name in sorted(by_name):
            group = sorted(by_name[name], key=lambda s: s.dp_rank)
            if len(kept) + len(group) > self.max_streams:
                log.warning("max_streams=%d reached: instance %s (%d streams) skipped",
                            self.max_streams, name, len(group))
                continue
            kept.extend(group)
        return kept


def _field_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("function-after", "function-before") or str(part).startswith("function-"):
            continue
        else:
            out += ("." if out else "") + str(part)
    return out


def translate_validation_error(exc: ValidationError, prefix: str = "") -> ConfigError:
    """Turn the first pydantic error into a :class:`ConfigError` naming the field."""
    err = exc.errors(include_url=False)[0]
    msg = str(err.get("msg", "invalid"))
    field = _field_path(tuple(err.get("loc", ())))
    # Model-level validators put the field in the message ("streams[1].endpoint: ...").
    if not field and ": " in msg:
        head, _, rest = msg.removeprefix("Value error, ").partition(": ")
        field, msg = head, rest
    msg = msg.removeprefix("Value error, ")
    if err.get("type") == "extra_forbidden":
        msg = "unknown key"
    if prefix:
        field = f"{prefix}{field}"
    return ConfigError(field, msg)


def parse_kv_events_config(data: Any) -> KvEventsConfig:
    """Validate a decoded ``kv_events_config_file`` document (§8).

    :param data: the JSON value (must be an object).
    :raises ConfigError: naming the first offending field.
    """
    if not isinstance(data, dict):
        raise ConfigError("kv_events_config_file", "top level must be a JSON object")
    try:
        return KvEventsConfig.model_validate(data)
    except ValidationError as exc:
        raise translate_validation_error(exc) from exc


def load_kv_events_config(path: str | os.PathLike[str]) -> KvEventsConfig:
    """Read and validate the ``kv_events_config_file`` (§8).

    :raises ConfigError: unreadable file, invalid JSON, or an invalid field.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError("kv_events_config_file", f"cannot read {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError("kv_events_config_file", f"{path} is not UTF-8 text: {exc.reason} "
                                                   f"at byte {exc.start}") from exc
    try:
        data = json.loads(text, object_pairs_hook=_reject_duplicate_keys)
    except json.JSONDecodeError as exc:
        raise ConfigError("kv_events_config_file", f"{path} is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise ConfigError("kv_events_config_file", f"{path} is nested too deeply") from exc
    except _DuplicateKey as exc:
        raise ConfigError(exc.key, "key given twice in one JSON object") from exc
    return parse_kv_events_config(data)


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """JSON object hook: a key given twice would silently keep only the last value."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


class ServiceSettings(BaseSettings):
    """Service settings, named after xllm-service's flags. Sources, highest first: command-line
    flags (passed as keyword arguments), ``KVSVC_<NAME>`` environment variables, defaults.
    The internal token can come from ``KVSVC_INTERNAL_API_TOKEN`` or a file named by
    ``--internal_api_token_file`` / ``KVSVC_INTERNAL_API_TOKEN_FILE`` so it never needs argv."""

    model_config = SettingsConfigDict(env_prefix="KVSVC_", extra="forbid", frozen=True)

    host: str = "0.0.0.0"
    """HTTP bind address."""
    port: Annotated[int, Field(ge=1, le=65535)] = 8888
    """HTTP port."""
    kv_events_config_file: str = ""
    """Path of the §8 JSON; empty disables the index."""
    internal_api_token: Optional[SecretStr] = None
    """Required ``X-Internal-Token`` of ``/v1/internal/*`` when set (§10)."""
    internal_api_token_file: str = ""
    """File holding the internal token (first line, stripped); exclusive with the token itself."""
    max_query_tokens: Annotated[int, Field(ge=1, le=16 * 1024 * 1024)] = 1 << 20
    """Largest ``token_ids`` list accepted by the query endpoint (§10)."""
    log_level: str = "info"
    """Level of the app's and gunicorn's error logs: debug, info, warning, error, critical."""
    log_format: str = "json"
    """``json`` (one JSON object per line, python-json-logger; the default, for journald and
    log shippers) or ``text`` (one human-readable line, for a terminal)."""
    access_log: bool = False
    """gunicorn's per-request access log (to stdout); off by default: every query and
    heartbeat would be a line."""
    metrics_require_token: bool = False
    """Require ``X-Internal-Token`` on ``GET /metrics`` too (off: Prometheus scrapes freely)."""
    etcd_addr: str = ""
    """etcd endpoint ``host:port`` of the instance registry (§9), xllm-service's flag; empty means
    no registry (static streams only, heartbeats answered 503)."""
    etcd_namespace: str = ""
    """Namespace of every registry key: keys live under ``/<ns>/`` when set (§9)."""
    detect_disconnected_instance_interval: Annotated[float, Field(gt=0, le=3600)] = 15.0
    """Seconds an instance stays ``SUSPECT`` before it is removed (§9), seconds."""
    self_address: str = ""
    """``host:port`` engines reach this service at, written to ``XLLM:SERVICE:MASTER`` when this
    replica is master (§9); empty derives it from ``host``/``port``."""
    max_concurrent_snapshots: Annotated[int, Field(ge=1, le=128)] = DEFAULT_MAX_CONCURRENT_SNAPSHOTS
    """Snapshot attempts (§6, §7: request, reply, decode, index build) running at once across
    all streams; the others queue, first come first served, before sending their request.
    A build is CPU work under the GIL, so with one at a time a request thread waits at most
    one build slice for it while many streams recover (bench 8); more speeds up recovery
    and lengthens that wait. 1-128."""
    # -- routing (§11; xllm-service flag names), read by kvsvc.http.routes --
    load_balance_policy: str = "CAR"
    """``RR`` or ``CAR`` (§11); ``SLO_AWARE`` and other names refuse start-up."""
    car_prefill_lambda: Annotated[float, Field(ge=0.0, le=1.0)] = 0.5
    """CAR weight of the cache miss against the queue cost in score(P), in [0, 1] (§11)."""
    car_host_hit_weight: Annotated[float, Field(ge=0.0, le=1.0)] = 0.5
    """CAR weight of a Host-only hit token against a Device one, in [0, 1] (§11)."""
    tokenizer_path: str = ""
    """Directory with ``tokenizer.json`` (+ ``tokenizer_config.json`` chat template) or a
    ``tokenizer.json`` file; empty: text prompts route with hit ratio 0."""
    model: str = ""
    """Comma-separated model names the instances serve (``/v1/models``; other names get 404);
    empty accepts any name and lists none."""
    upstream_connect_timeout_s: Annotated[float, Field(gt=0, le=600)] = 2.0
    """TCP connect bound of one upstream attempt, seconds."""
    upstream_read_timeout_s: Annotated[float, Field(gt=0, le=86400)] = 600.0
    """Bound of the wait for an upstream's response head and between body reads, seconds."""
    max_request_bytes: Annotated[int, Field(ge=1024, le=1 << 30)] = 16 * 1024 * 1024
    """Largest OpenAI request body accepted, bytes (413 above)."""
    worker_threads: Annotated[int, Field(ge=4, le=4096)] = 128
    """Threads of the one gunicorn gthread worker: requests served at once. Each proxied
    request holds one for its whole duration (a streamed answer: until its last token), so
    this caps the requests in flight to all instances together; also the proxy's kept-alive
    connections per instance. At least 4: heartbeats and ``/ready`` share these threads."""

    @field_validator("load_balance_policy")
    @classmethod
    def _policy_name(cls, value: str) -> str:
        if value == "SLO_AWARE":
            raise ValueError("SLO_AWARE is not supported by kvsvc yet; use CAR or RR")
        if value not in ("RR", "CAR"):
            raise ValueError(f"must be RR or CAR, got {value!r}")
        return value

    @field_validator("log_format")
    @classmethod
    def _log_format(cls, value: str) -> str:
        if value not in LOG_FORMATS:
            raise ValueError(f"must be one of {', '.join(LOG_FORMATS)}, got {value!r}")
        return value

    @field_validator("log_level")
    @classmethod
    def _log_level(cls, value: str) -> str:
        if value.lower() not in LOG_LEVELS:
            raise ValueError(f"must be one of {', '.join(LOG_LEVELS)}, got {value!r}")
        return value.lower()

    @field_validator("etcd_addr")
    @classmethod
    def _etcd_addr_form(cls, value: str) -> str:
        if value:
            parse_http_host_port(value)
        return value

    @field_validator("self_address")
    @classmethod
    def _self_address_form(cls, value: str) -> str:
        if value:
            parse_host_port(value)
        return value

    @field_validator("host")
    @classmethod
    def _bind_host(cls, value: str) -> str:
        # A bind address: an IP (0.0.0.0 / :: allowed here, unlike connect addresses) or a name.
        return check_bind_host(value)

    @model_validator(mode="after")
    def _token_sources(self) -> "ServiceSettings":
        if self.internal_api_token is not None and self.internal_api_token_file:
            raise ValueError("internal_api_token_file: give either the token or the token file, not both")
        if self.internal_api_token is not None and not self.internal_api_token.get_secret_value():
            # An empty KVSVC_INTERNAL_API_TOKEN would silently switch authentication off.
            raise ValueError("internal_api_token: empty; unset it to run without a token")
        if self.internal_api_token is not None:
            problem = _token_problem(self.internal_api_token.get_secret_value())
            if problem:
                raise ValueError(f"internal_api_token: {problem}")
        return self

    def token(self) -> Optional[str]:
        """The internal API token, reading ``internal_api_token_file`` if set.

        :raises ConfigError: the token file cannot be read or is empty.
        """
        if self.internal_api_token is not None:
            value = self.internal_api_token.get_secret_value()
            return value or None
        if self.internal_api_token_file:
            try:
                text = Path(self.internal_api_token_file).read_text(encoding="utf-8")
                # The token is the first line, as documented; anything after it is ignored.
                value = text.splitlines()[0].strip() if text else ""
            except UnicodeDecodeError as exc:
                raise ConfigError("internal_api_token_file",
                                  f"{self.internal_api_token_file} is not UTF-8 text") from exc
            except OSError as exc:
                raise ConfigError("internal_api_token_file",
                                  f"cannot read {self.internal_api_token_file}: {exc.strerror}") from exc
            if not value:
                raise ConfigError("internal_api_token_file", "file is empty")
            problem = _token_problem(value)
            if problem:
                raise ConfigError("internal_api_token_file", f"the token {problem}")
            return value
        return None

    def kv_events_config(self) -> Optional[KvEventsConfig]:
        """The validated §8 config, or ``None`` when the index is disabled (empty path).

        :raises ConfigError: see :func:`load_kv_events_config`; also ``--etcd_addr`` when the
            file enables discovery (§9 needs the registry) and no etcd address is set.
        """
        if not self.kv_events_config_file:
            return None
        config = load_kv_events_config(self.kv_events_config_file)
        check_discovery_needs_etcd(config, self.etcd_addr)
        return config

    def etcd_host_port(self) -> Optional[tuple[str, int]]:
        """``(host, port)`` of ``etcd_addr`` (an optional ``http://`` prefix dropped), or
        ``None`` when no registry is configured."""
        if not self.etcd_addr:
            return None
        addr = parse_http_host_port(self.etcd_addr)
        return addr.host, addr.port

    def advertised_address(self) -> str:
        """``host:port`` written as master address (§9): ``self_address``, else ``host:port``
        with a wildcard host replaced by this machine's host name."""
        if self.self_address:
            return self.self_address
        host = self.host
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostname()
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"


def _token_problem(token: str) -> Optional[str]:
    """Why no client could send ``token`` in an ``X-Internal-Token`` header (HTTP strips a
    value's surrounding whitespace; gunicorn refuses control characters; a non-ASCII value
    arrives in whatever encoding the client chose), or ``None``. Never includes the token."""
    if token != token.strip():
        return "starts or ends with whitespace, which no X-Internal-Token header can carry"
    if not all(" " <= c <= "~" for c in token):
        return ("holds a character outside printable ASCII, which no X-Internal-Token header "
                "can carry")
    return None


def check_discovery_needs_etcd(config: KvEventsConfig, etcd_addr: str) -> None:
    """§9: discovery reads the instance registry, so an enabled ``discovery`` block needs one.

    :raises ConfigError: naming ``--etcd_addr``.
    """
    if config.discovery is not None and config.discovery.enabled and not etcd_addr:
        raise ConfigError("--etcd_addr", "required when kv_events_config_file enables discovery")


def load_service_settings(**overrides: Any) -> ServiceSettings:
    """Build :class:`ServiceSettings` from flags (``overrides``, ``None`` values ignored) and env.

    :raises ConfigError: naming the field as it was given: ``--port`` for a flag,
        ``KVSVC_PORT`` for an environment variable (the operator edits the one that is wrong).
    """
    kwargs = {k: v for k, v in overrides.items() if v is not None}
    try:
        return ServiceSettings(**kwargs)
    except ValidationError as exc:
        err = translate_validation_error(exc)
        name = err.field.partition(".")[0]
        if name in ServiceSettings.model_fields and name not in kwargs:
            raise ConfigError(f"KVSVC_{err.field.upper()}", err.message) from exc
        raise ConfigError(f"--{err.field}", err.message) from exc
