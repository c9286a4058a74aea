"""The unit tier (``make test-fast``): rules and objects without sockets, checked in a few
seconds. A unit test that binds or connects a socket (plain or ZMQ) or sleeps fails at once,
naming what it did; such a test belongs in ``tests/integration/``.

A sleep is a wait on real time: any ``time.sleep`` called from test code, and any of
:data:`MAX_YIELD_S` or more from the code under test. Shorter ones from kvsvc are GIL yields
(:mod:`kvsvc.streams.pacing` sleeps 20 us between build slices), not waits, and pass."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import pytest
import zmq


#: The longest sleep of the code under test that is a GIL yield, not a wait (seconds).
MAX_YIELD_S = 0.001
_TESTS = str(Path(__file__).resolve().parents[1])


class UnitTierViolation(AssertionError):
    """A unit test used a socket or slept."""


def _refuse(what: str):
    def refused(*args, **kwargs):
        raise UnitTierViolation(f"unit tier: {what} is not allowed in tests/unit "
                                "(move the test to tests/integration)")
    return refused


_GUARDED = [(socket.socket, name, f"socket.{name}()")
            for name in ("bind", "connect", "connect_ex", "sendto")]
_GUARDED += [(zmq.Socket, name, f"zmq.Socket.{name}()") for name in ("bind", "connect")]


def _make_sleep(real_sleep):
    def sleep(seconds: float) -> None:
        caller = sys._getframe(1).f_code.co_filename
        if seconds >= MAX_YIELD_S or caller.startswith(_TESTS):
            _refuse(f"time.sleep({seconds}) from {caller}")()
        real_sleep(seconds)
    return sleep


@pytest.fixture(autouse=True)
def no_sockets_no_sleeps():
    """Replace the socket entry points and ``time.sleep`` for the test, restoring them before
    any other fixture's teardown (the root conftest's thread-leak wait may sleep)."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in _GUARDED]
    saved.append((time, "sleep", time.sleep))
    for owner, name, what in _GUARDED:
        setattr(owner, name, _refuse(what))
    time.sleep = _make_sleep(time.sleep)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
