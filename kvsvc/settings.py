"""The service settings table: every ``kvsvc serve`` setting declared once.

Each setting is one field of :class:`ServiceSettings`. That one declaration holds its name, its
type, its default and its range (pydantic ``Field`` constraints), plus a :class:`Setting`
marker with its section, help text, unit and accepted values. The model is gunicorn's one
``Setting`` class per option (``benoitc/gunicorn:gunicorn/config.py``). Everything else is
derived from the declaration, through :data:`SETTINGS` (one :class:`SettingRow` per field):

- the flag ``--<name>`` (xllm-service's spelling; ``--na-me`` is accepted too) and the
  environment variable ``KVSVC_<NAME>``;
- the argparse arguments of ``kvsvc serve`` and ``kvsvc check-config``
  (:func:`add_arguments`), whose help shows the variable, default, unit and range;
- the ``KVSVC_*`` export that hands the resolved settings to the gunicorn worker
  (:func:`export_environment`); the worker rebuilds them with :func:`load_service_settings`;
- the settings lines of ``check-config`` (:func:`describe_settings`);
- the settings table of docs/configuration.md (:func:`markdown_table`), ``config/kvsvc.env``
  (the ``env_file`` marker) and ``check-config``'s routing line (:func:`policy_summary`, the
  ``policies`` and ``summary`` markers): :mod:`kvsvc.reference` writes the files
  (``python -m kvsvc.reference --write``, ``make docs``), ``tests/unit/test_generated_docs.py``
  fails when they differ;
- where each value came from (:func:`source_of`: flag, ``KVSVC_*`` variable or default), the
  one answer of every error message and of ``check-config``'s listing.

The flag spelling rule of every ``kvsvc`` subcommand lives here too (:func:`add_flag`, used by
the testbed's parsers as well): each flag is declared once in one spelling, and the other
spelling (``_`` for ``-`` or back) is generated, so ``--etcd_addr`` and ``--etcd-addr`` are the
same flag everywhere; :class:`HelpFormatter` lists both, :class:`DefaultsHelpFormatter` also
shows each default.

Sources, highest first: command-line flags (keyword arguments of
:func:`load_service_settings`), ``KVSVC_<NAME>`` environment variables, defaults. Every
failure raises :class:`~kvsvc.errors.ConfigError` naming the setting as it was given:
``--port`` for a flag, ``KVSVC_PORT`` for a variable.

This module also declares the routing policy names and the ranges of the routing parameters
(§11, §12). Each setting is checked here only: its consumers (the policies, the registry)
receive valid values and do not check them again. It is in the bottom layer: it imports only
:mod:`kvsvc.config`, :mod:`kvsvc.address` and :mod:`kvsvc.errors`.
"""

from __future__ import annotations

import argparse
import enum
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any, Callable, Mapping, Optional, Sequence

import annotated_types
from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvsvc.address import (advertised_ipv4, check_bind_host, check_ipv4, format_host_port,
                           parse_host_port, parse_http_host_port)
from kvsvc.config import (
    DEFAULT_MAX_CONCURRENT_SNAPSHOTS,
    Backend,
    KvEventsConfig,
    check_discovery_needs_etcd,
    load_kv_events_config,
    validation_problems,
)
from kvsvc.errors import ConfigError, ConfigProblem

#: Prefix of every setting's environment variable.
ENV_PREFIX = "KVSVC_"

#: Accepted ``--log_level`` values (``KVSVC_LOG_LEVEL`` also in any case).
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
#: Accepted ``--log_format`` values.
LOG_FORMATS = ("json", "text")
#: ``--xllm_dispatch`` values (§13): ``native`` sends requests for ``backend_type`` "xllm" over
#: xLLM's API service and writes the answer from Generations; ``http`` relays them over HTTP;
#: ``auto`` is ``native`` for an xLLM instance unless this replica takes its heartbeats over
#: HTTP (its current incarnation), then ``http``.
XLLM_DISPATCH_MODES = ("auto", "http", "native")

#: Policy names accepted by ``--load_balance_policy`` (xllm-service's names, §11).
class PolicyName(enum.StrEnum):
    """The routing policies kvsvc has (xllm-service's names, §11), declared once: the
    ``--load_balance_policy`` choices, the policies' own names and the ``policy`` label."""

    RR = "RR"
    CAR = "CAR"
    SLO_AWARE = "SLO_AWARE"
    TTFT = "TTFT"


POLICY_NAMES = tuple(p.value for p in PolicyName)
#: xllm-service policy names kvsvc refuses, each with the reason given (none since §12:
#: SLO_AWARE is served; kept so a future refusal has its one place).
UNSUPPORTED_POLICIES: Mapping[str, str] = MappingProxyType({})
#: §12 SLO targets (xllm-service's ``--target_ttft`` / ``--target_tpot``, int32 ms >= 0):
#: defaults and closed ranges ``(low, high)``, milliseconds.
DEFAULT_TARGET_TTFT_MS = 1000
TARGET_TTFT_RANGE_MS = (0, 3_600_000)
DEFAULT_TARGET_TPOT_MS = 50
TARGET_TPOT_RANGE_MS = (0, 600_000)
#: §12 TTFT policy: prefill throughput assumed for an instance without TTFT profiling data,
#: tokens per second; default and range ``(low, high)``, low excluded.
DEFAULT_PREFILL_TOKENS_PER_S = 10000.0
PREFILL_TOKENS_PER_S_RANGE = (0.0, 1e9)
#: Closed range ``(low, high)`` of both CAR parameters, ``car_prefill_lambda`` and
#: ``car_host_hit_weight`` (§11).
CAR_WEIGHT_RANGE = (0.0, 1.0)
#: ``max_load_age_s`` (§11): default and range ``(low, high)``, seconds, low excluded.
DEFAULT_MAX_LOAD_AGE_S = 10.0
MAX_LOAD_AGE_RANGE_S = (0.0, 3600.0)

