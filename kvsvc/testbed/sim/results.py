"""What the simulated engine answers about its ranks: :class:`ExecResult` (one executed
request) and :class:`RankStats` (a rank's counters).

These values live apart from :mod:`kvsvc.testbed.sim.engine` so that its request front
(:mod:`kvsvc.testbed.sim.serving`) reads them without importing the engine it is part of.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True, slots=True)
class ExecResult:
    """Outcome of :meth:`~kvsvc.testbed.sim.engine.SimEngine.execute`.

    :param rank: DP rank that executed the request.
    :param seq: seq of the published batch (§1), ``None`` when the request changed nothing
        (no events, nothing published; a real engine does not publish empty batches).
    :param device_hit_tokens: prefix tokens on Device before execution (§10 truth).
    :param host_only_hit_tokens: prefix tokens only on Host before execution.
    :param stored_blocks: new blocks stored on Device.
    """

    rank: int
    seq: Optional[int]
    device_hit_tokens: int
    host_only_hit_tokens: int
    stored_blocks: int


@dataclass(frozen=True, slots=True)
class RankStats:
    """Counters of one rank since the engine started (kept across restarts).

    :param published: live batches sent to the socket.
    :param dropped: live batches dropped by a fault (their seqs consumed).
    :param snapshots: snapshot requests answered (including delayed or truncated ones).
    :param malformed: malformed messages injected.
    :param restarts: process restarts (:meth:`~kvsvc.testbed.sim.engine.SimEngine.restart`).
    """

    published: int
    dropped: int
    snapshots: int
    malformed: int
    restarts: int
