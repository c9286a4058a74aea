"""The backends' own model lists (§11, §15): model-aware candidates, and ``GET /v1/models``
with ``--model`` unset.

§15: a request's ``model`` is served only by the instances whose model list holds it; an
instance whose list is not known yet counts as serving every model
(:func:`serving_model`, applied by :meth:`kvsvc.routing.router.Router.decide` before the
policy); when no registered instance serves it the request is answered 404 ``model_not_found``
(:class:`~kvsvc.errors.UnknownModel`). With ``--model`` empty kvsvc serves whatever the engines
serve, and answers ``/v1/models`` as xllm-service does: the union of the model lists of the
registered instances. §9 registrations carry no model names, so :class:`ModelLister`, a
:class:`~kvsvc.lifecycle.BackgroundThread` owned by the service
(:class:`kvsvc.service.Service`), asks each instance itself:

- every :attr:`ModelListerSettings.poll_interval_s` it reads the registry's snapshot
  (lock-free) and fetches ``GET http://<instance>/v1/models`` of every schedulable (not
  ``SUSPECT``, §9) instance it has no list of yet, and of every one whose list is older than
  :attr:`ModelListerSettings.refresh_interval_s`; at most
  :attr:`ModelListerSettings.max_parallel` at once, each bounded by its connect and read
  timeouts, so a dead instance delays no other;
- an instance that fails a refresh (refused, timed out, not OpenAI's list shape) keeps its last
  list until it leaves the registry or stops being schedulable; one WARNING when it starts
  failing, one INFO when it answers again;
- :meth:`ModelLister.models` is what the request path reads: the union, each model id once,
  sorted by id, as an immutable tuple swapped in whole (one reference read, no I/O, no lock).
  A model's ``created`` and ``owned_by`` are those of the first instance (by name) listing it.
  :meth:`ModelLister.lists` is each instance's own list (instances whose list is known: they
  answered once with at least one model; an empty list tells nothing and counts as not
  known), swapped in whole the same way. A failing instance keeps its last known list.

Nothing here knows Flask; ``requests`` errors stay inside :meth:`ModelLister._fetch` (a failed
fetch is a logged state, never raised).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping, Optional, Protocol

import requests
import requests.adapters

from kvsvc.clock import MONOTONIC
from kvsvc.cluster.model import InstanceState, RegistrySnapshot
from kvsvc.lifecycle import BackgroundThread

log = logging.getLogger(__name__)

#: The path of an OpenAI-compatible engine's model list.
MODELS_PATH = "/v1/models"


@dataclass(frozen=True)
class ModelListerSettings:
    """Timings of :class:`ModelLister`, seconds.

    :ivar refresh_interval_s: age after which an instance's list is fetched again (> 0).
    :ivar poll_interval_s: how often the registry is read for instances without a list (> 0).
    :ivar connect_timeout_s: TCP connect bound of one fetch (> 0).
    :ivar read_timeout_s: bound of the wait for the answer's bytes of one fetch (> 0).
    :ivar max_parallel: fetches at once (>= 1).
    """

    refresh_interval_s: float = 5.0
    poll_interval_s: float = 0.5
    connect_timeout_s: float = 1.0
    read_timeout_s: float = 2.0
    max_parallel: int = 8


@dataclass(frozen=True)
class BackendModel:
    """One model some instance serves.

    :ivar id: the model name clients send as ``model``.
    :ivar created: the first listing instance's ``created`` (seconds since the epoch; 0 when it
        gave none).
    :ivar owned_by: the first listing instance's ``owned_by`` (``""`` when it gave none).
    :ivar instances: the instances listing it, by name.
    """

    id: str
    created: int
    owned_by: str
    instances: tuple[str, ...]


@dataclass(frozen=True)
class _Listed:
    """An instance's last good list and the state of its fetches."""

    models: tuple[tuple[str, int, str], ...]  # (id, created, owned_by), the instance's order
    fetched_at: float                         # the clock's seconds of the last attempt
    failing: bool                             # the last attempt failed
    known: bool = True                        # it answered once: ``models`` is its list


