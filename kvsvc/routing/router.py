"""The router (§11): one prompt's decision from in-process state, and the forwarding of an OpenAI
request to the chosen prefill (P) instance.

A :class:`Router` is built once per service (:class:`kvsvc.service.Service`) from its parts,
all passed to the constructor: the policy, the prompt tokenizer, the proxy, the in-flight
ledger the proxy counts in, the served model names and read-only views of the registry and the
directory.

The decision path (:meth:`Router.decide`) reads only ``registry.snapshot()``,
``directory.stream_ids()``/``identity()``/``query()`` and the ledger's snapshot: no ZMQ, etcd or
network I/O (§11); an unsynchronized stream only lowers its instance's hit ratio. Forwarding
(:meth:`Router.forward`) sends the request to the ranked P candidates through the proxy; in P/D
mode the body gains ``"routing": {"prefill_name": P, "decode_name": D}`` (xLLM's field) and the
request is counted in flight against its D too.

Errors: :class:`~kvsvc.errors.NoCandidate` when no instance can serve (:meth:`Router.forward`),
:class:`~kvsvc.errors.UpstreamTimeout` / :class:`~kvsvc.errors.UpstreamUnreachable` from the
proxy. Nothing here knows HTTP statuses or Flask.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Protocol, Sequence

from kvsvc.clock import Clock
from kvsvc.cluster.model import RegistrySnapshot
from kvsvc.errors import NoCandidate, UnknownModel
from kvsvc.index.overlay import PromptKeys
from kvsvc.routing.in_flight import InFlight
from kvsvc.routing.models import serving_model
from kvsvc.routing.observer import RequestInfo
from kvsvc.routing.policy import Decision, Policy, candidate_pools
from kvsvc.routing.prompt import TokenSource
from kvsvc.routing.proxy import ClientWatch, Proxy, UpstreamReply, upstream_headers
from kvsvc.streams.state import StreamId, StreamMatch

if TYPE_CHECKING:
    from kvsvc.routing.xllm_dispatch import XllmDispatcher

log = logging.getLogger(__name__)

#: What the router sees without a registry: no instance, so no candidate.
EMPTY_SNAPSHOT = RegistrySnapshot(MappingProxyType({}), False, False, 0)


#: The OpenAI paths an xLLM engine takes natively over ``XllmAPIService`` (§13 "Dispatch"):
#: its two generation methods. Other paths (embeddings) are relayed over its HTTP API.
NATIVE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})

class RegistryView(Protocol):
    """What the router reads of the instance registry (:class:`kvsvc.cluster.registry.Registry`):
    its snapshots, and the clock that dated their loads (:mod:`kvsvc.clock`)."""

    clock: Clock

    def snapshot(self) -> RegistrySnapshot:
        """The current immutable snapshot (lock-free)."""
        ...


class ModelListsView(Protocol):
    """What the router reads of the instances' model lists
    (:class:`kvsvc.routing.models.ModelLister`)."""

    def lists(self) -> Mapping[str, frozenset[str]]:
        """Instance -> its known model ids (absent: not known yet)."""
        ...


class DirectoryView(Protocol):
    """What the router reads of the KV-event directory (:class:`kvsvc.directory.Directory`)."""

    def stream_ids(self) -> list[StreamId]:
        """Every stream's id."""
        ...

    def identity(self, stream_id: StreamId) -> Optional[str]:
        """The identity the stream was added for (``None``: static stream)."""
        ...

    def query(self, token_ids: Sequence[int]) -> list[StreamMatch]:
        """One match per stream for the prompt (§10)."""
        ...

    def query_prompt(self, token_ids: Sequence[int]) -> tuple[list[StreamMatch], PromptKeys]:
        """:meth:`query` and the prompt's content keys (§14, §16: recorded at dispatch)."""
        ...


@dataclass(frozen=True)
class Routed:
    """An OpenAI request forwarded to an upstream that sent its response head.

    :ivar decision: the policy's decision the request was routed by.
    :ivar reply: the upstream's head and body; the caller must relay or close the body (that
        releases the request's in-flight count).
    :ivar decode: the D named in the body (``host:port``), ``""`` without a D.
    """

    decision: Decision
    reply: UpstreamReply
    decode: str