#: TTFT policy's work term (``--ttft_work_weight``): default and closed range (D29 in
#: docs/decisions.md: 6 keeps a conversation on the engine holding its prefix unless another
#: is faster by more than six times the prefill the move recomputes; 0 is §12 exactly).
DEFAULT_TTFT_WORK_WEIGHT = 6.0
#: TTFT's price of a Host-only hit token (``--ttft_host_hit_weight``, D30): the share of a
#: token's prefill a Host -> Device load saves (PCIe ~2 us against ~50 us of prefill per token
#: of a 7B model on one H100); range CAR_WEIGHT_RANGE.
DEFAULT_TTFT_HOST_HIT_WEIGHT = 0.95
TTFT_WORK_WEIGHT_RANGE = (0.0, 10.0)
#: §16 pending prefixes: ``--pending_ttl_ms`` default and closed range (0: off), ms, and
#: ``--pending_blocks`` default and closed range, blocks per (instance, DP rank).
DEFAULT_PENDING_TTL_MS = 15_000
PENDING_TTL_RANGE_MS = (0, 600_000)
DEFAULT_PENDING_BLOCKS = 65_536
PENDING_BLOCKS_RANGE = (1, 1 << 22)

#: Sections of ``--help`` and of the README table, in display order.
SECTION_HTTP = "HTTP and authentication"
SECTION_INDEX = "KV index (§6-§8)"
SECTION_REGISTRY = "Instance registry (§9)"
SECTION_ROUTING = "Routing (§11)"
SECTION_LOGS = "Logs"
SECTION_WORKER = "gunicorn worker"
SECTION_RPC = "xLLM engines: baidu_std (§13)"
SECTIONS = (SECTION_HTTP, SECTION_INDEX, SECTION_REGISTRY, SECTION_ROUTING, SECTION_RPC,
            SECTION_LOGS, SECTION_WORKER)

#: xllm-service's baidu_std port (``--rpc_server_port``), kvsvc's ``--rpc_port`` default.
DEFAULT_RPC_PORT = 8889

#: Marker lines around the generated table in docs/configuration.md.
README_BEGIN = ("<!-- settings-table:begin (generated: python -m kvsvc.settings --update-readme "
                "docs/configuration.md) -->")
README_END = "<!-- settings-table:end -->"


@dataclass(frozen=True)
class Setting:
    """What one setting's declaration holds besides pydantic's type, default and range; put in
    the field's ``Annotated[...]``.

    :param section: one of :data:`SECTIONS`.
    :param help: one sentence for ``--help`` and the README (Markdown; backticks are dropped
        in ``--help``).
    :param unit: unit of a number, shown after its default (``s``, ``bytes``).
    :param choices: accepted values of a string, shown as its range.
    :param flag_checks_choices: argparse rejects other values; off where the validator gives
        its own message (``SLO_AWARE``).
    :param path: a file path: exported to the worker as an absolute path (gunicorn runs in the
        project root).
    :param export_empty: exported to the worker even when empty.
    :param fold_case: the flag takes the value in any case (``INFO`` is ``info``), as the
        variable's validator does.
    :param policies: the routing policies (:class:`PolicyName` values) that use the setting;
        with ``summary``, ``check-config``'s routing line shows it for them
        (:func:`policy_summary`).
    :param summary: its label in that line (``lambda``, ``target TTFT``).
    :param env_file: set in the shipped ``config/kvsvc.env`` (:func:`env_file_text`): ``True``
        to its default, a string to that value; ``False``: listed there commented out, with
        its default.
    """

    section: str
    help: str
    unit: str = ""
    choices: tuple[str, ...] = ()
    flag_checks_choices: bool = True
    path: bool = False
    export_empty: bool = True
    fold_case: bool = False
    policies: tuple[str, ...] = ()
    summary: str = ""
    env_file: bool | str = False



def scrape_backends(value: str) -> frozenset[str]:
    """``--load_scrape_backends`` -> the set of names (``"vllm, sglang"`` ->
    ``{"vllm", "sglang"}``; empty: none)."""
    return frozenset(n.strip() for n in value.split(",") if n.strip())

