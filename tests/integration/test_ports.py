"""Testbed port picking (kvsvc.testbed.ports): picked ports, and every §9 port derived from
an instance port, are outside the ephemeral range (where an outgoing connection may hold
them), free, and never promised twice; reserved ports count as safe."""

from __future__ import annotations

import random
import socket

import pytest

from kvsvc.errors import LifecycleError
from kvsvc.testbed.ports import (EphemeralPorts, ephemeral_ports, free_instance_port,
                                 free_port_run, instance_ports, parse_port_list)
from kvsvc.testbed.sim.cli import ephemeral_hint

LINUX = EphemeralPorts(32768, 60999)


def test_reserved_port_list_and_proc_files(tmp_path):
    assert parse_port_list("") == frozenset()
    assert parse_port_list("8000,38000-38002\n") == {8000, 38000, 38001, 38002}
    (tmp_path / "range").write_text("40000\t50000\n")
    (tmp_path / "reserved").write_text("45000\n")
    eph = ephemeral_ports(str(tmp_path / "range"), str(tmp_path / "reserved"))
    assert (eph.low, eph.high) == (40000, 50000)
    assert eph.collides(40000) and not eph.collides(45000) and not eph.collides(39999)
    assert ephemeral_ports(str(tmp_path / "missing"), str(tmp_path / "missing")) == LINUX


def test_instance_ports_and_their_derived_ports_are_outside_the_range():
    taken: set[int] = set()
    rng = random.Random(3)
    for dp in (1, 2, 4):
        p = free_instance_port(dp, 10000, 30000, rng=rng, avoid=taken, ephemeral=LINUX)
        ports = instance_ports(p, dp, 10000, 30000)
        assert len(ports) == 1 + 2 * dp
        assert not any(LINUX.collides(q) for q in ports), ports
        assert ports <= taken
    # 8000 was the sim's default: its snapshot port 38000 is in the range.
    assert any(LINUX.collides(q) for q in instance_ports(8000, 1, 10000, 30000))


def test_reserved_ports_make_a_port_safe_and_no_safe_port_falls_back():
    reserved = EphemeralPorts(32768, 60999, frozenset(range(38000, 38002)))
    assert not any(reserved.collides(q) for q in instance_ports(8000, 2, 10000, 30000))
    everything = EphemeralPorts(1024, 65535)
    p = free_instance_port(1, 10000, 30000, ephemeral=everything)  # any free one, logged
    assert 1024 <= p <= 35535
    with pytest.raises(LifecycleError, match="leave no port"):
        free_instance_port(1, 60000, 65000)


def test_port_runs_are_free_outside_the_range_and_not_promised_twice():
    taken: set[int] = set()
    bases = [free_port_run(3, avoid=taken, ephemeral=LINUX) for _ in range(5)]
    assert len(taken) == 15
    for b in bases:
        assert not any(LINUX.collides(q) for q in range(b, b + 3))
    with socket.socket() as s:  # each one really free: it binds
        s.bind(("127.0.0.1", bases[0]))


def test_sim_warns_about_a_derived_port_in_the_range():
    if ephemeral_ports().collides(38000):
        hint = ephemeral_hint(8000, 2, 10000, 30000)
        assert "38000,38001 in the ephemeral range" in hint
        assert "net.ipv4.ip_local_reserved_ports=38000,38001" in hint
    assert ephemeral_hint(2000, 1, 10000, 30000) == "" or ephemeral_ports().collides(32000)
