"""The simulated engine's vLLM and SGLang flavors on real loopback sockets: their live wire
forms (§2) decode with kvsvc's own decoder to the engine's true blocks, and their replay
endpoint answers history with the §7h shape (every kept batch from ``start_seq`` on as
``[b"", seq, payload]``, payload byte-equal to the live one, then the end marker; a rolled
buffer says nothing; no replay endpoint never answers)."""

from __future__ import annotations

import ormsgpack
import pytest
import zmq

from kvsvc.events import DEVICE, HOST, AllBlocksCleared, BlockRemoved, BlockStored
from kvsvc.streams.decoder import decode_batch
from kvsvc.testbed.sim import Flavor, SimEngine
from kvsvc.testbed.sim.flavors import int_form, vllm_raw_hash
from kvsvc.testbed.sim.registration import EtcdRegistration, Load
from tests.support.util import wait_for
from tests.support.sim import (BS, blocks, consecutive_ports, dealer, hashes,
                                        nothing_within, recv, subscriber)

END = [b"", b"\xff" * 8, b""]
VLLM_STORED_KEYS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                    "lora_id", "medium", "lora_name"]


def make(zmq_ctx, flavor: str, **kw) -> SimEngine:
    kw.setdefault("dp_size", 1)
    n = kw["dp_size"]
    eng = SimEngine(f"sim-{flavor}", consecutive_ports(n), consecutive_ports(n), block_size=BS,
                    device_blocks=4, host_blocks=4, topic=b"kv", context=zmq_ctx,
                    flavor=flavor, **kw)
    eng.start()
    return eng


def history(d: zmq.Socket, start: int) -> list[list[bytes]]:
    """One §7h request; every reply message up to and including the end marker."""
    d.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    while True:
        f = recv(d)
        out.append(f)
        if f == END:
            return out


def offload_workload(eng: SimEngine) -> list[list[bytes]]:
    """Three batches on rank 0 (4 Device blocks): stores, then an offload of the root chain's
    leaf to Host (tokenless CPU replica + GPU removal), then a reuse."""
    sub = subscriber(eng._given_ctx, eng, 0)
    try:
        assert eng.execute(blocks(0, 10), 0).seq == 0
        assert eng.execute(blocks(20, 30, 40), 0).seq == 1   # 5 blocks > 4: one offload
        assert eng.execute(blocks(50), 0).seq == 2
        return [recv(sub) for _ in range(3)]
    finally:
        sub.close()


def test_vllm_map_form_and_hash_forms(zmq_ctx):
    eng = make(zmq_ctx, "vllm")
    try:
        live = offload_workload(eng)
        assert [f[1] for f in live] == [s.to_bytes(8, "big") for s in range(3)]
        raw = [ormsgpack.unpackb(f[2]) for f in live]
        assert all(list(b) == ["ts", "events", "data_parallel_rank"] for b in raw)
        assert all(b["data_parallel_rank"] == 0 and isinstance(b["ts"], float) for b in raw)
        first = raw[0]["events"]
        assert [list(e) for e in first] == [VLLM_STORED_KEYS]
        assert first[0]["medium"] == "GPU" and first[0]["block_hashes"] == hashes(blocks(0, 10))
        assert first[0]["parent_block_hash"] is None
        evs = raw[1]["events"]
        assert [(e["type"], e["medium"]) for e in evs] == [
            ("BlockStored", "CPU"), ("BlockRemoved", "GPU"), ("BlockStored", "GPU")]
        offloaded = evs[1]["block_hashes"][0]
        assert isinstance(offloaded, int)
        cpu_hash = evs[0]["block_hashes"][0]
        # The CPU tier names the same block by its raw bytes; §2's int form meets the GPU one.
        assert isinstance(cpu_hash, bytes) and len(cpu_hash) == 16
        assert cpu_hash == vllm_raw_hash(offloaded) and int_form(cpu_hash) == offloaded
        assert evs[0]["token_ids"] == [] and evs[0]["parent_block_hash"] is None
        assert list(evs[1]) == ["type", "block_hashes", "medium"]
        # kvsvc's decoder takes every batch; Device hashes as the engine's own ids.
        decoded = [decode_batch(f[2], 0) for f in live]
        stored = decoded[0].events[0]
        assert isinstance(stored, BlockStored) and stored.tier == DEVICE
        assert list(stored.block_hashes) == hashes(blocks(0, 10))
        assert list(stored.token_ids) == blocks(0, 10)
        cpu, removed, gpu = decoded[1].events
        assert isinstance(cpu, BlockStored) and cpu.tier == HOST and len(cpu.token_ids) == 0
        assert list(cpu.block_hashes) == [cpu_hash]     # kept as bytes (§2; §7h normalises)
        assert isinstance(removed, BlockRemoved) and removed.tier == DEVICE
        assert list(gpu.block_hashes) == hashes(blocks(20, 30, 40))[:len(gpu.block_hashes)]
        assert eng.resident(0)[offloaded] == HOST
    finally:
        eng.close()


