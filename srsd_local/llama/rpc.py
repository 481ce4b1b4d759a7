"""llama.cpp's RPC backend (ggml-rpc): one model split across several machines.

- `run_worker` serves this machine's CPU or GPUs to other machines with ggml's own RPC
  server (`ggml_backend_rpc_start_server`, in the libraries llama-cpp-python ships when it
  is built with GGML_RPC).
- `configure_model_params` turns `SRSDConfig.rpc_servers` / `tensor_split` into llama.cpp's
  model parameters: an explicit device list (the workers' devices, then any local GPU), the
  number of offloaded layers and their split, after checking every worker answers.
- `plan_split` and `layer_placement` are pure: they say which device holds which layer by
  the same rule llama.cpp's loader applies (`/health` and the UI show it).

ggml-rpc ends the whole process (GGML_ABORT) when a worker it talks to stops answering; the
checks here run before any llama.cpp call that would connect, so a worker that is down at
load time gives an error that names it instead. A worker that dies later ends the process:
`srsd-local` runs RPC commands in a child process for that reason (srsd_local/app/supervisor).
"""

from __future__ import annotations

import ctypes
import socket
import struct
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from ..config import SRSDConfig

DEFAULT_PORT = 50052
# ggml-rpc's handshake of the llama.cpp vendored by llama-cpp-python 0.3.36: command byte 14
# (HELLO, fixed across versions), a 64-bit request size, 24 bytes of transport capabilities;
# the reply is a 64-bit size, then major, minor, patch, padding and 24 bytes of capabilities
RPC_CMD_HELLO = 14
RPC_CONN_CAPS = 24
RPC_PROTO_MAJOR = 7
RPC_PROTO_MINOR = 0
PROBE_TIMEOUT_S = 5.0

_DEV_CPU, _DEV_GPU, _DEV_IGPU = 0, 1, 2
_VP = ctypes.c_void_p
_ADD_SERVER_T = ctypes.CFUNCTYPE(_VP, ctypes.c_char_p)
_START_SERVER_T = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t,
                                   ctypes.c_size_t, ctypes.POINTER(_VP))


class RPCUnavailableError(RuntimeError):
    """The loaded llama.cpp library was built without the RPC backend."""


class RPCWorkerError(ConnectionError):
    """A worker does not answer (down, unreachable, busy, or another protocol version)."""


def rebuild_command() -> str:
    """The pip command that rebuilds the installed llama-cpp-python with RPC."""
    try:
        version = metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        version = "0.3.36"
    return ('CMAKE_ARGS="-DGGML_RPC=on" pip install --force-reinstall --no-deps '
            f"--no-cache-dir llama-cpp-python=={version}")


def missing_message() -> str:
    return ("the installed llama-cpp-python was built without llama.cpp's RPC backend "
            "(GGML_RPC), which --rpc and rpc-worker need. Rebuild it with RPC (--no-cache-dir: "
            "pip would otherwise reuse its cached build without RPC; add -DGGML_CUDA=on to "
            "CMAKE_ARGS on a CUDA machine):\n  " + rebuild_command())


# -- the library ------------------------------------------------------------------------------
_LIB: Any = None


def _ggml() -> Any:
    """libggml with the argument types of the registry functions used here."""
    global _LIB
    if _LIB is None:
        from llama_cpp import _ggml as g  # noqa: PLC0415

        lib = g.libggml
        sz, cp = ctypes.c_size_t, ctypes.c_char_p
        for name, res, args in (
                ("ggml_backend_reg_by_name", _VP, [cp]),
                ("ggml_backend_reg_get_proc_address", _VP, [_VP, cp]),
                ("ggml_backend_reg_dev_count", sz, [_VP]),
                ("ggml_backend_reg_dev_get", _VP, [_VP, sz]),
                ("ggml_backend_reg_name", cp, [_VP]),
                ("ggml_backend_dev_count", sz, []),
                ("ggml_backend_dev_get", _VP, [sz]),
                ("ggml_backend_dev_name", cp, [_VP]),
                ("ggml_backend_dev_description", cp, [_VP]),
                ("ggml_backend_dev_type", ctypes.c_int, [_VP]),
                ("ggml_backend_dev_backend_reg", _VP, [_VP]),
                ("ggml_backend_dev_memory", None, [_VP, ctypes.POINTER(sz), ctypes.POINTER(sz)])):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        _LIB = lib
    return _LIB


def _proc(name: str, proto: Any) -> Any | None:
    lib = _ggml()
    reg = lib.ggml_backend_reg_by_name(b"RPC")
    if not reg:
        return None
    addr = lib.ggml_backend_reg_get_proc_address(reg, name.encode())
    return proto(addr) if addr else None