def parse_model_list(doc: object) -> tuple[tuple[str, int, str], ...]:
    """OpenAI's list ``{"object": "list", "data": [{"id": str, "created"?, "owned_by"?}, ...]}``
    -> ``(id, created, owned_by)`` per entry, each id once, in the list's order.

    :raises ValueError: not that shape (no ``data`` list, an entry without a string ``id``).
    """
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        raise ValueError("not an OpenAI model list (no \"data\" list)")
    out: dict[str, tuple[str, int, str]] = {}
    for entry in doc["data"]:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str) \
                or not entry["id"]:
            raise ValueError("a model entry without a string \"id\"")
        created = entry.get("created")
        owned_by = entry.get("owned_by")
        out.setdefault(entry["id"], (
            entry["id"], created if type(created) is int else 0,
            owned_by if isinstance(owned_by, str) else ""))
    return tuple(out.values())


def serving_model(snapshot: RegistrySnapshot, lists: Mapping[str, frozenset[str]],
                  model: str) -> tuple[RegistrySnapshot, dict[str, str]]:
    """The model-aware candidates rule (§15): ``snapshot`` without the instances whose known
    model list lacks ``model``; an instance absent from ``lists`` (its list not known yet)
    stays (it counts as serving every model).

    :param snapshot: the registry's snapshot.
    :param lists: :meth:`ModelLister.lists`.
    :param model: the request's ``model``.
    :returns: the filtered snapshot (the same object when nothing is removed) and every
        removed instance -> why (``"does not serve model `m` (its /v1/models)"``).
    """
    removed = {name: f"does not serve model `{model}` (its {MODELS_PATH})"
               for name in snapshot.instances
               if name in lists and model not in lists[name]}
    if not removed:
        return snapshot, {}
    kept = {n: i for n, i in snapshot.instances.items() if n not in removed}
    return RegistrySnapshot(MappingProxyType(kept), snapshot.fresh, snapshot.is_master,
                            snapshot.generation), removed


def union(lists: dict[str, tuple[tuple[str, int, str], ...]]) -> tuple[BackendModel, ...]:
    """Instance name -> its list (:func:`parse_model_list`) -> each model once, sorted by id;
    ``created``/``owned_by`` from the first instance by name."""
    first: dict[str, tuple[int, str]] = {}
    holders: dict[str, list[str]] = {}
    for name in sorted(lists):
        for model_id, created, owned_by in lists[name]:
            first.setdefault(model_id, (created, owned_by))
            holders.setdefault(model_id, []).append(name)
    return tuple(BackendModel(m, first[m][0], first[m][1], tuple(holders[m]))
                 for m in sorted(first))


class SnapshotSource(Protocol):
    """What the lister reads of the registry (:class:`kvsvc.cluster.registry.Registry`)."""

    def snapshot(self) -> RegistrySnapshot:
        """The current immutable snapshot (lock-free)."""
        ...


