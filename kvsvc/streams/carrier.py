"""Carrying the recovery rules' actions out on a stream's serving state (§6, §7h).

:class:`ActionCarrier` is the stream thread's half of the rules' contract
(:mod:`kvsvc.streams.actions`): it carries each serving action out on the
:class:`~kvsvc.streams.serving.ServingState` and each :class:`~kvsvc.streams.actions.Log` on
its logger, in order, and hands the attempt actions (open or close a replay attempt) back to
its caller in order, for the sockets (:mod:`kvsvc.streams.subscriber`) or a test.

An :class:`~kvsvc.streams.actions.ApplyEvents` the index refuses stops that index from serving
in the same lock hold; the actions after it are dropped and the rules' ``on_apply_failed``
gives what to do instead (carried the same way). Pure memory and logging, no socket.
"""

from __future__ import annotations

import logging
from typing import Protocol, Sequence

from kvsvc.errors import StreamError
from kvsvc.streams.actions import (
    NO_ACTIONS,
    AbandonSnapshot,
    Action,
    ApplyEvents,
    AttemptAction,
    Log,
    RequestHistory,
    RequestSnapshot,
)
from kvsvc.streams.serving import ServingState


ATTEMPT_TYPES = (RequestSnapshot, RequestHistory, AbandonSnapshot)


class ApplyFailureSink(Protocol):
    """What the carrier tells when an :class:`ApplyEvents` was refused (the rules)."""

    def on_apply_failed(self, action: ApplyEvents, error: StreamError,
                        now: float) -> tuple[Action, ...]:
        """``action`` (the very object the rules returned) was refused with ``error``;
        returns what to do instead."""


class ActionCarrier:
    """Carries one stream's rules' actions out on its serving state (module docstring).

    :param serving: the stream's serving state.
    :param rules: the stream's rule set (told of refused batches).
    """

    def __init__(self, serving: ServingState, rules: ApplyFailureSink) -> None:
        self._serving = serving
        self._rules = rules

    def carry(self, actions: Sequence[Action], now: float) -> tuple[AttemptAction, ...]:
        """Carry out the serving actions and logs of ``actions`` in order.

        :param now: monotonic seconds (for ``on_apply_failed``).
        :returns: the attempt actions, in order (:data:`~kvsvc.streams.actions.NO_ACTIONS`
            when there are none).
        """
        if not actions:
            return NO_ACTIONS
        serving = self._serving
        first = actions[0]
        if len(actions) == 1 and type(first) is ApplyEvents:
            # The hot path: one in-order live batch.
            failure = serving.apply(first)
            if failure is None:
                return NO_ACTIONS
            return self.carry(self._rules.on_apply_failed(first, failure, now), now)
        attempts: list[AttemptAction] = []
        for action in actions:
            if isinstance(action, ApplyEvents):
                failure = serving.apply(action)
                if failure is not None:
                    attempts.extend(self.carry(self._rules.on_apply_failed(action, failure, now),
                                               now))
                    break
            elif isinstance(action, ATTEMPT_TYPES):
                attempts.append(action)
            elif isinstance(action, Log):
                logging.getLogger(action.logger).log(action.level, action.msg, *action.args)
            else:
                serving.perform(action)
        return tuple(attempts) if attempts else NO_ACTIONS
