"""External peers: other implementations of (speculative) decoding on the same GGUF, timed the
way the engine is timed (README.md, "Benchmarks"; results in docs/benchmarks.md).

- `lcp-pld`: llama-cpp-python's own prompt lookup decoding
  (`Llama(..., draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10))`), in this process.
- `c-loop`: plain decoding with the whole generation in one C call on its own context of the
  same model, in this process (srsd_local/bench/cloop.py): the next token is the row's
  argmax, or at a temperature the engine's draw with the same seed, so its tokens are `ar`'s;
  what `ar` takes longer is the engine's per-token overhead. It decodes without output
  constraints (a JSON schema is ignored: a decode-speed baseline).
- `llama-server`, `llama-server-spec`, `llama-server-ngram-simple`: llama.cpp's HTTP server
  built from the llama.cpp vendored in the pinned llama-cpp-python, the llama.cpp commit the
  engine runs (scripts/build_llama_server.sh builds and caches it): plain decoding, its default
  speculative config (`--spec-default`) and n-gram lookup (`--spec-type ngram-simple`). One
  server process per mode, started once with the engine's model, threads, context, batch sizes,
  GPU layers and slots (`--parallel`, 1 unless the concurrency benchmark asks); each prompt
  goes to `/completion` as raw text (no chat template) with `cache_prompt` false, and the
  times and draft counts come from the response's `timings`. A missing binary drops these
  modes with a message saying how to build it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

from .. import store
from ..engine.stats import GenerationStats
from .workloads import BenchPrompt

# mode -> the llama-server flags that select its drafting (checked against the binary's --help)
SERVER_MODES: dict[str, tuple[str, ...]] = {
    "llama-server": (),
    "llama-server-spec": ("--spec-default",),
    "llama-server-ngram-simple": ("--spec-type", "ngram-simple"),
}
PEER_MODES = ("lcp-pld", "c-loop", *SERVER_MODES)
BUILD_SCRIPT = "scripts/build_llama_server.sh"
LLAMA_CPP_PYTHON_PIN = "0.3.36"  # the version pyproject.toml pins (the build script's default)


@dataclass
class PeerResult:
    """One peer generation. `token_ids` is None when the peer cannot return them; `seconds`
    is generation after the prompt, like the engine's `stats.seconds` (lcp-pld: from its first
    token to its last; llama-server: its `predicted_ms`, measured the same way)."""

    tokens: int
    seconds: float
    token_ids: list[int] | None = None
    draft_n: int = 0  # drafted tokens the peer verified
    draft_n_accepted: int = 0  # of those, accepted
    prompt_tokens: int = 0
    prompt_seconds: float = 0.0

    def to_stats(self, mode: str) -> GenerationStats:
        """As engine stats, so peers aggregate with `GenerationStats.merge` like every mode.
        Steps are unknown (0), so tokens per step is not reported for peers."""
        return GenerationStats(mode=mode, tokens=self.tokens, seconds=self.seconds,
                               prompt_tokens=self.prompt_tokens,
                               prompt_seconds=self.prompt_seconds, draft_tokens=self.draft_n,
                               accepted_tokens=self.draft_n_accepted)


class Peer(Protocol):
    # whether its output follows a prompt's JSON schema (c-loop decodes without one)
    follows_schema: bool

    def run(self, p: BenchPrompt) -> PeerResult: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class PeerSettings:
    """What a peer shares with the engine under test (from its public API)."""

    model_path: str
    n_ctx: int
    threads: int
    n_gpu_layers: int
    n_batch: int = 512
    n_ubatch: int = 512
    parallel: int = 1  # slots (llama-server --parallel), each with n_ctx tokens
    repack: bool = True  # weights in the CPU's repacked layouts, as the engine loads them

    @classmethod
    def of(cls, engine: Any) -> PeerSettings:
        cfg = engine.config
        return cls(engine.model_path, engine.n_ctx, cfg.threads, cfg.n_gpu_layers,
                   cfg.n_batch, cfg.n_ubatch, getattr(engine, "parallel", 1),
                   getattr(engine, "repacked_weights", True))


# -- lcp-pld ------------------------------------------------------------------------------------
@contextlib.contextmanager
def _model_params(repack: bool) -> Iterator[None]:
    """While it lasts, llama-cpp-python's `Llama` loads models with repacked weights or not,
    as the engine does (its constructor has no parameter for that: the default model
    parameters it starts from are patched)."""
    import llama_cpp.llama_cpp as lib  # noqa: PLC0415

    if repack:
        yield
        return
    default = lib.llama_model_default_params

    def no_repack():
        params = default()
        params.use_extra_bufts = False
        return params

    lib.llama_model_default_params = no_repack
    try:
        yield
    finally:
        lib.llama_model_default_params = default


class LcpPeer:
    """llama-cpp-python's prompt lookup decoding on the same GGUF."""

    follows_schema = True

    def __init__(self, s: PeerSettings) -> None:
        from llama_cpp import Llama  # noqa: PLC0415
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding  # noqa: PLC0415

        with _model_params(s.repack):
            self.llm = Llama(model_path=s.model_path, n_ctx=s.n_ctx, n_threads=s.threads,
                             n_threads_batch=s.threads, n_gpu_layers=s.n_gpu_layers,
                             logits_all=True, verbose=False,
                             draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10))

    def run(self, p: BenchPrompt) -> PeerResult:
        from llama_cpp import llama_cpp  # noqa: PLC0415

        llm = self.llm
        tokens = llm.tokenize(p.prompt.encode("utf-8"), add_bos=True, special=True)
        if p.seed is not None:
            llm.set_seed(p.seed)
        out: list[int] = []
        t_first = None
        grammar = None
        if p.json_schema is not None:
            from llama_cpp.llama_grammar import LlamaGrammar  # noqa: PLC0415

            grammar = LlamaGrammar.from_json_schema(json.dumps(p.json_schema), verbose=False)
        for tok in llm.generate(tokens, temp=p.temperature, top_k=0, top_p=1.0, min_p=0.0,
                                repeat_penalty=1.0, reset=True, grammar=grammar):
            if llama_cpp.llama_vocab_is_eog(llm._model.vocab, tok):
                break
            out.append(tok)
            if t_first is None:
                t_first = time.perf_counter()
            if len(out) >= p.max_tokens:
                break
        seconds = time.perf_counter() - t_first if t_first is not None else 0.0
        return PeerResult(len(out), seconds, out, prompt_tokens=len(tokens))

    def close(self) -> None:
        self.llm.close()