class ServiceSettings(BaseSettings):
    """The service settings (xllm-service's flag names where it has one), validated before any
    thread starts. The token can come from ``KVSVC_INTERNAL_API_TOKEN`` or from a file
    (``--internal_api_token_file``), so it never needs argv.

    Field order is the order of validation, hence which error is reported first; sections
    only group the display.
    """

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", frozen=True)

    host: Annotated[str, Setting(
        SECTION_HTTP, "HTTP bind address: an IP (`0.0.0.0` and `::` listen on every interface) "
        "or a host name", env_file=True)] = "0.0.0.0"
    port: Annotated[int, Field(ge=1, le=65535), Setting(SECTION_HTTP, "HTTP port",
                                                        env_file=True)] = 8888
    kv_events_config_file: Annotated[str, Setting(
        SECTION_INDEX, "§8 JSON file; empty disables the index (every query answers "
        "`{\"matches\": []}`, logged at start-up)", path=True,
        env_file="/etc/kvsvc/kv_events.json")] = ""
    internal_api_token: Annotated[Optional[SecretStr], Setting(
        SECTION_HTTP, "the `X-Internal-Token` value required on `/v1/internal/*` (§10); as a "
        "flag it is **visible to every local user in `ps`**: prefer the variable or "
        "`--internal_api_token_file`")] = None
    internal_api_token_file: Annotated[str, Setting(
        SECTION_HTTP, "file whose first line is the `X-Internal-Token` value; exclusive with "
        "the token itself", path=True, export_empty=False)] = ""
    max_query_tokens: Annotated[int, Field(ge=1, le=16 * 1024 * 1024), Setting(
        SECTION_HTTP, "longest `token_ids` list of a KV-cache query (§10)",
        unit="tokens")] = 1 << 20
    log_level: Annotated[str, Setting(
        SECTION_LOGS, "level of kvsvc's and gunicorn's error logs",
        choices=LOG_LEVELS, fold_case=True, env_file=True)] = "info"
    log_format: Annotated[str, Setting(
        SECTION_LOGS, "`json`: one JSON object per line (for journald and log shippers); "
        "`text`: plain lines for a terminal (docs/operating.md)", choices=LOG_FORMATS,
        env_file=True)] = "json"
    # Off by default: every query and heartbeat would be a line.
    access_log: Annotated[bool, Setting(
        SECTION_LOGS, "gunicorn's per-request access lines on stdout", env_file=True)] = False
    api_key: Annotated[Optional[SecretStr], Setting(
        SECTION_HTTP, "client API key: every `/v1/*` request except `/v1/internal/*` needs "
        "`Authorization: Bearer <key>` (vLLM's `--api-key`), else 401; unset: none needed. "
        "Prefer the variable to the flag (`ps` shows flags)")] = None
    max_in_flight_requests: Annotated[int, Field(ge=0, le=1 << 20), Setting(
        SECTION_HTTP, "OpenAI requests served at once (a streamed one until its last byte); "
        "one more is answered 429 with `Retry-After`. 0: no limit (beyond "
        "`--worker_threads` requests wait for a thread). Keep it below `--worker_threads` so "
        "heartbeats and probes always find a thread", env_file="120")] = 0
    metrics_require_token: Annotated[bool, Setting(
        SECTION_HTTP, "require `X-Internal-Token` on `GET /metrics` too (off: Prometheus "
        "scrapes freely)")] = False
    etcd_addr: Annotated[str, Setting(
        SECTION_REGISTRY, "etcd `host:port` of the instance registry (§9); empty = no registry "
        "(static streams only, heartbeats answered 503). Required when the config file "
        "enables `discovery`", env_file="127.0.0.1:2379")] = ""
    etcd_namespace: Annotated[str, Setting(
        SECTION_REGISTRY, "registry keys live under `/<ns>/` when set (no `/` in it)",
        env_file=True)] = ""
    detect_disconnected_instance_interval: Annotated[float, Field(gt=0, le=3600), Setting(
        SECTION_REGISTRY, "time a `SUSPECT` instance is kept before removal",
        unit="s")] = 15.0
    self_address: Annotated[str, Setting(
        SECTION_REGISTRY, "HTTP `host:port` engines reach this replica at; written to "
        "`XLLM:SERVICE:MASTER` while it is master when `--rpc_port` is 0 (else the master key "
        "holds the baidu_std `ip:port`, §13); empty: `--host`:`--port`, a wildcard host "
        "replaced by the machine's host name")] = ""
    rpc_port: Annotated[int, Field(ge=0, le=65535), Setting(
        SECTION_RPC, "baidu_std port of `xllm_service.proto.XllmRpcService` (Heartbeat, "
        "Generations, GetInstanceInfo... from real xLLM engines, §13); served only with "
        "`--etcd_addr`; **unauthenticated** (engines send no credential): bind it to the "
        "engines' network only; 0 disables it")] = DEFAULT_RPC_PORT
    rpc_host: Annotated[str, Setting(
        SECTION_RPC, "IPv4 address the baidu_std port binds (`0.0.0.0`: every interface)")] = (
        "0.0.0.0")
    rpc_advertise_host: Annotated[str, Setting(
        SECTION_RPC, "IPv4 engines reach the baidu_std port at, written as `ip:port` to "
        "`XLLM:SERVICE:MASTER` (while master) and `XLLM:SERVICE:<ip:port>`; empty: "
        "`--rpc_host`, or for `0.0.0.0` the host of `--self_address` when it is an IPv4, else "
        "the machine's host name's IPv4 (start-up is refused when there is none)")] = ""
    # One at a time: an index build is CPU work under the GIL, so a request thread then waits
    # at most one build slice while many streams recover; more speeds up recovery and
    # lengthens that wait (bench 8).
    max_concurrent_snapshots: Annotated[int, Field(ge=1, le=128), Setting(
        SECTION_INDEX, "snapshot recoveries (request, reply, decode, index build) running at "
        "once across all streams; the others queue, first come first served (docs/recovery.md)",
        env_file=True)] = DEFAULT_MAX_CONCURRENT_SNAPSHOTS
    load_balance_policy: Annotated[str, Setting(
        SECTION_ROUTING, "`CAR` (cache-aware, §11), `RR` (round robin, xllm-service's "
        "default), `SLO_AWARE` (xllm-service's SLO policy, §12) or `TTFT` (lowest predicted "
        "time to first token, §12); see docs/routing.md",
        choices=POLICY_NAMES, flag_checks_choices=False, env_file=True)] = PolicyName.CAR.value
    car_prefill_lambda: Annotated[float, Field(ge=CAR_WEIGHT_RANGE[0], le=CAR_WEIGHT_RANGE[1]),
                                  Setting(SECTION_ROUTING,
                                          "CAR weight of the cache-miss term against the queue "
                                          "term in score(P)", policies=("CAR",),
                                          summary="lambda")] = 0.5
    car_host_hit_weight: Annotated[float, Field(ge=CAR_WEIGHT_RANGE[0], le=CAR_WEIGHT_RANGE[1]),
                                   Setting(SECTION_ROUTING,
                                           "CAR weight of a Host-only hit token against a "
                                           "Device hit token", policies=("CAR",),
                                           summary="host hit weight")] = 0.5
    ttft_host_hit_weight: Annotated[float, Field(ge=CAR_WEIGHT_RANGE[0],
                                                 le=CAR_WEIGHT_RANGE[1]), Setting(
        SECTION_ROUTING, "TTFT: share of a token's prefill a Host-only hit saves (its load "
        "from Host to Device costs the rest); §12's CAR weight is `--car_host_hit_weight` "
        "(D30)", policies=("TTFT",),
        summary="host hit weight")] = DEFAULT_TTFT_HOST_HIT_WEIGHT
    target_ttft: Annotated[int, Field(ge=TARGET_TTFT_RANGE_MS[0], le=TARGET_TTFT_RANGE_MS[1]),
                           Setting(SECTION_ROUTING, "SLO_AWARE: time-to-first-token target; "
                                   "above it prefill may go to a lightly loaded decode "
                                   "instance (xllm-service's flag, §12)", unit="ms",
                                   policies=("SLO_AWARE",),
                                   summary="target TTFT")] = DEFAULT_TARGET_TTFT_MS
    target_tpot: Annotated[int, Field(ge=TARGET_TPOT_RANGE_MS[0], le=TARGET_TPOT_RANGE_MS[1]),
                           Setting(SECTION_ROUTING, "SLO_AWARE: time-per-output-token target "
                                   "of the decode choice (xllm-service's flag, §12)", unit="ms",
                                   policies=("SLO_AWARE",),
                                   summary="target TPOT")] = DEFAULT_TARGET_TPOT_MS
    default_prefill_tokens_per_s: Annotated[float, Field(
        gt=PREFILL_TOKENS_PER_S_RANGE[0], le=PREFILL_TOKENS_PER_S_RANGE[1]), Setting(
        SECTION_ROUTING, "TTFT: prefill throughput assumed for an instance that registered "
        "no usable `ttft_profiling_data` (§12)", unit="tokens/s", policies=("TTFT",),
        summary="default prefill")] = DEFAULT_PREFILL_TOKENS_PER_S
    max_load_age_s: Annotated[float, Field(gt=MAX_LOAD_AGE_RANGE_S[0],
                                           le=MAX_LOAD_AGE_RANGE_S[1]), Setting(
        SECTION_ROUTING, "an instance is a candidate only while its last load report (a "
        "heartbeat, or an `XLLM:LOADMETRICS` value read from etcd) is at most this old; keep "
        "it above the engines' heartbeat period and the master's 3 s `XLLM:LOADMETRICS` "
        "period (docs/routing.md)", unit="s")] = DEFAULT_MAX_LOAD_AGE_S
    dp_rank_routing: Annotated[bool, Setting(
        SECTION_ROUTING, "CAR and TTFT score each (instance, DP rank) pair of a backend that "
        "honours a rank (`vllm`, `sglang`) with that rank's own hits and load, and send the "
        "request with `X-data-parallel-rank`; off: the §11 minimum over ranks (§15)")] = True
    load_scrape_backends: Annotated[str, Setting(
        SECTION_ROUTING, "comma-separated `backend_type`s whose load is read from their "
        "Prometheus text at `http://<instance>/metrics` (vLLM and SGLang metric names, §15); "
        "empty: heartbeats only")] = "vllm,sglang"
    load_scrape_interval_ms: Annotated[int, Field(ge=50, le=60_000), Setting(
        SECTION_ROUTING, "period of the `/metrics` scrapes of `--load_scrape_backends` "
        "instances; keep it well below `--max_load_age_s`", unit="ms")] = 500
    ttft_work_weight: Annotated[float, Field(ge=TTFT_WORK_WEIGHT_RANGE[0],
                                             le=TTFT_WORK_WEIGHT_RANGE[1]), Setting(
        SECTION_ROUTING, "TTFT: weight of the prefill work a candidate adds beyond the "
        "best-cached candidate's (the prefix it recomputes: time the requests behind it there "
        "wait, and cache the cluster loses); 0: §12's predicted TTFT alone "
        "(docs/routing-overlays.md, D29)")] = DEFAULT_TTFT_WORK_WEIGHT
    pending_ttl_ms: Annotated[int, Field(ge=PENDING_TTL_RANGE_MS[0],
                                         le=PENDING_TTL_RANGE_MS[1]), Setting(
        SECTION_ROUTING, "pending prefixes (§16): the full blocks of a routed prompt count as "
        "pending on its exact stream from the dispatch until the stream's events store, remove "
        "or clear them, or this long after the dispatch (the longest queue plus prefill "
        "before a block's event must have arrived; docs/routing-overlays.md says why 15000); "
        "0: off", unit="ms")] = DEFAULT_PENDING_TTL_MS
    pending_blocks: Annotated[int, Field(ge=PENDING_BLOCKS_RANGE[0],
                                         le=PENDING_BLOCKS_RANGE[1]), Setting(
        SECTION_ROUTING, "pending prefixes (§16): blocks pending per (instance, DP rank) at "
        "most, the least recently routed dropped first")] = DEFAULT_PENDING_BLOCKS
    tokenizer_path: Annotated[str, Setting(
        SECTION_ROUTING, "`tokenizer.json`, or a directory with it and `tokenizer_config.json` "
        "/ `chat_template.jinja`, for text and chat prompts; empty: text requests route with "
        "hit ratio 0 (warned once)", path=True)] = ""
    tokenizer_cache_tokens: Annotated[int, Field(ge=0, le=1 << 30), Setting(
        SECTION_ROUTING, "bound of the cache of token ids of prompt segments already seen (a "
        "conversation's earlier turns are not tokenized again; exact: cut only where the "
        "result is the whole text's); 0: no cache", unit="tokens")] = 1 << 20
    model: Annotated[str, Setting(
        SECTION_ROUTING, "comma-separated model names served (`/v1/models`; others get 404); "
        "empty accepts any", env_file=True)] = ""
    xllm_dispatch: Annotated[str, Setting(
        SECTION_ROUTING, "how requests reach instances of `backend_type` \"xllm\": `auto` "
        "is `native` (an xLLM engine registers in etcd only with `--enable_service_routing`, "
        "heartbeats over baidu_std and gives its tokens only by `Generations`) except for an "
        "instance whose heartbeats this replica takes over HTTP (the simulated engine's HTTP "
        "mode): `http`; with `--rpc_port 0`, `http` for all; "
        "`native` calls every xLLM instance's `xllm.proto.XllmAPIService` and writes the "
        "answer from its `Generations` (§13; needs token ids, i.e. `--tokenizer_path` for "
        "text); `http` relays the OpenAI request over HTTP (the simulated engine's HTTP mode); "
        "vLLM and SGLang are always relayed", choices=XLLM_DISPATCH_MODES)] = "auto"
    upstream_connect_timeout_s: Annotated[float, Field(gt=0, le=600), Setting(
        SECTION_ROUTING, "TCP connect bound of one upstream attempt", unit="s")] = 2.0
    upstream_read_timeout_s: Annotated[float, Field(gt=0, le=86400), Setting(
        SECTION_ROUTING, "wait for the upstream's response head and between body reads",
        unit="s")] = 600.0
    max_request_bytes: Annotated[int, Field(ge=1024, le=1 << 30), Setting(
        SECTION_ROUTING, "largest OpenAI request body (413 above)",
        unit="bytes")] = 16 * 1024 * 1024
    worker_switch_interval_ms: Annotated[float, Field(ge=0, le=100), Setting(
        SECTION_WORKER, "the worker's interpreter switch interval (Python's "
        "`sys.setswitchinterval`, set after the fork): how long a thread that computes may "
        "keep a thread that is ready to run waiting. 0 (default): 0.5 ms with "
        "`--xllm_dispatch native` (a baidu_std answer waits at most about this long behind "
        "one busy thread), else Python's 5 ms (every forced switch costs the short HTTP "
        "requests' CPU: 0.5 ms took about 35% more per request at 128 in flight)",
        unit="ms")] = 0.0
    worker_threads: Annotated[int, Field(ge=4, le=4096), Setting(
        SECTION_WORKER, "threads of the gunicorn worker: requests served at once. A proxied "
        "request holds a thread until its answer is relayed (a streamed one until its last "
        "token), so this caps the OpenAI requests in flight to all instances together; "
        "heartbeats and `/ready` share the same threads (hence at least 4). Also the proxy's "
        "kept-alive connections per instance", env_file=True)] = 128

    @field_validator("load_balance_policy")
    @classmethod
    def _policy_name(cls, value: str) -> str:
        if value in UNSUPPORTED_POLICIES:
            raise ValueError(UNSUPPORTED_POLICIES[value])
        if value not in POLICY_NAMES:
            raise ValueError(f"must be {' or '.join(POLICY_NAMES)}, got {value!r}")
        return value

    @field_validator("load_scrape_backends")
    @classmethod
    def _scrape_backends(cls, value: str) -> str:
        # The names discovery.backends takes (§8): a typo would scrape nothing, silently.
        known = [b.value for b in Backend]
        for name in sorted(scrape_backends(value)):
            if name not in known:
                raise ValueError(f"{name!r} is not one of {', '.join(known)}")
        return value

    @field_validator("xllm_dispatch")
    @classmethod
    def _xllm_dispatch(cls, value: str) -> str:
        if value not in XLLM_DISPATCH_MODES:
            raise ValueError(f"must be one of {', '.join(XLLM_DISPATCH_MODES)}, got {value!r}")
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

    @field_validator("etcd_namespace")
    @classmethod
    def _namespace_form(cls, value: str) -> str:
        # Keys are /<namespace>/XLLM:...: a '/' inside would split the prefix (§9).
        if "/" in value:
            raise ValueError("must not contain '/'")
        return value

    @field_validator("self_address")
    @classmethod
    def _self_address_form(cls, value: str) -> str:
        if value:
            parse_host_port(value)
        return value

    @field_validator("rpc_host")
    @classmethod
    def _rpc_host(cls, value: str) -> str:
        # xLLM engines accept only ip:port (IPv4) as the service's address.
        return check_ipv4(value, "rpc_host")

    @field_validator("rpc_advertise_host")
    @classmethod
    def _rpc_advertise_host(cls, value: str) -> str:
        if value and check_ipv4(value, "rpc_advertise_host") == "0.0.0.0":
            raise ValueError("must be an address engines can reach, not 0.0.0.0")
        return value

    @field_validator("host")
    @classmethod
    def _bind_host(cls, value: str) -> str:
        # A bind address: an IP (0.0.0.0 / :: allowed here, unlike connect addresses) or a name.
        return check_bind_host(value)

    @model_validator(mode="after")
    def _rpc_port_apart(self) -> "ServiceSettings":
        if self.rpc_port and self.rpc_port == self.port:
            raise ValueError(f"rpc_port: {self.rpc_port} is also --port; the baidu_std port "
                             "needs its own (0 disables it)")
        return self

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
        if self.api_key is not None and not self.api_key.get_secret_value():
            raise ValueError("api_key: empty; unset it to run without a key")
        if self.api_key is not None:
            problem = _token_problem(self.api_key.get_secret_value())
            if problem:
                raise ValueError(f"api_key: {problem}")
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

        :raises ConfigError: see :func:`~kvsvc.config.load_kv_events_config`; also
            ``--etcd_addr`` when the file enables discovery (§9 needs the registry) and no etcd
            address is set.
        """
        if not self.kv_events_config_file:
            return None
        config = load_kv_events_config(self.kv_events_config_file)
        check_discovery_needs_etcd(config, self.etcd_addr)
        return config

    def rpc_address(self) -> Optional[str]:
        """This replica's baidu_std ``ip:port`` as engines must reach it (§13; the master
        key's value and ``source_xservice_addr``), ``None`` when ``--rpc_port`` is 0 or there
        is no registry (no engine can find the port then). A wildcard ``--rpc_host`` is
        resolved as ``--rpc_advertise_host`` says (the machine's host name is resolved here).

        :raises ConfigError: no IPv4 address can be advertised (``field`` is
            ``rpc_advertise_host``).
        """
        if not self.rpc_port or not self.etcd_addr:
            return None
        self_host = ""
        if self.self_address:
            self_host = parse_host_port(self.self_address).host
        ipv4s: list[str] = []
        if not self.rpc_advertise_host and self.rpc_host == "0.0.0.0" and not self_host:
            try:
                ipv4s = [str(info[4][0]) for info in socket.getaddrinfo(
                    socket.gethostname(), None, socket.AF_INET, socket.SOCK_STREAM)]
            except OSError:
                ipv4s = []
        try:
            host = advertised_ipv4(self.rpc_host, self.rpc_advertise_host, self_host, ipv4s)
        except ValueError as exc:
            raise ConfigError("rpc_advertise_host", f"{exc}; set --rpc_advertise_host to the "
                              "IPv4 engines reach this machine at, or bind --rpc_host to it")
        return f"{host}:{self.rpc_port}"

    def advertised_address(self) -> str:
        """``host:port`` written as master address (§9): ``self_address``, else ``host:port``
        with a wildcard host replaced by this machine's host name."""
        if self.self_address:
            return self.self_address
        host = self.host
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostname()
        return format_host_port(host, self.port)


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


# -- the table view --------------------------------------------------------------------------------

@dataclass(frozen=True)
class SettingRow:
    """One row of the settings table: a :class:`ServiceSettings` field with everything derived
    from its declaration.

    :ivar name: field name, e.g. ``port``.
    :ivar flag: command-line flag, ``--<name>``.
    :ivar env: environment variable, ``KVSVC_<NAME>``.
    :ivar kind: value type: ``str``, ``int``, ``float``, ``bool`` or ``SecretStr`` (absent
        when unset).
    :ivar default: default value (``None``: unset).
    :ivar ge, gt, le, lt: bounds of a number (``None``: none).
    :ivar meta: the :class:`Setting` marker (section, help, unit, choices, export rules).
    """

    name: str
    flag: str
    env: str
    kind: type
    default: Any
    ge: Optional[float]
    gt: Optional[float]
    le: Optional[float]
    lt: Optional[float]
    meta: Setting

    def range_text(self) -> str:
        """Accepted values in words: ``1-65535``, ``> 0, ≤ 3600``, ``json, text``; ``""``
        when any value of the type is accepted."""
        if self.meta.choices:
            return ", ".join(self.meta.choices)
        if self.ge is not None and self.le is not None:
            return f"{_number(self.ge)}-{_number(self.le)}"
        low = (f"≥ {_number(self.ge)}" if self.ge is not None else
               f"> {_number(self.gt)}" if self.gt is not None else "")
        high = (f"≤ {_number(self.le)}" if self.le is not None else
                f"< {_number(self.lt)}" if self.lt is not None else "")
        return ", ".join(part for part in (low, high) if part)

    def default_value(self) -> str:
        """The default as an operator writes it, without unit: ``8888``, ``15``, ``false``;
        ``""`` when empty or unset."""
        value = self.default
        if value is None:
            return ""
        if isinstance(value, bool):
            return "true" if value else "false"
        return _number(value)

    def default_text(self) -> str:
        """The default in words: ``8888``, ``2 s``, ``false``, ``empty``, ``unset``."""
        if self.default is None:
            return "unset"
        if self.default == "":
            return "empty"
        unit = f" {self.meta.unit}" if self.meta.unit else ""
        return self.default_value() + unit

    def env_value(self, value: Any) -> Optional[str]:
        """``value`` as this setting's ``KVSVC_*`` variable holds it, ``None`` when it is not
        exported (an unset token; an empty setting with ``export_empty`` off). Parsing the
        result gives ``value`` back: booleans ``true``/``false``, numbers by ``repr``, paths
        made absolute.
        """
        if value is None:
            return None
        if isinstance(value, SecretStr):
            return value.get_secret_value()
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, str):
            if not value:
                return "" if self.meta.export_empty else None
            return os.path.abspath(value) if self.meta.path else value
        return repr(value)

    def display(self, value: Any) -> str:
        """``value`` for ``check-config`` output; a token shows only whether it is set."""
        if isinstance(value, SecretStr):
            return "set (hidden)"
        if value is None:
            return "unset"
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, str):
            return value if value else "(empty)"
        return repr(value)