def test_vllm_history_reply_shape_and_dropped_batches_kept(zmq_ctx):
    eng = make(zmq_ctx, "vllm")
    d = dealer(zmq_ctx, eng, 0)
    try:
        live = offload_workload(eng)
        eng.drop_next(0, 1)
        assert eng.execute(blocks(60), 0).seq == 3           # lost on the wire, kept for replay
        reply = history(d, 1)
        assert [len(f) for f in reply] == [3, 3, 3, 3]
        assert [int.from_bytes(f[1], "big") for f in reply[:-1]] == [1, 2, 3]
        assert all(f[0] == b"" for f in reply)
        assert [f[2] for f in reply[:2]] == [f[2] for f in live[1:]]   # byte-equal to live
        assert decode_batch(reply[2][2], 0).events[-1].token_ids.tolist() == blocks(60)
        assert reply[-1] == END
        assert history(d, 4) == [END]                        # nothing from 4 on yet
        assert [int.from_bytes(f[1], "big") for f in history(d, 0)[:-1]] == [0, 1, 2, 3]
        assert eng.stats(0).snapshots == 3
    finally:
        d.close()
        eng.close()


def test_rolled_buffer_says_nothing_about_lost_history(zmq_ctx):
    eng = make(zmq_ctx, "vllm", buffer_steps=3)
    d = dealer(zmq_ctx, eng, 0)
    try:
        for i in range(5):
            assert eng.execute(blocks(100 * i + 1), 0).seq == i
        reply = history(d, 0)
        assert [int.from_bytes(f[1], "big") for f in reply[:-1]] == [2, 3, 4]
        assert reply[-1] == END
    finally:
        d.close()
        eng.close()


def test_restart_forgets_history(zmq_ctx):
    eng = make(zmq_ctx, "vllm")
    try:
        eng.execute(blocks(1), 0)
        eng.execute(blocks(2), 0)
        eng.restart()
        assert eng.execute(blocks(3), 0).seq == 0
        d = dealer(zmq_ctx, eng, 0)
        try:
            reply = history(d, 0)
            assert len(reply) == 2 and reply[0][1] == b"\0" * 8
            assert decode_batch(reply[0][2], 0).events[0].token_ids.tolist() == blocks(3)
        finally:
            d.close()
    finally:
        eng.close()


def test_no_replay_endpoint_never_answers(zmq_ctx):
    eng = make(zmq_ctx, "vllm", replay_endpoint=False)
    try:
        # Nothing is bound on the replay port: this process can bind it itself.
        probe = zmq_ctx.socket(zmq.ROUTER)
        probe.setsockopt(zmq.LINGER, 0)
        probe.bind(eng.endpoints(0)[1])
        probe.close()
        d = dealer(zmq_ctx, eng, 0)
        eng.execute(blocks(1), 0)
        d.send_multipart([b"", (0).to_bytes(8, "big")])
        assert nothing_within(d, 300)
        d.close()
    finally:
        eng.close()


def test_vllm_dp_ranks_use_port_plus_rank_and_carry_their_rank(zmq_ctx):
    eng = make(zmq_ctx, "vllm", dp_size=2)
    try:
        ev0, rp0 = eng.endpoints(0)
        ev1, rp1 = eng.endpoints(1)
        assert int(ev1.rsplit(":", 1)[1]) == int(ev0.rsplit(":", 1)[1]) + 1
        assert int(rp1.rsplit(":", 1)[1]) == int(rp0.rsplit(":", 1)[1]) + 1
        sub = subscriber(zmq_ctx, eng, 1)
        d = dealer(zmq_ctx, eng, 1)
        assert eng.execute(blocks(7), 1).seq == 0
        f = recv(sub)
        assert ormsgpack.unpackb(f[2])["data_parallel_rank"] == 1
        assert decode_batch(f[2], 1).dp_rank == 1
        assert history(d, 0)[0][2] == f[2]
        sub.close()
        d.close()
    finally:
        eng.close()


def test_vllm_array_form(zmq_ctx):
    eng = make(zmq_ctx, "vllm", vllm_array=True)
    try:
        live = offload_workload(eng)
        ts, evs, rank = ormsgpack.unpackb(live[1][2])
        assert rank == 0 and isinstance(ts, float)
        assert [e[0] for e in evs] == ["BlockStored", "BlockRemoved", "BlockStored"]
        assert evs[0][6] == "CPU" and isinstance(evs[0][1][0], bytes) and evs[1][2] == "GPU"
        assert len(evs[0]) == 7 and len(evs[1]) == 3
        cpu, removed, _ = decode_batch(live[1][2], 0).events
        assert cpu.tier == HOST and int_form(cpu.block_hashes[0]) == removed.block_hashes[0]
    finally:
        eng.close()


