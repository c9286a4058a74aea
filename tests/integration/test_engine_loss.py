"""The engine-loss probe and report over real loopback sockets (issue 19 item 1,
:mod:`kvsvc.routing.engine_loss`): a TCP connect is refused only when nothing listens, and the
baidu_std server reports a closed connection with the instance names that heartbeated on it
(never one that carried no heartbeat)."""

from __future__ import annotations

import socket
import time

from kvsvc.cluster.heartbeat import HeartbeatOutcome
from kvsvc.routing.engine_loss import port_refuses
from kvsvc.rpc import codec, messages
from kvsvc.rpc.server import RpcServer, XllmRpcHandler
from tests.support.util import free_port, wait_for


def test_the_probe_says_refused_only_when_nothing_listens() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        assert port_refuses(f"127.0.0.1:{listener.getsockname()[1]}") is False
    assert port_refuses(f"127.0.0.1:{free_port()}") is True
    assert port_refuses("no-port") is False and port_refuses("host:http") is False


class _Intake:
    """A heartbeat intake that accepts every heartbeat."""

    def outcome(self, *args, **kwargs) -> HeartbeatOutcome:
        return HeartbeatOutcome.OK


def test_the_server_reports_a_closed_connection_with_the_names_heard_on_it() -> None:
    closed: list[tuple[frozenset[str], str]] = []
    server = RpcServer(XllmRpcHandler(_Intake(), None, None), "127.0.0.1", 0,  # type: ignore[arg-type]
                       on_connection_closed=lambda names, peer: closed.append((names, peer)))
    server.start()
    try:
        client = codec.Connection(codec.Role.CLIENT)
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            for name in ["10.0.0.1:9000", "10.0.0.2:9000"]:
                msg = messages.serialize(messages.HeartbeatRequest(name=name))
                sock.sendall(client.send_request("xllm_service.proto.XllmRpcService",
                                                 "Heartbeat", msg)[1])
            got = []
            deadline = time.monotonic() + 5
            while len(got) < 2 and time.monotonic() < deadline:
                got += [e for e in client.receive_data(sock.recv(65536))]
            assert len(got) == 2
            local = "%s:%d" % sock.getsockname()
        wait_for(lambda: closed, 5, 0.02, "the close reported")
        assert closed == [(frozenset({"10.0.0.1:9000", "10.0.0.2:9000"}), local)]
        # A connection that carried no call is not reported; one that carried calls but no
        # heartbeat is, with no name.
        with socket.create_connection(("127.0.0.1", server.port), timeout=5):
            pass
        wait_for(lambda: server.stats().connections == 0, 5, 0.02, "the second one closed")
        assert len(closed) == 1
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(client.send_request("xllm_service.proto.XllmRpcService", "Hello",
                                             b"")[1])
            assert sock.recv(65536)
            local = "%s:%d" % sock.getsockname()
        wait_for(lambda: len(closed) == 2, 5, 0.02, "the third close reported")
        assert closed[1] == (frozenset(), local)
    finally:
        server.close()