def _number(value: Any) -> str:
    """``8888`` -> ``8888``, ``15.0`` -> ``15``, ``0.5`` -> ``0.5``."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _kind(field: FieldInfo) -> type:
    annotation = field.annotation
    for kind in (bool, int, float, str, SecretStr):
        if annotation is kind or annotation == Optional[kind]:
            return kind
    raise TypeError(f"settings table: unsupported type {annotation!r}")


def _row(name: str, field: FieldInfo) -> SettingRow:
    meta = [m for m in field.metadata if isinstance(m, Setting)]
    if len(meta) != 1:
        raise TypeError(f"settings table: {name} needs exactly one Setting marker")
    bounds: dict[str, Optional[float]] = {"ge": None, "gt": None, "le": None, "lt": None}
    for m in field.metadata:
        if isinstance(m, annotated_types.Ge):
            bounds["ge"] = float(m.ge)  # type: ignore[arg-type]
        elif isinstance(m, annotated_types.Gt):
            bounds["gt"] = float(m.gt)  # type: ignore[arg-type]
        elif isinstance(m, annotated_types.Le):
            bounds["le"] = float(m.le)  # type: ignore[arg-type]
        elif isinstance(m, annotated_types.Lt):
            bounds["lt"] = float(m.lt)  # type: ignore[arg-type]
    kind = _kind(field)
    if kind is int:  # shown as integers: 16777216, not 1.6777216e7
        bounds = {k: (None if v is None else int(v)) for k, v in bounds.items()}
    return SettingRow(name=name, flag=f"--{name}", env=f"{ENV_PREFIX}{name.upper()}", kind=kind,
                      default=field.default, meta=meta[0], **bounds)


#: The settings table: one row per :class:`ServiceSettings` field, in validation order.
SETTINGS: tuple[SettingRow, ...] = tuple(
    _row(name, field) for name, field in ServiceSettings.model_fields.items())
_BY_NAME: Mapping[str, SettingRow] = MappingProxyType({row.name: row for row in SETTINGS})


def setting(name: str) -> SettingRow:
    """The row of setting ``name``.

    :raises KeyError: no such setting.
    """
    return _BY_NAME[name]


def by_section() -> list[tuple[str, list[SettingRow]]]:
    """``(section, rows)`` in :data:`SECTIONS` order, rows in declaration order within each."""
    return [(section, [row for row in SETTINGS if row.meta.section == section])
            for section in SECTIONS]


# -- sources ---------------------------------------------------------------------------------------

#: Settings whose value no message shows.
_SECRET_SETTINGS = frozenset(row.name for row in SETTINGS if row.kind is SecretStr)


class Origin(enum.StrEnum):
    """Where a setting's value came from, highest first (:func:`source_of`)."""

    FLAG = "flag"
    ENV = "environment variable"
    DEFAULT = "default"


