"""kvsvc.clock: the real clock reads time.monotonic; the virtual one moves only when advanced,
never backwards, and wakes every registered waker once per advance."""

from __future__ import annotations

import time

import pytest

from kvsvc.clock import MONOTONIC, VirtualClock


def test_the_real_clock_is_time_monotonic_and_needs_no_wakers():
    before = time.monotonic()
    now = MONOTONIC.now()
    assert before <= now <= time.monotonic()
    MONOTONIC.add_waker(pytest.fail)      # never called: real time flows by itself
    MONOTONIC.remove_waker(pytest.fail)


def test_virtual_time_moves_only_when_advanced_and_wakes_each_waker_once():
    clock = VirtualClock(start=50.0)
    woken: list[str] = []
    a, b = (lambda: woken.append("a")), (lambda: woken.append("b"))
    clock.add_waker(a)
    clock.add_waker(b)
    assert clock.now() == clock.now() == 50.0
    assert clock.advance(2.5) == 52.5 == clock.now()
    assert woken == ["a", "b"]
    clock.remove_waker(a)
    clock.remove_waker(a)                 # unknown: ignored
    clock.advance(0)
    assert woken == ["a", "b", "b"] and clock.now() == 52.5


def test_virtual_time_never_goes_back():
    clock = VirtualClock()
    with pytest.raises(ValueError, match="cannot go back"):
        clock.advance(-0.001)
    assert clock.now() == 1000.0
