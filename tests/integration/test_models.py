"""``GET /v1/models`` with ``--model`` unset (issue 13): the union of the backends' own lists,
fetched in the background by kvsvc.routing.models.ModelLister from small real HTTP servers on
127.0.0.1 registered in a real etcd; never fetched on the request path. Model-aware candidates
(§15): a request goes only to the instances listing its model, 404 ``model_not_found`` when
none does; ``GET /v1/models/{id}``."""

from __future__ import annotations

import logging
import time

import pytest

from kvsvc.http.extensions import EXTENSION
from kvsvc.clock import VirtualClock
from kvsvc.routing.models import ModelLister, ModelListerSettings, parse_model_list, union
from tests.support.upstreams import refused_name, upstreams
from tests.support.routes import NS, completion, register, running
from tests.support.util import wait_for


def listed(client) -> list[str]:
    r = client.get("/v1/models")
    assert r.status_code == 200
    body = r.get_json()
    assert body["object"] == "list"
    return [m["id"] for m in body["data"]]


def test_models_answers_the_union_of_the_backends_lists(etcd_server, etcd):
    with upstreams("json", "json", "json") as (a, b, broken), \
            running(etcd_server, model="") as app:
        a.models, b.models = ("llama", "qwen"), ("qwen", "mistral", "llama")
        broken.models_status = 404  # e.g. an engine that does not serve the OpenAI API
        for up in (a, b, broken):
            register(app, etcd, up.name)
        register(app, etcd, refused_name())
        client = app.test_client()
        wait_for(lambda: listed(client) == ["llama", "mistral", "qwen"], timeout_s=15.0,
                 what="the union of both lists")
        first = min(a.name, b.name)
        by_id = {m["id"]: m for m in client.get("/v1/models").get_json()["data"]}
        # Each model once, OpenAI's entry shape; created/owned_by of the first instance by name.
        assert set(by_id["qwen"]) == {"id", "object", "created", "owned_by"}
        assert by_id["qwen"]["object"] == "model"
        assert by_id["qwen"]["owned_by"] == first
        assert by_id["mistral"] == {"id": "mistral", "object": "model",
                                    "created": 1700000001, "owned_by": b.name}
        # Any model name is still accepted with --model unset.
        r = completion(client, {"model": "not-listed-anywhere", "prompt": [1]})
        assert r.status_code == 200
        # An instance that leaves the registry takes its models with it.
        etcd.delete(f"/{NS}/XLLM:DEFAULT:{b.name}")
        wait_for(lambda: listed(client) == ["llama", "qwen"], timeout_s=15.0,
                 what="mistral gone with its instance")


def test_models_are_never_fetched_on_the_request_path(etcd_server, etcd):
    """One backend holds its /v1/models answer: the list of the other appears once the
    lister's round is over, and /v1/models answers at once meanwhile and after."""
    with upstreams("json", "json") as (slow, quick), running(etcd_server, model="") as app:
        slow.models, slow.models_hang = ("held",), True
        quick.models = ("quick",)
        register(app, etcd, slow.name)
        register(app, etcd, quick.name)
        client = app.test_client()
        wait_for(lambda: listed(client) == ["quick"], timeout_s=15.0, what="quick's list")
        started = time.monotonic()
        for _ in range(20):
            assert listed(client) == ["quick"]
        assert time.monotonic() - started < 1.0  # one fetch of slow would take 2 s
        assert slow.models_served == 0


def test_models_with_model_set_are_the_flag(etcd_server):
    with running(etcd_server) as app:  # --model m1,m2
        # The lister runs all the same: its lists decide the candidates (§15).
        assert app.extensions[EXTENSION].models is not None
        assert listed(app.test_client()) == ["m1", "m2"]
        r = app.test_client().get("/v1/models/m2")
        assert (r.status_code, r.get_json()) == (200, {"id": "m2", "object": "model",
                                                       "created": 0, "owned_by": "kvsvc"})