@dataclass(frozen=True)
class Source:
    """Where one setting's value came from (:func:`source_of`).

    :ivar origin: flag, ``KVSVC_*`` variable or default.
    :ivar name: ``--port``, ``KVSVC_PORT`` or ``default``: what ``check-config`` shows.
    :ivar field: the name an error about the value gives, the one the operator edits:
        the variable when the value came from it, else the flag.
    """

    origin: Origin
    name: str
    field: str


def source_of(name: str, flags: Mapping[str, Any],
              environ: Optional[Mapping[str, str]] = None) -> Source:
    """Where setting ``name``'s value came from, by the sources' order (flag over
    ``KVSVC_*`` variable over default): the one answer ``check-config``'s listing, the
    settings' validation errors and the later checks of ``serve`` (the listen address, the
    worker's app) all use. No setting comes from a file: the §8 file
    (``kv_events_config_file``) holds the streams' configuration, whose problems are named by
    their path in it (``streams[0].endpoint``, :mod:`kvsvc.config`).

    :param flags: setting name -> flag value, ``None`` (or absent) when the flag was not given.
    :param environ: the environment (``os.environ`` when ``None``); a variable counts when it
        is set, even empty, and in any case (as pydantic-settings reads it).
    :raises KeyError: ``name`` is not a setting.
    """
    row = _BY_NAME[name]
    if flags.get(name) is not None:
        return Source(Origin.FLAG, row.flag, row.flag)
    env = os.environ if environ is None else environ
    if row.env in env or any(k.upper() == row.env for k in env):
        return Source(Origin.ENV, row.env, row.env)
    return Source(Origin.DEFAULT, "default", row.flag)


