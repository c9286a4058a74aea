"""kvsvc.lifecycle.BackgroundThread: the one start/close contract of every background thread.

start() returns once _setup has returned and raises LifecycleError (naming the thread) when the
setup fails or does not finish in time, with _teardown still run; close() signals, wakes (its
_sleep at once, a blocking wait through _wake) and joins, raises LifecycleError naming the thread
when the join times out, and is idempotent; a close before start does nothing. Every blocking
condition here is an Event the test holds, never a sleep or a mock of the thread."""

from __future__ import annotations

import threading
import time

import pytest

from kvsvc.errors import LifecycleError
from kvsvc.lifecycle import BackgroundThread


class Probe(BackgroundThread):
    """Records what ran on which thread; every phase can be held by an Event."""

    def __init__(self, name: str = "kvsvc-test-probe") -> None:
        super().__init__(name)
        self.setup_gate = threading.Event()
        self.setup_gate.set()
        self.setup_error: Exception | None = None
        self.setup_done = threading.Event()
        self.loop_entered = threading.Event()
        self.teardown_done = threading.Event()
        self.threads: dict[str, str] = {}

    def _setup(self) -> None:
        self.threads["setup"] = threading.current_thread().name
        assert self.setup_gate.wait(10)
        if self.setup_error is not None:
            raise self.setup_error
        self.setup_done.set()

    def _loop(self) -> None:
        self.threads["loop"] = threading.current_thread().name
        self.loop_entered.set()
        while not self.stopping:
            self._sleep(60.0)

    def _teardown(self) -> None:
        self.threads["teardown"] = threading.current_thread().name
        self.teardown_done.set()


class Stubborn(Probe):
    """A loop blocked on an Event of its own that close() cannot wake (no _wake)."""

    def __init__(self) -> None:
        super().__init__("kvsvc-test-stubborn")
        self.release = threading.Event()

    def _loop(self) -> None:
        self.loop_entered.set()
        assert self.release.wait(30)


class Woken(Probe):
    """A loop blocked on an Event of its own that its _wake sets."""

    def __init__(self) -> None:
        super().__init__("kvsvc-test-woken")
        self.poke = threading.Event()

    def _wake(self) -> None:
        self.poke.set()

    def _loop(self) -> None:
        self.loop_entered.set()
        while not self.stopping:
            self.poke.wait(60.0)
            self.poke.clear()


def test_start_returns_once_setup_returned_and_everything_runs_on_the_thread():
    probe = Probe()
    probe.setup_gate.clear()
    returned = threading.Event()
    starter = threading.Thread(target=lambda: (probe.start(), returned.set()), name="starter")
    starter.start()
    try:
        assert not returned.wait(0.2), "start() returned while _setup was still running"
        assert probe.running and not probe.setup_done.is_set()
        probe.setup_gate.set()
        assert returned.wait(5)
        assert probe.setup_done.is_set() and probe.running and probe.started
    finally:
        starter.join(5)
        probe.close()
    assert probe.threads == dict.fromkeys(("setup", "loop", "teardown"), "kvsvc-test-probe")
    assert not probe.running and not probe.started


def test_setup_failure_raises_naming_the_thread_and_teardown_still_ran():
    probe = Probe()
    probe.setup_error = OSError("port taken")
    with pytest.raises(LifecycleError, match=r"^kvsvc-test-probe: could not start: port taken$") \
            as err:
        probe.start()
    assert isinstance(err.value.__cause__, OSError)
    assert probe.teardown_done.is_set() and "loop" not in probe.threads
    assert not probe.running and not probe.started
    probe.close()                    # nothing left to close
    probe.setup_error = None
    probe.start()                    # and it can be started again
    probe.close()


def test_setup_not_done_in_time_raises_and_the_thread_ends_once_setup_does():
    probe = Probe()
    probe.setup_gate.clear()
    with pytest.raises(LifecycleError, match=r"^kvsvc-test-probe: not running after 0.2 s$"):
        probe.start(timeout_s=0.2)
    probe.setup_gate.set()           # setup finishes late: the loop sees the stop at once
    assert probe.teardown_done.wait(5)
    probe.close()
    assert not probe.running


def test_close_wakes_a_sleeping_loop_promptly():
    probe = Probe()
    probe.start()
    assert probe.loop_entered.wait(5)
    t0 = time.monotonic()
    probe.close()                    # the loop sleeps 60 s at a time
    assert time.monotonic() - t0 < 1.0
    assert probe.teardown_done.is_set() and not probe.running


def test_close_calls_wake_for_a_wait_of_the_threads_own():
    woken = Woken()
    woken.start()
    assert woken.loop_entered.wait(5)
    t0 = time.monotonic()
    woken.close()
    assert time.monotonic() - t0 < 1.0 and not woken.running


def test_close_timeout_raises_naming_the_thread_and_a_later_close_joins_it():
    stubborn = Stubborn()
    stubborn.start()
    assert stubborn.loop_entered.wait(5)
    with pytest.raises(LifecycleError, match=r"^kvsvc-test-stubborn: did not stop within 0.2 s$"):
        stubborn.close(timeout_s=0.2)
    assert stubborn.running and stubborn.started and stubborn.stopping
    with pytest.raises(LifecycleError, match="already started"):
        stubborn.start()
    assert not stubborn.teardown_done.is_set()
    stubborn.release.set()
    stubborn.close()
    assert stubborn.teardown_done.is_set() and not stubborn.running and not stubborn.started


def test_start_twice_raises_close_before_start_and_twice_are_no_ops():
    probe = Probe()
    probe.close()                    # never started
    assert not probe.started and not probe.teardown_done.is_set()
    probe.start()
    with pytest.raises(LifecycleError, match=r"^kvsvc-test-probe: already started$"):
        probe.start()
    probe.close()
    probe.close()
    assert not probe.running


class OneShot(Probe):
    restartable = False


def test_restart_after_close_only_when_restartable():
    probe = Probe()
    probe.start()
    probe.close()
    probe.loop_entered.clear()
    probe.start()                    # restartable by default: a second run
    assert probe.loop_entered.wait(5)
    probe.close()
    once = OneShot("kvsvc-test-once")
    once.start()
    once.close()
    with pytest.raises(LifecycleError, match=r"^kvsvc-test-once: already started$"):
        once.start()
    assert not once.running


def test_a_loop_that_raises_is_logged_and_torn_down(caplog):
    class Crashing(Probe):
        def _loop(self) -> None:
            raise RuntimeError("bug")

    crashing = Crashing()
    crashing.start()
    assert crashing.teardown_done.wait(5)
    crashing.close()
    assert "kvsvc-test-probe: crashed" in caplog.text and "RuntimeError: bug" in caplog.text
