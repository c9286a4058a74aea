"""Validated configuration: the ``kv_events_config_file`` JSON (§8).

Checked before any thread starts; a failure raises one :class:`~kvsvc.errors.ConfigError`
listing every problem of the document at once (``problems``), each naming the field
(``streams[2].endpoint``, ``max_streams``) and the bad value, so an operator fixes the file in one
go. Unknown keys, wrong types (no string-to-number coercion), out-of-range values, an
``instance_name`` that is not ``host:port`` and a file that configures no stream are rejected.
Rules between fields (duplicates, streams beside discovery) are checked once every field is
valid. The service settings (flags, ``KVSVC_*`` variables) are :mod:`kvsvc.settings`, which
uses :func:`translate_validation_error` and :func:`check_discovery_needs_etcd` from here.
"""

from __future__ import annotations

import enum
import json
import logging
import os
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any, Dict, List, Mapping, Optional

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from kvsvc.address import check_tcp_endpoint, endpoint_key, parse_host_port
from kvsvc.errors import ConfigError, ConfigProblem

log = logging.getLogger(__name__)

MAX_U64 = 2**64 - 1
#: Default of the directory's snapshot gate, also the ``max_concurrent_snapshots`` setting's
#: default (:mod:`kvsvc.settings`).
DEFAULT_MAX_CONCURRENT_SNAPSHOTS = 1


class ReplayMode(enum.StrEnum):
    """What a stream's engine answers on its replay endpoint: ``snapshot`` (§7, xLLM: its
    current residency) or ``history`` (§7h, vLLM and SGLang: its buffered batches)."""

    SNAPSHOT = "snapshot"
    HISTORY = "history"


class Backend(enum.StrEnum):
    """An instance's registered ``backend_type`` that kvsvc can index (§9): the engine family
    whose KV events and replay channel a stream speaks."""

    XLLM = "xllm"
    VLLM = "vllm"
    SGLANG = "sglang"


#: §8/§9 default of ``discovery.backends``: the seed's rule, xLLM instances only.
DEFAULT_BACKENDS = (Backend.XLLM,)
#: §8 default of ``discovery.replay_modes``: what each backend answers on its replay endpoint
#: (xLLM a snapshot of its residency, §7; vLLM and SGLang their buffered history, §7h).
DEFAULT_REPLAY_MODES: Mapping[Backend, ReplayMode] = MappingProxyType({
    Backend.XLLM: ReplayMode.SNAPSHOT,
    Backend.VLLM: ReplayMode.HISTORY,
    Backend.SGLANG: ReplayMode.HISTORY,
})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class StreamConfig(_Strict):
    """One static stream: one (instance, DP rank) KV-event channel (§8 ``streams[]``)."""

    instance_name: Annotated[StrictStr, Field(min_length=1)]
    """Instance identity: its HTTP ``host:port`` as registered (§9), the name routing and the
    registry know it by."""
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
    # strict=False: the JSON file gives the mode as its string value.
    replay_mode: ReplayMode = Field(default=ReplayMode.SNAPSHOT, strict=False)
    """``snapshot`` (§7) or ``history`` (§7h): how the engine answers the replay request."""

    _endpoint_rule = field_validator("endpoint", "replay_endpoint")(check_tcp_endpoint)

    @field_validator("instance_name")
    @classmethod
    def _instance_name_form(cls, value: str) -> str:
        # The same rule as registered names (§9): a stream named otherwise could never be
        # matched with the instance the router picks.
        try:
            parse_host_port(value)
        except ValueError as exc:
            raise ValueError(f"{exc} (the instance's HTTP address as it registers itself, "
                             "e.g. 10.0.0.5:9000)") from None
        return value