def load_service_settings(**overrides: Any) -> ServiceSettings:
    """Build :class:`ServiceSettings` from flags (``overrides``, ``None`` values ignored) and env.

    :raises ConfigError: naming the field as it was given (:func:`source_of`): ``--port`` for
        a flag, ``KVSVC_PORT`` for an environment variable (the operator edits the one that is
        wrong).
    """
    kwargs = {k: v for k, v in overrides.items() if v is not None}
    try:
        return ServiceSettings(**kwargs)
    except ValidationError as exc:
        problems = []
        # Every problem at once, each under the name it was given by (the token never shown).
        for problem in validation_problems(exc, hidden=_SECRET_SETTINGS):
            name = problem.field.partition(".")[0]
            given = (source_of(name, kwargs).field if name in _BY_NAME
                     else f"--{problem.field}")
            problems.append(ConfigProblem(given, problem.message))
        raise ConfigError.of(problems) from exc


def policy_summary(settings: ServiceSettings) -> str:
    """The settings the configured routing policy uses, for ``check-config``'s routing line:
    each row whose ``policies`` name it, by its ``summary`` label in declaration order
    (``lambda 0.5, host hit weight 0.5``); ``no parameters`` when none."""
    policy = settings.load_balance_policy.upper()
    parts = []
    for row in SETTINGS:
        if policy in row.meta.policies and row.meta.summary:
            unit = f" {row.meta.unit}" if row.meta.unit else ""
            parts.append(f"{row.meta.summary} {_number(getattr(settings, row.name))}{unit}")
    return ", ".join(parts) or "no parameters"