# -- c-loop -------------------------------------------------------------------------------------
class CLoopPeer:
    """Plain decoding in one C call per generation (see cloop.py), on its own context with
    the engine's model, context size, batch sizes, threads and GPU layers. It ignores
    JSON schemas (a decode-speed baseline): its output is plain unconstrained decoding."""

    follows_schema = False

    def __init__(self, s: PeerSettings) -> None:
        from ..config import SRSDConfig  # noqa: PLC0415
        from ..llama.backend import Backend  # noqa: PLC0415
        from .cloop import DecodeLoop  # noqa: PLC0415

        cfg = SRSDConfig(n_ctx=s.n_ctx, n_batch=s.n_batch, n_ubatch=s.n_ubatch,
                         n_threads=s.threads, n_gpu_layers=s.n_gpu_layers,
                         sample_in_graph=False)
        self.backend = Backend(s.model_path, cfg)
        try:
            self.loop = DecodeLoop(self.backend)
        except BaseException:
            self.backend.close()
            raise

    def run(self, p: BenchPrompt) -> PeerResult:
        tokens = self.backend.tokenize(p.prompt)
        ids, seconds, prompt_seconds = self.loop.generate(tokens, p.max_tokens,
                                                          p.temperature, p.seed)
        return PeerResult(len(ids), seconds, ids, prompt_tokens=len(tokens),
                          prompt_seconds=prompt_seconds)

    def close(self) -> None:
        self.backend.close()