def test_sglang_form_signed_hashes_and_history(zmq_ctx):
    eng = make(zmq_ctx, "sglang")
    d = dealer(zmq_ctx, eng, 0)
    try:
        live = offload_workload(eng)
        ts, evs, rank = ormsgpack.unpackb(live[0][2])
        assert rank == 0 and isinstance(ts, float)
        h = hashes(blocks(0, 10))
        signed = [x - (1 << 64) if x >= 1 << 63 else x for x in h]
        assert evs == [["BlockStored", signed, None, blocks(0, 10), BS, None, "GPU"]]
        # §2: integers normalised to u64, so the decoder sees the engine's own ids.
        assert list(decode_batch(live[0][2], 0).events[0].block_hashes) == h
        cpu, removed, _ = decode_batch(live[1][2], 0).events
        assert cpu.tier == HOST and cpu.block_hashes == removed.block_hashes
        reply = history(d, 0)
        assert [f[2] for f in reply[:-1]] == [f[2] for f in live] and reply[-1] == END
    finally:
        d.close()
        eng.close()


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
def test_clear_cache_publishes_all_blocks_cleared(zmq_ctx, flavor):
    eng = make(zmq_ctx, flavor)
    try:
        sub = subscriber(zmq_ctx, eng, 0)
        eng.execute(blocks(1, 2), 0)
        assert eng.clear_cache(0) == 1
        assert eng.resident(0) == {}
        recv(sub)
        f = recv(sub)
        assert f[1] == (1).to_bytes(8, "big")
        assert decode_batch(f[2], 0).events == [AllBlocksCleared(None)]
        sub.close()
    finally:
        eng.close()


def test_xllm_flavor_is_unchanged(zmq_ctx):
    eng = make(zmq_ctx, "xllm")
    try:
        assert eng.flavor is Flavor.XLLM
        sub = subscriber(zmq_ctx, eng, 0)
        eng.execute(blocks(1), 0)
        ts, evs, rank = ormsgpack.unpackb(recv(sub)[2])
        assert evs[0]["medium"] == "gpu" and rank == 0
        sub.close()
    finally:
        eng.close()


def test_registration_as_a_vllm_instance():
    reg = EtcdRegistration("127.0.0.1:2379", "127.0.0.1:8000", 2, lambda: Load(0, 0.0),
                           backend_type=Flavor.VLLM.backend_type)
    value = reg.value()
    assert (value["backend_type"], value["type"], value["dp_size"]) == ("vllm", 0, 2)
    assert reg.key == "XLLM:DEFAULT:127.0.0.1:8000"


def test_sim_cli_flavor_sglang_replays_history(zmq_ctx):
    """``kvsvc sim --flavor sglang --buffer-steps 3``: rank 1 answers history in SGLang's
    form, the last 3 of its batches."""
    import argparse
    import threading

    from kvsvc.testbed.sim import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    port = consecutive_ports(2)
    replay = consecutive_ports(2)
    args = parser.parse_args([
        "--port", str(port), "--dp", "2", "--event-port-offset", "0",
        "--replay-port-offset", str(replay - port), "--device-blocks", "64",
        "--flavor", "sglang", "--buffer-steps", "3", "--trace", "conversation",
        "--requests", "12", "--interval-ms", "0", "--log-level", "warning"])
    assert (args.flavor, args.buffer_steps, args.no_replay) == ("sglang", 3, False)
    stop = threading.Event()
    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(cli.run(args, stop)), name="sim-cli-test")
    t.start()
    try:
        d = zmq_ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(f"tcp://127.0.0.1:{replay + 1}")
        # 12 requests round robin: rank 1 publishes up to 6 batches; 3 are kept.
        seqs: list[int] = []

        def kept() -> bool:
            reply = history(d, 0)
            seqs[:] = [int.from_bytes(f[1], "big") for f in reply[:-1]]
            for f in reply[:-1]:
                ts, evs, rank = ormsgpack.unpackb(f[2])
                assert rank == 1 and evs and all(isinstance(e, list) for e in evs)
            return len(seqs) == 3 and seqs[-1] >= 3

        wait_for(kept, 10.0, interval_s=0.05, what="history of dp1")
        assert seqs == [seqs[0], seqs[0] + 1, seqs[0] + 2]
        d.close()
    finally:
        stop.set()
        t.join(10.0)
    assert not t.is_alive() and result == [0]


@pytest.mark.parametrize("flavor", ["xllm", "sglang"])
def test_the_vllm_array_form_is_refused_for_another_flavor(flavor):
    with pytest.raises(ValueError, match=f"needs flavor vllm, got {flavor}"):
        SimEngine("sim-x", 1, 2, flavor=flavor, vllm_array=True)
