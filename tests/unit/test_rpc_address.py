"""The baidu_std address a replica advertises in XLLM:SERVICE:MASTER (§13): an IPv4 ip:port
with exactly one colon, chosen from --rpc_advertise_host, --rpc_host, --self_address and the
host name, or a refusal naming the setting; and the settings' own checks."""

from __future__ import annotations

import pytest

from kvsvc.address import advertised_ipv4, is_master_address
from kvsvc.errors import ConfigError
from kvsvc.settings import load_service_settings


def test_master_address_form():
    assert is_master_address("10.0.0.1:8889")
    for bad in ("[::1]:8889", "host:8889", "0.0.0.0:8889", "10.0.0.1", "10.0.0.1:0",
                "10.0.0.1:70000", "10.0.0.1:88:89", "::1:8889"):
        assert not is_master_address(bad), bad


def test_the_order_of_the_rules():
    assert advertised_ipv4("0.0.0.0", "10.9.9.9", "10.1.1.1", ["10.2.2.2"]) == "10.9.9.9"
    assert advertised_ipv4("10.3.3.3", "", "10.1.1.1", ["10.2.2.2"]) == "10.3.3.3"
    assert advertised_ipv4("0.0.0.0", "", "10.1.1.1", ["10.2.2.2"]) == "10.1.1.1"
    # A --self_address that is a host name, not an IPv4, is skipped.
    assert advertised_ipv4("0.0.0.0", "", "svc.example", ["10.2.2.2"]) == "10.2.2.2"
    # The host name: a non-loopback address first (Debian maps it to 127.0.1.1 too).
    assert advertised_ipv4("0.0.0.0", "", "", ["127.0.1.1", "10.2.2.2"]) == "10.2.2.2"
    assert advertised_ipv4("0.0.0.0", "", "", ["127.0.1.1"]) == "127.0.1.1"
    with pytest.raises(ValueError, match="no IPv4 address to advertise"):
        advertised_ipv4("0.0.0.0", "", "", [])
    with pytest.raises(ValueError, match="must be an IPv4"):
        advertised_ipv4("0.0.0.0", "fe80::1", "", [])


def test_settings_rpc_address():
    base = dict(etcd_addr="127.0.0.1:2379", port=8888)
    s = load_service_settings(rpc_host="127.0.0.1", rpc_port=9889, **base)
    assert s.rpc_address() == "127.0.0.1:9889" and is_master_address(s.rpc_address())
    s = load_service_settings(rpc_advertise_host="10.0.0.7", rpc_port=9889, **base)
    assert s.rpc_address() == "10.0.0.7:9889"
    s = load_service_settings(self_address="10.0.0.8:8888", rpc_port=9889, **base)
    assert s.rpc_address() == "10.0.0.8:9889"
    # No baidu_std port without a registry (engines find it through etcd) or with port 0.
    assert load_service_settings(rpc_port=9889).rpc_address() is None
    assert load_service_settings(rpc_port=0, **base).rpc_address() is None


def test_settings_refusals():
    with pytest.raises(ConfigError, match="rpc_host") as exc:
        load_service_settings(rpc_host="::")
    assert "IPv4" in str(exc.value)
    with pytest.raises(ConfigError, match="rpc_advertise_host"):
        load_service_settings(rpc_advertise_host="0.0.0.0")
    with pytest.raises(ConfigError, match="rpc_port"):
        load_service_settings(rpc_port=8888, port=8888)


def test_no_address_to_advertise_refuses_start(monkeypatch):
    import socket

    def no_ipv4(*args, **kwargs):
        raise socket.gaierror("no address")

    monkeypatch.setattr(socket, "getaddrinfo", no_ipv4)
    s = load_service_settings(etcd_addr="127.0.0.1:2379", rpc_port=9889)
    with pytest.raises(ConfigError, match="rpc_advertise_host") as exc:
        s.rpc_address()
    assert "set --rpc_advertise_host" in str(exc.value)
