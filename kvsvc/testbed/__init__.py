"""The testbed: tools that exercise the service from outside, never imported by it (only the
``kvsvc sim|demo|soak|bench-routing`` subcommands of :mod:`kvsvc.cli` load them).

- :mod:`kvsvc.testbed.sim`: the simulated engine (prefix cache, KV events and snapshots on
  ZMQ, §1, §2, §7; ``/health`` and OpenAI serving; etcd registration and heartbeats, §9).
- :mod:`kvsvc.testbed.traces`: the shipped Mooncake traces (``data/mooncake``) as token ids.
- :mod:`kvsvc.testbed.demo`: ``kvsvc demo``, the whole system checked against ground truth.
- :mod:`kvsvc.testbed.soak`: ``kvsvc soak``, the chaos soak audited against ground truth.
- :mod:`kvsvc.testbed.bench_routing`: ``kvsvc bench-routing``, routing policies compared.
- :mod:`kvsvc.testbed.etcd_launcher`: a local single-member etcd for the demo and benches.
"""