# -- llama-server -------------------------------------------------------------------------------
def llama_cpp_python_version() -> str:
    try:
        return metadata.version("llama_cpp_python")
    except metadata.PackageNotFoundError:
        return LLAMA_CPP_PYTHON_PIN


def default_llama_server(version: str | None = None) -> Path:
    """Where scripts/build_llama_server.sh caches the binary for this llama-cpp-python."""
    return store.path("llama-server", version or llama_cpp_python_version()) / "llama-server"


def missing_binary_message(binary: Path, modes: Sequence[str]) -> str:
    return (f"llama-server not found at {binary}; skipping {', '.join(modes)}. Build it (about "
            f"10-15 minutes on 2 cores) with `{BUILD_SCRIPT}` from a srsd-local source checkout, "
            f"or pass --llama-server PATH.")


def server_command(binary: str | Path, mode: str, s: PeerSettings, port: int) -> list[str]:
    """The llama-server command line of one mode: the engine's model, threads, context, batch
    sizes, GPU layers, weight repacking and full-size SWA cache; as many slots as the engine
    (each with the engine's context); no RAM prompt cache (each prompt is processed from
    scratch, as `cache_prompt: false` asks); no web UI."""
    if mode not in SERVER_MODES:
        raise ValueError(f"unknown llama-server mode {mode!r}: accepted are "
                         + ", ".join(SERVER_MODES))
    # the engine's -1 is every layer: llama-server spells that 'all' (its -1 means 'auto')
    ngl = "all" if s.n_gpu_layers < 0 else str(s.n_gpu_layers)
    return [str(binary), "--model", s.model_path, "--host", "127.0.0.1", "--port", str(port),
            "--threads", str(s.threads), "--threads-batch", str(s.threads),
            "--ctx-size", str(s.n_ctx * s.parallel), "--batch-size", str(s.n_batch),
            "--ubatch-size", str(s.n_ubatch), "--n-gpu-layers", ngl, "--fit", "off",
            "--swa-full", "--parallel", str(s.parallel), "--cache-ram", "0", "--no-webui",
            *(() if s.repack else ("--no-repack",)), *SERVER_MODES[mode]]


def display_command(cmd: Sequence[str]) -> str:
    """A llama-server command line for the docs: no cache path, model file name only, no
    host or port (they change every run)."""
    out, skip = ["llama-server"], False
    for i, a in enumerate(cmd[1:], 1):
        if skip:
            skip = False
        elif a in ("--host", "--port"):
            skip = True
        else:
            out.append(Path(a).name if cmd[i - 1] == "--model" else a)
    return " ".join(out)


def completion_request(p: BenchPrompt) -> dict[str, Any]:
    """The /completion body of one prompt: raw text, no prompt cache, the engine's sampling
    (temperature 0 is greedy; otherwise only temperature and the seed shape the draw)."""
    body: dict[str, Any] = {
        "prompt": p.prompt, "n_predict": p.max_tokens, "temperature": p.temperature,
        "top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0,
        "presence_penalty": 0.0, "frequency_penalty": 0.0, "cache_prompt": False,
        "return_tokens": True, "stream": False,
    }
    if p.seed is not None:
        body["seed"] = p.seed
    if p.json_schema is not None:
        body["json_schema"] = p.json_schema
    return body


