"""llama.cpp model + context over the low-level ctypes API (see docs/architecture.md).

Sequence 0 holds the committed context. A token tree is verified by giving each
root-to-leaf path a sequence id (`fork` copies the context into ids 1..B-1), decoding all
nodes in one batch, then folding the accepted path back into sequence 0 (`commit`).
"""

from __future__ import annotations

import ctypes
import os
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import MAX_PLAIN_RUN as MAX_RUN
from ..config import SRSDConfig, environment
from .capture import CompiledCapture, HiddenCapture, make_capture, resolve_layer
from .cpubufs import cpu_features, use_extra_buffer_types
from .graph_argmax import (
    DrawState,
    batch_filler,
    draws_available,
    make_draw_sampler,
    make_sampler,
    plain_stepper,
    rows_stepper,
    run_stepper,
    sampled_reader,
)
from .replay import PassReplay
from .spm import SpmTokenizer

_VOCAB_SPM = 1  # llama_vocab_type: SentencePiece (spm.py tokenizes its short texts)
SPM_MAX_CHARS = 48  # longer texts go to llama.cpp's tokenizer (its own cost takes over)
# texts on which spm.py must give llama.cpp's tokens before it is used for a model: words,
# spaces, indentation, line ends, tabs, markup, control-token text, digits, accents, CJK,
# emoji, lone bytes of a vocabulary without them
SPM_CHECKS = ("hello", " world", "def foo(x):\n    return x + 1\n", "  two  spaces   three",
              "\n\n\nnew\tlines\t\ttabs", "<b>bold</b> <h1>x</h1><table>", "<start_of_turn>user",
              "x" * 40, "1234567890 3.14159", "Grüße, café, naïve", "世界 你好", "emoji 🦙🦙!",
              "[multimodal] <end_of_image>", " ", "\n", "a" + " " * 40 + "b", "\u0007\u001f\x7f")


class DecodeError(RuntimeError):
    """llama_decode failed; the message says why."""


class ContextFullError(DecodeError, ValueError):
    pass


_BACKEND_READY = False


def _llama():
    global _BACKEND_READY
    from llama_cpp import llama_cpp as L  # noqa: PLC0415

    if not _BACKEND_READY:
        if not environment().verbose:
            _silence_llama_log(L)
        L.llama_backend_init()
        _BACKEND_READY = True
    return L


_LOG_CB = None
_CTX_FNS: dict[str, object] = {}


def _ctx_fn(L, name: str, restype):
    """llama.cpp's function `name` of a context alone, bound once through a plain ctypes
    prototype (no pointer object or cast per call: tens of microseconds per step on caches a
    forward pass has just flushed)."""
    fn = _CTX_FNS.get(name)
    if fn is None:
        fn = _CTX_FNS[name] = ctypes.CFUNCTYPE(restype, ctypes.c_void_p)((name, L._lib))
    return fn


def _get_logits_address(L, ctx) -> int | None:
    """llama_get_logits as a plain address."""
    return _ctx_fn(L, "llama_get_logits", ctypes.c_void_p)(ctx)


def _sampled_logits_address(L, ctx, i: int) -> int | None:
    """llama_get_sampled_logits_ith as a plain address (None: the row has none)."""
    fn = _CTX_FNS.get("llama_get_sampled_logits_ith")
    if fn is None:
        fn = _CTX_FNS["llama_get_sampled_logits_ith"] = ctypes.CFUNCTYPE(
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32)(
                ("llama_get_sampled_logits_ith", L._lib))
    return fn(ctx, i)


def _synchronize(L, ctx) -> None:
    """llama_synchronize: llama_decode returns once the forward pass is queued, and with GPU
    layers the pass (after the last captured tensor, at least) is still running then;
    waiting here keeps it inside the timed decode (the cost model's step times, the host
    time per step) instead of in the first read of its results."""
    _ctx_fn(L, "llama_synchronize", None)(ctx)


def _silence_llama_log(L) -> None:
    global _LOG_CB

    @L.llama_log_callback
    def _quiet(level, text, _user):  # errors still reach stderr
        if level >= 4:  # GGML_LOG_LEVEL_ERROR
            os.write(2, text)

    _LOG_CB = _quiet
    L.llama_log_set(_LOG_CB, None)


_PROGRESS_CB = None


def _NO_PROGRESS(L):  # llama.cpp prints dots while loading unless given a callback
    global _PROGRESS_CB
    if _PROGRESS_CB is None:
        _PROGRESS_CB = L.llama_progress_callback(lambda _p, _u: True)
    return _PROGRESS_CB


def gpu_offload_supported() -> bool:
    return bool(_llama().llama_supports_gpu_offload())


_DEVICES: list[str] | None = None


def device_names() -> list[str]:
    """The compute devices ggml sees ("CPU", "NVIDIA H200", ...), from its device registry."""
    global _DEVICES
    if _DEVICES is None:
        _llama()
        try:
            from llama_cpp import _ggml  # noqa: PLC0415

            lib = _ggml.libggml
            lib.ggml_backend_dev_count.restype = ctypes.c_size_t
            lib.ggml_backend_dev_get.restype = ctypes.c_void_p
            lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
            lib.ggml_backend_dev_description.restype = ctypes.c_char_p
            lib.ggml_backend_dev_description.argtypes = [ctypes.c_void_p]
            _DEVICES = [(lib.ggml_backend_dev_description(lib.ggml_backend_dev_get(i)) or b"?")
                        .decode("utf-8", "replace") for i in range(lib.ggml_backend_dev_count())]
        except (AttributeError, OSError, ImportError):
            _DEVICES = ["unknown"]
    return _DEVICES


@dataclass
class DecodeOutput:
    logits: np.ndarray  # float32 [n_outputs, n_vocab]; a view valid until the next decode
    # (rows of a llama_decode call whose every output row was sampled in llama.cpp's graph
    # are not copied out: those rows read as NaN)
    hidden: np.ndarray | None  # float32 [n_tokens, n_embd] of the capture layer
    # per output row: the token llama.cpp's in-graph greedy sampler took (-1: the row's first
    # sequence has none); None when no row had one
    sampled: np.ndarray | array | None = None
    # how many plain steps' captured rows went to the address they were given (`step_at`'s
    # and `step_run`'s `stage`) instead of `hidden` (those of the first steps)
    staged: int = 0
    # a run with a check (`step_run`'s `check`): its last token was rejected (not taken;
    # `logits` holds its row, kept by the sequence's sampler)
    rejected: bool = False