class DiscoveryConfig(_Strict):
    """Discovery rule block (§8, §9)."""

    enabled: StrictBool = True
    block_size: Annotated[StrictInt, Field(ge=1, le=1 << 20)] = 128
    topic: StrictStr = ""
    event_port_offset: Annotated[StrictInt, Field(ge=0, le=65535)] = 10000
    replay_port_offset: Annotated[StrictInt, Field(ge=0, le=65535)] = 30000
    refresh_interval_ms: Annotated[StrictInt, Field(ge=50, le=60000)] = 1000
    hash_seed: Annotated[StrictInt, Field(ge=0, le=MAX_U64)] = 1024
    # strict=False on the enum fields below: the JSON file gives them as their string values;
    # anything else (another string, a number) is still refused, naming the field.
    backends: List[Annotated[Backend, Field(strict=False)]] = Field(
        default_factory=lambda: list(DEFAULT_BACKENDS))
    """Backend types whose instances get streams (§9), each once: ``xllm`` (the default, the
    seed's rule), ``vllm`` (e.g. registered by xllm-service's ``vllm_sidecar``), ``sglang``.
    Instances of other backends are skipped (logged once per instance)."""
    replay_modes: Dict[Annotated[Backend, Field(strict=False)],
                       Annotated[ReplayMode, Field(strict=False)]] = Field(
        default_factory=lambda: dict(DEFAULT_REPLAY_MODES))
    """Backend -> ``snapshot`` (§7) or ``history`` (§7h): the replay mode of the streams of that
    backend's instances. The keys given override :data:`DEFAULT_REPLAY_MODES` one by one; the
    others keep their default, so after validation every backend has a mode."""

    approximate_backends: List[Annotated[Backend, Field(strict=False)]] = Field(
        default_factory=list)
    """Backend types whose instances publish no KV events and get an approximate index per
    (instance, DP rank) instead of a stream (§14; an xLLM cluster of today: ``"backends": []``,
    ``"approximate_backends": ["xllm"]``), each once and never also in ``backends``."""
    approximate_ttl_s: Annotated[StrictInt, Field(ge=1, le=86400)] = 120
    """Seconds an approximate entry lives after its last use (§14)."""
    approximate_blocks: Annotated[StrictInt, Field(ge=1)] = 65536
    """Blocks one approximate index holds at most (per DP rank), least recently used dropped
    first (§14); at most ``max_blocks_per_stream``."""

    @field_validator("backends", "approximate_backends")
    @classmethod
    def _backends_once(cls, value: List[Backend]) -> List[Backend]:
        seen: set[Backend] = set()
        for backend in value:
            if backend in seen:
                raise ValueError(f"{backend.value!r} listed twice")
            seen.add(backend)
        return value

    @model_validator(mode="after")
    def _backends_apart(self) -> "DiscoveryConfig":
        problems: list[ConfigProblem] = []
        if not self.backends and not self.approximate_backends:
            # Discovery would index nothing: say so rather than run an empty index.
            problems.append(ConfigProblem(
                "discovery.backends", "must list at least one backend type ("
                + ", ".join(repr(b.value) for b in Backend) + "), got [] (or list the "
                "backends without KV events in approximate_backends, §14)"))
        for i, backend in enumerate(self.approximate_backends):
            if backend in self.backends:
                # §14: an instance gets a stream or an approximate index, never both.
                problems.append(ConfigProblem(
                    f"discovery.approximate_backends[{i}]",
                    f"{backend.value!r} is also in discovery.backends (a backend has KV "
                    "event streams or an approximate index, not both), got "
                    f"{backend.value!r}"))
        if problems:
            raise _Problems(problems)
        return self

    @field_validator("replay_modes")
    @classmethod
    def _modes_over_defaults(cls, value: Dict[Backend, ReplayMode]) -> Dict[Backend, ReplayMode]:
        return {**DEFAULT_REPLAY_MODES, **value}

    def replay_mode(self, backend: Backend) -> ReplayMode:
        """The replay mode of ``backend``'s streams (§8 ``replay_modes``, defaults filled in)."""
        return self.replay_modes[backend]


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
        problems: list[ConfigProblem] = []
        if self.streams and self.discovery is not None and self.discovery.enabled:
            problems.append(ConfigProblem(
                "streams", "non-empty streams and enabled discovery are mutually exclusive"))
        seen_pairs: dict[tuple[str, int], int] = {}
        # Compared as (normalised host, port): "tcp://127.0.0.1:018100" is "tcp://127.0.0.1:18100".
        # Names are not resolved (no DNS at start-up), so "localhost" and "127.0.0.1" differ.
        seen_endpoints: dict[tuple[str, int], str] = {}
        for i, s in enumerate(self.streams):
            pair = (s.instance_name, s.dp_rank)
            if pair in seen_pairs:
                problems.append(ConfigProblem(
                    f"streams[{i}]", f"duplicate instance_name/dp_rank {pair[0]!r}/{pair[1]} "
                                     f"(also streams[{seen_pairs[pair]}])"))
            else:
                seen_pairs[pair] = i
            for name in ("endpoint", "replay_endpoint"):
                ep = getattr(s, name)
                key = endpoint_key(ep)
                if key in seen_endpoints:
                    problems.append(ConfigProblem(
                        f"streams[{i}].{name}",
                        f"endpoint {ep} already used by {seen_endpoints[key]}"))
                else:
                    seen_endpoints[key] = f"streams[{i}].{name}"
        d = self.discovery
        if d is not None and d.approximate_blocks > self.max_blocks_per_stream:
            problems.append(ConfigProblem(
                "discovery.approximate_blocks",
                f"must be at most max_blocks_per_stream ({self.max_blocks_per_stream}), "
                f"got {d.approximate_blocks}"))
        if problems:
            raise _Problems(problems)
        return self

    def configures_streams(self) -> bool:
        """True when the document yields streams: static ones, or enabled discovery (§8)."""
        return bool(self.streams) or (self.discovery is not None and self.discovery.enabled)

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
        elif part == "[key]":
            continue  # a bad dict key: the key itself, just before, names it
        elif part in ("function-after", "function-before") or str(part).startswith("function-"):
            continue
        else:
            out += ("." if out else "") + str(part)
    return out