def parse_completion(data: Mapping[str, Any]) -> PeerResult:
    """A /completion response: `timings.predicted_n` / `predicted_ms` / `draft_n` /
    `draft_n_accepted` and the generated `tokens`. llama-server counts (and returns) the
    end-of-generation token; the engine does not emit it, so it is dropped here."""
    t = data.get("timings")
    if not isinstance(t, Mapping) or "predicted_n" not in t or "predicted_ms" not in t:
        raise ValueError("llama-server response has no timings.predicted_n / predicted_ms")
    n = int(t["predicted_n"])
    seconds = float(t["predicted_ms"]) / 1000.0
    raw = data.get("tokens")
    ids = [int(x) for x in raw] if isinstance(raw, list) and len(raw) == n else None
    if data.get("stop_type") == "eos" and n > 0:
        n -= 1
        ids = ids[:-1] if ids is not None else None
    return PeerResult(n, seconds, ids, int(t.get("draft_n", 0)),
                      int(t.get("draft_n_accepted", 0)), int(t.get("prompt_n", 0)),
                      float(t.get("prompt_ms", 0.0)) / 1000.0)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LlamaServerPeer:
    """One llama-server process (one mode), started here and stopped by `close`."""

    follows_schema = True

    def __init__(self, mode: str, binary: str | Path, s: PeerSettings,
                 startup_timeout: float = 300.0, request_timeout: float = 600.0) -> None:
        try:
            import httpx  # noqa: PLC0415
        except ImportError as exc:
            raise RuntimeError("the llama-server modes need httpx: pip install httpx") from exc
        self.mode = mode
        port = _free_port()
        self.command = server_command(binary, mode, s, port)
        self._log = tempfile.NamedTemporaryFile(prefix=f"srsd-{mode}-", suffix=".log",
                                                delete=False)
        self.proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{port}",
                                   timeout=request_timeout)
        try:
            self._wait_ready(startup_timeout)
        except BaseException:
            self.close()
            raise

    def _log_tail(self, chars: int = 2000) -> str:
        self._log.flush()
        try:
            return Path(self._log.name).read_text(encoding="utf-8", errors="replace")[-chars:]
        except OSError:
            return ""

    def _wait_ready(self, timeout: float) -> None:
        import httpx  # noqa: PLC0415

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.mode}: llama-server exited with status "
                                   f"{self.proc.returncode}:\n{self._log_tail()}")
            try:
                if self.client.get("/health", timeout=5.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.2)
        raise RuntimeError(f"{self.mode}: llama-server not ready after {timeout:.0f} s:\n"
                           f"{self._log_tail()}")

    def run(self, p: BenchPrompt) -> PeerResult:
        resp = self.client.post("/completion", json=completion_request(p))
        if resp.status_code != 200:
            raise RuntimeError(f"{self.mode}: /completion answered {resp.status_code}: "
                               f"{resp.text[:500]}")
        return parse_completion(resp.json())

    def close(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)


def _warn(msg: str) -> None:
    print(f"srsd-local bench: {msg}", file=sys.stderr)


def start_peers(modes: Sequence[str], settings: PeerSettings, llama_server: str | Path | None,
                warn: Callable[[str], None] = _warn,
                make_server: Callable[..., Peer] = LlamaServerPeer,
                make_lcp: Callable[[PeerSettings], Peer] = LcpPeer,
                make_loop: Callable[[PeerSettings], Peer] = CLoopPeer,
                ) -> tuple[list[str], dict[str, Peer]]:
    """Start a peer for each peer mode in `modes`. Returns the modes that will run (server
    modes dropped, with a message, when the binary is missing) and the peers by mode; on an
    error every peer already started is closed."""
    server_modes = [m for m in modes if m in SERVER_MODES]
    binary = Path(llama_server) if llama_server else default_llama_server()
    if server_modes and not (binary.is_file() and os.access(binary, os.X_OK)):
        warn(missing_binary_message(binary, server_modes))
        modes = [m for m in modes if m not in SERVER_MODES]
    elif server_modes and importlib.util.find_spec("httpx") is None:
        warn(f"the llama-server modes need httpx (pip install httpx); skipping "
             f"{', '.join(server_modes)}")
        modes = [m for m in modes if m not in SERVER_MODES]
    peers: dict[str, Peer] = {}
    try:
        for m in modes:
            if m == "lcp-pld":
                peers[m] = make_lcp(settings)
            elif m == "c-loop":
                peers[m] = make_loop(settings)
            elif m in SERVER_MODES:
                peers[m] = make_server(m, binary, settings)
    except BaseException:
        close_peers(peers)
        raise
    return list(modes), peers


def close_peers(peers: Mapping[str, Peer]) -> None:
    for peer in peers.values():
        try:
            peer.close()
        except Exception as exc:  # noqa: BLE001 - closing the others matters more
            _warn(f"closing a peer failed: {exc}")
