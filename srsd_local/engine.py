"""The engine: prefill, then (draft -> verify -> commit -> index) until done.

Contract:
- `Engine.stream()` is the only generation loop; `generate()`, `chat()`, the CLI, the server,
  the UI and the benchmark all consume its events.
- Every mode emits the tokens plain decoding would emit: a draft only saves forward passes.
  Greedy outputs equal plain greedy outputs except where the model's top two logits are
  nearly tied (batched kernels round differently); seeded sampling draws one sample per
  emitted token from the same generator in the same order.
- Stop strings, end-of-generation tokens and max_tokens cut exactly where plain decoding cuts.
- A call whose prompt starts with tokens already in the context reuses them (KV cache and
  hidden-state index are trimmed to the common prefix; only new tokens are prefilled).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .backend import Backend, ContextFullError, TextStream
from .calibrate import CALIBRATED_FIELDS, load_calibration_file, model_key
from .chat import render_chat
from .config import MODES, SamplingParams, SRSDConfig
from .controller import (
    AcceptanceModel,
    CostModel,
    DepthCalibration,
    choose,
    evidence,
    load_json,
)
from .drafters import Drafter, DraftInput, make_drafter
from .index import VectorIndex
from .models import cache_dir, resolve_model
from .sampling import Sampler, walk_tree


@dataclass
class GenerationStats:
    mode: str = "ar"
    prompt_tokens: int = 0
    reused_prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    tokens: int = 0
    seconds: float = 0.0  # generation only (after the prompt is processed)
    steps: int = 0  # forward passes that produced tokens (the prompt's pass included)
    drafts: int = 0  # steps that verified a tree
    draft_tokens: int = 0  # drafted nodes verified
    accepted_tokens: int = 0  # drafted nodes accepted
    accepted_per_depth: list[int] = field(default_factory=list)  # accepted at depth d+1
    predicted_per_depth: list[float] = field(default_factory=list)  # controller's forecast
    tokens_per_step: list[int] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)  # tokens decoded per step
    time_draft: float = 0.0
    time_verify: float = 0.0
    time_index: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per forward pass (1.0 for plain decoding)."""
        return self.tokens / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(tokens_per_second=self.tokens_per_second,
                 mean_accepted_length=self.mean_accepted_length,
                 acceptance_rate=self.acceptance_rate)
        return d


@dataclass
class StreamEvent:
    text: str  # new text (may be empty while a possible stop string is held back)
    token_ids: list[int]  # tokens emitted by this event
    drafted: list[bool]  # per token: did it come from an accepted draft?
    finish_reason: str | None = None  # "stop" | "length" on the last event
    stats: GenerationStats | None = None  # on the last event


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: GenerationStats


_SEED_TRIALS = 10  # calibration seeds count at most this many outcomes per kind of node
_RECENT_RATE = 0.3
_RECENT_DRIFT = 0.05
_MAX_SKIP = 8


