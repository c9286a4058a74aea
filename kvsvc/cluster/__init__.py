"""The cluster (§9): the instance registry in etcd and what follows it.

- :mod:`~kvsvc.cluster.etcd`: the one boundary over etcd (etcd3gw and requests errors are
  translated here, once).
- :mod:`~kvsvc.cluster.model`: the registry's values and parsers (instances, loads, the
  immutable snapshot request threads read); no I/O.
- :mod:`~kvsvc.cluster.probe`: the ``/health`` probe of an instance whose lease went away.
- :mod:`~kvsvc.cluster.registry`: the registry's threads (etcd list/watch, state timer) and the
  heartbeat intake.
- :mod:`~kvsvc.cluster.election`: master election among kvsvc replicas, the master's load writes.
- :mod:`~kvsvc.cluster.discovery`: the registry's instances turned into the directory's streams
  by the port rule.
"""
