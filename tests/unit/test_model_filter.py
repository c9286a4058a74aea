"""§15 model-aware candidates as a pure function (kvsvc.routing.models.serving_model): an
instance is a candidate for a model when its known list holds it or its list is not known."""

from __future__ import annotations

from types import MappingProxyType

from kvsvc.cluster.model import Instance, InstanceState, InstanceType, RegistrySnapshot
from kvsvc.routing.models import serving_model


def inst(name: str) -> Instance:
    return Instance(name=name, type=InstanceType.DEFAULT, role=InstanceType.DEFAULT,
                    incarnation_id=None, register_ts_ms=1, dp_size=1, backend_type="vllm",
                    rpc_address=None, state=InstanceState.ACTIVE, load=None)


SNAP = RegistrySnapshot(MappingProxyType({n: inst(n) for n in ("a:1", "b:1", "c:1")}),
                        True, False, 7)
LISTS = {"a:1": frozenset({"qwen", "qwen-lora"}), "b:1": frozenset({"llama"})}


def test_only_instances_listing_the_model_or_not_known_stay():
    kept, removed = serving_model(SNAP, LISTS, "qwen")
    assert sorted(kept.instances) == ["a:1", "c:1"]   # c:1's list is not known: every model
    assert removed == {"b:1": "does not serve model `qwen` (its /v1/models)"}
    assert (kept.fresh, kept.is_master, kept.generation) == (True, False, 7)


def test_nothing_removed_returns_the_same_snapshot():
    kept, removed = serving_model(SNAP, {}, "anything")
    assert kept is SNAP and removed == {}


def test_a_model_nobody_lists_leaves_only_unknown_lists():
    kept, removed = serving_model(SNAP, LISTS, "mistral")
    assert list(kept.instances) == ["c:1"] and set(removed) == {"a:1", "b:1"}
    kept, _ = serving_model(SNAP, {**LISTS, "c:1": frozenset({"x"})}, "mistral")
    assert not kept.instances