def test_a_request_goes_only_to_instances_serving_its_model(etcd_server, etcd):
    """§15: each instance's own list decides; a model nobody lists is 404 model_not_found;
    an instance whose list is not known (its /v1/models fails) serves every model."""
    with upstreams("json", "json", "json") as (qwen, llama, unknown), \
            running(etcd_server, model="") as app:
        qwen.models, llama.models = ("Qwen/Qwen2.5-7B",), ("meta-llama/Llama-3.1-8B",)
        unknown.models_status = 404
        for up in (qwen, llama):
            register(app, etcd, up.name)
        client = app.test_client()
        lister = app.extensions[EXTENSION].models
        wait_for(lambda: len(lister.lists()) == 2, timeout_s=15.0, what="both lists known")
        for _ in range(4):
            r = completion(client, {"model": "meta-llama/Llama-3.1-8B", "prompt": [1, 2]})
            assert r.status_code == 200 and r.headers["x-kvsvc-prefill"] == llama.name
            r = completion(client, {"model": "Qwen/Qwen2.5-7B", "prompt": [1, 2]})
            assert r.status_code == 200 and r.headers["x-kvsvc-prefill"] == qwen.name
        r = completion(client, {"model": "mistral", "prompt": [1, 2]})
        assert r.status_code == 404
        err = r.get_json()["error"]
        assert (err["code"], err["param"], err["type"]) == (
            "model_not_found", "model", "invalid_request_error")
        assert "mistral" in err["message"]
        # /v1/internal/route says why the other instance is not a candidate.
        decision = client.post("/v1/internal/route", headers={"X-Internal-Token": "route-token"},
                               json={"token_ids": [1, 2], "model": "Qwen/Qwen2.5-7B"}).get_json()
        assert [c["name"] for c in decision["candidates"]] == [qwen.name]
        assert "does not serve model `Qwen/Qwen2.5-7B`" in decision["excluded"][llama.name]
        # An instance whose list is not known yet takes every model, mistral too.
        register(app, etcd, unknown.name)
        wait_for(lambda: unknown.models_served >= 1, timeout_s=15.0, what="a failed fetch")
        r = completion(client, {"model": "mistral", "prompt": [1, 2]})
        assert r.status_code == 200 and r.headers["x-kvsvc-prefill"] == unknown.name


def test_models_retrieve_by_id(etcd_server, etcd):
    with upstreams("json") as (up,), running(etcd_server, model="") as app:
        up.models = ("Qwen/Qwen2.5-7B",)
        register(app, etcd, up.name)
        client = app.test_client()
        wait_for(lambda: listed(client) == ["Qwen/Qwen2.5-7B"], timeout_s=15.0, what="listed")
        r = client.get("/v1/models/Qwen/Qwen2.5-7B")   # an id with a slash
        assert r.status_code == 200
        assert r.get_json()["id"] == "Qwen/Qwen2.5-7B" and r.get_json()["object"] == "model"
        r = client.get("/v1/models/nope")
        assert r.status_code == 404 and r.get_json()["error"]["code"] == "model_not_found"


def test_lister_keeps_a_failing_instances_last_list_and_warns_once(etcd_server, etcd,
                                                                   caplog):
    with upstreams("json") as (up,), running(etcd_server, model="") as app:
        up.models = ("m",)
        register(app, etcd, up.name)
        registry = app.extensions[EXTENSION].registry
        # The refresh rule runs on a virtual clock: a refresh is due only when the test moves
        # it by refresh_interval_s, never by waiting.
        clock = VirtualClock()
        lister = ModelLister(registry, ModelListerSettings(refresh_interval_s=60.0,
                                                           poll_interval_s=0.02), clock.now)
        lister.start()
        try:
            wait_for(lambda: [m.id for m in lister.models()] == ["m"], what="listed")
            assert lister.models()[0].instances == (up.name,)
            with caplog.at_level(logging.WARNING, logger="kvsvc.routing.models"):
                up.models_status = 500
                for _ in range(3):
                    served = up.models_served
                    clock.advance(60.0)
                    wait_for(lambda: up.models_served > served, what="a failed refresh")
                assert [m.id for m in lister.models()] == ["m"]
            warnings = [r.getMessage() for r in caplog.records
                        if r.name == "kvsvc.routing.models" and r.levelno == logging.WARNING]
            assert len(warnings) == 1
            assert up.name in warnings[0] and "HTTP 500" in warnings[0]
            assert "keeping its last list" in warnings[0]
            etcd.delete(f"/{NS}/XLLM:DEFAULT:{up.name}")
            wait_for(lambda: lister.models() == (), what="list dropped with the instance")
        finally:
            lister.close()


def test_parse_and_union_rules():
    assert parse_model_list({"object": "list", "data": [
        {"id": "a", "created": 5, "owned_by": "x"}, {"id": "a"}, {"id": "b", "created": True}]}
    ) == (("a", 5, "x"), ("b", 0, ""))
    for bad in ([], {"data": {}}, {"data": [{"id": 1}]}, {"data": [{"id": ""}]}, {"data": [1]}):
        with pytest.raises(ValueError):
            parse_model_list(bad)
    models = union({"h2:1": (("b", 2, "h2"), ("a", 2, "h2")), "h1:1": (("b", 1, "h1"),)})
    assert [(m.id, m.created, m.owned_by, m.instances) for m in models] == [
        ("a", 2, "h2", ("h2:1",)), ("b", 1, "h1", ("h1:1", "h2:1"))]
