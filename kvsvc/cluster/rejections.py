"""The ledger of refused heartbeats (§9, §10): who is being refused, why, since when, how often.

A heartbeat that kvsvc refuses (401 without the right ``X-Internal-Token``, 409 from an
instance the registry does not hold or from a replaced process) records nothing in the
registry, so the instance is judged on no load (or none at all). Without this ledger the
operator sees only a counter move. :class:`HeartbeatRejections` turns the refusals into
episodes, one per sender:

- the first refusal of a sender for a reason logs one WARNING naming the sender and the likely
  cause (:data:`CAUSES`); an episode is one sender and one reason;
- while refusals go on, at most one reminder WARNING per ``reminder_interval_s`` (60 s), with
  the count since the first;
- the first accepted heartbeat of that name ends its episodes with one INFO;
- a sender refused no more for ``forget_after_s`` (300 s: it stopped sending, e.g. the engine
  is gone) is forgotten with one INFO.

A sender is its instance ``host:port``. For a 401 the body is not trusted, but its ``name``
(when it parses) identifies the sender in the log, as one that "claims to be" that instance;
without one the sender is its remote address. At most ``max_senders`` (256) episodes are
kept, the one refused longest ago dropped first, so refusals from anywhere cannot grow it (each new
sender still logs one WARNING: a flood of invented names shows in the log as such).

The ledger is the service's (:attr:`kvsvc.service.Service.heartbeat_rejections`); the HTTP
layer reports into it and shows :meth:`HeartbeatRejections.to_json` in ``/ready`` and
``/v1/internal/route``. Thread-safe (one lock, no I/O under it besides logging); the clock is
injected for tests.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional

log = logging.getLogger(__name__)


class RejectionReason(str, enum.Enum):
    """Why a heartbeat was refused (the ``reason`` field of :meth:`HeartbeatRejections.to_json`)."""

    TOKEN_MISMATCH = "token_mismatch"
    MISSING_TOKEN = "missing_token"
    UNKNOWN_INSTANCE = "unknown_instance"
    STALE_INCARNATION = "stale_incarnation"


#: Reason -> the likely cause, in the words the log and the JSON use.
CAUSES: dict[RejectionReason, str] = {
    RejectionReason.TOKEN_MISMATCH:
        "token mismatch: the sender's X-Internal-Token differs from --internal_api_token",
    RejectionReason.MISSING_TOKEN:
        "missing X-Internal-Token: the sender sends no token but --internal_api_token is set",
    RejectionReason.UNKNOWN_INSTANCE:
        "unknown instance: registered under another --etcd_namespace, or not registered yet?",
    RejectionReason.STALE_INCARNATION:
        "stale incarnation: a replaced engine process is still sending",
}


@dataclass(frozen=True, slots=True)
class Rejection:
    """One sender's current episode of refusals.

    :ivar sender: the instance ``host:port`` (claimed, for a 401), or ``"unidentified sender
        <address>"``.
    :ivar reason: why its heartbeats are refused.
    :ivar first_at: clock time of the episode's first refusal, seconds.
    :ivar last_at: clock time of its latest refusal, seconds.
    :ivar count: refusals in the episode.
    :ivar claimed: the name comes from a body that was not authenticated (401).
    :ivar detail: what the refusal saw (e.g. the incarnations), for the log and the JSON.
    """

    sender: str
    reason: RejectionReason
    first_at: float
    last_at: float
    count: int
    claimed: bool
    detail: str

    def to_json(self, now: float) -> dict[str, Any]:
        """``{"reason", "cause", "since_s", "last_s_ago", "count", "claimed", "detail"}``;
        ``since_s``: seconds since the episode's first refusal at ``now``."""
        return {"reason": self.reason.value, "cause": CAUSES[self.reason],
                "since_s": round(max(0.0, now - self.first_at), 3),
                "last_s_ago": round(max(0.0, now - self.last_at), 3),
                "count": self.count, "claimed": self.claimed, "detail": self.detail}


@dataclass(slots=True)
class _Episode:
    """Mutable state of one sender's episode, under ``HeartbeatRejections._lock``."""

    reason: RejectionReason
    first_at: float
    last_at: float
    count: int
    claimed: bool
    detail: str
    reminded_at: float   # the WARNING or reminder last logged, clock seconds
    reminded_count: int  # ``count`` at that line


