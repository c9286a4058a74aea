"""Pacing of CPU-bound snapshot builds on a stream thread: how long a build runs between two
GIL yields, how long a yield sleeps, and the thread's timer slack while it builds.

A build is pure CPU under the GIL, and a request thread that wants the GIL waits until the
holder drops it (voluntarily, or forced after the interpreter's switch interval, and with many
runnable stream threads the forced hand-over often goes to another stream thread). So every
:data:`BUILD_SLICE_S` of decode/index work the building thread sleeps :data:`BUILD_YIELD_S`,
which hands the GIL to a waiting request thread; while it builds, the thread's timer slack is
:data:`BUILD_TIMER_SLACK_NS` (:func:`set_timer_slack`), so those sleeps end on time.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Callable, Optional

#: Longest stretch (seconds) of decode/index work between two GIL yields while building.
BUILD_SLICE_S = 0.0003
#: The yield: a sleep this long releases the GIL so that a request thread waiting for it takes
#: it. Shorter sleeps let this thread take the GIL back before the waiter has woken up.
BUILD_YIELD_S = 0.00002
#: The building thread's timer slack (ns) while it builds: the kernel may end a sleep this
#: much late (Linux's default of 50 us would make each yield cost several times its length).
BUILD_TIMER_SLACK_NS = 1


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