class Backend:
    """One llama.cpp model and context. Use as a context manager or call `close()`."""

    def __init__(self, model_path: str | Path, config: SRSDConfig,
                 capture_layer: int | float | None = None) -> None:
        L = self._L = _llama()
        self.config = config
        self.model_path = str(model_path)
        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = 10**6 if config.n_gpu_layers < 0 else config.n_gpu_layers
        mparams.progress_callback = _NO_PROGRESS(L)
        # no repacked weights where llama.cpp's kernels for them crash (see cpubufs.py)
        self.extra_bufts = use_extra_buffer_types(L._lib)
        # whether ggml's CPU backend decodes on OpenMP's threads: then the sampler's draws
        # share that pool (idle between passes); else they would add threads that spin while
        # the backend's own threads decode
        self.cpu_openmp = "OPENMP" in cpu_features(L._lib)
        mparams.use_extra_bufts = self.extra_bufts
        # which device holds which layer ({device, description, where, layers}), when known
        self.placement: list[dict[str, str]] | None = None
        if config.rpc_servers:  # layers split across this machine and RPC workers
            from .rpc import configure_model_params  # noqa: PLC0415

            devices = configure_model_params(L, mparams, config, self.model_path)
            self.placement = devices.placement
        elif config.n_gpu_layers == 0:
            self.placement = [{"device": "CPU", "description": "this machine's CPU",
                               "where": "local", "layers": "all"}]
        self.model = L.llama_model_load_from_file(self.model_path.encode(), mparams)
        if not self.model:
            raise ValueError(f"llama.cpp could not load the model {self.model_path!r} "
                             "(is it a GGUF of an architecture this llama.cpp supports?)")
        self.ctx = None
        self.graph_seqs: frozenset[int] = frozenset()  # sequences sampled in llama.cpp's graph
        self.graph_rows = 0  # output rows whose token llama.cpp's graph took, ever
        self.graph_sampler = ""  # which sampler takes them (_attach_greedy), "" for none
        self.graph_sampling = False  # whether graph samplers are set up
        self._main_chains: dict[int, object] = {}  # sample_main: sequence -> its chain
        self._main_kind: dict[int, tuple] = {}  # and what the chain does
        self._draws: dict[int, list] = {}  # a drawing chain's state and scratch (kept alive)
        # sampled sequences whose rows are copied out as well (keep_rows, sample_main's
        # `keep`)
        self.kept_seqs: frozenset[int] = frozenset()
        # the sampled branch ids' chains (a chain is attached once: a change of kind is a
        # new chain)
        self._branch_chains: dict[int, object] = {}
        self._shares: dict[int, tuple[int, int]] = {}  # branch id -> cells it holds (KV)
        self._lows: dict[int, int] = {}  # branch id -> its main's first position then
        self._text_tokenizer: Callable[[str], list[int]] | None = None
        self.capture: HiddenCapture | CompiledCapture | None = None
        try:
            self.vocab = L.llama_model_get_vocab(self.model)
            self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
            # the logits of a row sampled in llama.cpp's graph (not copied out)
            self._nan_views: dict[int, np.ndarray] = {}
            self._no_rows = self._nan_rows(1)
            self._one_token = array("i", [0])  # its token (reused: like a logits view)
            self.n_embd = L.llama_model_n_embd(self.model)
            self.n_layer = L.llama_model_n_layer(self.model)
            # sliding-window attention's window (Gemma 3: 512 of its layers), 0: none
            self.n_swa = int(getattr(L, "llama_model_n_swa", lambda m: 0)(self.model))
            self.layer = None
            if capture_layer is not None:
                self.layer = resolve_layer(capture_layer, self.n_layer)
                self.capture = make_capture(self.layer, max(config.n_batch, config.n_ubatch),
                                            self.n_embd)
            cparams = L.llama_context_default_params()
            cparams.n_ctx = config.n_ctx * config.slots  # every slot gets n_ctx cells
            cparams.n_batch = config.n_batch
            cparams.n_ubatch = config.n_ubatch
            cparams.n_seq_max = config.seq_max
            cparams.n_threads = cparams.n_threads_batch = config.threads
            cparams.kv_unified = True
            cparams.swa_full = True
            cparams.no_perf = True
            # in-graph sampling: asked for, or (auto) where the sequence ids allow it
            graph = config.graph_sampling
            if graph:  # output rows one sampled sequence may have in a batch: a tree's root
                # and its nodes on one branch
                cparams.n_outputs_max_per_seq = config.max_nodes + 1
            if self.capture is not None:
                cparams.cb_eval = self.capture.callback
                cparams.cb_eval_user_data = self.capture.user_data
            self.ctx = L.llama_init_from_model(self.model, cparams)
            if not self.ctx:
                raise ValueError(f"llama.cpp could not create a context with n_ctx={config.n_ctx}"
                                 f" x {config.slots} slots, n_batch={config.n_batch}, "
                                 f"n_seq_max={config.seq_max}")
            self.n_ctx = L.llama_n_ctx(self.ctx)
            self.n_batch = L.llama_n_batch(self.ctx)  # llama.cpp clamps it to n_ctx
            self.mem = L.llama_get_memory(self.ctx)
            if graph:
                self.graph_sampling = True
                self._attach_greedy([config.graph_branch_base(i) + b
                                     for i in range(config.slots)
                                     for b in range(config.max_branches)],
                                    required=config.sample_in_graph is not None)
            self._batch = L.llama_batch_init(self.n_batch, 0, config.seq_max)
            cap = self.n_batch
            self._b_tok = np.ctypeslib.as_array(self._batch.token, shape=(cap,))
            self._b_pos = np.ctypeslib.as_array(self._batch.pos, shape=(cap,))
            self._b_nseq = np.ctypeslib.as_array(self._batch.n_seq_id, shape=(cap,))
            self._b_logits = np.ctypeslib.as_array(self._batch.logits, shape=(cap,))
            # a call's in-graph sampled tokens (an int32 array("i"): its address and its
            # slices come without numpy's calls, each slow on the caches a pass flushed)
            self._tokens_buf = array("i", bytes(4 * cap))
            self._tokens_addr = self._tokens_buf.buffer_info()[0]
            self._reader = sampled_reader(L)  # reads them in one call (None: one per row)
            self._filler = batch_filler(self._batch)  # a tree's rows in one call (or None)
            # a plain step in one call (None: through ctypes; the Python capture's callback
            # cannot be switched from C)
            stepper = None if isinstance(self.capture, HiddenCapture) else plain_stepper(
                L, self.ctx, self._batch, None if self.capture is None else self.capture.state,
                self.n_embd)
            self._stepper, self._step_state = stepper or (None, None)
            # ... and a pass whose rows' sampled tokens are read (a tree's), likewise
            self._rows_step = None if stepper is None else rows_stepper(self._step_state)
            # ... and a run of plain steps, each decoding the token the last one sampled
            self._run, self._run_eog = (None, 0) if stepper is None else \
                run_stepper(L, self._step_state)
            self._run_buf = array("i", bytes(4 * MAX_RUN))
            self._run_addr = self._run_buf.buffer_info()[0]
            # the plain step writes its one token, and every step its rows' sequence ids,
            # through ctypes pointers (fewer calls into numpy on caches a forward pass just
            # flushed)
            b = self._batch
            self._p_one = (b.token, b.pos, b.logits, b.n_seq_id, b.seq_id[0])
            self._p_seq = [b.seq_id[i] for i in range(cap)]  # per row: its ids' array
            self._piece_cache: dict[int, bytes] = {}
            self._eog: dict[int, bool] = {}
            self._views: dict[tuple[int | None, int], np.ndarray] = {}
            self.n_past = 0  # tokens of sequence 0 in the KV cache
            self.decode_seconds = 0.0  # time spent inside llama_decode, ever
            # a recording of llama_decode calls, recorded or served (engine/replay.py)
            self.replay: PassReplay | None = None
            # recurrent and hybrid models keep a state that cannot roll back part of a
            # sequence: no trees there (the engine decodes plainly and says so once)
            self.can_speculate = not (L.llama_model_is_recurrent(self.model)
                                      or L.llama_model_is_hybrid(self.model))
        except BaseException:
            self.close()
            raise

    @property
    def can_draw(self) -> bool:
        """Whether a sampled request's rows can be drawn in llama.cpp's graph here (graph
        sampling set up, logits computed on the CPU, the draw samplers built)."""
        return self.graph_sampling and self._output_on_cpu() and draws_available()

    @property
    def sample_threads(self) -> int:
        """Threads a sampled row is drawn on: the decode's, where the CPU backend runs on
        OpenMP (the compiled draw shares that pool, idle while a row is sampled); else one."""
        return self.config.threads if self.cpu_openmp else 1

    def _output_on_cpu(self) -> bool:
        """Whether llama.cpp computes the logits on this machine's CPU: no GPU offload, or
        fewer offloaded layers than the model's layers and its output layer."""
        cfg = self.config
        if cfg.rpc_servers:
            return False
        if cfg.n_gpu_layers == 0 or not gpu_offload_supported():
            return True
        return 0 <= cfg.n_gpu_layers <= self.n_layer

    def _attach_greedy(self, seqs: Sequence[int], required: bool = True) -> None:
        """A greedy sampler chain on each of these sequences (one chain each: a chain serves
        one sequence), so their rows' argmax is taken in llama.cpp's graph: the compiled
        samplers of graph_argmax.py (on a CPU, its argmax on every thread), else llama.cpp's
        own greedy sampler. Where llama.cpp refuses one, an error, or without `required`
        none stays attached."""
        L = self._L
        self.graph_sampler = "llama"
        for s in seqs:
            chain = self._branch_chains[s] = self._greedy_chain()
            if not L.llama_set_sampler(self.ctx, s, chain):
                if not required:
                    for q in seqs:
                        L.llama_set_sampler(self.ctx, q, None)
                    self.graph_sampler = ""
                    self.graph_sampling = False
                    return
                raise ValueError("sample_in_graph: llama.cpp could not take the argmax in its "
                                 "graph on this device setup (backend sampling is not "
                                 "supported with a tensor split); run without it")
        self.graph_seqs = frozenset(seqs)

    def _greedy_chain(self, keep: bool = False):
        """A new sampler chain of one greedy sampler: the compiled one of graph_argmax.py
        where it can be built (on a CPU, its argmax on every thread), else llama.cpp's.
        `keep`: the row is copied out as well, as its sampled logits (llama.cpp's own greedy
        sampler always does that)."""
        L = self._L
        threads = self._output_on_cpu()
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        smpl = (make_sampler(L, threads, keep) if environment().graph_sampler == "srsd"
                else None)
        if smpl is not None:
            self.graph_sampler = "srsd-threads" if threads else "srsd-ggml"
        L.llama_sampler_chain_add(chain, smpl or L.llama_sampler_init_greedy())
        return chain

    def sample_main(self, seq: int, on: bool, keep: bool = False,
                    draw: float | None = None) -> bool:
        """Take (`on`) or stop taking the argmax of sequence `seq`'s rows in llama.cpp's graph:
        for a slot's main sequence while it serves a greedy request that needs no logits, so
        that its plain steps and its chains' rows come back as token ids (no row copied out,
        no argmax on the host); with `keep`, rows copied out as well (a greedy request under
        a grammar: the argmax checked first, the row read where the grammar rejects it).
        `draw` (a temperature, on a CPU): instead of the argmax, the row's token drawn at
        that temperature with the uniform draw set in `draw_state(seq)` before each pass (a
        sampled request's plain steps; None where it cannot be built). Only where graph
        sampling is set up (`graph_sampling`); the next pass after a change re-plans
        llama.cpp's graph (a few milliseconds on a CPU). Returns whether the sequence is
        sampled in the graph now."""
        if not self.graph_sampling:
            return seq in self._main_chains
        kind = (None if not on else ("draw", draw) if draw is not None else
                ("kept",) if keep else ("argmax",))
        if self._main_kind.get(seq) == kind:
            return on
        L = self._L
        chain = state = None
        if kind is not None:
            if draw is None:
                chain = self._greedy_chain(keep)
            elif self._output_on_cpu():
                made = make_draw_sampler(L, draw, self.n_vocab)
                if made is not None:
                    smpl, *state = made
                    chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
                    L.llama_sampler_chain_add(chain, smpl)
        old = self._main_chains.pop(seq, None)
        ok = L.llama_set_sampler(self.ctx, seq, chain)  # (None: taken off)
        if old is not None:  # replaced, taken off, or dropped by a refusal: not the context's
            L.llama_sampler_free(old)
        self._main_kind.pop(seq, None)
        self._draws.pop(seq, None)  # (its chain is freed)
        self.graph_seqs = self.graph_seqs - {seq}
        self.kept_seqs = self.kept_seqs - {seq}
        if chain is None or not ok:
            if chain is not None:
                L.llama_sampler_free(chain)
            return False
        self._main_chains[seq], self._main_kind[seq] = chain, kind
        self.graph_seqs = self.graph_seqs | {seq}
        if keep:
            self.kept_seqs = self.kept_seqs | {seq}
        if state is not None:
            self._draws[seq] = state
        return True

    def draw_state(self, seq: int) -> DrawState | None:
        """The draw state of sequence `seq` when its rows are drawn in the graph
        (`sample_main`'s `draw`): set its `u` before each pass."""
        got = self._draws.get(seq)
        return None if got is None else got[0]

    def keep_rows(self, seqs: Sequence[int], on: bool) -> bool:
        """Whether the rows of these sampled branch ids (set up with graph sampling) are
        copied out as well as their argmax taken (`on`: for a greedy request under a grammar)
        or their argmax alone comes back. Returns whether they are as asked now (llama.cpp
        refused no chain)."""
        L = self._L
        for s in seqs:
            old = self._branch_chains.get(s)
            if old is None or s not in self.graph_seqs or (s in self.kept_seqs) == on:
                continue
            chain = self._branch_chains[s] = self._greedy_chain(on)
            ok = L.llama_set_sampler(self.ctx, s, chain)
            L.llama_sampler_free(old)  # (replaced, or dropped by llama.cpp's refusal)
            if not ok:  # back to an argmax alone
                chain = self._branch_chains[s] = self._greedy_chain()
                self.kept_seqs = self.kept_seqs - {s}
                if not L.llama_set_sampler(self.ctx, s, chain):
                    raise DecodeError(f"llama.cpp no longer takes a sampler for sequence {s}")
                return False
            self.kept_seqs = self.kept_seqs | {s} if on else self.kept_seqs - {s}
        return True

    # -- lifecycle ------------------------------------------------------------------------
    def close(self) -> None:
        L = self._L
        if getattr(self, "_batch", None) is not None:
            L.llama_batch_free(self._batch)
            self._batch = None
        if self.ctx:
            L.llama_free(self.ctx)
            self.ctx = None
        for chain in [*getattr(self, "_branch_chains", {}).values(),
                      *getattr(self, "_main_chains", {}).values()]:
            L.llama_sampler_free(chain)  # (the context no longer uses them)
        self._branch_chains, self._main_chains = {}, {}
        if self.model:
            L.llama_model_free(self.model)
            self.model = None

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- model facts ----------------------------------------------------------------------
    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(4096)
        n = self._L.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    def chat_template(self) -> str | None:
        ptr = self._L.llama_model_chat_template(self.model, None)
        return ptr.decode("utf-8", "replace") if ptr else None

    @property
    def eos_token(self) -> int:
        return int(self._L.llama_vocab_eos(self.vocab))

    def token_text(self, token: int) -> str:
        return (self._L.llama_vocab_get_text(self.vocab, token) or b"").decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        out = self._eog.get(token)
        if out is None:
            out = self._eog[token] = bool(self._L.llama_vocab_is_eog(self.vocab, token))
        return out

    @property
    def name(self) -> str:
        return self.meta("general.name") or Path(self.model_path).stem

    # -- tokens ---------------------------------------------------------------------------
    def tokenize(self, text: str, add_bos: bool = True, special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (self._L.llama_token * cap)()
        n = self._L.llama_tokenize(self.vocab, data, len(data), buf, cap, add_bos, special)
        if n < 0:
            cap = -n
            buf = (self._L.llama_token * cap)()
            n = self._L.llama_tokenize(self.vocab, data, len(data), buf, cap, add_bos, special)
        return list(buf[:n])

    def text_tokenizer(self) -> Callable[[str], list[int]]:
        """`tokenize(text, add_bos=False, special=False)` for the short texts drafting
        tokenizes: the same tokens from the Python tokenizer of spm.py where this model's
        vocabulary is of llama.cpp's SPM type and that tokenizer gives llama.cpp's tokens
        on a set of test texts (built on first use: ~0.5 s), else llama.cpp's."""
        if self._text_tokenizer is None:
            self._text_tokenizer = self._make_text_tokenizer()
        return self._text_tokenizer

    def _make_text_tokenizer(self) -> Callable[[str], list[int]]:
        def slow(text: str) -> list[int]:
            return self.tokenize(text, add_bos=False, special=False)

        L, vocab = self._L, self.vocab
        if environment().tokenizer == "llama" or L.llama_vocab_type(vocab) != _VOCAB_SPM:
            return slow
        n = self.n_vocab
        fast = SpmTokenizer.from_vocab(
            [L.llama_vocab_get_text(vocab, t) or b"" for t in range(n)],
            [L.llama_vocab_get_score(vocab, t) for t in range(n)],
            [L.llama_vocab_get_attr(vocab, t) for t in range(n)],
            self.meta("tokenizer.ggml.add_space_prefix") == "true")
        if fast is None or any(fast(t) != slow(t) for t in SPM_CHECKS):
            return slow

        def tokenize(text: str) -> list[int]:
            return fast(text) if len(text) <= SPM_MAX_CHARS else slow(text)

        return tokenize

    def piece(self, token: int) -> bytes:
        out = self._piece_cache.get(token)
        if out is None:
            buf = ctypes.create_string_buffer(64)
            n = self._L.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = self._L.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
            out = self._piece_cache[token] = buf.raw[:n]
        return out

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", "replace")

    # -- decoding -------------------------------------------------------------------------
    def decode(self, tokens: Sequence[int], positions: Sequence[int] | None = None,
               seq_ids: Sequence[Sequence[int]] | None = None,
               want_logits: str | Sequence[bool] = "last") -> DecodeOutput:
        """Decode tokens (more than n_batch are split into several llama_decode calls).

        positions default to n_past, n_past+1, ...; seq_ids default to [0] for every token;
        want_logits is "last", "all", "none" or one flag per token. Returns the logits rows of
        the flagged tokens in order and the captured hidden rows of every token.
        """
        n = len(tokens)
        if n == 0:
            raise ValueError("decode needs at least one token")
        if type(tokens) is array and type(positions) is array and \
                type(want_logits) is array and seq_ids is not None and n <= self.n_batch and \
                self._filler is not None and tokens.typecode == positions.typecode == "i" \
                and want_logits.typecode == "b":  # (a tree's pass)
            return self._decode_rows(tokens, positions, seq_ids, want_logits)
        if seq_ids is None:  # sequence 0, with its logits
            self.sample_main(0, False)
        pos = (np.arange(self.n_past, self.n_past + n, dtype=np.int32) if positions is None
               else np.asarray(positions, dtype=np.int32))
        if isinstance(want_logits, str):
            flags = np.zeros(n, dtype=np.int8)
            if want_logits == "all":
                flags[:] = 1
            elif want_logits == "last":
                flags[-1] = 1
            elif want_logits != "none":
                raise ValueError(f"want_logits={want_logits!r}: accepted are 'last', 'all', "
                                 "'none' or one flag per token")
        else:
            flags = np.asarray(want_logits, dtype=np.int8)
        top = int(pos.max()) + 1
        if top > self.n_ctx:
            raise ContextFullError(f"context is full: {top} tokens, n_ctx={self.n_ctx}")
        toks = np.asarray(tokens, dtype=np.int32)
        cap = self.n_batch
        logits_parts, hidden_parts, sampled_parts = [], [], []
        any_sampled = False
        for s in range(0, n, cap):
            e = min(n, s + cap)
            ids = None if seq_ids is None else seq_ids[s:e]
            self._fill(toks[s:e], pos[s:e], ids, flags[s:e])
            n_out = int(np.count_nonzero(flags[s:e]))
            logits, hidden, got, some = self._run_filled(e - s, n_out, ids, None, e == n)
            any_sampled = any_sampled or some
            if got is not None:
                sampled_parts.append(got)
            if logits is not None:
                logits_parts.append(logits)
            if hidden is not None or self.capture is not None:
                hidden_parts.append(hidden)
        if seq_ids is None:  # a plain decode of sequence 0; tree passes end with commit()
            self.n_past = max(self.n_past, top)
        logits = (logits_parts[0] if len(logits_parts) == 1 else
                  np.concatenate(logits_parts) if logits_parts else
                  np.zeros((0, self.n_vocab), np.float32))
        hidden = None
        if hidden_parts and all(h is not None for h in hidden_parts):
            hidden = hidden_parts[0] if len(hidden_parts) == 1 else np.concatenate(hidden_parts)
        sampled = None
        if any_sampled:
            sampled = np.concatenate(sampled_parts) if len(sampled_parts) > 1 else \
                sampled_parts[0]
        return DecodeOutput(logits=logits, hidden=hidden, sampled=sampled)

    def _decode_rows(self, tokens: array, positions: array, seq_ids: Sequence[Sequence[int]],
                     flags: array) -> DecodeOutput:
        """`decode` of one llama_decode call's rows given as arrays (tokens and positions
        `array("i")`, flags `array("b")`), the batch filled in one compiled call: a tree's
        pass, without numpy's calls on its way in. Its hidden rows are a view of the
        capture's buffer (as its logits rows are of llama.cpp's): valid until the next
        decode."""
        n = len(tokens)
        top = max(positions) + 1
        if top > self.n_ctx:
            raise ContextFullError(f"context is full: {top} tokens, n_ctx={self.n_ctx}")
        nseq, seq = array("i"), array("i")
        for ids in seq_ids:
            nseq.append(len(ids))
            seq.extend(ids)
        n_out = self._filler(n, tokens, positions, flags, nseq, seq)
        logits, hidden, got, some = self._run_filled(n, n_out, seq_ids, flags, True, False)
        if logits is None:
            logits = np.zeros((0, self.n_vocab), np.float32)
        return DecodeOutput(logits=logits, hidden=hidden, sampled=got if some else None)

    def _run_filled(self, m: int, n_out: int, ids: Sequence[Sequence[int]] | None,
                    flags: array | None, last: bool, copy_hidden: bool = True
                    ) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None, bool]:
        """One llama_decode call of the batch's first m rows, filled (`ids`: their sequence
        ids, None for sequence 0 alone; `flags`: their output flags where known, else read
        back from the batch): its logits rows (None without output rows), captured hidden
        rows, in-graph sampled token per output row (-1: none; None: no row has a sampler)
        and whether any row was sampled. Rows of a call that is not the `last` of a decode
        are copied (the next call overwrites the buffers); without `copy_hidden` the hidden
        rows are a view of the capture's buffer, as the logits rows are of llama.cpp's."""
        # what the rows will be is known before the pass: worked out now, while the caches
        # still hold this code (a forward pass flushes them)
        plan = (self._graph_plan(m, ids, flags) if n_out and self.graph_seqs and
                ids is not None else None)
        if plan is not None and max(plan[1]) < 0:  # no output row is sampled in graph
            plan = None
        # a sampled row copied out as well: where the copied rows are found
        kept = (self._first_kept(ids, self._b_logits[:m] if flags is None else flags)
                if plan is not None and self.kept_seqs else None)
        raw, sampled, some = True, None, False
        if plan is not None and self._rows_step is not None and self.replay is None:
            raw, rows = plan  # the pass and the reading of its sampled tokens in one call
            some = self._decode_sampled(m, rows)
            sampled = self._tokens_buf[: len(rows)]  # (an array's slice: a copy)
        else:
            if self.capture is not None:
                self.capture.reset()
            self._decode_batch(m)
            if plan is not None:
                raw, got, some = self._sampled(plan)
                sampled = got if last or type(got) is array else got.copy()  # (a reused
                # buffer)
        logits = None
        if n_out and raw:  # a view of llama.cpp's buffer: the next call overwrites it
            view = self._logits(n_out)
            logits = view if last else view.copy()
        elif n_out and kept is not None:  # every row was sampled in its graph, some rows
            # copied out as well (the others' rows there are not theirs: never read)
            view = self._kept_rows(kept, n_out)
            logits = view if last else view.copy()
        elif n_out:  # not copied out by llama.cpp: every row was sampled in its graph
            logits = self._nan_rows(n_out)
        hidden = self._captured(copy_hidden) if self.capture is not None else None
        return logits, hidden, sampled, some

    def _graph_plan(self, m: int, seq_ids: Sequence[Sequence[int]] | None = None,
                    flags: array | None = None) -> tuple[bool, array]:
        """For a llama_decode call of the batch's first m rows (`seq_ids`: theirs, read
        back from the batch when not given), known before it runs: whether llama.cpp
        copies the logits rows out (unless every output row's sequences all have a
        sampler), and per output row the batch row whose in-graph sampled token is read
        after it (-1: not sampled; a row's sampler is its first sequence's)."""
        graph, seqs, nseq = self.graph_seqs, self._p_seq, self._b_nseq
        raw, rows = False, array("i")  # (an int32 array: read in one compiled call)
        if flags is None:
            flags = self._b_logits[:m].tolist()
        for i, flag in enumerate(flags):
            if not flag:
                continue
            ids = (seq_ids[i] if seq_ids is not None else
                   [seqs[i][j] for j in range(int(nseq[i]))])
            if not raw and any(q not in graph for q in ids):
                raw = True
            rows.append(i if ids[0] in graph else -1)
        return raw, rows

    def _first_kept(self, seq_ids: Sequence[Sequence[int]], flags: array | None
                    ) -> tuple[int, int] | None:
        """The first output row whose first sequence is in `kept_seqs`: (its batch row, its
        output row), or None."""
        kept, out = self.kept_seqs, 0
        for i, ids in enumerate(seq_ids):
            if flags is not None and not flags[i]:
                continue
            if ids[0] in kept:
                return i, out
            out += 1
        return None

    def _kept_rows(self, at: tuple[int, int], n_out: int) -> np.ndarray:
        """The n_out output rows of the last decode as llama.cpp copied them out for sampled
        rows (its "sampled logits"; rows copied out in output order), found from output row
        at[1] (batch row at[0]), which has one: a view (views cached per address)."""
        addr = _sampled_logits_address(self._L, self.ctx, at[0])
        if not addr:
            raise DecodeError("llama.cpp returned no logits for a row sampled in its graph "
                              "with its row kept")
        return self._rows_at(addr - at[1] * self.n_vocab * 4, n_out)

    def _rows_at(self, address: int, n_out: int) -> np.ndarray:
        """n_out rows of n_vocab float32 values at `address` (llama.cpp's buffer) as an array
        view, cached per address and row count."""
        key = (address, n_out)
        view = self._views.get(key)
        if view is None:
            if len(self._views) > 64:
                self._views.clear()
            buf = (ctypes.c_float * (n_out * self.n_vocab)).from_address(address)
            view = self._views[key] = np.frombuffer(buf, np.float32).reshape(n_out,
                                                                             self.n_vocab)
        return view

    def _sampled(self, plan: tuple[bool, array]) -> tuple[bool, np.ndarray, bool]:
        """After the llama_decode call `plan` (_graph_plan) was made for: whether llama.cpp
        copied the logits rows out, the in-graph sampled token of each output row or -1 (a
        recorded or served call's as its recording holds it), and whether any row has one.
        The tokens are an int32 array("i") of their own (a recorded or served call's: a view
        of a buffer the next call overwrites, as logits rows are)."""
        rep = self.replay
        if rep is not None:
            raw, got = rep.sampled_rows()
            some = int(np.count_nonzero(got >= 0))
        else:
            raw, rows = plan
            some = self._read_sampled(rows, self._tokens_buf)
            got = self._tokens_buf[: len(rows)]  # (an array's slice: a copy)
        self.graph_rows += some
        return raw, got, some > 0

    def _read_sampled(self, rows: array, out: array | np.ndarray) -> int:
        """Into `out` (an int32 array("i") or numpy array): the in-graph sampled token of
        each batch row in `rows` (-1 for -1) after the last llama_decode call; how many were
        sampled (in one compiled call where there is a build, else one call into llama.cpp
        per row)."""
        if self._reader is not None:
            return self._reader(self.ctx, rows, self._tokens_addr if out is self._tokens_buf
                                else out.ctypes.data)
        get, ctx = self._L.llama_get_sampled_token_ith, self.ctx
        some = 0
        for k, i in enumerate(rows):
            if i >= 0:
                out[k] = get(ctx, i)
                some += 1
            else:
                out[k] = -1
        return some

    def graph_outputs(self, m: int, seq_ids: Sequence[Sequence[int]] | None = None
                      ) -> tuple[bool, np.ndarray]:
        """`_sampled`'s answer read from llama.cpp for the batch's first m rows (their
        sequence ids read back from the batch when not given), in a new array."""
        raw, rows = self._graph_plan(m, seq_ids)
        got = np.empty(len(rows), np.int32)
        self._read_sampled(rows, got)
        return raw, got

    def _nan_rows(self, n_out: int) -> np.ndarray:
        """The logits of n_out rows sampled in llama.cpp's graph (not copied out): NaN, one
        read-only view per row count."""
        view = self._nan_views.get(n_out)
        if view is None:
            view = self._nan_views[n_out] = np.broadcast_to(np.float32(np.nan),
                                                            (n_out, self.n_vocab))
        return view

    def step(self, token: int) -> DecodeOutput:
        """Decode one token of sequence 0 at n_past with its logits: the plain step, without
        the general path's allocations."""
        self.sample_main(0, False)  # sequence 0, with its logits
        out = self.step_at(token, self.n_past, 0)
        self.n_past += 1
        return out

    def step_at(self, token: int, pos: int, seq: int, capture: bool | None = None,
                stage: int = 0) -> DecodeOutput:
        """Decode one token of sequence `seq` at position `pos` with its logits; `capture`:
        whether the hidden-state capture takes its row (None: as it was set). `stage`: an
        address for n_embd float32 values where the compiled step may put the captured row
        instead of returning it (`staged`: 1 where it did)."""
        if pos >= self.n_ctx:
            raise ContextFullError(f"context is full: {pos + 1} tokens, n_ctx={self.n_ctx}")
        main = seq in self._main_chains  # its argmax taken in the graph: no row copied out
        step = self._stepper
        if step is not None and self.replay is None:  # the whole step in one compiled call
            if capture is None:
                capture = self.capture is not None and self.capture.enabled
            # timed around the call, as a llama_decode through ctypes is: the return into
            # Python after a forward pass (its code back into the caches the pass flushed,
            # some 40 us on a CPU) counts as the pass's, in every path alike
            t0 = time.perf_counter()
            rc = step(token, pos, seq, capture, main, stage or None)
            self.decode_seconds += time.perf_counter() - t0
            st = self._step_state
            if rc != 0:
                self._decode_failed(rc, 1)
            staged = stage and st.staged
            hidden = None if staged or self.capture is None else self.capture.rows()
            if main:
                got = self._one_token
                got[0] = st.token
                self.graph_rows += 1
                rows = self._kept_rows((0, 0), 1) if seq in self.kept_seqs else self._no_rows
                return DecodeOutput(rows, hidden, got, staged)
            return DecodeOutput(self._logits(1), hidden, None, staged)
        if capture is not None and self.capture is not None:
            self.capture.enabled = capture
        self._batch.n_tokens = 1
        tok, p, logits, nseq, seq0 = self._p_one
        tok[0], p[0], logits[0], nseq[0], seq0[0] = token, pos, 1, 1, seq
        if self.capture is not None:
            self.capture.reset()
        self._decode_batch(1)
        hidden = None if self.capture is None else self._captured()
        if main:
            rep, got = self.replay, self._one_token
            got[0] = (rep.sampled_rows()[1][0] if rep is not None else
                      self._L.llama_get_sampled_token_ith(self.ctx, 0))
            self.graph_rows += 1
            rows = (self._kept_rows((0, 0), 1) if seq in self.kept_seqs and rep is None else
                    self._no_rows)
            return DecodeOutput(rows, hidden, got)
        return DecodeOutput(self._logits(1), hidden)

    def can_run(self, seq: int) -> bool:
        """Whether `step_run` can decode several plain steps of sequence `seq` in one call:
        a compiled build, the sequence's argmax taken in the graph, no replay."""
        return self._run is not None and self.replay is None and seq in self._main_chains

    def step_run(self, token: int, pos: int, seq: int, n: int, capture: bool,
                 stage: int = 0, capture_from: int = 0, draws: array | None = None,
                 check: tuple[int, int] | None = None) -> DecodeOutput:
        """Up to n plain steps of sequence `seq` (see `can_run`) in one compiled call: `token`
        at `pos`, then the token the graph took for it at pos + 1, and so on; it stops
        early after an end-of-generation token. `sampled` holds each step's token (an
        array("i") reused by the next call). With `capture`, the hidden rows of the steps
        from `capture_from` on are captured (the others' not), written one after the other
        from `stage` (an address with room for n rows; 0: nowhere) where they can be
        (`staged` of them, the first ones), the last step's row in `hidden` where it was
        not. `draws`: for a sequence whose tokens are drawn in the graph (`sample_main`'s
        `draw`), each step's uniform draw (an array("d") of at least n). `check`: (address of
        a C check, address of its data), see grammar.py's `run_check`: each step's token is
        checked; the run stops after one the check ends it with, or at one it rejects (not
        taken: `rejected`, the row in `logits`; the sequence's sampler must keep its rows,
        `keep_rows`). Context positions past n_ctx, or n outside 1..MAX_RUN, raise."""
        if not 1 <= n <= MAX_RUN:
            raise ValueError(f"a run of {n} plain steps: accepted are 1 to {MAX_RUN}")
        if pos + n > self.n_ctx:
            raise ContextFullError(f"context is full: {pos + n} tokens, n_ctx={self.n_ctx}")
        if self._run is None or seq not in self._main_chains:
            raise RuntimeError("a run of plain steps needs the compiled step and the "
                               "sequence's tokens taken in the graph (see can_run)")
        draw_u = u = None
        if draws is not None:
            state = self.draw_state(seq)
            if state is None or len(draws) < n or draws.typecode != "d":
                raise ValueError("draws: an array('d') of a uniform draw per step, for a "
                                 "sequence whose tokens are drawn in the graph")
            draw_u, u = ctypes.addressof(state) + DrawState.u.offset, draws.buffer_info()[0]
        if check is not None and seq not in self.kept_seqs:
            raise ValueError("a run whose tokens are checked needs the sequence's rows kept "
                             "(keep_rows): a rejected token's row is read")
        fn, data = check if check is not None else (None, None)
        t0 = time.perf_counter()
        rc = self._run(token, pos, seq, capture, capture_from, n, stage or None,
                       self._run_addr, self._run_eog, self.vocab, draw_u, u, fn, data)
        self.decode_seconds += time.perf_counter() - t0
        st = self._step_state
        done = st.token
        self.graph_rows += done
        if rc != 0:
            self._decode_failed(rc, 1)
        tokens = self._run_buf[:done]
        if tokens[-1] < 0:
            raise DecodeError("llama.cpp's graph took no token for a plain step's row")
        staged = st.staged if stage else 0
        captured = max(0, done - capture_from) if capture else 0
        hidden = (self.capture.rows() if self.capture is not None and staged < captured
                  else None)
        if check is not None and st.verdict == 0:
            return DecodeOutput(self._kept_rows((0, 0), 1), hidden, tokens, staged, True)
        return DecodeOutput(self._no_rows, hidden, tokens, staged)

    def _captured(self, copy: bool = True) -> np.ndarray | None:
        """The hidden rows the last llama_decode call captured (without `copy`, where the
        capture can: a view of its buffer, valid until the next decode)."""
        rep = self.replay
        if rep is not None and rep.serving:
            return rep.captured()
        return self.capture.rows() if copy else self.capture.rows(copy=False)

    def _logits(self, n_out: int) -> np.ndarray:
        """The logits rows of the last decode as an array view (views cached per address)."""
        rep = self.replay
        if rep is not None and rep.serving:
            return rep.logits
        address = _get_logits_address(self._L, self.ctx)
        if not address:
            raise DecodeError("llama.cpp returned no logits for the last decode")
        return self._rows_at(address, n_out)

    def _fill(self, toks: np.ndarray, pos: np.ndarray, seq_ids, flags: np.ndarray) -> None:
        m = len(toks)
        self._batch.n_tokens = m
        self._b_tok[:m] = toks
        self._b_pos[:m] = pos
        self._b_logits[:m] = flags
        rows = self._p_seq  # ctypes pointers: no numpy call per row
        if seq_ids is None:
            self._b_nseq[:m] = 1
            for i in range(m):
                rows[i][0] = 0
        else:
            self._b_nseq[:m] = [len(ids) for ids in seq_ids]
            for row, ids in zip(rows, seq_ids):
                for j, s in enumerate(ids):
                    row[j] = s

    def _decode_batch(self, m: int) -> None:
        rep = self.replay
        if rep is not None and rep.serving:
            rep.serve(self, m)
            return
        t0 = time.perf_counter()
        rc = self._L.llama_decode(self.ctx, self._batch)
        if rc == 0:
            _synchronize(self._L, self.ctx)
        dt = time.perf_counter() - t0
        self.decode_seconds += dt
        if rc == 0:
            if rep is not None:
                rep.record(self, m, dt)
            return
        self._decode_failed(rc, m)

    def _decode_sampled(self, m: int, rows: array) -> bool:
        """`_decode_batch(m)` then `_read_sampled(rows, self._tokens_buf)` in one compiled
        call (`_rows_step`); whether any row was sampled. Timed as a llama_decode through
        ctypes is (around the call: the return into Python counts as the pass's), less the
        reading of the tokens, which counts as the host's, as it does elsewhere."""
        st = self._step_state
        t0 = time.perf_counter()
        rc = self._rows_step(rows.buffer_info()[0], len(rows), self._tokens_addr)
        self.decode_seconds += time.perf_counter() - t0 - st.read_seconds
        if rc != 0:
            self._decode_failed(rc, m)
        some = st.token
        self.graph_rows += some
        return some > 0

    def _decode_failed(self, rc: int, m: int) -> None:
        """Raise what llama_decode's return code `rc` for a batch of m tokens means."""
        if rc == 1:
            raise ContextFullError(f"context is full: no KV cache slot for {m} more tokens "
                                   f"({self.n_past} in use, n_ctx={self.n_ctx})")
        if rc == 2:
            raise DecodeError("llama_decode was aborted")
        raise DecodeError(f"llama_decode failed with code {rc} for a batch of {m} tokens "
                          "(invalid batch: positions, sequence ids or tokens out of range)")

    def profile(self, sizes: Sequence[int], reps: int = 5, long_ctx: int = 1024
                ) -> tuple[list[float], float, int]:
        """Step costs for the controller: seconds of one decode of n tokens (logits for
        all) for each n in sizes at a short context, plus seconds per (token x context
        token) from the largest size at a long context. Uses and then clears the context.

        Each figure is the fastest of `reps` timings (other load on the machine only ever
        adds time; the controller refines these figures from real steps anyway), taken in
        rounds over all sizes after a warm-up round: a virtual machine's speed moves for
        seconds at a time (t(16) measured 147 and 107 ms a few seconds apart on a 2-core
        VM), and a slow spell then costs one round of every size instead of every timing
        of the sizes it overlapped, which would bend the profile's shape."""
        text = "The quick brown fox jumps over the lazy dog. "
        self.clear()
        filler = self.tokenize(text * 12)
        self.decode(filler, want_logits="none")
        ctx0 = self.n_past

        def once(n: int, base: int) -> float:
            t0 = time.perf_counter()
            res = self.decode([filler[1 + i % (len(filler) - 1)] for i in range(n)],
                              want_logits="all")
            np.argmax(res.logits, axis=1)
            seconds = time.perf_counter() - t0
            self.trim(base)
            return seconds

        def fastest(ns: Sequence[int], base: int) -> list[float]:
            best = [np.inf] * len(ns)
            for r in range(max(reps, 1) + 1):  # round 0 is a warm-up
                for i, n in enumerate(ns):
                    t = once(n, base)
                    if r:
                        best[i] = min(best[i], t)
            return [float(t) for t in best]

        short = fastest(sizes, ctx0)
        per_kv = 0.0
        n_long = min(int(sizes[-1]), 32)
        long_ctx = min(long_ctx, self.n_ctx - n_long - 1)
        if long_ctx > 2 * ctx0:
            self.clear()
            many = self.tokenize(text * (long_ctx // 8 + 1))[:long_ctx]
            self.decode(many, want_logits="none")
            t_long = fastest([n_long], self.n_past)[0]
            t_short = float(np.interp(n_long, sizes, short))
            per_kv = max(0.0, (t_long - t_short) / (n_long * (self.n_past - ctx0)))
        self.clear()
        return short, per_kv, ctx0

    # -- KV cache -------------------------------------------------------------------------
    # Sequence-explicit operations (the engine's slots: each owns a main sequence id `base`
    # and the branch ids base+1..base+B-1 of its trees); the methods without `seq_` work on
    # sequence 0 and `n_past` (single-sequence use: profiling, verification, tests).
    #
    # A branch id keeps the main sequence's cells between trees: a tree's rows attend to
    # the cells of their first sequence id, so every branch id must hold the whole context,
    # and copying all of it into each branch for every tree (then dropping it again) costs
    # llama.cpp a bookkeeping entry per cell and branch both ways: 0.7 ms for a two-branch
    # tree at 2k tokens of context on a CPU, 1.5 ms at 3.4k, as much as verifying it. So a
    # commit drops only the tree's cells from the branch ids, and the next fork copies only
    # the cells the main sequence got since. `_shares[s] = (base, end)`: branch id s holds
    # exactly the cells of sequence `base` at positions < end (and nothing else, outside a
    # tree pass); every removal from `base` is applied to its branch ids as well.
    # One removal is llama.cpp's own: with a sliding-window cache (Gemma 3's), a cell only
    # `base` holds that lies outside its window may be taken for another sequence's token,
    # and `base` then loses its positions up to that one in that cache (its first position
    # there moves up) while the branch ids keep theirs. llama.cpp refuses a batch whose
    # token is shared by sequences whose first or last positions differ ("coupled ... but
    # have diverged"), so a branch id whose `base` lost its first cells since the id was
    # forked is copied afresh (`_lows[s]`: the first position of `base` then).
    _UNBOUNDED = 1 << 30  # `end` of a branch id forked from its whole main sequence
    _NOT_SHARED = -2  # the `base` of an id whose cells are not known to be another's

    @staticmethod
    def _branch_ids(base: int, n_branches: int, first: int | None, with_base: bool = False
                    ) -> list[int]:
        """A tree's branch sequence ids other than `base`: first..first+n_branches-1, where
        first defaults to `base` (branch 0 is `base` itself); `with_base`: branch 0 is `base`
        and branches 1.. are first, first+1, ... (first..first+n_branches-2)."""
        seqs = Backend.branch_seqs(base, n_branches, first, with_base)
        return seqs[1:] if seqs[0] == base else [s for s in seqs if s != base]

    @staticmethod
    def branch_seqs(base: int, n_branches: int, first: int | None, with_base: bool = False
                    ) -> list[int]:
        """The sequence id of each branch 0..n_branches-1 of a tree laid out as
        `_branch_ids` says."""
        if first is None or first == base:
            return list(range(base, base + n_branches))
        if with_base:
            return [base, *range(first, first + n_branches - 1)]
        return list(range(first, first + n_branches))

    def seq_fork(self, base: int, n_branches: int, first: int | None = None,
                 with_base: bool = False) -> None:
        """Make the branch ids first..first+n_branches-1 (default first = base: branch 0 is
        `base` itself; `with_base`: see `_branch_ids`) hold sequence `base`'s cells: those
        it got since the id last did."""
        if n_branches > self.config.max_branches + (first is None or first == base or
                                                    with_base):
            raise ValueError(f"{n_branches} branches > max_branches + 1 "
                             f"({self.config.max_branches + 1})")
        L, mem, shares, lows = self._L, self.mem, self._shares, self._lows
        low = L.llama_memory_seq_pos_min(mem, base)
        for s in self._branch_ids(base, n_branches, first, with_base):
            of, end = shares.get(s, (base, 0))
            if of != base or (end and lows.get(s) != low):  # it held another sequence's
                # cells, or `base` lost its first cells since it got them: start afresh
                L.llama_memory_seq_rm(mem, s, -1, -1)
                end = 0
            L.llama_memory_seq_cp(mem, base, s, end, -1)
            shares[s] = (base, self._UNBOUNDED)
            lows[s] = low

    def seq_share(self, base: int, n_branches: int, first: int | None = None,
                  with_base: bool = False) -> None:
        """`seq_fork` outside a tree: the branch ids get sequence `base`'s cells as they are
        now (a prompt's, before its generation: a tree's fork then copies only the cells
        `base` got since), and are known to hold them up to its end."""
        self.seq_fork(base, n_branches, first, with_base)
        end = self._L.llama_memory_seq_pos_max(self.mem, base) + 1
        for s in self._branch_ids(base, n_branches, first, with_base):
            self._shares[s] = (base, end)

    def seq_commit(self, base: int, winner: int, start: int, keep_until: int,
                   n_branches: int, first: int | None = None, with_base: bool = False
                   ) -> None:
        """After a tree pass from position `start`: keep the cells of sequence `winner` (one
        of the tree's branch ids, laid out as `_branch_ids` says) up to `keep_until` as
        sequence `base`, drop the rest the pass wrote. The branch ids keep the cells before
        `start`. Other sequences (other slots) are untouched."""
        L, mem = self._L, self.mem
        # (each of these calls scans every cell of the cache: no call that would change
        # nothing is made)
        if winner != base:  # (the raw calls: the branch ids still hold the tree's cells)
            if first is None or first == base or with_base:  # base holds branch 0's
                # cells: they go
                self._check_rm(L.llama_memory_seq_rm(mem, base, start, -1), base, start)
            # (else the tree was all on other ids: base holds nothing from `start`)
            L.llama_memory_seq_cp(mem, winner, base, start, keep_until)  # the accepted
        self._drop_tree(base, n_branches, start, first, with_base)
        if winner == base:  # its cells past the accepted ones go
            self._check_rm(L.llama_memory_seq_rm(mem, base, keep_until, -1), base,
                           keep_until)

    def _drop_tree(self, base: int, n_branches: int, start: int, first: int | None,
                   with_base: bool = False) -> None:
        """The cells of a tree pass from `start` dropped from its branch ids (not `base`)."""
        L, mem, shares = self._L, self.mem, self._shares
        for s in self._branch_ids(base, n_branches, first, with_base):
            L.llama_memory_seq_rm(mem, s, start, -1)
            of, end = shares.get(s, (base, 0))
            shares[s] = (of, min(end, start))

    def seq_abandon(self, base: int, n_branches: int, start: int,
                    first: int | None = None, with_base: bool = False) -> None:
        """Undo a tree pass from position `start` that will not be committed (an error
        between fork and commit): the tree's cells go from the branch ids and `base`."""
        self._drop_tree(base, n_branches, start, first, with_base)
        self._seq_rm(base, start)

    def continuable(self, seq: int, n: int) -> int:
        """How much of sequence `seq`'s first n positions a continuation may start from: n,
        or 0 where its sliding-window cache lost positions that the window of position n
        still needs. (llama.cpp's sliding-window cache gives a cell that only one sequence
        holds, outside that sequence's window, to another token when it needs room, and the
        sequence then loses its positions up to that one there: `seq_pos_min` moves up.
        A sequence cut back to an earlier position would attend to a window with a hole:
        the text it starts with, gone from those layers.)"""
        low = self._L.llama_memory_seq_pos_min(self.mem, seq)
        if low <= 0 or n <= 0:
            return n
        return n if self.n_swa and low <= n - self.n_swa + 1 else 0

    def seq_trim(self, seq: int, start: int) -> None:
        """Drop positions >= start of sequence `seq` (all of it for start 0)."""
        self._seq_rm(seq, start)

    def seq_copy(self, src: int, dst: int, end: int) -> None:
        """Sequence `dst` becomes positions [0, end) of sequence `src` (shared cells)."""
        self._seq_rm(dst, 0)
        self._L.llama_memory_seq_cp(self.mem, src, dst, 0, end)
        # what it holds from here on is the caller's: a fork into it starts afresh
        self._shares[dst] = (self._NOT_SHARED, 0)

    def _seq_rm(self, seq: int, start: int) -> None:
        """Drop positions >= start of sequence `seq` (-1: of every sequence), and of the
        branch ids that hold its cells."""
        L, mem, shares = self._L, self.mem, self._shares
        self._check_rm(L.llama_memory_seq_rm(mem, seq, start, -1), seq, start)
        for s, (of, end) in list(shares.items()):
            if s == seq or seq < 0:
                shares[s] = (of, min(end, start))
            elif of == seq and end > start:
                L.llama_memory_seq_rm(mem, s, start, -1)
                shares[s] = (of, start)

    @staticmethod
    def _check_rm(ok: bool, seq: int, start: int) -> None:
        if not ok:
            raise DecodeError(f"llama.cpp could not remove positions {start}.. of sequence "
                              f"{seq} (this model's memory cannot roll back part of a "
                              "sequence)")

    def fork(self, n_branches: int) -> None:
        """Copy sequence 0 into ids 1..n_branches-1 (branch 0 is sequence 0 itself)."""
        self.seq_fork(0, n_branches)

    def commit(self, branch: int, n_keep: int, n_branches: int | None = None) -> None:
        """Keep `n_keep` tree tokens of `branch` (from position n_past) in sequence 0 and
        drop everything else the tree pass wrote."""
        nb = n_branches if n_branches is not None else self.config.max_branches + 1
        self.seq_commit(0, branch, self.n_past, self.n_past + n_keep, nb)
        self.n_past += n_keep

    def abandon(self, n_branches: int) -> None:
        """`seq_abandon` for sequence 0 at n_past."""
        self.seq_abandon(0, n_branches, self.n_past)

    def trim(self, n: int) -> None:
        """Drop everything from position n on."""
        if n < self.n_past:
            self._seq_rm(-1, n)
            self.n_past = n

    def clear(self) -> None:
        """Empty the KV cache (main sequences sampled in the graph stay so: taking a sampler
        off and putting it back re-plans llama.cpp's graph; the methods on sequence 0 that
        return its logits take its sampler off)."""
        self._L.llama_memory_clear(self.mem, True)
        self._shares.clear()
        self.n_past = 0
