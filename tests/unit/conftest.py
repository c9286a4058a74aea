"""The unit tier (``make test-fast``): rules and objects without sockets, checked in a few
seconds. A unit test that binds or connects a socket (plain or ZMQ) or sleeps fails at once,
naming what it did; such a test belongs in ``tests/integration/``."""

from __future__ import annotations

import socket
import time

import pytest
import zmq


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
_GUARDED += [(time, "sleep", "time.sleep()")]


@pytest.fixture(autouse=True)
def no_sockets_no_sleeps():
    """Replace the socket entry points and ``time.sleep`` for the test, restoring them before
    any other fixture's teardown (the root conftest's thread-leak wait may sleep)."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in _GUARDED]
    for owner, name, what in _GUARDED:
        setattr(owner, name, _refuse(what))
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
