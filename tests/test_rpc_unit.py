"""RPC pieces that need no model and no RPC build: endpoint and split validation, the layer
placement rule, the worker handshake probe (against fake servers), error messages."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable, Iterator

import pytest

from srsd_local.cli import _engine_config, build_parser
from srsd_local.config import SRSDConfig
from srsd_local.llama import rpc
from srsd_local.llama.rpc import Device, Split, layer_placement, plan_split, probe


# -- configuration --------------------------------------------------------------------------
def test_rpc_servers_accept_a_string_or_a_list():
    assert SRSDConfig(rpc_servers="a:1, b.lan:50052").rpc_servers == ("a:1", "b.lan:50052")
    assert SRSDConfig(rpc_servers=["10.0.0.2:50052"]).rpc_servers == ("10.0.0.2:50052",)
    assert SRSDConfig().rpc_servers == ()


@pytest.mark.parametrize("bad", ["a", "a:", ":1", "a:0", "a:65536", "a:x", "::1:5", "a:1,a:1",
                                 ",".join(f"h:{i}" for i in range(1, 18)), 5])
def test_bad_rpc_servers_say_what_is_accepted(bad):
    with pytest.raises(ValueError, match=r"invalid rpc_servers=.*HOST:PORT"):
        SRSDConfig(rpc_servers=bad)


def test_tensor_split_has_one_share_for_this_machine_and_each_worker():
    cfg = SRSDConfig(rpc_servers="a:1,b:2", tensor_split="1,2,3")
    assert cfg.tensor_split == (1.0, 2.0, 3.0)
    assert SRSDConfig(rpc_servers="a:1", tensor_split=[0, 1]).tensor_split == (0.0, 1.0)
    for bad in ("1,2", (1, 2, -1), (0, 0, 0), "x,y,z", 3):
        with pytest.raises(ValueError, match=r"invalid tensor_split=.*3 numbers >= 0"):
            SRSDConfig(rpc_servers="a:1,b:2", tensor_split=bad)
    with pytest.raises(ValueError, match="a split needs rpc_servers"):
        SRSDConfig(tensor_split=(1.0,))


def test_cli_rpc_flags_reach_the_engine_config():
    for cmd in (["generate", "--prompt", "x"], ["serve"], ["ui"], ["bench"], ["calibrate"],
                ["verify", "--prompt", "x"]):
        args = build_parser().parse_args([*cmd, "--rpc", "h:1,g:2", "--tensor-split", "1,1,2"])
        cfg = _engine_config(args)
        assert SRSDConfig(**cfg).rpc_servers == ("h:1", "g:2"), cmd
        assert SRSDConfig(**cfg).tensor_split == (1.0, 1.0, 2.0), cmd
    args = build_parser().parse_args(["rpc-worker"])
    assert (args.host, args.port, args.cache_dir) == ("127.0.0.1", 50052, None)


# -- the split and the placement ----------------------------------------------------------------
W1 = [Device("RPC0", "a:1", "a:1", 11)]
W2 = [Device("RPC1", "b:2", "b:2", 12)]
GPU = [Device("CUDA0", "NVIDIA", "local", 13)]


def test_equal_split_keeps_a_third_of_the_layers_on_this_cpu():
    split = plan_split(18, [W1, W2], [], (), 0)
    assert split.n_gpu_layers == 13  # 19 units (18 layers + output), 6 local
    assert [d.name for d in split.devices] == ["RPC0", "RPC1"]
    place = layer_placement(18, split)
    assert [(p["device"], p["where"], p["layers"]) for p in place] == [
        ("CPU", "local", "0-5"), ("RPC0", "a:1", "6-12"), ("RPC1", "b:2", "13-17, output")]


def test_every_layer_is_placed_once_for_any_split():
    for n_layer in (1, 2, 7, 18, 32, 61):
        for shares in ((1, 1, 1), (0, 1, 1), (1, 0, 1), (3, 1, 0), (0.2, 0.5, 0.3), (5, 1, 1)):
            split = plan_split(n_layer, [W1, W2], [], shares, 0)
            placed: list[int] = []
            for p in layer_placement(n_layer, split):
                for part in p["layers"].split(", "):
                    if part == "output":
                        placed.append(n_layer)
                    elif "-" in part:
                        lo, hi = map(int, part.split("-"))
                        placed += range(lo, hi + 1)
                    else:
                        placed.append(int(part))
            assert sorted(placed) == list(range(n_layer + 1)), (n_layer, shares)


def test_zero_local_share_puts_every_layer_on_the_workers():
    split = plan_split(18, [W1, W2], [], (0, 1, 1), 0)
    assert split.n_gpu_layers == 19
    assert [p["device"] for p in layer_placement(18, split)] == ["RPC0", "RPC1"]


def test_a_local_gpu_takes_the_local_share_after_the_workers():
    split = plan_split(18, [W1], GPU, (1, 1), -1)
    assert [d.name for d in split.devices] == ["RPC0", "CUDA0"]
    assert split.shares == (1.0, 1.0) and split.n_gpu_layers == 19
    place = layer_placement(18, split)
    assert [p["device"] for p in place] == ["RPC0", "CUDA0"]


def test_a_worker_with_two_devices_divides_its_share():
    two = [Device("RPC0", "a:1", "a:1", 1), Device("RPC1", "a:1", "a:1", 2)]
    split = plan_split(10, [two, W2], [], (1, 2, 1), 0)
    assert split.shares == (1.0, 1.0, 1.0)


def test_gpu_layers_without_a_local_gpu_point_at_tensor_split():
    with pytest.raises(ValueError, match=r"needs a local GPU.*tensor_split.*0,1,1"):
        plan_split(18, [W1, W2], [], (), -1)


def test_a_placement_without_offload_is_all_cpu():
    place = layer_placement(4, Split((), (), 0))
    assert place == [{"device": "CPU", "description": "this machine's CPU", "where": "local",
                      "layers": "0-3, output"}]
    assert rpc.placement_text(place) == "CPU (local): 0-3, output"


# -- the handshake probe ------------------------------------------------------------------------
@pytest.fixture
def fake_server() -> Iterator[Callable[[Callable[[socket.socket], None]], str]]:
    """fake_server(handler) -> "127.0.0.1:PORT" of a one-connection server."""
    socks: list[socket.socket] = []

    def start(handler: Callable[[socket.socket], None]) -> str:
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        socks.append(srv)

        def serve() -> None:
            conn, _ = srv.accept()
            with conn:
                handler(conn)

        threading.Thread(target=serve, daemon=True).start()
        return f"127.0.0.1:{srv.getsockname()[1]}"

    yield start
    for s in socks:
        s.close()


def _read_hello(conn: socket.socket) -> bytes:
    data = b""
    while len(data) < 9 + rpc.RPC_CONN_CAPS:
        data += conn.recv(64)
    return data


def _hello_reply(major: int, minor: int) -> bytes:
    return struct.pack("<Q", 28) + bytes([major, minor, 0, 0]) + bytes(24)


def test_probe_accepts_a_worker_of_this_protocol(fake_server):
    seen: list[bytes] = []

    def worker(conn: socket.socket) -> None:
        seen.append(_read_hello(conn))
        conn.sendall(_hello_reply(rpc.RPC_PROTO_MAJOR, rpc.RPC_PROTO_MINOR))

    assert probe(fake_server(worker)) is None
    assert seen[0][0] == 14 and struct.unpack("<Q", seen[0][1:9])[0] == 24


def test_probe_names_the_protocol_mismatch(fake_server):
    ep = fake_server(lambda c: (_read_hello(c), c.sendall(_hello_reply(6, 0))))
    assert "protocol 6.0.0" in probe(ep)


def test_probe_says_when_the_peer_is_not_a_worker(fake_server):
    assert "closed the connection" in probe(fake_server(lambda c: None))
    ep = fake_server(lambda c: (_read_hello(c), c.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")))
    assert "not as an RPC worker" in probe(ep)


def test_probe_times_out_on_a_silent_peer(fake_server):
    done = threading.Event()
    ep = fake_server(lambda c: done.wait(5))
    try:
        assert "no handshake within 0.3 s" in probe(ep, timeout=0.3)
    finally:
        done.set()


def test_check_workers_names_every_worker_that_is_down():
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    eps = [f"127.0.0.1:{p}" for p in ports]
    with pytest.raises(rpc.RPCWorkerError) as err:
        rpc.check_workers(eps)
    msg = str(err.value)
    assert all(ep in msg for ep in eps) and "nothing listens there" in msg
    assert f"srsd-local rpc-worker --host 127.0.0.1 --port {ports[0]}" in msg
    assert rpc.dead_workers(eps) == eps


def test_the_rebuild_command_bypasses_pips_wheel_cache():
    cmd = rpc.rebuild_command()
    assert cmd.startswith('CMAKE_ARGS="-DGGML_RPC=on" pip install')
    assert "--no-cache-dir" in cmd and "--force-reinstall" in cmd
    assert "llama-cpp-python==" in cmd
    assert cmd in rpc.missing_message()


def test_a_crash_report_names_the_dead_worker(monkeypatch):
    from srsd_local.app import supervisor

    monkeypatch.setattr(supervisor, "dead_workers", lambda eps: ["h:2"])
    msg = supervisor.death_message(-6, ["h:1", "h:2"])
    assert "RPC worker h:2 stopped answering" in msg and "SIGABRT" in msg
    monkeypatch.setattr(supervisor, "dead_workers", lambda eps: [])
    assert "every worker answers now" in supervisor.death_message(-6, ["h:1"])


def test_the_unavailable_answer_has_openais_error_shape():
    from srsd_local.app.schemas import ErrorResponse
    from srsd_local.app.supervisor import unavailable_body

    body = ErrorResponse.model_validate(unavailable_body())
    assert body.error.type == "server_error" and body.error.code == "rpc_worker_unavailable"
