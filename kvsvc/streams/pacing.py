"""Pacing of CPU-bound snapshot builds on a stream thread: how long a build runs between two
GIL yields, how long a yield sleeps, and the thread's timer slack while it builds.

A build is pure CPU under the GIL, and a request thread that wants the GIL waits until the
holder drops it (voluntarily, or forced after the interpreter's switch interval, and with many
runnable stream threads the forced hand-over often goes to another stream thread). So every
:data:`BUILD_SLICE_S` of decode/index work the building thread sleeps :data:`BUILD_YIELD_S`,
which hands the GIL to a waiting request thread; while it builds, the thread's timer slack is
:data:`BUILD_TIMER_SLACK_NS` (:func:`set_timer_slack`), so those sleeps end on time.

Against a *CPU-bound* thread (a request loop that never blocks, or request threads of a
saturated worker) each yield costs much more than its 20 us: the taker keeps the GIL until the
interpreter's switch interval (5 ms by default) forces it to drop it, so the builder gets one
0.3 ms slice per ~5 ms. A history rebuild (§7h: 10,000 small reply messages) measured ~10x its
quiet time that way (bench/history_load.py, benchmark 12; the reply's pyzmq receives, which
release the GIL too, are a small part of it: too short for a waiter to take the GIL). So a
history reply's next slice after a late yield is longer (:func:`reply_slice_s`, at most
:data:`REPLY_SLICE_MAX_S`). :class:`SwitchIntervalLease` (lowering the process's switch interval
while a reply is received) was measured too and is off (:data:`REPLY_SWITCH_INTERVAL_S`).
"""

from __future__ import annotations

import ctypes
import sys
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

#: Longest stretch (seconds) of decode/index work between two GIL yields while building.
BUILD_SLICE_S = 0.0003
#: The yield: a sleep this long releases the GIL so that a request thread waiting for it takes
#: it. Shorter sleeps let this thread take the GIL back before the waiter has woken up.
BUILD_YIELD_S = 0.00002
#: The building thread's timer slack (ns) while it builds: the kernel may end a sleep this
#: much late (Linux's default of 50 us would make each yield cost several times its length).
BUILD_TIMER_SLACK_NS = 1


#: A history reply's build slice after a yield that came back late (§7h): the next slice is the
#: yield's duration times :data:`REPLY_SLICE_SHARE`, between :data:`BUILD_SLICE_S` and this
#: (seconds). A late yield means a CPU-bound thread held the GIL for its whole switch interval;
#: working longer before the next yield gives the reply about 1 ms per 5 ms instead of 0.3 ms,
#: while a request thread that waits for the GIL waits at most this long.
REPLY_SLICE_MAX_S = 0.001
#: See :data:`REPLY_SLICE_MAX_S`.
REPLY_SLICE_SHARE = 0.25
#: The interpreter's switch interval (seconds) while a history reply is received, through
#: :class:`SwitchIntervalLease`; ``None`` (the default) leaves it alone. Measured and not used:
#: 0.5 ms made a 10,000-batch rebuild against a spinning thread 3.5-5x faster, but the other
#: streams' query p99 under HTTP load 11-13x idle (bench/history_load.py, benchmark 12): a
#: waiting request thread queues behind every thread the shorter interval preempts.
REPLY_SWITCH_INTERVAL_S: Optional[float] = None


def reply_slice_s(yield_s: float) -> float:
    """The next build slice (seconds) of a history reply after a yield that took ``yield_s``
    seconds: ``yield_s * REPLY_SLICE_SHARE`` within ``[BUILD_SLICE_S, REPLY_SLICE_MAX_S]``. A
    prompt yield (tens of us: no thread, or one that blocked again soon) keeps the 0.3 ms slice;
    one that took a whole 5 ms switch interval gives the next slice ~1 ms."""
    return min(REPLY_SLICE_MAX_S, max(BUILD_SLICE_S, yield_s * REPLY_SLICE_SHARE))


class SwitchIntervalLease:
    """Lowers ``sys.setswitchinterval`` while one reply is received, and gives it back.

    The interval is process-wide, but the lease keeps no shared state: :meth:`engage` (called
    every receive turn) lowers it to ``target`` when it is above, remembering the value it
    replaced; :meth:`release` puts that value back only if the interval is still ``target``
    (nobody changed it since). Two replies at once: the second finds it lowered and owns
    nothing; if the first ends first and restores it, the second's next turn lowers it again
    and owns it. So the interval is never left lowered once every lease is released, and never
    raised above what the process had set. Never lowers an interval already at or below
    ``target``.

    :param target: seconds; ``None``: the lease does nothing.
    """

    __slots__ = ("_target", "_saved")

    def __init__(self, target: Optional[float]) -> None:
        self._target = target
        self._saved: Optional[float] = None

    @property
    def engaged(self) -> bool:
        """This lease lowered the interval and has not given it back."""
        return self._saved is not None

    def engage(self) -> None:
        """Lower the interval to ``target`` if it is above it (cheap when already done)."""
        target = self._target
        if target is None:
            return
        current = sys.getswitchinterval()
        if current > target * 1.0001:
            # (Owned already and above target again: someone set it since; that is the value
            # to give back.)
            self._saved = current
            sys.setswitchinterval(target)

    def release(self) -> None:
        """Give back the interval this lease replaced, unless someone changed it since;
        idempotent."""
        saved = self._saved
        if saved is None:
            return
        self._saved = None
        target = self._target
        assert target is not None
        if abs(sys.getswitchinterval() - target) <= target * 0.01:
            sys.setswitchinterval(saved)


def _load_prctl() -> Optional[Callable[..., int]]:
    """libc's ``prctl`` on Linux, else ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover - a Linux without a usable libc
        return None


_PRCTL = _load_prctl()
_PR_SET_TIMERSLACK, _PR_GET_TIMERSLACK = 29, 30


def set_timer_slack(ns: int) -> Optional[int]:
    """Set the calling thread's timer slack (Linux ``PR_SET_TIMERSLACK``: how late the kernel
    may end its sleeps and timed waits, to batch wake-ups).

    :param ns: the new slack in nanoseconds, >= 1 (0 would mean "the default").
    :returns: the slack it had, to set back; ``None`` where the call is not available or
        failed (then nothing changed).
    """
    if _PRCTL is None:
        return None
    previous = _PRCTL(_PR_GET_TIMERSLACK, ctypes.c_ulong(0), ctypes.c_ulong(0),
                      ctypes.c_ulong(0), ctypes.c_ulong(0))
    if previous <= 0 or _PRCTL(_PR_SET_TIMERSLACK, ctypes.c_ulong(ns), ctypes.c_ulong(0),
                                ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
        return None
    return previous



@contextmanager
def build_timer_slack() -> Iterator[None]:
    """Run the block with the thread's timer slack at :data:`BUILD_TIMER_SLACK_NS` (a build's
    GIL yields then end on time) and set the previous slack back afterwards, also when the
    block raises; a no-op where :func:`set_timer_slack` is not available."""
    slack = set_timer_slack(BUILD_TIMER_SLACK_NS)
    try:
        yield
    finally:
        if slack is not None:
            set_timer_slack(slack)
