"""Per-stream KV-event ingestion (§1, §2, §6, §7, §7h).

The rules, sans-IO (no socket, thread, clock or serving-state read; the import-linter contract
``rules-sans-io`` holds them and what they import to it):

- ``recovery``: the recovery plumbing both modes share (``AttemptRules``: attempts, live link,
  backoff, silent-channel judgement; ``Mode``, ``Link``) and the §6/§7 snapshot rules
  (``SnapshotRecovery``).
- ``history``: the §7h rules of history-mode streams (vLLM, SGLang): one state machine
  (``Mode`` x ``Input`` -> handler, ``MODE_TABLE``), catch-ups from an anchor, rebuilds into
  exact or subset indexes, live-only subsets.
- ``history_reply``: the rules of one history reply (order, continuity, truncation, exactness)
  and the pure merges of a reply with the live batches buffered meanwhile.
- ``anchor``: the continuity anchor (``Anchor.judge``: contiguous, duplicate, restarted, gap)
  and ``starts_cleared`` (§6 complete state).
- ``actions``: what the rules return (apply, swap, hold, invalidate, count, log, request).

Values and pure helpers:

- ``frame``: wire framing of live messages, snapshot requests and replies (§1, §7).
- ``decoder``: MessagePack batches and events (§2).
- ``split``: the MessagePack scanner that cuts large snapshot payloads into event groups.
- ``counters``: the metric label values (declared once) and ``StreamCounters``.
- ``state``: values shared with the directory and the HTTP layer (ids, states, answers, the
  replies ``SnapshotResult``, ``CatchUpReply``, ``RebuildReply``).
- ``history_doc``: the mode table in docs/recovery.md, generated from ``history``.

Memory under a lock, and I/O, on the stream's thread:

- ``serving``: the serving index, state and counters request threads read (one lock).
- ``carrier``: carries the rules' actions out on the serving state.
- ``live``: the ``SUB`` + monitor connection with its reopen backoff.
- ``snapshot_client``: ``ReplayAttempt`` (one attempt on a fresh ``DEALER``) and the §7
  ``SnapshotAttempt``.
- ``history_client``: one history attempt (§7h) collecting a catch-up or a rebuild reply.
- ``gate``: the permits bounding replay attempts across streams (thread-safe).
- ``pacing``: GIL yields and timer slack while a reply builds.
- ``subscriber``: the stream thread that owns the sockets, feeds the rules and carries out
  their actions.
"""
