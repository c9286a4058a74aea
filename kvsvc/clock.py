"""Monotonic time as an object a component is given, so that its timer rules can run on a
virtual clock (tests, simulations) instead of waiting on real time.

- :class:`MonotonicClock` (:data:`MONOTONIC`, every component's default): ``time.monotonic()``.
- :class:`VirtualClock`: time that moves only by :meth:`VirtualClock.advance`, which wakes every
  thread that registered a waker, so a thread blocked until its next deadline re-reads the time.

Units: seconds, monotonic (meaningful only as differences; never a wall-clock date). A thread
that owns a clock registers its wake-up with :meth:`add_waker` while it runs and removes it
with :meth:`remove_waker` when it stops; a real clock needs no wake-ups and ignores both.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Protocol

#: A callable that interrupts one thread's blocking wait (it then reads the clock again).
Waker = Callable[[], None]


class Clock(Protocol):
    """What a component needs of time: ``now()`` and, for a clock that jumps, wake-ups."""

    def now(self) -> float:
        """Monotonic seconds."""
        ...

    def add_waker(self, waker: Waker) -> None:
        """Call ``waker`` whenever the time jumps (a no-op where time flows by itself)."""
        ...

    def remove_waker(self, waker: Waker) -> None:
        """Stop calling ``waker``; unknown wakers are ignored."""
        ...


class MonotonicClock:
    """The real clock: ``time.monotonic()``; time flows by itself, so nobody is woken."""

    def now(self) -> float:
        """``time.monotonic()``, seconds."""
        return time.monotonic()

    def add_waker(self, waker: Waker) -> None:
        """Nothing to do: a blocked thread's own timeout ends its wait."""

    def remove_waker(self, waker: Waker) -> None:
        """Nothing to do (see :meth:`add_waker`)."""


#: The real clock every component uses unless given another.
MONOTONIC: Clock = MonotonicClock()


class VirtualClock:
    """A clock that stands still until :meth:`advance` moves it.

    :param start: the first reading, seconds (any value: only differences mean something).

    Thread-safe: one thread (the test) advances it while the components' threads read it.
    A component's thread blocked in a poll until its next deadline is woken by every
    :meth:`advance` and re-reads the time, so a 10-minute resync interval takes no real time.
    """

    def __init__(self, start: float = 1000.0) -> None:
        self._lock = threading.Lock()
        self._now = float(start)
        self._wakers: list[Waker] = []

    def now(self) -> float:
        """The current virtual time, seconds."""
        return self._now

    def advance(self, seconds: float) -> float:
        """Move the time forward by ``seconds`` and wake every registered thread.

        :returns: the new time.
        :raises ValueError: ``seconds`` is negative (monotonic time never goes back).
        """
        if seconds < 0:
            raise ValueError(f"a monotonic clock cannot go back ({seconds} s)")
        with self._lock:
            self._now += seconds
            now = self._now
            wakers = list(self._wakers)
        for wake in wakers:
            wake()
        return now

    def add_waker(self, waker: Waker) -> None:
        """Call ``waker`` after each :meth:`advance`."""
        with self._lock:
            self._wakers.append(waker)

    def remove_waker(self, waker: Waker) -> None:
        """Stop calling ``waker``; unknown wakers are ignored."""
        with self._lock:
            if waker in self._wakers:
                self._wakers.remove(waker)
