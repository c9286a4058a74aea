"""kvsvc's baidu_std calls of xLLM engines' API (§13 "Dispatch"): the
:class:`~kvsvc.routing.xllm_dispatch.EngineCaller` the service's native dispatch uses. Here,
not in :mod:`kvsvc.routing`, because the routing layer never imports :mod:`kvsvc.rpc` (the rpc
package's Generations conversion reads routing's values)."""

from __future__ import annotations

import re
from typing import Any, Mapping

from google.protobuf import json_format

from kvsvc.errors import BadRequest, RpcCallFailed, RpcMessageError, UpstreamUnreachable
from kvsvc.routing.answers import engine_param
from kvsvc.rpc import messages
from kvsvc.rpc.client import ClientSettings, RpcClient
from kvsvc.rpc.codec import EREQUEST

#: xLLM's API service and its chat method (``xllm/proto/xllm_service.proto``).
API_SERVICE = "xllm.proto.XllmAPIService"
CHAT_METHOD = "ChatCompletions"
#: Bound of the engine's answer to the dispatch call (it answers at once), seconds.
DISPATCH_ANSWER_TIMEOUT_S = 10.0
#: The field protobuf's JSON parser names in its error ("Failed to parse n field: ...").
_PARSE_FIELD = re.compile(r"Failed to parse (\w+) field")


class BaiduStdCaller:
    """An :class:`~kvsvc.routing.xllm_dispatch.EngineCaller` over baidu_std (:class:`~kvsvc.rpc.client.RpcClient`, one pooled
    connection per engine), as xllm-service calls engines: the message built from its JSON
    form into xLLM's ``ChatRequest`` / ``CompletionRequest`` (fields kvsvc's schema lacks are
    dropped), the (empty) answer parsed as ``ChatResponse`` / ``CompletionResponse``.
    Thread-safe.

    :param connect_timeout_s: TCP connect bound, seconds.
    :param answer_timeout_s: bound of the engine's answer, seconds.
    """

    def __init__(self, connect_timeout_s: float = 2.0,
                 answer_timeout_s: float = DISPATCH_ANSWER_TIMEOUT_S) -> None:
        self._client = RpcClient(ClientSettings(connect_timeout_s=connect_timeout_s,
                                                timeout_s=answer_timeout_s))

    def call(self, target: str, method: str, message: Mapping[str, Any]) -> None:
        """See :class:`~kvsvc.routing.xllm_dispatch.EngineCaller`."""
        chat = method == CHAT_METHOD
        try:
            request = json_format.ParseDict(
                message, messages.ChatRequest() if chat else messages.CompletionRequest(),
                ignore_unknown_fields=True)
        except json_format.ParseError as exc:
            # protobuf names the field: "Failed to parse max_tokens field: ...".
            found = _PARSE_FIELD.search(str(exc))
            param = found.group(1) if found else engine_param(str(exc), message)
            raise BadRequest(f"{param or 'body'}: the value has no xLLM form ({exc})",
                             param=param) from exc
        try:
            self._client.call_message(target, API_SERVICE, method, request,
                                      messages.ChatResponse if chat
                                      else messages.CompletionResponse)
        except RpcCallFailed as exc:
            if exc.code == EREQUEST:
                raise BadRequest(f"the engine {target} refused the request: {exc.text}",
                                 param=engine_param(exc.text, message)) from exc
            raise UpstreamUnreachable(f"upstream {target}: {method} failed: {exc}") from exc
        except RpcMessageError as exc:
            raise UpstreamUnreachable(f"upstream {target}: {method} answered something "
                                      f"else: {exc.message}") from exc

    def close(self) -> None:
        """See :class:`~kvsvc.routing.xllm_dispatch.EngineCaller`."""
        self._client.close()