class Router:
    """Policy, tokenizer, proxy, in-flight ledger and served model names of one service.
    Thread-safe: request threads call every method concurrently.

    :param policy: the §11 policy.
    :param tokens: prompt tokenization.
    :param proxy: upstream forwarding; it must count in ``in_flight``.
    :param in_flight: the ledger the proxy counts in and the policy reads.
    :param models: served model names (empty: any name accepted), see :func:`served_models`.
    :param registry: the instance registry, ``None`` without ``--etcd_addr`` (no candidate).
    :param directory: the KV-event directory, ``None`` with the index disabled (hit ratio 0).
    :raises ValueError: ``proxy`` counts in another ledger (or in none).
    """

    def __init__(self, policy: Policy, tokens: TokenSource, proxy: Proxy, in_flight: InFlight,
                 models: tuple[str, ...], registry: Optional[RegistryView],
                 directory: Optional[DirectoryView]) -> None:
        if proxy.in_flight is not in_flight:
            raise ValueError("the proxy must count in the router's in-flight ledger")
        self.policy = policy
        self.tokens = tokens
        self.proxy = proxy
        self.in_flight = in_flight
        self.models = models
        self._registry = registry
        self._directory = directory
        self._attempt_ids = itertools.count(1)
        #: Native dispatch to xLLM engines (§13, ``--xllm_dispatch native`` or ``auto``: the
        #: instances it :meth:`~kvsvc.routing.xllm_dispatch.XllmDispatcher.handles`), set by
        #: the service; ``None``: every instance is relayed over HTTP.
        self.xllm: Optional["XllmDispatcher"] = None
        #: Instances that are no candidate besides the policy's own rules -> why (the P/D
        #: instances whose link failed, §13, :class:`~kvsvc.cluster.pd_links.PdLinks`); set by
        #: the service, ``None``: none.
        self.excluded: Optional[Callable[[], Mapping[str, str]]] = None
        #: The instances' model lists (§15), set by the service once its lister is built;
        #: ``None``: every instance serves every model.
        self.model_lists: Optional[ModelListsView] = None

    def decide(self, token_ids: Optional[Sequence[int]],
               model: Optional[str] = None) -> Decision:
        """Route one prompt with in-process state only (§11); sends nothing.

        Model-aware candidates (§15): with ``model`` and the instances' model lists
        (:attr:`model_lists`), the instances whose known list lacks it are not candidates
        (in the decision's ``excluded`` with why; :func:`~kvsvc.routing.models.serving_model`).

        Stream identities are read before the query, so a stream replaced in between is judged
        by its predecessor's identity (counts 0) rather than lending its hits to a new
        incarnation. The in-flight snapshot is read after the registry's, so a load report
        received in between makes requests look unreported (counted) rather than reported twice.

        :param token_ids: the prompt's tokens, ``None`` when unknown (hit ratio 0).
        :param model: the request's ``model``; ``None``: not checked.
        :returns: the decision; ``prefill`` is ``None`` (with ``reason``) when no instance can
            serve.
        :raises UnknownModel: instances are registered and none of them serves ``model``
            (404 ``model_not_found``).
        """
        snapshot = self._view()
        lists = self.model_lists
        if model is not None and lists is not None and snapshot.instances:
            snapshot, removed = serving_model(snapshot, lists.lists(), model)
            if removed and not snapshot.instances:
                raise UnknownModel(f"The model `{model}` does not exist: no instance serves "
                                   "it (their /v1/models lists).")
            if removed:
                decision = self._choose(token_ids, snapshot)
                return dataclasses.replace(decision, excluded=MappingProxyType(
                    dict(sorted({**decision.excluded, **removed}.items()))))
        return self._choose(token_ids, snapshot)

    def _choose(self, token_ids: Optional[Sequence[int]],
                snapshot: RegistrySnapshot) -> Decision:
        """The policy's decision on ``snapshot`` (:meth:`decide`)."""
        in_flight = self.in_flight.snapshot()
        now = self._now()   # load ages are judged at this instant (§11)
        directory = self._directory
        if directory is None:
            return self.policy.choose(token_ids, snapshot, None, None, in_flight, now=now)
        identities = {sid: directory.identity(sid) for sid in directory.stream_ids()}
        matches, prompt = directory.query_prompt(token_ids if token_ids is not None else [])
        decision = self.policy.choose(token_ids, snapshot, matches, identities, in_flight,
                                      now=now)
        if not token_ids or decision.prefill is None:
            return decision
        # The keys travel with the decision to the dispatch (§14, §16): hashed once.
        return dataclasses.replace(decision, prompt=prompt)

    def _now(self) -> float:
        """Monotonic seconds on the registry's clock, which dated the loads (§11)."""
        return self._registry.clock.now() if self._registry is not None else time.monotonic()

    def _view(self) -> RegistrySnapshot:
        """The registry's snapshot without the instances :attr:`excluded` names (the same
        object when it names none)."""
        snapshot = self._registry.snapshot() if self._registry is not None else EMPTY_SNAPSHOT
        excluded = self.excluded() if self.excluded is not None else None
        if not excluded:
            return snapshot
        return dataclasses.replace(snapshot, instances=MappingProxyType(
            {n: i for n, i in snapshot.instances.items() if n not in excluded}))

    def prefill_candidates(self) -> tuple[str, ...]:
        """The instances a request could be routed to now (the P side of
        :func:`~kvsvc.routing.policy.candidate_pools`, by name; ``()`` without a registry):
        what ``/ready`` requires one of (§15)."""
        if self._registry is None:
            return ()
        pools = candidate_pools(self._view(), self._now(), self.policy.max_load_age_s)
        return tuple(i.name for i in pools.prefill)

    def not_candidates(self) -> dict[str, str]:
        """Every registered instance that is not a candidate now -> why (§11), by the rule
        :meth:`decide` uses (:func:`~kvsvc.routing.policy.candidate_pools`); ``{}`` without a
        registry."""
        if self._registry is None:
            return {}
        out = dict(candidate_pools(self._view(), self._now(),
                                   self.policy.max_load_age_s).excluded)
        if self.excluded is not None:
            out.update(self.excluded())
        return out

    def forward(self, decision: Decision, path: str, body: bytes, doc: dict[str, Any],
                client_headers: Sequence[tuple[str, str]],
                client: Optional[ClientWatch] = None,
                token_ids: Optional[Sequence[int]] = None) -> Routed:
        """Send one validated OpenAI request as ``decision`` says: to its best P, once more to
        the next one when the first fails before the response head; an instance the
        decision chose a DP rank on gets it in ``X-data-parallel-rank`` (§15). Without a D the client's
        bytes go up unchanged; with one, ``doc`` plus ``routing`` (naming the P tried). Each
        attempt is described to the proxy's request observer (§12) by a
        :class:`~kvsvc.routing.observer.RequestInfo` naming its P, its D, the prompt's tokens
        and the decision's predicted prefill time on that P.

        :param decision: :meth:`decide`'s answer for the request's prompt.
        :param path: request path with query string, e.g. ``/v1/completions?x=1``.
        :param body: the client's raw body.
        :param doc: ``body`` parsed (a JSON object).
        :param client_headers: the client's headers as (name, value) pairs (filtered here,
            :func:`~kvsvc.routing.proxy.upstream_headers`).
        :param client: the client's connection, watched while the upstream prepares its head
            (§15); ``None``: not watched.
        :param token_ids: the prompt's tokens (``None``: unknown); needed when the P is an
            xLLM engine dispatched natively (:attr:`xllm`, §13), which takes the request over
            ``XllmAPIService`` instead of HTTP.
            Only generation paths (:data:`NATIVE_PATHS`) go natively: an xLLM engine answers
            anything else (``/v1/embeddings``) over its HTTP API, which the proxy relays.
        :raises NoCandidate: ``decision`` has no P.
        :raises ClientGone: the client went away before the head (the upstream cancelled).
        :raises BadRequest: native xLLM dispatch without token ids, or the engine refused.
        :raises UpstreamTimeout: every attempt failed, the last one by a timeout.
        :raises UpstreamUnreachable: every attempt failed, the last one refused or reset.
        """
        if decision.prefill is None:
            raise NoCandidate(decision.reason)
        decode = decision.decode.name if decision.decode is not None else ""
        if (self.xllm is not None and path.split("?", 1)[0] in NATIVE_PATHS
                and self.xllm.handles(decision.prefill)):
            x_request_id = next((v for k, v in client_headers if k.lower() == "x-request-id"),
                                "")
            return Routed(decision, self.xllm.forward(decision, path, doc, token_ids,
                                                      x_request_id, client), decode)

        def body_for(target: str) -> bytes:
            if not decode:
                return body
            return json.dumps({**doc, "routing": {"prefill_name": target,
                                                  "decode_name": decode}}).encode()

        given = doc.get("model")
        model = given if isinstance(given, str) else ""

        def info_for(target: str) -> RequestInfo:
            return RequestInfo(next(self._attempt_ids), target, decode, decision.input_tokens,
                               decision.prefill_estimates_ms.get(target, 0.0),
                               decision.policy, decision=decision,
                               streamed=doc.get("stream") is True,
                               dp_rank=decision.prefill_ranks.get(target), model=model)

        reply = self.proxy.forward([i.name for i in decision.prefill_ranking], path, body_for,
                                   upstream_headers(client_headers),
                                   companions=(decode,) if decode else (), info_for=info_for,
                                   dp_ranks=decision.prefill_ranks, client=client)
        return Routed(decision, reply, decode)

    def close(self) -> None:
        """Close the proxy's pooled upstream connections (and the native dispatcher's).
        Idempotent."""
        self.proxy.close()
        if self.xllm is not None:
            self.xllm.close()


def served_models(value: str) -> tuple[str, ...]:
    """``--model`` -> distinct names in order (``"a, b"`` -> ``("a", "b")``)."""
    return tuple(dict.fromkeys(n.strip() for n in value.split(",") if n.strip()))