class _StopScanner:
    """Holds back text that may be the start of a stop string; finds the cut point."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.text = ""
        self.sent = 0

    def push(self, delta: str) -> tuple[str, bool]:
        """Add text; return (text safe to send now, whether a stop string was hit)."""
        start = max(0, self.sent - max((len(s) for s in self.stops), default=0))
        self.text += delta
        if self.stops:
            hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
            if hits:
                cut = min(hits)
                out, self.sent = self.text[self.sent: cut], cut
                self.text = self.text[:cut]
                return out, True
        safe = len(self.text)
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:k]):
                    safe = min(safe, len(self.text) - k)
                    break
        safe = max(safe, self.sent)
        out, self.sent = self.text[self.sent: safe], safe
        return out, False

    def flush(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


def _check_stop(stop: str | Sequence[str] | None) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if not all(isinstance(s, str) for s in stop):
        raise ValueError(f"invalid stop={stop!r}: accepted is a string or a list of strings")
    return list(stop)


class Engine:
    """One model, one context, one generation at a time."""

    def __init__(self, backend: Backend, config: SRSDConfig, cost: CostModel | None = None
                 ) -> None:
        self.backend = backend
        self.config = config
        # without a measured profile, verification is assumed as cheap as a plain step
        self.cost = cost or CostModel([1, 2], [1.0, 1.0])
        self.acceptance = AcceptanceModel()
        self.depth_calibration: dict[tuple[str, bool], DepthCalibration] = {}
        self.index = VectorIndex(backend.n_embd, backend.n_ctx, config.index_backend)
        self._ctx = np.zeros(backend.n_ctx + 1, dtype=np.int32)  # tokens in sequence 0
        self._last_hidden: np.ndarray | None = None  # hidden row of position n_past-1
        # (position, logits, hidden row) after the last prefilled prompt
        self._prompt_end: tuple[int, np.ndarray, np.ndarray | None] | None = None
        self._drafters: dict[str, Drafter | None] = {m: make_drafter(m, config) for m in MODES}

    @classmethod
    def load(cls, model: str | Path | None = None, *, learned: bool = True, **config: Any
             ) -> Engine:
        """Load a model (see `resolve_model`); `config` takes SRSDConfig fields. The acceptance
        model starts from what earlier runs learned (`learned=False`: from the model's
        calibration only, as benchmarks do for repeatable results)."""
        cfg = config.pop("config", None) or SRSDConfig()
        path = resolve_model(model)
        calibration = load_calibration_file(path) or {}
        calibrated = {k: calibration[k] for k in CALIBRATED_FIELDS if k in calibration}
        cfg = cfg.with_(**{k: v for k, v in calibrated.items() if k not in config}, **config)
        backend = Backend(path, cfg, capture_layer=cfg.layer)
        try:
            cost = load_cost_model(backend, cfg) if cfg.adaptive else None
            engine = cls(backend, cfg, cost)
        except BaseException:
            backend.close()
            raise
        engine._acceptance_file = cache_dir() / "acceptance" / f"{model_key(path)}.json"
        saved = load_json(engine._acceptance_file) if learned else None
        if not learned:
            engine._acceptance_file = None  # and leave the user's learned state alone
        if isinstance(saved, list):  # what earlier runs learned (seed included)
            engine.acceptance.load_json(saved)
        elif calibration.get("acceptance"):
            engine.acceptance.load_json(calibration["acceptance"], cap=_SEED_TRIALS)
        return engine

    def reconfigure(self, **changes: Any) -> None:
        """Change retrieval / tree settings between generations (validated; the layer and
        context settings need a new Engine)."""
        fixed = {"layer", "n_ctx", "n_batch", "n_ubatch", "n_seq_max", "n_threads",
                 "n_gpu_layers", "index_backend"} & set(changes)
        if fixed:
            raise ValueError(f"{sorted(fixed)} cannot change on a loaded engine; load a new one")
        self.config = self.config.with_(**changes)
        self._drafters = {m: make_drafter(m, self.config) for m in MODES}

    def close(self) -> None:
        """Free the model; the acceptance calibration is kept for the next load."""
        path = getattr(self, "_acceptance_file", None)
        if path is not None and self.acceptance.counts:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(self.acceptance.to_json()), encoding="utf-8")
            except OSError:
                pass
        self.backend.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def reset(self) -> None:
        """Forget the context (KV cache and index): the next call prefills from scratch."""
        self.backend.clear()
        self.index.clear()
        self._prompt_end = None

    @property
    def model_name(self) -> str:
        return self.backend.name

    def tokenize(self, text: str, add_bos: bool = True) -> list[int]:
        return self.backend.tokenize(text, add_bos=add_bos)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> str:
        return render_chat(self.backend, messages)

    # -- the loop ---------------------------------------------------------------------------
    def _prepare(self, prompt_tokens: list[int], needs_index: bool) -> tuple[np.ndarray, int]:
        """Reuse the common prefix, prefill the rest; return (last logits row, reused).

        The prompt is always prefilled with capture on, so its hidden rows are indexed
        whatever the mode. When the context already holds the whole prompt and the logits
        after it were kept from its prefill, nothing is decoded at all: repeated prompts
        start from the very same numbers whatever mode asks (batched and one-token passes
        round differently, so re-decoding the last token would not)."""
        be = self.backend
        n = len(prompt_tokens)
        prompt = np.asarray(prompt_tokens, dtype=np.int32)
        limit = min(be.n_past, n)
        diff = np.flatnonzero(self._ctx[:limit] != prompt[:limit])
        common = int(diff[0]) if len(diff) else limit
        common = min(common, len(self.index))
        saved = self._prompt_end
        if common == n and saved is not None and saved[0] == n - 1:
            be.trim(n)
            self.index.truncate(n)
            self._last_hidden = saved[2]
            return saved[1], n
        common = min(common, n - 1)  # decode at least one token, for its logits
        be.trim(common)
        self.index.truncate(common)
        if common == 0:
            be.clear()
            self.index.clear()
        new = prompt_tokens[common:]
        if be.capture is not None:
            be.capture.enabled = True
        out = be.decode(new, want_logits="last")
        self._ctx[common: n] = new
        last = out.logits[-1].copy()
        if out.hidden is not None:
            self.index.add(out.hidden, np.arange(common, n))
            self._last_hidden = out.hidden[-1].copy()
        self._prompt_end = (n - 1, last, self._last_hidden)
        return last, common

    def stream(self, prompt: str | Sequence[int], max_tokens: int = 256,
               temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
               min_p: float = 0.0, seed: int | None = None,
               stop: str | Sequence[str] | None = None,
               mode: str | None = None) -> Iterator[StreamEvent]:
        """Generate from `prompt` (text, or token ids including BOS); yields StreamEvents."""
        mode = self.config.mode if mode is None else mode
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}: accepted are {', '.join(MODES)}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise ValueError(f"invalid max_tokens={max_tokens!r}: accepted is an integer >= 0")
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                                seed=seed)
        stops = _check_stop(stop)
        be = self.backend
        tokens = be.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not tokens:
            raise ValueError("the prompt is empty after tokenization")
        if len(tokens) >= be.n_ctx:
            raise ContextFullError(f"context is full: the prompt has {len(tokens)} tokens, "
                                   f"n_ctx={be.n_ctx}")
        drafter = self._drafters[mode]
        needs_index = mode in ("srsd", "hybrid")
        sampler = Sampler(params)
        stats = GenerationStats(mode=mode, prompt_tokens=len(tokens), steps=1)
        text = TextStream(be.piece)
        scan = _StopScanner(stops)

        # 1. prefill (reusing what the context already holds)
        t0 = time.perf_counter()
        last_logits, stats.reused_prompt_tokens = self._prepare(tokens, needs_index)
        if be.capture is not None:
            be.capture.enabled = needs_index
        x = sampler(last_logits)
        t1 = time.perf_counter()
        stats.prompt_seconds = t1 - t0
        if max_tokens == 0:
            stats.seconds = 0.0
            yield StreamEvent("", [], [], "length", stats)
            return

        emitted = 0
        recent = 0.5  # EMA: did the last verified trees get a token accepted?
        declined = skip = 0  # plans in a row the controller declined; steps not to draft
        pending: list[int] = [x]  # tokens to emit this step (x: chosen, not yet in the KV)
        drafted_flags: list[bool] = [False]
        while True:
            # 2. emit, applying EOS / stop strings / max_tokens token by token
            out_ids, out_flags, chunks, finish, hit = [], [], [], None, False
            for tok, was_draft in zip(pending, drafted_flags):
                if be.is_eog(tok):
                    finish = "stop"
                    break
                out_ids.append(tok)
                out_flags.append(was_draft)
                emitted += 1
                safe, hit = scan.push(text.push(tok))
                chunks.append(safe)
                if hit:
                    finish = "stop"
                    break
                if emitted >= max_tokens:
                    finish = "length"
                    break
            if finish is None and be.n_past >= be.n_ctx:
                finish = "length"  # no room to decode another token
            stats.tokens = emitted
            if finish is not None:
                if not hit:  # release the decoder's tail and any held-back text
                    safe, hit = scan.push(text.flush())
                    chunks.append(safe if hit else safe + scan.flush())
                    finish = "stop" if hit else finish
                stats.seconds = time.perf_counter() - t1
                yield StreamEvent("".join(chunks), out_ids, out_flags, finish, stats)
                return
            yield StreamEvent("".join(chunks), out_ids, out_flags)

            # 3. draft a tree rooted at x; the controller keeps what pays for itself
            n = be.n_past
            ta = time.perf_counter()
            tree, plan = None, None
            room = 0 if drafter is None else min(drafter.config.max_nodes, be.n_ctx - n - 2)
            if skip > 0:  # the controller kept declining: look again later, not every step
                skip -= 1
            elif room > 0:
                tree = drafter.draft(DraftInput(self._ctx[:n], x, self._last_hidden,
                                                self.index if needs_index else None),
                                     max_nodes=room)
                if tree.n_draft and drafter.config.adaptive:
                    plan = self._plan(tree, mode, params.greedy, room, recent)
                    tree = plan.tree
                    declined = 0 if tree.n_draft else declined + 1
                    skip = min(2 ** declined // 2, _MAX_SKIP)
            tb = time.perf_counter()
            stats.time_draft += tb - ta

            # 4. verify it in one forward pass and walk it
            if tree is None or tree.n_draft == 0:
                out = be.decode([x])
                path, y = [0], sampler(out.logits[0])
                path_tokens = [x]
                # without fresh evidence, drift back towards neutral so drafting is retried
                recent += _RECENT_DRIFT * (0.5 - recent)
            else:
                lay = tree.layout()
                be.fork(lay.n_branches)
                out = be.decode(lay.tokens, positions=n + lay.depths, seq_ids=lay.seq_ids,
                                want_logits="all")
                path, y = walk_tree(tree, out.logits.__getitem__, sampler)
                be.commit(lay.seq_ids[path[-1]][0], len(path), lay.n_branches)
                path_tokens = [tree.tokens[i] for i in path]
                stats.drafts += 1
                stats.draft_tokens += tree.n_draft
                stats.accepted_tokens += len(path) - 1
                _add_per_depth(stats.accepted_per_depth, [1] * (len(path) - 1),
                               range(1, len(path)))
                if plan is not None:
                    _add_per_depth(stats.predicted_per_depth, plan.probs[1:], tree.depths[1:])
                    self.depth_calibration[(mode, params.greedy)].update(
                        plan.raw_probs[1:], tree.depths[1:], len(path) - 1)
                    ev = plan.evidence
                else:
                    ev = evidence(tree, recent)
                self._learn(tree, ev, path, mode, params.greedy)
                recent += _RECENT_RATE * (float(len(path) > 1) - recent)
            tc = time.perf_counter()
            stats.time_verify += tc - tb
            stats.steps += 1
            stats.tokens_per_step.append(len(path))

            # 5. commit: context tokens and hidden-state index
            self._ctx[n: n + len(path)] = path_tokens
            if needs_index and out.hidden is not None:
                rows = out.hidden[path]
                self.index.add(rows, np.arange(n, n + len(path)))
                self._last_hidden = rows[-1].copy()
            td = time.perf_counter()
            stats.time_index += td - tc
            stats.tree_sizes.append(len(path) if tree is None else len(tree))
            if self.config.adaptive:
                self.cost.observe(stats.tree_sizes[-1], td - ta, n)
            pending = path_tokens[1:] + [y]
            drafted_flags = [True] * (len(path) - 1) + [False]
            x = y

    # -- the controller -----------------------------------------------------------------------
    def _plan(self, tree, mode: str, greedy: bool, room: int, recent: float):
        ev = evidence(tree, recent)
        acc = self.acceptance
        q = [1.0] + [acc.q_explore(e, mode, greedy) for e in ev[1:]]
        q_mean = [1.0] + [acc.q(e, mode, greedy) for e in ev[1:]]
        n_max = min(room, len(tree) - 1) + 1
        cost = self.cost.table(n_max, self.backend.n_past)
        dc = self.depth_calibration.setdefault((mode, greedy), DepthCalibration())
        return choose(tree, q, cost, self.config.max_branches, q_mean, dc.scale(), ev)

    def _learn(self, tree, ev, path: list[int], mode: str, greedy: bool) -> None:
        """Every verified node whose parent was accepted is one outcome for calibration."""
        on_path = set(path)
        for node in range(1, len(tree)):
            if tree.parents[node] in on_path:
                self.acceptance.update(ev[node], mode, greedy, node in on_path)

    def generate(self, prompt: str | Sequence[int], **kwargs: Any) -> GenerationResult:
        return collect(self.stream(prompt, **kwargs))

    def chat_stream(self, messages: Sequence[dict[str, Any]], **kwargs: Any
                    ) -> Iterator[StreamEvent]:
        return self.stream(self.apply_chat_template(messages), **kwargs)

    def chat(self, messages: Sequence[dict[str, Any]], **kwargs: Any) -> GenerationResult:
        return collect(self.chat_stream(messages, **kwargs))


def _add_per_depth(acc: list, values, depths) -> None:
    for v, d in zip(values, depths):
        while len(acc) < d:
            acc.append(0)
        acc[d - 1] += v


def load_cost_model(backend: Backend, cfg: SRSDConfig) -> CostModel:
    """The step-cost profile of this model file, device and thread count: cached, else measured
    now (about a second or two on a CPU)."""
    import hashlib  # noqa: PLC0415

    from .backend import gpu_offload_supported  # noqa: PLC0415

    n_max = min(cfg.max_nodes + 1, backend.n_batch)
    sizes = [n for n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128) if n < n_max]
    sizes.append(n_max)
    st = Path(backend.model_path).stat()
    key = "|".join(str(v) for v in ("v2", Path(backend.model_path).resolve(), st.st_size,
                                    st.st_mtime_ns,
                                    cfg.threads, cfg.n_gpu_layers, gpu_offload_supported(),
                                    backend.n_batch, sizes))
    path = cache_dir() / "profiles" / (hashlib.sha1(key.encode()).hexdigest() + ".json")
    cached = load_json(path)
    if cached and cached.get("key") == key:
        return CostModel.from_dict(cached)
    seconds, per_kv, ctx0 = backend.profile(sizes)
    model = CostModel(sizes, seconds, per_kv, ctx0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": key, **model.to_dict()}), encoding="utf-8")
    return model


def collect(events: Iterator[StreamEvent]) -> GenerationResult:
    parts: list[str] = []
    ids: list[int] = []
    for ev in events:
        parts.append(ev.text)
        ids.extend(ev.token_ids)
        if ev.finish_reason is not None:
            assert ev.stats is not None
            return GenerationResult("".join(parts), ids, ev.finish_reason, ev.stats)
    raise RuntimeError("the generation ended without a finish event")
