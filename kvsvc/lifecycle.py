"""One contract for every background thread of kvsvc (STYLE: a thread owns what it uses).

A :class:`BackgroundThread` owns one daemon thread and everything that thread opens. Its life:

- :meth:`BackgroundThread.start` starts the thread and returns once the thread's
  :meth:`~BackgroundThread._setup` has returned (sockets connected, clients built), i.e. once the
  thread really runs. A setup that raises, or that does not finish within ``timeout_s``, makes
  ``start`` raise :class:`~kvsvc.errors.LifecycleError` naming the thread; nothing stays running.
- The thread runs :meth:`~BackgroundThread._loop` until :meth:`~BackgroundThread.close` is called
  (``_loop`` returns or waits with :meth:`~BackgroundThread._sleep`, which ends at once on close).
  An exception escaping ``_loop`` is logged with the thread's name and ends the thread.
- :meth:`~BackgroundThread._teardown` always runs on the thread itself, last, so whatever it
  opened (ZMQ sockets, etcd clients, leases) is closed by the thread that used it.
- :meth:`BackgroundThread.close` signals the thread (:meth:`~BackgroundThread._wake` interrupts a
  blocking wait), joins it within ``timeout_s`` and raises :class:`~kvsvc.errors.LifecycleError`
  when it is still alive then (logged once as an error too). Idempotent; a close before start
  does nothing.

Nothing starts in a constructor, so objects can be built before gunicorn forks and started after
(``post_worker_init``, :mod:`kvsvc.server`).
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

from kvsvc.errors import LifecycleError

log = logging.getLogger(__name__)

#: Default bound of :meth:`BackgroundThread.start` and :meth:`BackgroundThread.close`, seconds.
DEFAULT_TIMEOUT_S = 5.0


class BackgroundThread:
    """Owner of one daemon thread named ``name`` (see the module docstring for the contract).

    Subclasses override :meth:`_loop` and, where needed, :meth:`_setup`, :meth:`_teardown` and
    :meth:`_wake`. They read :attr:`stopping` or call :meth:`_sleep` to notice :meth:`close`.

    :param name: the thread's name (``kvsvc-...``), used in every lifecycle message.
    :cvar restartable: whether :meth:`start` may be called again after :meth:`close`. False for
        owners whose state outlives the thread and would be stale on a second run (a stream's
        serving index and sequence bookkeeping): :meth:`start` then raises.
    """

    restartable: bool = True

    def __init__(self, name: str) -> None:
        self.thread_name = name
        self._stop_event = threading.Event()
        self._started = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._setup_error: Optional[BaseException] = None
        self._ran = False

    # -- the contract ---------------------------------------------------------------------

    def start(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Start the thread; return once its :meth:`_setup` has returned.

        :param timeout_s: how long to wait for the thread to run, seconds.
        :raises LifecycleError: already started (or started once and not
            :attr:`restartable`), setup raised, or not running within ``timeout_s`` (the
            thread is then signalled and joined).
        """
        if self._thread is not None or (self._ran and not self.restartable):
            raise LifecycleError(f"{self.thread_name}: already started")
        self._ran = True
        self._stop_event.clear()
        self._started.clear()
        self._setup_error = None
        thread = threading.Thread(target=self._bootstrap, name=self.thread_name, daemon=True)
        self._thread = thread
        thread.start()
        if not self._started.wait(timeout_s):
            try:
                self.close(timeout_s)
            except LifecycleError:
                pass  # the start failure below is the one to report
            raise LifecycleError(f"{self.thread_name}: not running after {timeout_s:g} s")
        if self._setup_error is not None:
            thread.join(timeout_s)
            if not thread.is_alive():  # a hung teardown keeps the thread: no second one
                self._thread = None
            raise LifecycleError(f"{self.thread_name}: could not start: "
                                 f"{self._setup_error}") from self._setup_error

    def close(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Signal the thread, wake it and join it; idempotent.

        :param timeout_s: join bound, seconds.
        :raises LifecycleError: the thread is still alive after ``timeout_s`` (what it owns is
            then closed by the thread whenever it ends).
        """
        self._stop_event.set()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return
        self._wake()
        thread.join(timeout_s)
        if thread.is_alive():
            log.error("%s: did not stop within %.1f s", self.thread_name, timeout_s)
            raise LifecycleError(f"{self.thread_name}: did not stop within {timeout_s:g} s")
        self._thread = None

    @property
    def running(self) -> bool:
        """True while the thread is alive."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    @property
    def started(self) -> bool:
        """True from :meth:`start` until a :meth:`close` (or a failed start) has joined the
        thread, whether or not it is still alive; :meth:`start` raises while it is True. An
        owner reads it to tell a component that was started from one that never was."""
        return self._thread is not None

    @property
    def stopping(self) -> bool:
        """True once :meth:`close` has been called (the loop should return)."""
        return self._stop_event.is_set()

    # -- for subclasses ----------------------------------------------------------------------

    def _setup(self) -> None:
        """Open what the thread owns; runs on the thread before :meth:`start` returns. An
        exception makes :meth:`start` raise (and :meth:`_teardown` still runs)."""

    def _loop(self) -> None:
        """The thread's work until :attr:`stopping`; must return soon after :meth:`close`."""
        raise NotImplementedError

    def _teardown(self) -> None:
        """Close what the thread owns; runs on the thread, last, whatever happened."""

    def _wake(self) -> None:
        """Interrupt a blocking wait of the thread (called by :meth:`close` after the stop
        signal). :meth:`_sleep` needs nothing here; a thread blocked in a poll, on a queue or
        on an ``Event`` of its own (a timer that other threads also wake) does: set that event
        or put a sentinel on that queue here."""

    def _sleep(self, seconds: float) -> bool:
        """Wait up to ``seconds``; True when :meth:`close` was called meanwhile."""
        return self._stop_event.wait(max(0.0, seconds))

    # -- the thread --------------------------------------------------------------------------

    def _bootstrap(self) -> None:
        try:
            try:
                self._setup()
            except BaseException as exc:  # noqa: BLE001 - handed to start() to raise
                self._setup_error = exc
                return
            finally:
                self._started.set()
            try:
                self._loop()
            except Exception:  # noqa: BLE001 - a thread must not die silently
                log.exception("%s: crashed", self.thread_name)
        finally:
            try:
                self._teardown()
            except Exception:  # noqa: BLE001 - the thread is ending anyway
                log.exception("%s: teardown failed", self.thread_name)