def parse_bool(value: str) -> bool:
    """``true``/``false`` (also 1/0, yes/no, on/off) of a boolean flag.

    :raises argparse.ArgumentTypeError: anything else.
    """
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def flag_help(row: SettingRow) -> str:
    """``--help`` text of one flag: the help, then variable, default and range."""
    text = row.meta.help.replace("`", "").replace("**", "")
    facts = [row.env, f"default {row.default_text()}"]
    if row.range_text() and not (row.meta.choices and row.meta.flag_checks_choices):
        facts.append(row.range_text())  # argparse lists enforced choices itself
    if row.meta.fold_case:
        facts.append("any case")
    return f"{text} ({'; '.join(facts)})".replace("%", "%%")


def flag_spellings(flag: str) -> tuple[str, ...]:
    """Both spellings of a long flag, the given one first: ``--etcd_addr`` ->
    ``("--etcd_addr", "--etcd-addr")``, ``--log-level`` -> ``("--log-level", "--log_level")``;
    a flag with neither character (``--port``) or a short one (``-h``) has one."""
    if not flag.startswith("--"):
        return (flag,)
    name = flag[2:]
    other = name.replace("_", "-") if "_" in name else name.replace("-", "_")
    return (flag,) if other == name else (flag, f"--{other}")


def add_flag(container: Any, *flags: str, **kwargs: Any) -> argparse.Action:
    """``container.add_argument`` with both spellings of every flag in ``flags``
    (:func:`flag_spellings`): the one declaration of a flag, its alias generated. ``dest`` is
    the first flag's name with ``_`` (``--block-size`` -> ``block_size``) unless given.

    :param container: an ``argparse.ArgumentParser`` or argument group.
    :param flags: the flag, then other names of the same thing (``"--etcd", "--etcd_addr"``).
    :param kwargs: passed to ``add_argument``.
    """
    names: list[str] = []
    for flag in flags:
        names.extend(s for s in flag_spellings(flag) if s not in names)
    kwargs.setdefault("dest", flags[0].lstrip("-").replace("-", "_"))
    action: argparse.Action = container.add_argument(*names, **kwargs)
    return action