class HeartbeatRejections:
    """The refused-heartbeat ledger (see the module docstring).

    :param clock: monotonic seconds (``time.monotonic``; the service passes its clock's
        ``now``, :mod:`kvsvc.clock`).
    :param reminder_interval_s: least time between two WARNINGs of one episode, seconds.
    :param forget_after_s: an episode without a refusal for this long is dropped, seconds.
    :param max_senders: most episodes (sender and reason) kept; the one refused longest ago
        goes first.
    :raises ValueError: a non-positive interval or bound.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 reminder_interval_s: float = 60.0, forget_after_s: float = 300.0,
                 max_senders: int = 256) -> None:
        if reminder_interval_s <= 0 or forget_after_s <= 0 or max_senders < 1:
            raise ValueError("reminder_interval_s, forget_after_s and max_senders must be "
                             "positive")
        self._clock = clock
        self._reminder_s = reminder_interval_s
        self._forget_s = forget_after_s
        self._max = max_senders
        self._lock = threading.Lock()
        # (sender, reason) -> episode, least recently refused first.
        self._episodes: "OrderedDict[tuple[str, RejectionReason], _Episode]" = OrderedDict()

    def rejected(self, sender: str, reason: RejectionReason, *, claimed: bool = False,
                 detail: str = "") -> None:
        """Record one refused heartbeat of ``sender`` (logs as the module docstring says).

        An episode is one sender and one reason: a sender refused for two reasons in turn
        (a token that sometimes is missing) has two, each warned once, not a line each time.

        :param sender: instance ``host:port``, or the description of an unidentified sender.
        :param reason: why it was refused.
        :param claimed: the name was read from an unauthenticated body (a 401).
        :param detail: what the refusal saw, e.g. ``incarnation 'a', registered 'b'``.
        """
        now = self._clock()
        who = _describe(sender, claimed)
        key = (sender, reason)
        with self._lock:
            self._forget_idle(now)
            ep = self._episodes.get(key)
            if ep is None:
                self._episodes[key] = _Episode(reason, now, now, 1, claimed, detail, now, 1)
                log.warning("heartbeats from %s refused: %s%s; its load is not recorded",
                            who, CAUSES[reason], f" [{detail}]" if detail else "")
                while len(self._episodes) > self._max:
                    (dropped, why), _ = self._episodes.popitem(last=False)
                    log.debug("heartbeat rejections: %s (%s) dropped (more than %d kept)",
                              dropped, why.value, self._max)
                return
            ep.count += 1
            ep.last_at = now
            ep.claimed = claimed
            ep.detail = detail
            self._episodes.move_to_end(key)
            if now - ep.reminded_at >= self._reminder_s:
                log.warning("heartbeats from %s still refused: %s; %d refused since the first "
                            "%.0f s ago (%d since the last reminder)", who, CAUSES[reason],
                            ep.count, now - ep.first_at, ep.count - ep.reminded_count)
                ep.reminded_at = now
                ep.reminded_count = ep.count

    def accepted(self, name: str) -> None:
        """A heartbeat of ``name`` was accepted: its episodes, if any, end (one INFO)."""
        if not self._episodes:   # the usual case, without the lock (a racy read only skips)
            return
        now = self._clock()
        with self._lock:
            ended = [(key, self._episodes.pop(key)) for key in
                     [k for k in self._episodes if k[0] == name]]
            if ended:
                first = min(ep.first_at for _, ep in ended)
                log.info("heartbeats from %s accepted again, after %d refused over %.1f s (%s)",
                         name, sum(ep.count for _, ep in ended), now - first,
                         ", ".join(_short(ep.reason) for _, ep in ended))
            self._forget_idle(now)

    def current(self) -> dict[str, Rejection]:
        """sender -> its current :class:`Rejection` (of the reason it was refused for last),
        in sender order."""
        now = self._clock()
        with self._lock:
            self._forget_idle(now)
            latest: dict[str, _Episode] = {}
            for (sender, _), ep in self._episodes.items():   # least recently refused first
                latest[sender] = ep
            return {s: Rejection(s, e.reason, e.first_at, e.last_at, e.count, e.claimed, e.detail)
                    for s, e in sorted(latest.items())}

    def to_json(self) -> dict[str, dict[str, Any]]:
        """``{sender: Rejection.to_json}`` (the ``heartbeat_rejections`` field of ``/ready``
        and ``/v1/internal/route``), ``{}`` while nothing is refused."""
        now = self._clock()
        return {s: r.to_json(now) for s, r in self.current().items()}

    def __len__(self) -> int:
        """Episodes kept (sender and reason pairs)."""
        with self._lock:
            return len(self._episodes)

    def _forget_idle(self, now: float) -> None:
        """Drop the episodes refused no more for ``forget_after_s`` (under _lock)."""
        while self._episodes:
            (sender, reason), ep = next(iter(self._episodes.items()))
            if now - ep.last_at < self._forget_s:
                return
            del self._episodes[(sender, reason)]
            log.info("heartbeats from %s: none refused for %.0f s (%d refused, %s); forgotten",
                     _describe(sender, ep.claimed), now - ep.last_at, ep.count, _short(reason))


def unidentified_sender(remote_addr: Optional[str]) -> str:
    """The sender key of a refused heartbeat whose body names no instance."""
    return f"unidentified sender {remote_addr or 'unknown address'}"


def _describe(sender: str, claimed: bool) -> str:
    return f"a sender that claims to be {sender}" if claimed else sender


def _short(reason: RejectionReason) -> str:
    """The cause's first words (``token mismatch``), for lines that name it again."""
    return CAUSES[reason].split(":", 1)[0]
