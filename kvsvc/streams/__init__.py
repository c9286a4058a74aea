"""Per-stream KV-event ingestion (§1, §2, §6, §7, §7h). Pure modules (no sockets, no threads):

- ``frame``: wire framing of live messages, snapshot requests and replies (§1, §7).
- ``decoder``: MessagePack batches and events (§2).
- ``split``: the MessagePack scanner that cuts large snapshot payloads into event groups.
- ``recovery``: the §6/§7 recovery rules as a state machine fed with events and times.
- ``history``: the §7h rules of history-mode streams (vLLM, SGLang): catch-up from an anchor
  proven by a payload digest, rebuilds into exact or subset indexes, live-only subsets.
- ``serving``: the serving index, state and counters request threads read (one lock).
- ``counters``: the metric label values (declared once) and ``StreamCounters``.
- ``state``: values shared with the directory and the HTTP layer (ids, states, answers).

I/O, on the stream's thread:

- ``live``: the ``SUB`` + monitor connection with its reopen backoff.
- ``snapshot_client``: one snapshot attempt on a fresh ``DEALER``.
- ``history_client``: one history attempt (§7h): a catch-up or a rebuild reply, per-message
  deadline.
- ``gate``: the permits bounding snapshot attempts across streams (thread-safe).
- ``pacing``: GIL yields and timer slack while a snapshot builds.
- ``subscriber``: the stream thread that owns the sockets and drives ``recovery``.
"""
