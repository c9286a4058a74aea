"""Simulated engine (xLLM, vLLM or SGLang flavor): a two-tier prefix cache per DP rank
(:mod:`.block_manager`) that publishes KV events and answers replay requests on ZMQ exactly
like a real engine (:mod:`.engine`, :mod:`.flavors`; §1, §2, §7, §7h), plus the ``kvsvc sim``
command (:mod:`.cli`)."""

from kvsvc.testbed.sim.block_manager import BlockManager, chain_hash
from kvsvc.testbed.sim.engine import NO_SEQ, SimEngine
from kvsvc.testbed.sim.flavors import Flavor
from kvsvc.testbed.sim.results import ExecResult, RankStats

__all__ = ["BlockManager", "chain_hash", "ExecResult", "Flavor", "NO_SEQ", "RankStats",
           "SimEngine"]
