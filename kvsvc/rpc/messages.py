"""The protobuf messages of the xLLM control plane and of brpc's ``baidu_std`` meta (§13),
built as descriptors in code: kvsvc's own schema with xLLM's package, message and field names
and numbers (xLLM-AI/xllm @3906f5a ``xllm/proto/xservice.proto``, ``common.proto``,
``disagg_pd.proto``, ``chat.proto``, ``completion.proto``; apache/brpc 1.12.1
``src/brpc/policy/baidu_rpc_meta.proto``), so the bytes are the engines' bytes. Nothing is
generated, so nothing can drift from a generator's output: the tables below are the schema.

Only what kvsvc reads or writes is declared; unknown fields of a peer's newer schema are kept
by protobuf and ignored. Packages:

- ``brpc.policy`` (proto2): :data:`RpcMeta` (``request`` 1 :data:`RpcRequestMeta`,
  ``response`` 2 :data:`RpcResponseMeta`, ``compress_type`` 3, ``correlation_id`` 4,
  ``attachment_size`` 5, ``chunk_info`` 6, ``authentication_data`` 7, ``stream_settings`` 8,
  ``user_fields`` 9);
- ``xllm_service.proto`` (proto3, the service's own package): :data:`HeartbeatRequest`,
  :data:`Status`, :data:`StatusCode`, :data:`InstanceMetaInfo`, :data:`InstanceID`,
  :data:`InstanceIDs`, :data:`Empty`, ``LoadMetrics``, ``LatencyMetrics``, ``KvCacheEvent``,
  the ``InstanceType`` enum (:data:`INSTANCE_TYPES`);
- ``xllm.proto`` (proto3, the engine's package): :data:`DisaggStreamGenerations` (entries
  ``DisaggStreamGeneration``: ``SequenceOutput``, ``GenerationStatus``, ``OutputUsage``),
  :data:`StatusSet` (entries :data:`XllmStatus`), :data:`ChatRequest`,
  :data:`ChatResponse`, :data:`CompletionRequest`, :data:`CompletionResponse`, ``Routing``,
  ``StreamOptions``, ``Usage``, :data:`InstanceClusterInfo` (PD links).

The classes are protobuf message classes (``Cls()``, ``Cls.FromString(b)``,
``m.SerializeToString()``); they are typed ``Any`` because their fields exist only at run time.
Parsing errors are ``google.protobuf.message.DecodeError``: :func:`parse` translates it into
:class:`~kvsvc.errors.RpcMessageError`.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, struct_pb2
from google.protobuf.message import DecodeError, Message

from kvsvc.errors import RpcMessageError

#: Packages, as on the wire (service names are ``<package>.<Service>``).
BRPC_PACKAGE = "brpc.policy"
SERVICE_PACKAGE = "xllm_service.proto"
ENGINE_PACKAGE = "xllm.proto"

_FDP = descriptor_pb2.FieldDescriptorProto
_SCALARS = {
    "double": _FDP.TYPE_DOUBLE, "float": _FDP.TYPE_FLOAT, "int64": _FDP.TYPE_INT64,
    "uint64": _FDP.TYPE_UINT64, "int32": _FDP.TYPE_INT32, "uint32": _FDP.TYPE_UINT32,
    "bool": _FDP.TYPE_BOOL, "string": _FDP.TYPE_STRING, "bytes": _FDP.TYPE_BYTES,
}
# A field: (name, number, type, label). type: a scalar name, "msg:<full name>" or
# "enum:<full name>". label: "" (proto3 implicit / proto2 optional), "opt" (proto3
# `optional`, explicit presence), "rep" (repeated), "req" (proto2 required).
_Field = tuple[str, int, str, str]


def _field(name: str, number: int, kind: str, label: str, proto3: bool) -> Any:
    f = _FDP(name=name, number=number, json_name=_json_name(name))
    if kind.startswith("msg:"):
        f.type, f.type_name = _FDP.TYPE_MESSAGE, "." + kind[4:]
    elif kind.startswith("enum:"):
        f.type, f.type_name = _FDP.TYPE_ENUM, "." + kind[5:]
    else:
        f.type = _SCALARS[kind]
    f.label = {"rep": _FDP.LABEL_REPEATED, "req": _FDP.LABEL_REQUIRED}.get(
        label, _FDP.LABEL_OPTIONAL)
    if label == "opt" and proto3:
        f.proto3_optional = True
    return f


def _json_name(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


def _message(name: str, fields: Sequence[_Field], proto3: bool,
             maps: Sequence[tuple[str, int, str, str]] = (),
             nested: Sequence[Any] = ()) -> Any:
    """A ``DescriptorProto``; ``maps``: (field name, number, key type, value kind)."""
    msg = descriptor_pb2.DescriptorProto(name=name)
    msg.nested_type.extend(nested)
    for fname, number, kind, label in fields:
        f = _field(fname, number, kind, label, proto3)
        if f.proto3_optional:
            # proto3 `optional`: a synthetic one-field oneof named `_<field>` (after the real
            # oneofs; there are none here).
            f.oneof_index = len(msg.oneof_decl)
            msg.oneof_decl.add(name="_" + fname)
        msg.field.append(f)
    for fname, number, key, value in maps:
        entry = "".join(p[:1].upper() + p[1:] for p in fname.split("_")) + "Entry"
        e = msg.nested_type.add(name=entry)
        e.options.map_entry = True
        e.field.append(_field("key", 1, key, "", proto3))
        e.field.append(_field("value", 2, value, "", proto3))
        f = _FDP(name=fname, number=number, json_name=_json_name(fname),
                 label=_FDP.LABEL_REPEATED, type=_FDP.TYPE_MESSAGE,
                 type_name=f".{{pkg}}.{name}.{entry}")
        msg.field.append(f)
    return msg


def _enum(name: str, values: Sequence[tuple[str, int]]) -> Any:
    e = descriptor_pb2.EnumDescriptorProto(name=name)
    for vname, number in values:
        e.value.add(name=vname, number=number)
    return e


def _file(name: str, package: str, proto3: bool, messages: Sequence[Any],
          enums: Sequence[Any] = (), deps: Sequence[str] = ()) -> Any:
    fdp = descriptor_pb2.FileDescriptorProto(name=name, package=package,
                                             syntax="proto3" if proto3 else "proto2")
    fdp.dependency.extend(deps)
    fdp.enum_type.extend(enums)
    for msg in messages:
        for f in msg.field:
            if "{pkg}" in f.type_name:
                f.type_name = f.type_name.replace("{pkg}", package)
        fdp.message_type.append(msg)
    return fdp


_B = BRPC_PACKAGE
_S = SERVICE_PACKAGE
_E = ENGINE_PACKAGE


def _brpc_file() -> Any:
    m = [
        _message("RpcRequestMeta", [
            ("service_name", 1, "string", "req"), ("method_name", 2, "string", "req"),
            ("log_id", 3, "int64", ""), ("trace_id", 4, "int64", ""),
            ("span_id", 5, "int64", ""), ("parent_span_id", 6, "int64", ""),
            ("request_id", 7, "string", ""), ("timeout_ms", 8, "int32", "")], False),
        _message("RpcResponseMeta", [
            ("error_code", 1, "int32", ""), ("error_text", 2, "string", "")], False),
        _message("ChunkInfo", [
            ("stream_id", 1, "int64", "req"), ("chunk_id", 2, "int64", "req")], False),
        _message("StreamSettings", [
            ("stream_id", 1, "int64", "req"), ("need_feedback", 2, "bool", ""),
            ("writable", 3, "bool", ""), ("extra_stream_ids", 4, "int64", "rep")], False),
        _message("RpcMeta", [
            ("request", 1, f"msg:{_B}.RpcRequestMeta", ""),
            ("response", 2, f"msg:{_B}.RpcResponseMeta", ""),
            ("compress_type", 3, "int32", ""), ("correlation_id", 4, "int64", ""),
            ("attachment_size", 5, "int32", ""), ("chunk_info", 6, f"msg:{_B}.ChunkInfo", ""),
            ("authentication_data", 7, "bytes", ""),
            ("stream_settings", 8, f"msg:{_B}.StreamSettings", "")], False,
            maps=[("user_fields", 9, "string", "string")]),
    ]
    return _file("kvsvc/rpc/baidu_rpc_meta.proto", _B, False, m)


def _engine_file() -> Any:
    enums = [_enum("Priority", [("DEFAULT", 0), ("HIGH", 1), ("NORMAL", 2), ("LOW", 3)])]
    m = [
        # common.proto
        _message("FunctionCall", [("name", 1, "string", ""), ("arguments", 2, "string", "")],
                 True),
        _message("ToolCall", [
            ("index", 1, "uint32", "opt"), ("id", 2, "string", "opt"),
            ("type", 3, "string", ""), ("function", 4, f"msg:{_E}.FunctionCall", "")], True),
        _message("Function", [
            ("name", 1, "string", ""), ("description", 2, "string", ""),
            ("parameters", 3, "msg:google.protobuf.Struct", "")], True),
        _message("Tool", [("type", 1, "string", ""), ("function", 2, f"msg:{_E}.Function", "")],
                 True),
        _message("Usage", [
            ("prompt_tokens", 1, "int32", "opt"), ("completion_tokens", 2, "int32", "opt"),
            ("total_tokens", 3, "int32", "opt"),
            ("prompt_tokens_details", 4, f"msg:{_E}.Usage.PromptTokensDetails", "opt"),
            ("completion_tokens_details", 5, f"msg:{_E}.Usage.CompletionTokensDetails",
             "opt")], True, nested=[
            _message("PromptTokensDetails", [
                ("cached_tokens", 1, "int32", "opt"), ("audio_tokens", 2, "int32", "opt")],
                True),
            _message("CompletionTokensDetails", [
                ("reasoning_tokens", 1, "int32", "opt"), ("audio_tokens", 2, "int32", "opt")],
                True)]),
        _message("StreamOptions", [("include_usage", 1, "bool", "opt")], True),
        _message("Status", [("ok", 1, "bool", "")], True),
        _message("Routing", [("prefill_name", 1, "string", ""),
                             ("decode_name", 2, "string", "")], True),
        _message("Empty", [], True),
        # disagg_pd.proto: what an engine pushes to its service, and PD links
        _message("OutputUsage", [
            ("num_prompt_tokens", 1, "int32", ""), ("num_generated_tokens", 2, "int32", ""),
            ("num_total_tokens", 3, "int32", ""), ("num_cached_tokens", 4, "int32", "")], True),
        _message("LogProbData", [
            ("token", 1, "string", ""), ("token_id", 2, "int32", ""),
            ("logprob", 3, "float", ""), ("finished_token", 4, "bool", "")], True),
        _message("LogProb", [
            ("log_prob_data", 1, f"msg:{_E}.LogProbData", ""),
            ("top_logprobs", 2, f"msg:{_E}.LogProbData", "rep")], True),
        _message("SequenceOutput", [
            ("index", 1, "int32", ""), ("text", 2, "string", ""),
            ("token_ids", 3, "int32", "rep"), ("finish_reason", 4, "string", ""),
            ("logprobs", 5, f"msg:{_E}.LogProb", "rep")], True),
        _message("GenerationStatus", [
            ("status_code", 1, "int32", ""), ("status_msg", 2, "string", "")], True),
        _message("DisaggStreamGeneration", [
            ("req_id", 1, "string", ""), ("service_req_id", 2, "string", ""),
            ("gen_status", 3, f"msg:{_E}.GenerationStatus", ""),
            ("outputs", 4, f"msg:{_E}.SequenceOutput", "rep"),
            ("usage", 5, f"msg:{_E}.OutputUsage", ""), ("finished", 6, "bool", ""),
            ("finished_on_prefill_instance", 7, "bool", "")], True),
        _message("DisaggStreamGenerations", [
            ("gens", 1, f"msg:{_E}.DisaggStreamGeneration", "rep")], True),
        _message("StatusSet", [("all_status", 1, f"msg:{_E}.Status", "rep")], True),
        _message("InstanceClusterInfo", [
            ("instance_name", 1, "string", ""), ("cluster_ids", 2, "uint64", "rep"),
            ("addrs", 3, "string", "rep"), ("ports", 5, "uint32", "rep"),
            ("dp_size", 6, "int32", ""), ("kv_split_size", 7, "int32", "")], True),
        # chat.proto
        _message("ChatMessage", [
            ("role", 1, "string", "opt"), ("content", 2, "string", "opt"),
            ("reasoning_content", 3, "string", "opt"),
            ("tool_calls", 4, f"msg:{_E}.ToolCall", "rep"),
            ("tool_call_id", 5, "string", "opt")], True),
        _message("ResponseFormat", [("type", 1, "string", "opt")], True),
        _message("ChatRequest", [
            ("model", 1, "string", ""), ("messages", 2, f"msg:{_E}.ChatMessage", "rep"),
            ("best_of", 3, "uint32", "opt"), ("temperature", 5, "float", "opt"),
            ("top_p", 6, "float", "opt"), ("n", 7, "uint32", "opt"),
            ("stream", 8, "bool", "opt"), ("stop", 9, "string", "rep"),
            ("max_tokens", 10, "uint32", "opt"), ("presence_penalty", 11, "float", "opt"),
            ("frequency_penalty", 12, "float", "opt"), ("user", 14, "string", ""),
            ("stop_token_ids", 16, "int32", "rep"),
            ("repetition_penalty", 17, "float", "opt"), ("top_k", 18, "int64", "opt"),
            ("skip_special_tokens", 19, "bool", "opt"), ("ignore_eos", 20, "bool", "opt"),
            ("logprobs", 21, "bool", "opt"), ("top_logprobs", 22, "int32", "opt"),
            ("stream_options", 23, f"msg:{_E}.StreamOptions", "opt"),
            ("request_id", 24, "string", "opt"), ("service_request_id", 25, "string", "opt"),
            ("token_ids", 26, "int32", "rep"), ("routing", 27, f"msg:{_E}.Routing", ""),
            ("tools", 28, f"msg:{_E}.Tool", "rep"), ("tool_choice", 29, "string", "opt"),
            ("offline", 30, "bool", "opt"), ("ttlt_slo_ms", 31, "int32", "opt"),
            ("priority", 32, f"enum:{_E}.Priority", "opt"),
            ("beam_width", 33, "int32", "opt"), ("add_special_tokens", 34, "bool", "opt"),
            ("chat_template_kwargs", 35, "msg:google.protobuf.Struct", "opt"),
            ("ttft_slo_ms", 36, "int32", "opt"), ("tpot_slo_ms", 37, "int32", "opt"),
            ("tpot_priority_weight", 38, "int32", "opt"),
            ("ttft_priority_weight", 39, "int32", "opt"),
            ("ttlt_priority_weight", 40, "int32", "opt"),
            ("priority_weight", 41, "int32", "opt"),
            ("source_xservice_addr", 42, "string", "opt"),
            ("x_request_id", 43, "string", "opt"), ("x_request_time", 44, "string", "opt"),
            ("num_return_sequences", 45, "int32", "opt"),
            ("include_stop_str_in_output", 46, "bool", "opt"),
            ("response_format", 47, f"msg:{_E}.ResponseFormat", "opt")], True),
        _message("ChatLogProbData", [
            ("token", 1, "string", "opt"), ("token_id", 2, "int32", "opt"),
            ("logprob", 3, "float", "opt")], True),
        _message("ChatLogProb", [
            ("token", 1, "string", "opt"), ("token_id", 2, "int32", "opt"),
            ("logprob", 3, "float", "opt"),
            ("top_logprobs", 5, f"msg:{_E}.ChatLogProbData", "rep")], True),
        _message("ChatLogProbs", [("content", 1, f"msg:{_E}.ChatLogProb", "rep")], True),
        _message("ChatChoice", [
            ("index", 1, "uint32", "opt"), ("delta", 2, f"msg:{_E}.ChatMessage", "opt"),
            ("message", 3, f"msg:{_E}.ChatMessage", "opt"),
            ("finish_reason", 4, "string", "opt"),
            ("logprobs", 5, f"msg:{_E}.ChatLogProbs", "opt")], True),
        _message("ChatResponse", [
            ("id", 1, "string", ""), ("object", 2, "string", ""), ("created", 3, "uint32", ""),
            ("model", 4, "string", ""), ("choices", 5, f"msg:{_E}.ChatChoice", "rep"),
            ("usage", 6, f"msg:{_E}.Usage", "")], True),
        # completion.proto (input_tensors 31 / output_tensors 7, recommendation tensors, are
        # not declared: kvsvc never sends them and keeps them as unknown fields)
        _message("CompletionRequest", [
            ("model", 1, "string", ""), ("prompt", 2, "string", ""),
            ("best_of", 3, "uint32", "opt"), ("max_tokens", 4, "uint32", "opt"),
            ("temperature", 5, "float", "opt"), ("top_p", 6, "float", "opt"),
            ("n", 7, "uint32", "opt"), ("stream", 8, "bool", "opt"),
            ("logprobs", 9, "uint32", "opt"), ("echo", 10, "bool", "opt"),
            ("stop", 11, "string", "rep"), ("presence_penalty", 12, "float", "opt"),
            ("frequency_penalty", 13, "float", "opt"),
            ("skip_special_tokens", 14, "bool", "opt"), ("ignore_eos", 15, "bool", "opt"),
            ("user", 16, "string", ""), ("stop_token_ids", 18, "int32", "rep"),
            ("top_k", 19, "int64", "opt"), ("repetition_penalty", 20, "float", "opt"),
            ("stream_options", 21, f"msg:{_E}.StreamOptions", "opt"),
            ("request_id", 22, "string", "opt"), ("service_request_id", 23, "string", "opt"),
            ("token_ids", 24, "int32", "rep"), ("routing", 25, f"msg:{_E}.Routing", ""),
            ("offline", 26, "bool", "opt"), ("ttlt_slo_ms", 27, "int32", "opt"),
            ("priority", 28, f"enum:{_E}.Priority", "opt"),
            ("beam_width", 29, "int32", "opt"), ("add_special_tokens", 30, "bool", "opt"),
            ("ttft_slo_ms", 32, "int32", "opt"), ("tpot_slo_ms", 33, "int32", "opt"),
            ("tpot_priority_weight", 34, "int32", "opt"),
            ("ttft_priority_weight", 35, "int32", "opt"),
            ("ttlt_priority_weight", 36, "int32", "opt"),
            ("priority_weight", 37, "int32", "opt"),
            ("source_xservice_addr", 38, "string", "opt"),
            ("x_request_id", 39, "string", "opt"), ("x_request_time", 40, "string", "opt"),
            ("num_return_sequences", 41, "int32", "opt"),
            ("include_stop_str_in_output", 42, "bool", "opt")], True),
        _message("LogProbs", [
            ("token_logprobs", 1, "float", "rep"), ("tokens", 2, "string", "rep"),
            ("token_ids", 3, "int32", "rep")], True),
        _message("Choice", [
            ("index", 1, "uint32", "opt"), ("text", 2, "string", "opt"),
            ("logprobs", 3, f"msg:{_E}.LogProbs", "opt"),
            ("finish_reason", 4, "string", "opt")], True),
        _message("CompletionResponse", [
            ("id", 1, "string", ""), ("object", 2, "string", ""), ("created", 3, "uint32", ""),
            ("model", 4, "string", ""), ("choices", 5, f"msg:{_E}.Choice", "rep"),
            ("usage", 6, f"msg:{_E}.Usage", "")], True),
    ]
    return _file("kvsvc/rpc/xllm.proto", _E, True, m, enums,
                 deps=[struct_pb2.DESCRIPTOR.name])


def _service_file() -> Any:
    enums = [_enum("InstanceType", [("DEFAULT", 0), ("PREFILL", 1), ("DECODE", 2),
                                    ("MIX", 3)])]
    m = [
        _message("Empty", [], True),
        _message("Status", [("ok", 1, "bool", "")], True),
        _message("StatusCode", [("status_code", 1, "int32", "")], True),
        _message("InstanceMetaInfo", [
            ("name", 1, "string", ""), ("rpc_address", 2, "string", ""),
            ("type", 3, f"enum:{_S}.InstanceType", "opt"),
            ("cluster_ids", 4, "uint64", "rep"), ("dp_size", 7, "int32", ""),
            ("addrs", 8, "string", "rep"), ("ports", 10, "uint32", "rep"),
            ("incarnation_id", 11, "string", ""), ("register_ts_ms", 12, "uint64", ""),
            ("kv_split_size", 13, "int32", "")], True),
        _message("KvCacheEvent", [
            ("stored_cache", 1, "bytes", "rep"), ("removed_cache", 2, "bytes", "rep")], True),
        _message("LoadMetrics", [
            ("waiting_requests_num", 1, "uint64", ""),
            ("gpu_cache_usage_perc", 2, "float", "")], True),
        _message("LatencyMetrics", [
            ("recent_max_ttft", 1, "int64", ""), ("recent_max_tbt", 2, "int64", "")], True),
        _message("WeightSegmentInfo", [("offset", 1, "uint64", ""), ("size", 2, "uint64", "")],
                 True),
        _message("WeightSegmentList", [
            ("segments", 1, f"msg:{_S}.WeightSegmentInfo", "rep")], True),
        _message("XTensorHeartbeatInfo", [
            ("worker_free_phy_pages", 1, "uint64", "rep")], True,
            maps=[("model_weight_segments", 3, "string", f"msg:{_S}.WeightSegmentList")]),
        _message("HeartbeatRequest", [
            ("name", 1, "string", ""), ("cache_event", 2, f"msg:{_S}.KvCacheEvent", ""),
            ("load_metrics", 3, f"msg:{_S}.LoadMetrics", ""),
            ("latency_metrics", 4, f"msg:{_S}.LatencyMetrics", ""),
            ("xtensor_info", 5, f"msg:{_S}.XTensorHeartbeatInfo", ""),
            ("incarnation_id", 6, "string", "")], True),
        _message("InstanceID", [("name", 1, "string", "")], True),
        _message("InstanceIDs", [("names", 1, "string", "rep")], True),
    ]
    return _file("kvsvc/rpc/xservice.proto", _S, True, m, enums)


def _build_pool() -> descriptor_pool.DescriptorPool:
    pool = descriptor_pool.DescriptorPool()
    struct_file = descriptor_pb2.FileDescriptorProto()
    struct_pb2.DESCRIPTOR.CopyToProto(struct_file)
    for fdp in (struct_file, _brpc_file(), _engine_file(), _service_file()):
        pool.Add(fdp)
    return pool


#: The private descriptor pool holding kvsvc's schema (nothing is added to protobuf's default
#: pool, so no other library's ``.proto`` of the same names can clash).
POOL = _build_pool()


def message_class(full_name: str) -> Any:
    """The message class of ``full_name`` (``xllm_service.proto.HeartbeatRequest``).

    :raises KeyError: no such message in kvsvc's schema.
    """
    return message_factory.GetMessageClass(POOL.FindMessageTypeByName(full_name))


RpcMeta: Any = message_class(f"{_B}.RpcMeta")
RpcRequestMeta: Any = message_class(f"{_B}.RpcRequestMeta")
RpcResponseMeta: Any = message_class(f"{_B}.RpcResponseMeta")

HeartbeatRequest: Any = message_class(f"{_S}.HeartbeatRequest")
Status: Any = message_class(f"{_S}.Status")
StatusCode: Any = message_class(f"{_S}.StatusCode")
Empty: Any = message_class(f"{_S}.Empty")
InstanceMetaInfo: Any = message_class(f"{_S}.InstanceMetaInfo")
InstanceID: Any = message_class(f"{_S}.InstanceID")
InstanceIDs: Any = message_class(f"{_S}.InstanceIDs")

DisaggStreamGenerations: Any = message_class(f"{_E}.DisaggStreamGenerations")
DisaggStreamGeneration: Any = message_class(f"{_E}.DisaggStreamGeneration")
StatusSet: Any = message_class(f"{_E}.StatusSet")
XllmStatus: Any = message_class(f"{_E}.Status")
ChatRequest: Any = message_class(f"{_E}.ChatRequest")
ChatResponse: Any = message_class(f"{_E}.ChatResponse")
CompletionRequest: Any = message_class(f"{_E}.CompletionRequest")
CompletionResponse: Any = message_class(f"{_E}.CompletionResponse")
InstanceClusterInfo: Any = message_class(f"{_E}.InstanceClusterInfo")

#: ``xllm_service.proto.InstanceType`` by the registration's ``type`` number (§9).
INSTANCE_TYPES: dict[int, str] = {0: "DEFAULT", 1: "PREFILL", 2: "DECODE", 3: "MIX"}


def parse(cls: Any, data: bytes, what: Optional[str] = None) -> Any:
    """``cls.FromString(data)`` with protobuf's error translated.

    :param cls: a message class of this module.
    :param data: the serialized message (decompressed).
    :param what: how the message is named in the error (default: its full name).
    :raises RpcMessageError: ``data`` is not a valid ``cls`` (truncated, wrong wire types,
        a proto2 required field missing).
    """
    try:
        msg = cls.FromString(data)
    except (DecodeError, ValueError) as exc:
        name = what or cls.DESCRIPTOR.full_name
        raise RpcMessageError(f"cannot parse {name} ({len(data)} bytes): {exc}") from exc
    if not msg.IsInitialized():
        raise RpcMessageError(f"{what or cls.DESCRIPTOR.full_name}: missing required fields "
                              f"{msg.FindInitializationErrors()}")
    return msg


def serialize(msg: Message) -> bytes:
    """The wire bytes of ``msg`` (deterministic: map entries in key order)."""
    return msg.SerializeToString(deterministic=True)