class ModelLister(BackgroundThread):
    """Keeps the union of the schedulable instances' own model lists (module docstring).

    :param registry: the instance registry (its snapshot is read, lock-free).
    :param settings: timings.
    :param clock: monotonic seconds of the refresh rule (due after ``refresh_interval_s``):
        the service's clock (:mod:`kvsvc.clock`).
    """

    def __init__(self, registry: "SnapshotSource",
                 settings: ModelListerSettings = ModelListerSettings(),
                 clock: Callable[[], float] = MONOTONIC.now) -> None:
        super().__init__("kvsvc-models")
        self._registry = registry
        self.settings = settings
        self._clock = clock
        self._listed: dict[str, _Listed] = {}  # the thread's own
        self._models: tuple[BackendModel, ...] = ()
        self._lists: Mapping[str, frozenset[str]] = MappingProxyType({})
        self._session: Optional[requests.Session] = None
        self._pool: Optional[ThreadPoolExecutor] = None

    def models(self) -> tuple[BackendModel, ...]:
        """The union of the instances' lists, each model once, sorted by id (empty before the
        first answer). One reference read: safe from any thread."""
        return self._models

    def lists(self) -> Mapping[str, frozenset[str]]:
        """Instance ``host:port`` -> the model ids it lists, for the instances whose list is
        known (absent: not known yet, serves every model, §15). One reference read: safe from
        any thread."""
        return self._lists

    # -- the thread ----------------------------------------------------------------------------

    def _setup(self) -> None:
        session = requests.Session()
        session.trust_env = False  # never an environment HTTP proxy, never .netrc
        adapter = requests.adapters.HTTPAdapter(pool_maxsize=self.settings.max_parallel,
                                                max_retries=0)
        session.mount("http://", adapter)
        self._session = session
        self._pool = ThreadPoolExecutor(self.settings.max_parallel,
                                        thread_name_prefix="kvsvc-models-fetch")

    def _loop(self) -> None:
        while not self.stopping:
            self.refresh()
            if self._sleep(self.settings.poll_interval_s):
                return

    def _teardown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self._session is not None:
            self._session.close()

    def refresh(self, now: Optional[float] = None) -> None:
        """One round (on the thread): forget instances that left, fetch those due, swap in the
        new union when it changed."""
        now = self._clock() if now is None else now
        names = sorted(name for name, inst in self._registry.snapshot().instances.items()
                       if inst.state is not InstanceState.SUSPECT)
        for gone in set(self._listed) - set(names):
            del self._listed[gone]
        due = [n for n in names if n not in self._listed
               or now - self._listed[n].fetched_at >= self.settings.refresh_interval_s]
        if due:
            assert self._pool is not None, "refresh() runs on the started thread"
            for name, got in zip(due, self._pool.map(self._fetch, due), strict=True):
                self._record(name, got, now)
        lists = {n: frozenset(m[0] for m in entry.models)
                 for n, entry in sorted(self._listed.items()) if entry.known}
        if lists != dict(self._lists):
            self._lists = MappingProxyType(lists)
        models = union({n: entry.models for n, entry in self._listed.items()})
        if models != self._models:
            self._models = models
            log.info("backend models: %s", ", ".join(m.id for m in models) or "none")

    def _record(self, name: str, got: tuple[Optional[tuple[tuple[str, int, str], ...]], str],
                now: float) -> None:
        listed, error = got
        before = self._listed.get(name)
        if listed is not None:
            if before is not None and before.failing:
                log.info("instance %s: %s answers again", name, MODELS_PATH)
            # An empty list tells nothing about what the instance serves: it stays a
            # candidate for every model (as one whose list is not known yet, §15).
            self._listed[name] = _Listed(listed, now, False, bool(listed))
            return
        if before is None or not before.failing:
            log.warning("instance %s: %s failed (%s); %s", name, MODELS_PATH, error,
                        "keeping its last list" if before is not None and before.models
                        else "none of its models listed")
        self._listed[name] = _Listed(before.models if before is not None else (), now, True,
                                     before.known if before is not None else False)

    def _fetch(self, name: str) -> tuple[Optional[tuple[tuple[str, int, str], ...]], str]:
        """``GET http://<name>/v1/models`` -> (its list, "") or (None, why it failed)."""
        assert self._session is not None, "fetches run on the started thread's pool"
        try:
            r = self._session.get(f"http://{name}{MODELS_PATH}", allow_redirects=False,
                                  timeout=(self.settings.connect_timeout_s,
                                           self.settings.read_timeout_s))
            if r.status_code != 200:
                return None, f"HTTP {r.status_code}"
            return parse_model_list(r.json()), ""
        except requests.exceptions.RequestException as exc:
            return None, type(exc).__name__
        except ValueError as exc:  # not JSON, or not the list shape
            return None, f"not an OpenAI model list: {exc}"