def rpc_supported() -> bool:
    """Whether the loaded llama.cpp has the RPC backend (and its server and client entry
    points)."""
    try:
        from llama_cpp import llama_cpp as L  # noqa: PLC0415
    except (ImportError, OSError):
        return False
    check = getattr(L, "llama_supports_rpc", None)
    if check is None or not check():
        return False
    return (_proc("ggml_backend_rpc_add_server", _ADD_SERVER_T) is not None
            and _proc("ggml_backend_rpc_start_server", _START_SERVER_T) is not None)


def require_rpc() -> None:
    if not rpc_supported():
        raise RPCUnavailableError(missing_message())


# -- workers: reachability ----------------------------------------------------------------------
def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host, int(port)


def _recv(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def probe(endpoint: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """None when an rpc-worker of this protocol answers the handshake at `endpoint`, else
    why not (one line, for an error message)."""
    host, port = split_endpoint(endpoint)
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(struct.pack("<BQ", RPC_CMD_HELLO, RPC_CONN_CAPS) + bytes(RPC_CONN_CAPS))
            (size,) = struct.unpack("<Q", _recv(s, 8))
            if not 4 <= size <= 4096:
                return "it answered, but not as an RPC worker (unexpected handshake reply)"
            major, minor, patch = _recv(s, size)[:3]
    except ConnectionRefusedError:
        return (f"nothing listens there: start `srsd-local rpc-worker --host {host} --port "
                f"{port}` on that machine")
    except socket.gaierror as exc:
        return f"unknown host {host!r} ({exc.strerror})"
    except TimeoutError:
        return (f"no handshake within {timeout:g} s: the machine is unreachable, or the worker "
                "is serving another client (a worker serves one client at a time)")
    except (EOFError, ConnectionResetError, BrokenPipeError):
        return ("it closed the connection during the handshake: not an rpc-worker, or one "
                "of another llama.cpp version")
    except OSError as exc:
        return exc.strerror or str(exc)
    if major != RPC_PROTO_MAJOR or minor > RPC_PROTO_MINOR:
        return (f"it speaks RPC protocol {major}.{minor}.{patch}, this llama.cpp speaks "
                f"{RPC_PROTO_MAJOR}.{RPC_PROTO_MINOR}.x: install the same llama-cpp-python "
                "version on both machines")
    return None


def check_workers(endpoints: Sequence[str], timeout: float = PROBE_TIMEOUT_S) -> None:
    """RPCWorkerError naming every worker of `endpoints` that does not answer."""
    bad = [(ep, why) for ep in endpoints if (why := probe(ep, timeout)) is not None]
    if bad:
        lines = "; ".join(f"{ep}: {why}" for ep, why in bad)
        raise RPCWorkerError(f"RPC worker{'s' if len(bad) > 1 else ''} not reachable: {lines}")


def dead_workers(endpoints: Sequence[str], timeout: float = 2.0) -> list[str]:
    """The endpoints that do not answer the handshake now."""
    return [ep for ep in endpoints if probe(ep, timeout) is not None]


# -- devices and the layer split ----------------------------------------------------------------
@dataclass(frozen=True)
class Device:
    name: str  # ggml's device name: CPU, RPC0, CUDA0, ...
    description: str
    where: str  # "local", or the worker's HOST:PORT
    handle: int = 0  # ggml_backend_dev_t


@dataclass(frozen=True)
class Split:
    devices: tuple[Device, ...]  # the devices layers are offloaded to, in llama.cpp's order
    shares: tuple[float, ...]  # one per device
    n_gpu_layers: int  # layers offloaded (counting the output layer, as llama.cpp does)


def plan_split(n_layer: int, workers: Sequence[Sequence[Device]], local_gpus: Sequence[Device],
               tensor_split: Sequence[float], n_gpu_layers: int) -> Split:
    """The offload devices, their shares and the offloaded layer count for a model of
    `n_layer` repeating layers. `tensor_split` is [local, worker 1, ...] (empty: equal);
    a worker's share is divided equally among its devices. With a local GPU and
    n_gpu_layers != 0 the local share goes to the GPU(s) and n_gpu_layers is kept (-1: all);
    otherwise the local share is the first layers, kept on this machine's CPU."""
    if any(not devs for devs in workers):
        raise ValueError("an RPC worker reported no devices")
    shares = list(tensor_split) or [1.0] * (len(workers) + 1)
    if len(shares) != len(workers) + 1:
        raise ValueError(f"tensor_split has {len(shares)} entries; accepted are "
                         f"{len(workers) + 1}: the local machine's share, then one per worker")
    devices: list[Device] = []
    dev_shares: list[float] = []
    for devs, share in zip(workers, shares[1:]):
        devices += devs
        dev_shares += [share / len(devs)] * len(devs)
    units = n_layer + 1  # the repeating layers and the output layer
    if local_gpus and n_gpu_layers != 0:
        devices += local_gpus
        dev_shares += [shares[0] / len(local_gpus)] * len(local_gpus)
        ngl = units if n_gpu_layers < 0 else min(n_gpu_layers, units)
        return Split(tuple(devices), tuple(dev_shares), ngl)
    if n_gpu_layers != 0:
        raise ValueError(f"n_gpu_layers={n_gpu_layers} with rpc_servers needs a local GPU, and "
                         "this machine has none: the layers are split by tensor_split instead "
                         "(local share first; e.g. 0,1,1 puts every layer on two workers)")
    local = int(np.floor(units * shares[0] / sum(shares) + 0.5))
    return Split(tuple(devices), tuple(dev_shares), units - local)


def layer_placement(n_layer: int, split: Split) -> list[dict[str, str]]:
    """Which device holds which layer, by llama.cpp's rule (llama-model.cpp load_tensors):
    layers before n_layer + 1 - n_gpu_layers stay on the CPU, the others go to the device
    whose cumulative share first exceeds the layer's fraction (float32, as there). One
    entry per device holding layers: {device, description, where, layers}."""
    units = n_layer + 1
    act = min(split.n_gpu_layers, units) if split.devices else 0
    start = max(units - split.n_gpu_layers, 0)
    cum = np.cumsum(np.asarray(split.shares or [1.0], dtype=np.float32), dtype=np.float32)
    cum = (cum / cum[-1]).astype(np.float32) if cum[-1] > 0 else cum
    held: dict[int, list[int]] = {}
    for il in range(units):
        if il < start or il - start >= act:
            dev = -1
        else:
            frac = np.float32(il - start) / np.float32(act)
            dev = min(int(np.searchsorted(cum, frac, side="right")), len(split.devices) - 1)
        held.setdefault(dev, []).append(il)
    out = []
    for dev in sorted(held, key=lambda d: held[d][0]):
        d = Device("CPU", "this machine's CPU", "local") if dev < 0 else split.devices[dev]
        out.append({"device": d.name, "description": d.description, "where": d.where,
                    "layers": _ranges(held[dev], n_layer)})
    return out


def _ranges(layers: list[int], n_layer: int) -> str:
    """[0, 1, 2, 5, 18] with n_layer 18 -> '0-2, 5, output'."""
    parts, run = [], []
    for il in [x for x in layers if x < n_layer] + [None]:
        if run and (il is None or il != run[-1] + 1):
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        if il is not None:
            run.append(il)
    if n_layer in layers:
        parts.append("output")
    return ", ".join(parts)


def placement_text(placement: Sequence[dict[str, str]] | None) -> str:
    """One line: 'CPU (local): 0-8 · RPC0 (host:50052): 9-17, output'."""
    if not placement:
        return ""
    return " · ".join(f"{p['device']} ({p['where']}): {p['layers']}" for p in placement)


def _device(lib: Any, handle: int, where: str) -> Device:
    name = (lib.ggml_backend_dev_name(handle) or b"?").decode("utf-8", "replace")
    desc = (lib.ggml_backend_dev_description(handle) or b"?").decode("utf-8", "replace")
    return Device(name, desc, where, handle)


def local_gpus() -> list[Device]:
    """This machine's GPUs (discrete ones; integrated ones when there is no discrete one)."""
    lib = _ggml()
    gpus, igpus = [], []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        kind = lib.ggml_backend_dev_type(dev)
        reg = lib.ggml_backend_dev_backend_reg(dev)
        if reg and lib.ggml_backend_reg_name(reg) == b"RPC":
            continue
        if kind == _DEV_GPU:
            gpus.append(_device(lib, dev, "local"))
        elif kind == _DEV_IGPU:
            igpus.append(_device(lib, dev, "local"))
    return gpus or igpus


def worker_devices(endpoint: str) -> list[Device]:
    """The devices a (reachable) worker serves, registered with ggml's RPC backend."""
    lib = _ggml()
    add = _proc("ggml_backend_rpc_add_server", _ADD_SERVER_T)
    if add is None:
        raise RPCUnavailableError(missing_message())
    reg = add(endpoint.encode())
    if not reg:
        raise RPCWorkerError(f"RPC worker {endpoint} reports no devices")
    return [_device(lib, lib.ggml_backend_reg_dev_get(reg, i), endpoint)
            for i in range(lib.ggml_backend_reg_dev_count(reg))]


def model_layers(model_path: str | Path) -> int:
    """The repeating layers of a GGUF model, from its header."""
    from .gguf import read_header  # noqa: PLC0415

    head = read_header(model_path)
    arch = head.get("general.architecture")
    n = head.get(f"{arch}.block_count") if arch else None
    if not isinstance(n, int) or n <= 0:
        raise ValueError(f"the model {str(model_path)!r} has no {arch}.block_count in its header:"
                         " its layers cannot be split across RPC workers")
    return n


@dataclass
class ModelDevices:
    """What `configure_model_params` set: keep it alive until the model is loaded."""

    placement: list[dict[str, str]]
    _keep: tuple[Any, ...]


def configure_model_params(L: Any, mparams: Any, config: SRSDConfig,
                           model_path: str | Path) -> ModelDevices:
    """Point llama.cpp's model parameters at the workers of `config.rpc_servers` (checked
    first: an error names any that does not answer) and the local machine."""
    require_rpc()
    n_layer = model_layers(model_path)
    check_workers(config.rpc_servers)
    workers = [worker_devices(ep) for ep in config.rpc_servers]
    split = plan_split(n_layer, workers, local_gpus(), config.tensor_split, config.n_gpu_layers)
    handles = (_VP * (len(split.devices) + 1))(*[d.handle for d in split.devices], None)
    shares = (ctypes.c_float * max(L.llama_max_devices(), len(split.devices)))(*split.shares)
    mparams.devices = ctypes.cast(handles, _VP)
    mparams.tensor_split = shares
    mparams.n_gpu_layers = split.n_gpu_layers
    return ModelDevices(layer_placement(n_layer, split), (handles, shares))


# -- the worker ---------------------------------------------------------------------------------
LOOPBACK = ("127.0.0.1", "localhost", "::1")
SECURITY_NOTE = ("llama.cpp's RPC protocol has no authentication and no encryption: anyone "
                 "who can reach this port can run computations on this machine and read what "
                 "it holds. Only listen on a trusted network.")


def serving_devices(n_gpu_layers: int) -> list[Device]:
    """What a worker serves: its GPUs (n_gpu_layers != 0 and there are any), else its CPU."""
    gpus = local_gpus() if n_gpu_layers != 0 else []
    if gpus:
        return gpus
    lib = _ggml()
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        if lib.ggml_backend_dev_type(dev) == _DEV_CPU:
            return [_device(lib, dev, "local")]
    raise RuntimeError("ggml reports no CPU device")


def run_worker(host: str, port: int, threads: int, cache_dir: str | Path | None = None,
               n_gpu_layers: int = -1, say: Callable[[str], None] | None = None) -> int:
    """Serve this machine's devices to other machines until interrupted (blocks). Returns 1
    when ggml's server stops on its own (its reason is on stderr)."""
    say = say or (lambda s: print(s, file=sys.stderr, flush=True))
    require_rpc()
    if not 0 < port < 65536:
        raise ValueError(f"invalid port={port}: accepted is an integer in [1, 65535]")
    if ":" in host:
        raise ValueError(f"invalid host={host!r}: llama.cpp's RPC server takes an IPv4 address "
                         "or a host name")
    if threads < 1:
        raise ValueError(f"invalid threads={threads}: accepted is an integer >= 1")
    try:  # a clear error for a port in use (ggml's server would only say it failed)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as exc:
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    cache = None
    if cache_dir is not None:
        Path(cache_dir).expanduser().mkdir(parents=True, exist_ok=True)
        cache = str(Path(cache_dir).expanduser()).encode()
    devices = serving_devices(n_gpu_layers)
    start = _proc("ggml_backend_rpc_start_server", _START_SERVER_T)
    if start is None:
        raise RPCUnavailableError(missing_message())
    if host not in LOOPBACK:
        say(f"WARNING: listening on {host}, not only on this machine. {SECURITY_NOTE}")
    names = ", ".join(f"{d.name} ({d.description})" for d in devices)
    say(f"srsd-local rpc-worker on {host}:{port}: serving {names} with {threads} threads; "
        "connect with --rpc " + (f"{host}:{port}" if host not in ("0.0.0.0",) else
                                 f"THIS_MACHINE:{port}"))
    handles = (_VP * len(devices))(*[d.handle for d in devices])
    # ggml's server loop never returns while it serves: it runs in a thread so that the main
    # thread still handles Ctrl-C
    worker = threading.Thread(target=start, name="rpc-worker", daemon=True,
                              args=(f"{host}:{port}".encode(), cache, threads, len(devices),
                                    handles))
    worker.start()
    while worker.is_alive():
        worker.join(0.5)
    return 1
