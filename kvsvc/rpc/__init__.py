"""brpc ``baidu_std`` for xLLM engines (PROTOCOL.md §13), one module per role:

- :mod:`kvsvc.rpc.messages`: the protobuf messages of xLLM (``xllm_service.proto``,
  ``xllm.proto``) and brpc's ``RpcMeta``, built as descriptors in code (no generator);
- :mod:`kvsvc.rpc.codec`: the frame rules without I/O (bytes in, calls and answers out);
- :mod:`kvsvc.rpc.generations`: Generations entries to kvsvc's values and the sink interface
  the dispatch side implements;
- :mod:`kvsvc.rpc.client`: a pooled caller of engines (``ChatCompletions`` / ``Completions``);
- :mod:`kvsvc.rpc.server`: ``xllm_service.proto.XllmRpcService`` on ``--rpc_port``.

The package's ``__init__`` imports nothing, so each layer imports only what it needs
(``.importlinter``).
"""
