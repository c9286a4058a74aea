"""Simulated xLLM engine: a two-tier prefix cache per DP rank (:mod:`.block_manager`) that
publishes KV events and serves snapshots on ZMQ exactly like a real engine (:mod:`.engine`,
§1, §2, §7), plus the ``kvsvc sim`` command (:mod:`.cli`)."""

from kvsvc.testbed.sim.block_manager import BlockManager, chain_hash
from kvsvc.testbed.sim.engine import NO_SEQ, SimEngine
from kvsvc.testbed.sim.results import ExecResult, RankStats

__all__ = ["BlockManager", "chain_hash", "ExecResult", "NO_SEQ", "RankStats", "SimEngine"]
