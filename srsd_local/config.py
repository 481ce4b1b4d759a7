"""Configuration dataclasses, validated on construction.

Every knob of the runtime lives here. A bad value raises ``ValueError`` with a message that
says which field was wrong, what it was and what is accepted.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

MODES = ("ar", "pld", "ngram", "retrieval", "srsd", "hybrid")
INDEX_BACKENDS = ("auto", "faiss-gpu", "faiss-cpu", "numpy")
MAX_PLAIN_RUN = 64  # SRSDConfig.plain_run at most (the compiled run's buffer)
RETRIEVAL_SEARCHES = ("next", "all")


def _check(cond: bool, field: str, value: Any, accepted: str) -> None:
    if not cond:
        raise ValueError(f"invalid {field}={value!r}: accepted is {accepted}")


def _int(name: str, value: Any, lo: int, hi: int | None = None) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= lo
    ok = ok and (hi is None or value <= hi)
    rng = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
    _check(ok, name, value, rng)


def _float(name: str, value: Any, lo: float, hi: float) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and lo <= value <= hi
    _check(ok, name, value, f"a number in [{lo}, {hi}]")


@dataclass(frozen=True)
class Environment:
    """The environment variables the runtime reads (read here only, at call time):

    - SRSD_CACHE_DIR: measured profiles, calibrations, the compiled callback and kernel
      (default: $XDG_CACHE_HOME/srsd-local or ~/.cache/srsd-local)
    - SRSD_MODELS_DIR: where the default model is assembled (default: models/ of a source
      checkout, else <cache>/models)
    - SRSD_VERBOSE: non-empty shows llama.cpp's log
    - SRSD_CAPTURE: "python" forces the Python eval callback instead of the compiled one
    - SRSD_KERNELS: "python" samples and normalises index rows with numpy instead of the
      compiled kernels
    - SRSD_GRAPH_SAMPLER: "llama" takes in-graph argmaxes (sample_in_graph) with llama.cpp's
      greedy sampler instead of the compiled ones (llama/graph_argmax.py)
    - SRSD_TOKENIZER: "llama" tokenizes drafting's short texts with llama.cpp's tokenizer
      instead of the Python one of llama/spm.py (the same tokens, checked per model)
    - SRSD_EXTRA_BUFTS: 1/0 loads models with / without llama.cpp's repacked weight layouts
      (default: with them, unless the CPU backend offers AMX's, which crash: cpubufs.py)
    - CC: the C compiler for the compiled callback and kernel (else cc, gcc or clang)

    and, to find and download models where other tools keep them (the standard variables of
    those tools, read here at call time and handed to huggingface_hub explicitly):

    - HF_ENDPOINT: the Hugging Face hub (default https://huggingface.co)
    - HF_HUB_CACHE, else HF_HOME/hub: the hub's download cache (default
      $XDG_CACHE_HOME/huggingface/hub or ~/.cache/huggingface/hub)
    - HF_HUB_OFFLINE: non-empty and not 0/false: never ask the hub, use the cache only
      (HF_TOKEN is read by huggingface_hub itself)
    - OLLAMA_MODELS: Ollama's model store (default ~/.ollama/models)
    - HOME: LM Studio's folders ~/.lmstudio/models and ~/.cache/lm-studio/models
    """

    cache_dir: Path
    models_dir: Path | None
    verbose: bool
    capture: str
    cc: str | None
    kernels: str = "c"
    graph_sampler: str = "srsd"
    tokenizer: str = "spm"
    extra_bufts: str | None = None  # SRSD_EXTRA_BUFTS as given (cpubufs.py decides)
    hf_endpoint: str = "https://huggingface.co"
    hf_cache: Path = Path("~/.cache/huggingface/hub")
    hf_offline: bool = False
    ollama_dir: Path = Path("~/.ollama/models")
    lmstudio_dirs: tuple[Path, ...] = ()


def _path(value: str) -> Path:
    return Path(os.path.expandvars(value)).expanduser()


def environment() -> Environment:
    env = os.environ
    home = Path.home()
    xdg = Path(env.get("XDG_CACHE_HOME") or home / ".cache")
    cache = Path(env["SRSD_CACHE_DIR"]).expanduser() if env.get("SRSD_CACHE_DIR") else \
        xdg / "srsd-local"
    models = Path(env["SRSD_MODELS_DIR"]).expanduser() if env.get("SRSD_MODELS_DIR") else None
    hf_home = _path(env["HF_HOME"]) if env.get("HF_HOME") else xdg / "huggingface"
    hub_cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    offline = env.get("HF_HUB_OFFLINE") or env.get("TRANSFORMERS_OFFLINE") or ""
    return Environment(cache_dir=cache, models_dir=models, verbose=bool(env.get("SRSD_VERBOSE")),
                       capture="python" if env.get("SRSD_CAPTURE", "").lower() == "python"
                       else "c", cc=env.get("CC") or None,
                       kernels="python" if env.get("SRSD_KERNELS", "").lower() == "python"
                       else "c",
                       graph_sampler="llama" if env.get("SRSD_GRAPH_SAMPLER", "").lower()
                       == "llama" else "srsd",
                       tokenizer="llama" if env.get("SRSD_TOKENIZER", "").lower() == "llama"
                       else "spm",
                       extra_bufts=env.get("SRSD_EXTRA_BUFTS"),
                       hf_endpoint=(env.get("HF_ENDPOINT") or "https://huggingface.co"
                                    ).rstrip("/"),
                       hf_cache=_path(hub_cache) if hub_cache else hf_home / "hub",
                       hf_offline=offline.strip().lower() not in ("", "0", "false", "no", "off"),
                       ollama_dir=_path(env["OLLAMA_MODELS"]) if env.get("OLLAMA_MODELS")
                       else home / ".ollama" / "models",
                       lmstudio_dirs=(home / ".lmstudio" / "models",
                                      home / ".cache" / "lm-studio" / "models"))


RPC_MAX_SERVERS = 16  # ggml-rpc's GGML_RPC_MAX_SERVERS


def rpc_endpoints(value: Any) -> tuple[str, ...]:
    """`rpc_servers` as a tuple of "HOST:PORT" (from a comma-separated string or a sequence);
    ValueError saying what is accepted otherwise."""
    accepted = ('"HOST:PORT" endpoints of rpc-worker processes (a comma-separated string or a '
                f"list, at most {RPC_MAX_SERVERS}, no repeats; IPv6 addresses are not supported "
                "by llama.cpp's RPC backend: use a host name)")
    items = value.split(",") if isinstance(value, str) else value
    try:
        items = [str(x).strip() for x in items if str(x).strip()]
    except TypeError:
        raise ValueError(f"invalid rpc_servers={value!r}: accepted are {accepted}") from None
    for item in items:
        host, sep, port = item.rpartition(":")
        ok = bool(sep and host and ":" not in host and port.isdigit()
                  and 0 < int(port) < 65536 and not any(c.isspace() for c in host))
        _check(ok, "rpc_servers", item, accepted)
    _check(len(items) <= RPC_MAX_SERVERS and len(set(items)) == len(items), "rpc_servers",
           value, accepted)
    return tuple(items)


def default_threads() -> int:
    """Physical-ish core count: llama.cpp is memory bound, one thread per core is best."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, n)


@dataclass(frozen=True)
class SRSDConfig:
    """Everything `Engine.load` accepts besides the model.

    Speculation defaults were measured on the default model (Gemma 3 270M) with
    `srsd-local bench`; see docs/benchmarks.md.
    """

    # llama.cpp context
    n_ctx: int = 4096  # tokens of context each request gets
    n_batch: int = 512
    n_ubatch: int = 512
    n_seq_max: int = 0  # sequence ids; 0: parallel * (max_branches + 1), as the slots need
    n_threads: int = 0  # 0: one per available core
    n_gpu_layers: int = 0  # -1: all layers
    # llama.cpp's RPC backend: "HOST:PORT" of `srsd-local rpc-worker` processes whose devices
    # take a share of the layers, and the shares: [local, worker 1, ...] (default: equal)
    rpc_servers: tuple[str, ...] = ()
    tensor_split: tuple[float, ...] = ()
    # concurrency: requests decoded side by side in one batch (0: 4 with GPU layers, else 1),
    # and the most prompt tokens prefilled per step while other requests decode (0: as many
    # as keep that step within twice the cost of the others' step, by the cost model, at
    # least 16 and at most 512)
    parallel: int = 0
    prefill_chunk: int = 0
    # generation
    mode: str = "srsd"
    # hidden-state capture and retrieval
    layer: int | float = 0.25  # index, or depth fraction in (0, 1)
    index_backend: str = "auto"
    top_k: int = 10
    min_similarity: float = 0.2
    # which positions retrieval's query is compared with: "next", those the known next token
    # follows (the only hits that can draft: reads a few of the context's rows, in one
    # compiled call); "all", every position, then the hits the next token does not follow
    # are dropped (the original SRSD search, on the index backend; top_k counts them all)
    retrieval_search: str = "next"
    # token tree: the drafters' candidates are bounded by these; with `adaptive` the
    # controller then keeps the sub-tree that maximises expected tokens per second
    draft_depth: int = 16
    max_nodes: int = 32
    max_branches: int = 8
    adaptive: bool = True
    # greedy decoding with an in-graph greedy sampler (llama/graph_argmax.py): the argmax of
    # each row of a greedy request's plain steps and trees is taken inside llama.cpp's graph
    # and only token ids come back, instead of its logits rows being copied out for an
    # argmax on the host (requests that need the logits: sampled, constrained, with
    # log-probabilities, still get them). True / False: on / off; None (auto): on where the
    # sequence ids allow it (a second block of branch ids per slot)
    sample_in_graph: bool | None = None
    # plain steps whose tokens the graph takes (greedy, or drawn at a temperature alone)
    # decoded one after the other in one compiled call, each on the token the last one took,
    # where nothing is to be looked at between them (no drafting due, no other request in
    # the pass, no stop string, grammar or log-probabilities): at most this many (1: every
    # step returns to Python). The output is the same; its events then carry up to this
    # many tokens each.
    plain_run: int = 8
    # n-gram drafter (in srsd/hybrid trees, and as mode "pld")
    ngram_max: int = 4
    ngram_min: int = 1
    ngram_matches: int = 4
    # mode "pld" is the classic baseline: one linear draft of this many tokens from the
    # longest, most recent n-gram match, verified whenever there is a match (no controller)
    pld_draft_len: int = 10

    def __post_init__(self) -> None:
        _int("n_ctx", self.n_ctx, 64)
        _int("n_batch", self.n_batch, 1)
        _int("n_ubatch", self.n_ubatch, 1)
        _int("n_seq_max", self.n_seq_max, 0, 256)
        _int("parallel", self.parallel, 0, 64)
        _int("prefill_chunk", self.prefill_chunk, 0)
        _int("n_threads", self.n_threads, 0)
        _int("n_gpu_layers", self.n_gpu_layers, -1)
        object.__setattr__(self, "rpc_servers", rpc_endpoints(self.rpc_servers))
        split = self.tensor_split
        if isinstance(split, str):
            try:
                split = tuple(float(x) for x in split.split(",") if x.strip())
            except ValueError:
                split = (self.tensor_split,)
        elif not isinstance(split, (tuple, list)):
            split = (split,)
        want = (f"{len(self.rpc_servers) + 1} numbers >= 0 (the shares of the local machine "
                "and of each rpc_servers entry, in order), not all 0; or empty: equal shares"
                if self.rpc_servers else "empty: a split needs rpc_servers")
        _check(not split or (len(split) == len(self.rpc_servers) + 1 and self.rpc_servers
                             and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                     and x >= 0 for x in split) and sum(split) > 0),
               "tensor_split", self.tensor_split, want)
        object.__setattr__(self, "tensor_split", tuple(float(x) for x in split))
        _check(self.mode in MODES, "mode", self.mode, "one of " + ", ".join(MODES))
        if isinstance(self.layer, float):
            _check(0.0 < self.layer < 1.0, "layer", self.layer,
                   "a layer index (int) or a depth fraction in (0, 1)")
        else:
            _int("layer", self.layer, 0)
        _check(self.index_backend in INDEX_BACKENDS, "index_backend", self.index_backend,
               "one of " + ", ".join(INDEX_BACKENDS))
        _int("top_k", self.top_k, 1, 1024)
        _check(self.retrieval_search in RETRIEVAL_SEARCHES, "retrieval_search",
               self.retrieval_search, "one of " + ", ".join(RETRIEVAL_SEARCHES))
        _float("min_similarity", self.min_similarity, -1.0, 1.0)
        _int("draft_depth", self.draft_depth, 1, 255)
        _int("max_nodes", self.max_nodes, 1, 255)
        _int("max_branches", self.max_branches, 1, 255)
        _check(isinstance(self.adaptive, bool), "adaptive", self.adaptive, "True or False")
        _check(self.sample_in_graph is None or isinstance(self.sample_in_graph, bool),
               "sample_in_graph", self.sample_in_graph, "True, False or None (auto)")
        _int("plain_run", self.plain_run, 1, MAX_PLAIN_RUN)
        _int("ngram_max", self.ngram_max, 1, 64)
        _int("ngram_min", self.ngram_min, 1, self.ngram_max)
        _int("ngram_matches", self.ngram_matches, 1, 64)
        _int("pld_draft_len", self.pld_draft_len, 1, 255)
        _check(self.pld_draft_len + 1 <= self.n_ubatch, "pld_draft_len", self.pld_draft_len,
               f"a value < n_ubatch ({self.n_ubatch})")
        _check(self.n_ubatch <= self.n_batch, "n_ubatch", self.n_ubatch,
               f"a value <= n_batch ({self.n_batch})")
        _check(self.max_nodes + 1 <= self.n_ubatch, "max_nodes", self.max_nodes,
               f"a value < n_ubatch ({self.n_ubatch}): a tree is verified in one ubatch")
        need = self._ids_needed
        per = "(2 * max_branches + 1)" if self.graph_sampling else "(max_branches + 1)"
        if self.n_seq_max:
            _check(need <= self.n_seq_max, "max_branches", self.max_branches,
                   f"a value with parallel * {per} <= n_seq_max "
                   f"({self.n_seq_max}): one sequence id per branch of every slot")
        _check(need <= 256, "max_branches", self.max_branches,
               f"a value with parallel * {per} <= 256 (llama.cpp's sequence ids)"
               f"; parallel is {self.slots}")

    @property
    def slots(self) -> int:
        """Requests decoded side by side (`parallel`, resolved)."""
        return self.parallel or (4 if self.n_gpu_layers != 0 else 1)

    @property
    def seq_max(self) -> int:
        """Sequence ids of the llama.cpp context (`n_seq_max`, resolved)."""
        return self.n_seq_max or self._ids_needed

    @property
    def graph_sampling(self) -> bool:
        """Whether requests are sampled in llama.cpp's graph (greedy ones, and the plain steps
        of those sampled at a temperature alone): `sample_in_graph`, or for None, where there
        are sequence ids to spare."""
        if self.sample_in_graph is not None:
            return self.sample_in_graph
        need = self.graph_branch_base(self.slots)
        return need <= 256 and (not self.n_seq_max or need <= self.n_seq_max)

    @property
    def _ids_needed(self) -> int:
        """Sequence ids the slots use: per slot its main id and max_branches branch ids, and
        with graph sampling a second block of max_branches sampled branch ids."""
        return self.graph_branch_base(self.slots if self.graph_sampling else 0)

    def graph_branch_base(self, slot: int) -> int:
        """With sample_in_graph: the first of slot `slot`'s sampled branch sequence ids (after
        every slot's ordinary ids)."""
        return self.slots * (self.max_branches + 1) + slot * self.max_branches



    @property
    def threads(self) -> int:
        return self.n_threads or default_threads()

    def with_(self, **changes: Any) -> SRSDConfig:
        """A copy with some fields changed (validated again)."""
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise ValueError(f"unknown config field(s) {sorted(unknown)}: accepted are "
                             + ", ".join(f.name for f in fields(self)))
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class SamplingParams:
    """Per-call sampling settings. temperature 0 is greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        _float("temperature", self.temperature, 0.0, 100.0)
        _int("top_k", self.top_k, 0)
        _float("top_p", self.top_p, 0.0, 1.0)
        _check(self.top_p > 0.0, "top_p", self.top_p, "a number in (0, 1]")
        _float("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _int("seed", self.seed, 0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