class _Problems(ValueError):
    """Several problems found by one model validator. pydantic reports a validator's
    ``ValueError`` as one error and keeps the exception in its context, from which
    :func:`validation_problems` takes them all back."""

    def __init__(self, problems: list[ConfigProblem]) -> None:
        super().__init__("; ".join(str(p) for p in problems))
        self.problems = problems


#: Longest rendering of a bad value in a message: a 10,000-element list must not flood stderr.
_VALUE_CHARS = 80
#: pydantic error types that carry no value worth showing (a missing key has none; an unknown
#: key is named by its path).
_NO_VALUE = frozenset({"missing", "extra_forbidden"})


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _VALUE_CHARS else f"{text[:_VALUE_CHARS - 3]}..."


def validation_problems(exc: ValidationError, prefix: str = "",
                        hidden: frozenset[str] = frozenset()) -> list[ConfigProblem]:
    """Every pydantic error of ``exc`` as a :class:`ConfigProblem`, in document order: the
    field path (``streams[1].endpoint``) and the message with the bad value (``..., got 0``)
    unless the message already shows it.

    :param prefix: put before every field path.
    :param hidden: top-level field names whose values are never shown (a token).
    """
    problems: list[ConfigProblem] = []
    for err in exc.errors(include_url=False):
        inner = (err.get("ctx") or {}).get("error")
        if isinstance(inner, _Problems):
            problems.extend(ConfigProblem(f"{prefix}{p.field}", p.message)
                            for p in inner.problems)
            continue
        loc = tuple(err.get("loc", ()))
        msg = str(err.get("msg", "invalid"))
        field = _field_path(loc)
        kind = err.get("type")
        # Model-level validators put the field in the message ("streams[1].endpoint: ...").
        if not field and ": " in msg:
            head, _, rest = msg.removeprefix("Value error, ").partition(": ")
            field, msg = head, rest
        msg = msg.removeprefix("Value error, ")
        if kind == "extra_forbidden":
            msg = "unknown key"
        elif (loc and kind not in _NO_VALUE and "input" in err
              and str(loc[0]) not in hidden and not (
                  # A validator's own message usually names the value already.
                  kind == "value_error" and str(err["input"]) in msg)):
            msg = f"{msg}, got {_shown(err['input'])}"
        problems.append(ConfigProblem(f"{prefix}{field}", msg))
    return problems


def translate_validation_error(exc: ValidationError, prefix: str = "",
                               hidden: frozenset[str] = frozenset()) -> ConfigError:
    """Every pydantic error of ``exc`` in one :class:`ConfigError` (:func:`validation_problems`;
    ``field``/``message`` are the first)."""
    return ConfigError.of(validation_problems(exc, prefix, hidden))


def parse_kv_events_config(data: Any) -> KvEventsConfig:
    """Validate a decoded ``kv_events_config_file`` document (§8). A document with no stream is
    accepted here (the limits alone, for streams added later); a file must configure some
    (:func:`load_kv_events_config`).

    :param data: the JSON value (must be an object).
    :raises ConfigError: listing every offending field.
    """
    if not isinstance(data, dict):
        raise ConfigError("kv_events_config_file", "top level must be a JSON object")
    try:
        return KvEventsConfig.model_validate(data)
    except ValidationError as exc:
        raise translate_validation_error(exc) from exc


def load_kv_events_config(path: str | os.PathLike[str]) -> KvEventsConfig:
    """Read and validate the ``kv_events_config_file`` (§8): :func:`parse_kv_events_config`,
    and the file must configure streams (static ones or enabled discovery): one that configures
    none would run an index of nothing, which is what an empty ``kv_events_config_file`` says
    on purpose.

    :raises ConfigError: unreadable file, invalid JSON, a file that configures no stream, or
        invalid fields (all of them).
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
    config = parse_kv_events_config(data)
    if not config.configures_streams():
        disabled = " (discovery is disabled)" if config.discovery is not None else ""
        raise ConfigError("streams", f"empty and no enabled discovery{disabled}: {path} "
                                     "configures no stream. List the engines' streams, enable "
                                     "\"discovery\" (needs --etcd_addr, §9), or set "
                                     "kv_events_config_file empty to run without a KV index")
    return config


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """JSON object hook: a key given twice would silently keep only the last value.

    :raises ConfigError: naming the key (it passes through ``json.loads`` unchanged).
    """
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(key, "key given twice in one JSON object")
        out[key] = value
    return out


def check_discovery_needs_etcd(config: KvEventsConfig, etcd_addr: str) -> None:
    """§9: discovery reads the instance registry, so an enabled ``discovery`` block needs one.

    :raises ConfigError: naming ``--etcd_addr``.
    """
    if config.discovery is not None and config.discovery.enabled and not etcd_addr:
        raise ConfigError("--etcd_addr", "required when kv_events_config_file enables discovery")