def add_log_level(parser: argparse.ArgumentParser, default: str) -> None:
    """``--log-level`` (and ``--log_level``) of a testbed command: one of :data:`LOG_LEVELS` in
    any case, as ``serve``'s."""
    add_flag(parser, "--log-level", default=default, type=str.lower, choices=LOG_LEVELS,
             help="log level (any case)")


class HelpFormatter(argparse.HelpFormatter):
    """``--help`` listing a flag's spellings once with its value: ``--etcd_addr, --etcd-addr
    ETCD_ADDR`` (argparse would repeat the value after each spelling)."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings or action.nargs == 0:
            return super()._format_action_invocation(action)
        value = self._format_args(action, self._get_default_metavar_for_optional(action))
        return f"{', '.join(action.option_strings)} {value}"


class DefaultsHelpFormatter(HelpFormatter):
    """:class:`HelpFormatter` that also ends every flag's help with its default, as
    ``argparse.ArgumentDefaultsHelpFormatter`` does but for every flag (one without help
    too) and in words for the ones it would print blank (``empty``, ``none``, ``off``): the
    testbed commands. ``serve``'s help states its defaults from the settings table."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.default is argparse.SUPPRESS
                or "%(default)" in text):
            return text
        if action.default is None:
            shown = "none"
        elif action.default == "":
            shown = "empty"
        elif action.default is False and action.nargs == 0:
            shown = "off"
        else:
            shown = "%(default)s"
        return f"{text} (default: {shown})".lstrip()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per setting to ``parser``, grouped by section, each in both spellings
    (``--etcd_addr``, ``--etcd-addr``: :func:`add_flag`). Every flag defaults to ``None`` (not
    given), so that the ``KVSVC_*`` variable or the default applies."""
    for section, rows in by_section():
        group = parser.add_argument_group(section)
        for row in rows:
            kwargs: dict[str, Any] = {"default": None, "help": flag_help(row), "dest": row.name}
            if row.kind is bool:
                kwargs.update(type=parse_bool, nargs="?", const=True)
            elif row.kind in (int, float):
                kwargs["type"] = row.kind
            elif row.meta.fold_case:
                kwargs["type"] = str.lower
            if row.meta.choices and row.meta.flag_checks_choices:
                kwargs["choices"] = row.meta.choices
            add_flag(group, row.flag, **kwargs)


def flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """Setting name -> flag value (``None``: not given) of parsed :func:`add_arguments` flags."""
    return {row.name: getattr(args, row.name, None) for row in SETTINGS}


def export_environment(settings: ServiceSettings, base: Mapping[str, str]) -> dict[str, str]:
    """``base`` without any ``KVSVC_*`` variable, plus ``settings`` as ``KVSVC_*`` variables
    (:meth:`SettingRow.env_value`): what :func:`load_service_settings` in the gunicorn worker
    turns back into the same settings. The token travels here, never in argv.

    :param settings: validated settings.
    :param base: the current environment.
    """
    env = {k: v for k, v in base.items() if not k.startswith(ENV_PREFIX)}
    for row in SETTINGS:
        value = row.env_value(getattr(settings, row.name))
        if value is not None:
            env[row.env] = value
    return env


def describe_settings(settings: ServiceSettings,
                      source: Optional[Callable[[SettingRow], str]] = None) -> list[str]:
    """``check-config`` lines listing every setting's effective value (a token only as
    ``set (hidden)``) by section, with where it came from.

    :param source: the origin of a row's value, e.g. ``--port``, ``KVSVC_PORT`` or
        ``default``; ``None`` leaves it out.
    """
    lines = ["settings (flag, else KVSVC_* variable, else default):"]
    for section, rows in by_section():
        lines.append(f"  [{section}]")
        for row in rows:
            origin = f"  ({source(row)})" if source is not None else ""
            lines.append(f"    {row.name} = {row.display(getattr(settings, row.name))}{origin}")
    return lines


# -- README ----------------------------------------------------------------------------------------

def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_table() -> str:
    """The README settings table (GitHub Markdown), one row per setting, a bold row per
    section; ends with a newline."""
    lines = ["| flag | env | default | range | meaning |", "|---|---|---|---|---|"]
    for section, rows in by_section():
        lines.append(f"| **{section}** | | | | |")
        for row in rows:
            flag = f"`{row.flag} [true\\|false]`" if row.kind is bool else f"`{row.flag}`"
            default = (row.default_text() if row.default in (None, "") else
                       f"`{row.default_value()}`" + (f" {row.meta.unit}" if row.meta.unit else ""))
            if row.meta.choices:
                allowed = ", ".join(f"`{c}`" for c in row.meta.choices)
            else:
                allowed = row.range_text()
            lines.append(f"| {flag} | `{row.env}` | {default} | {_cell(allowed)} | "
                         f"{_cell(row.meta.help)} |")
    return "\n".join(lines) + "\n"


def replace_readme_table(readme: str) -> str:
    """``readme`` with the text between :data:`README_BEGIN` and :data:`README_END` replaced by
    :func:`markdown_table`.

    :raises ValueError: a marker is missing or they are out of order.
    """
    begin = readme.find(README_BEGIN)
    end = readme.find(README_END)
    if begin < 0 or end < begin:
        raise ValueError(f"README markers {README_BEGIN!r} ... {README_END!r} not found")
    head = readme[:begin + len(README_BEGIN)]
    return f"{head}\n{markdown_table()}{readme[end:]}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m kvsvc.settings``: print the README table or rewrite it in place.

    :returns: the exit code (0).
    """
    parser = argparse.ArgumentParser(prog="python -m kvsvc.settings",
                                     description="The settings table of kvsvc serve.")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--markdown", action="store_true", help="print the README table")
    mode.add_argument("--update-readme", metavar="PATH",
                      help="replace the table between the markers of PATH (README.md)")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(markdown_table())
        return 0
    path = Path(args.update_readme)
    path.write_text(replace_readme_table(path.read_text(encoding="utf-8")), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
