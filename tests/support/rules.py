"""Driving the recovery rules without sockets, as the stream thread does (kvsvc.streams.actions).

:class:`Carried` wraps a rule set (``SnapshotRecovery`` or ``HistoryRecovery``): each input is
called on the rules, its serving actions and log lines are carried out on the given
``ServingState`` (``kvsvc.streams.carrier.ActionCarrier``, refused batches included), and the
attempt actions (``RequestSnapshot``, ``RequestHistory``, ``AbandonSnapshot``) are returned, in
order (``NO_ACTIONS`` when there are none). Live inputs are counted on the serving state first,
as the subscriber counts them. With ``on_request`` every requested attempt is handed to it
(the stream thread opens it and reports ``on_snapshot_opened``). Anything else (``view``,
``attempt``, ``anchor``, ...) is read from the rules as it is.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from kvsvc.streams.actions import AbandonSnapshot
from kvsvc.streams.carrier import ActionCarrier
from kvsvc.streams.serving import ServingState

#: The rules' inputs (what returns actions); ``now`` is their last positional argument,
#: except ``on_live_opened`` (none).
INPUTS = frozenset({"start", "tick", "on_live_batch", "on_live_error", "on_live_opened",
                    "on_live_up", "on_live_down", "on_snapshot_opened", "on_snapshot_failed",
                    "on_snapshot_complete", "on_internal_error", "on_history_batch",
                    "on_apply_failed"})


class Carried:
    """A rule set whose inputs return only attempt actions (see the module docstring).

    :param rules: the rule set.
    :param serving: the serving state its actions are carried out on.
    :param on_request: called with each requested attempt (not with abandons).
    :param clock: the ``now`` for a refused batch's ``on_apply_failed`` when an input has none.
    """

    def __init__(self, rules: Any, serving: ServingState,
                 on_request: Optional[Callable[[Any], None]] = None,
                 clock: Callable[[], float] = lambda: 0.0) -> None:
        self.rules = rules
        self.serving = serving
        self._carrier = ActionCarrier(serving, rules)
        self._on_request = on_request
        self._clock = clock

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.rules, name)
        if name not in INPUTS:
            return value

        def fed(*args: Any, **kwargs: Any) -> tuple:
            if name == "on_live_batch":
                now = args[3] if len(args) > 3 else kwargs["now"]
                self.serving.note_live(now)
            else:
                if name == "on_live_error":
                    self.serving.note_live(None)
                now = args[-1] if args and isinstance(args[-1], float) else self._clock()
            actions = self._carrier.carry(value(*args, **kwargs), now)
            if self._on_request is not None:
                for action in actions:
                    if type(action) is not AbandonSnapshot:
                        self._on_request(action)
            return actions
        return fed
