"""The engine: a token-only loop over one model and one context.

Contract:
- `Engine.stream()` is the only generation loop; `generate()`, `chat()`, the CLI, the server,
  the UI and the benchmark all consume its events. It reads like the method: prefill, then
  propose -> verify -> walk -> commit -> emit (the numbered phases in its body).
- Every mode emits the tokens plain decoding would emit: a draft only saves forward passes.
  Greedy outputs equal plain greedy outputs except where the model's top two logits are
  nearly tied (batched kernels round differently); seeded sampling draws one sample per
  emitted token from the same generator in the same order.
- Stop strings, end-of-generation tokens and max_tokens cut exactly where plain decoding cuts
  (`emit.Emitter`).
- A call whose prompt starts with tokens already in the context reuses them (KV cache and
  hidden-state index are trimmed to the common prefix; only new tokens are prefilled).
- What to draft and whether it pays is the `Speculator`'s business (pure logic, spec/); the
  engine only runs it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import store
from ..config import SamplingParams, SRSDConfig
from ..llama.backend import Backend, ContextFullError
from ..llama.chat import render_chat
from ..llama.models import resolve_model
from ..spec.acceptance import AcceptanceModel
from ..spec.cost import CostModel
from ..spec.draft import DraftInput
from ..spec.index import VectorIndex
from ..spec.sampling import MAX_TOP_LOGPROBS, Sampler, TokenLogprob, token_logprob
from ..spec.speculator import SEED_TRIALS, Speculator
from ..spec.verify import walk_tree
from .calibrate import CALIBRATED_FIELDS, load_calibration_file
from .emit import Emitter, check_stop
from .profile import load_cost_model, save_cost_model
from .stats import GenerationStats
from .verify import VerifyReport, verify_tokens


@dataclass
class StreamEvent:
    text: str  # new text (may be empty while a possible stop string is held back)
    token_ids: list[int]  # tokens emitted by this event
    drafted: list[bool]  # per token: did it come from an accepted draft?
    finish_reason: str | None = None  # "stop" | "length" on the last event
    stats: GenerationStats | None = None  # on the last event
    logprobs: list[TokenLogprob] | None = None  # per token, when asked for


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None  # per token, when asked for


class Engine:
    """One model, one context, one generation at a time."""

    def __init__(self, backend: Backend, config: SRSDConfig, cost: CostModel | None = None,
                 acceptance: AcceptanceModel | None = None) -> None:
        self.backend = backend
        self.config = config
        self.speculator = Speculator(config, cost, acceptance)
        self.index = VectorIndex(backend.n_embd, backend.n_ctx, config.index_backend)
        self._ctx = np.zeros(backend.n_ctx + 1, dtype=np.int32)  # tokens in sequence 0
        self._last_hidden: np.ndarray | None = None  # hidden row of position n_past-1
        # (position, logits, hidden row) after the last prefilled prompt
        self._prompt_end: tuple[int, np.ndarray, np.ndarray | None] | None = None
        self._acceptance_name: str | None = None  # where learned acceptance is kept
        self._profile: tuple[str, str] | None = None  # (file, key) of the cost profile
        # a recurrent or hybrid model cannot roll back part of a sequence: plain steps only
        self.plain_only = not getattr(backend, "can_speculate", True)
        if self.plain_only:
            print(f"srsd-local: {backend.name} keeps a recurrent state that cannot roll back "
                  "part of a sequence: every mode decodes plainly (no speculation)",
                  file=sys.stderr)

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
        acceptance = AcceptanceModel()
        name = f"{store.file_key(path)}.json"
        saved = store.read_json("acceptance", name) if learned else None
        if isinstance(saved, list):  # what earlier runs learned (seed included)
            acceptance.load_json(saved)
        elif calibration.get("acceptance"):
            acceptance.load_json(calibration["acceptance"], cap=SEED_TRIALS)
        backend = Backend(path, cfg, capture_layer=cfg.layer)
        try:
            cost, profile = None, None
            if cfg.adaptive:
                cost, *profile = load_cost_model(backend, cfg)
            engine = cls(backend, cfg, cost, acceptance)
        except BaseException:
            backend.close()
            raise
        # learned=False leaves the user's learned state (and corrected profile) alone
        if learned:
            engine._acceptance_name = name
            engine._profile = tuple(profile) if profile else None
        return engine

    def reconfigure(self, **changes: Any) -> None:
        """Change retrieval / tree settings between generations (validated; the layer and
        context settings need a new Engine)."""
        fixed = {"layer", "n_ctx", "n_batch", "n_ubatch", "n_seq_max", "n_threads",
                 "n_gpu_layers", "index_backend"} & set(changes)
        if fixed:
            raise ValueError(f"{sorted(fixed)} cannot change on a loaded engine; load a new one")
        self.config = self.config.with_(**changes)
        self.speculator.reconfigure(self.config)

    def close(self) -> None:
        """Free the model; what was learned (acceptance counts, the step-cost profile as
        corrected by real steps) is kept for the next load."""
        spec = self.speculator
        try:
            if self._acceptance_name is not None and spec.acceptance.counts:
                store.write_json("acceptance", self._acceptance_name, spec.acceptance.to_json())
            if self._profile is not None and spec.cost.steps:
                save_cost_model(spec.cost, *self._profile)
        except OSError:
            pass  # a read-only cache must not break closing
        self.backend.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- what applications may ask about the model -----------------------------------------
    @property
    def model_name(self) -> str:
        return self.backend.name

    @property
    def model_path(self) -> str:
        return self.backend.model_path

    @property
    def n_ctx(self) -> int:
        return self.backend.n_ctx

    @property
    def n_vocab(self) -> int:
        return self.backend.n_vocab

    @property
    def n_layer(self) -> int:
        return self.backend.n_layer

    @property
    def index_backend(self) -> str:
        return self.index.backend

    def token_text(self, token: int) -> str:
        """The text of one token (invalid UTF-8 replaced), for display."""
        return self.backend.piece(token).decode("utf-8", "replace")

    def tokenize(self, text: str, add_bos: bool = True) -> list[int]:
        return self.backend.tokenize(text, add_bos=add_bos)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> str:
        return render_chat(self.backend, messages)

    def reset(self) -> None:
        """Forget the context (KV cache and index): the next call prefills from scratch."""
        self.backend.clear()
        self.index.clear()
        self._prompt_end = None

    # -- the loop ---------------------------------------------------------------------------
    def _prepare(self, prompt_tokens: list[int]) -> tuple[np.ndarray, int]:
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
        if self.plain_only:  # a recurrent state cannot be cut back to a common prefix
            common = 0
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
            self.index.add(out.hidden, common)
            self._last_hidden = out.hidden[-1].copy()
        self._prompt_end = (n - 1, last, self._last_hidden)
        return last, common

    def _check_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        be = self.backend
        tokens = be.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not tokens:
            raise ValueError("the prompt is empty after tokenization")
        bad = [t for t in tokens if not 0 <= t < be.n_vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of range: accepted are 0.."
                             f"{be.n_vocab - 1} (the model's vocabulary)")
        if len(tokens) >= be.n_ctx:
            raise ContextFullError(f"context is full: the prompt has {len(tokens)} tokens, "
                                   f"n_ctx={be.n_ctx}")
        return tokens

    def stream(self, prompt: str | Sequence[int], max_tokens: int = 256,
               temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
               min_p: float = 0.0, seed: int | None = None,
               stop: str | Sequence[str] | None = None,
               mode: str | None = None, logprobs: int | None = None
               ) -> Iterator[StreamEvent]:
        """Generate from `prompt` (text, or token ids including BOS); yields StreamEvents.

        `logprobs`: None (off), or how many most likely alternatives to report with each
        emitted token's log-probability (0..20); with speculation they come from the rows the
        verification pass computed anyway.

        1. prefill (reusing what the context already holds), sample the first token x;
        then each step: 2. emit, 3. propose a tree rooted at x, 4. verify it in one forward
        pass and walk it, 5. commit the accepted path (KV cache, context, index), learn."""
        mode = self.config.mode if mode is None else mode
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise ValueError(f"invalid max_tokens={max_tokens!r}: accepted is an integer >= 0")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                     or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"invalid logprobs={logprobs!r}: accepted is None or an integer "
                             f"0..{MAX_TOP_LOGPROBS}")
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                                seed=seed)
        req = self.speculator.begin(mode, params.greedy)
        stops = check_stop(stop)
        tokens = self._check_prompt(prompt)
        be = self.backend
        sampler = Sampler(params)
        stats = GenerationStats(mode=mode, prompt_tokens=len(tokens), steps=1)
        emit = Emitter(be.piece, be.is_eog, max_tokens, stops)

        # 1. prefill
        t0 = time.perf_counter()
        last_logits, stats.reused_prompt_tokens = self._prepare(tokens)
        if be.capture is not None:
            be.capture.enabled = req.uses_index
        x = sampler(last_logits)
        t1 = time.perf_counter()
        stats.prompt_seconds = t1 - t0
        if max_tokens == 0:
            yield StreamEvent("", [], [], "length", stats, [] if logprobs is not None else None)
            return
        pending, drafted = [x], [False]  # x: chosen, not yet in the KV cache
        # per pending token, when asked for: its log-probability from the row it was drawn from
        lps = None if logprobs is None else [token_logprob(last_logits, x, logprobs)]
        while True:
            # 2. emit, applying EOS / stop strings / max_tokens token by token
            out = emit.push(pending, drafted, out_of_room=be.n_past >= be.n_ctx)
            stats.tokens = emit.count
            ev_lps = None if lps is None else lps[: len(out.token_ids)]
            if out.finish_reason is not None:
                stats.seconds = time.perf_counter() - t1
                yield StreamEvent(out.text, out.token_ids, out.drafted, out.finish_reason, stats,
                                  ev_lps)
                return
            yield StreamEvent(out.text, out.token_ids, out.drafted, logprobs=ev_lps)

            # 3. propose: a tree rooted at x that pays for itself, or None (plain step)
            n = be.n_past
            ta, in_decode = time.perf_counter(), be.decode_seconds
            room = 0 if self.plain_only else self.speculator.room(req, be.n_ctx - n - 2)
            plan = self.speculator.propose(
                req, DraftInput(self._ctx[:n], x, self._last_hidden,
                                self.index if req.uses_index else None), room) if room else None
            tb = time.perf_counter()

            # 4. verify in one forward pass and walk the tree
            if plan is None:
                dec = be.step(x)
                path, y, path_tokens = [0], sampler(dec.logits[0]), [x]
            else:
                lay = plan.tree.layout()
                be.fork(lay.n_branches)
                try:
                    dec = be.decode(lay.tokens, positions=n + lay.depths, seq_ids=lay.seq_ids,
                                    want_logits="all")
                    path, y = walk_tree(plan.tree, dec.logits.__getitem__, sampler)
                except BaseException:  # nothing of the tree may stay in the cache
                    be.abandon(lay.n_branches)
                    raise
                be.commit(lay.seq_ids[path[-1]][0], len(path), lay.n_branches)
                path_tokens = [plan.tree.tokens[i] for i in path]
            tc = time.perf_counter()

            # 5. commit: context tokens and hidden-state index; learn from the outcome
            self._ctx[n: n + len(path)] = path_tokens
            if req.uses_index and dec.hidden is not None:
                rows = dec.hidden[path]
                self.index.add(rows, n)
                self._last_hidden = rows[-1].copy()
            self.speculator.observe(req, plan, path, time.perf_counter() - ta, n)
            td = time.perf_counter()
            times = dict(draft=tb - ta, verify=tc - tb, index=td - tc,
                         host=(td - ta) - (be.decode_seconds - in_decode))
            if plan is None:
                stats.observe_step(1, 0, **times)
            else:  # the forecast (if the controller made one) covers the drafted nodes
                t = plan.tree
                stats.observe_step(len(t), len(path) - 1, drafted=t.n_draft,
                                   forecast=plan.probs[1:],
                                   forecast_depths=t.depths[1:len(plan.probs)], **times)
            pending = path_tokens[1:] + [y]
            drafted = [True] * (len(path) - 1) + [False]
            if logprobs is not None:  # pending[i] was drawn from the row of node path[i]
                lps = [token_logprob(dec.logits[node], tok, logprobs)
                       for node, tok in zip(path, pending)]
            x = y

    def verify_output(self, prompt: str | Sequence[int], tokens: Sequence[int]) -> VerifyReport:
        """Check a greedy output of `prompt` against plain decoding at every position, with
        the rounding noise measured in the same call (see engine/verify.py). Resets the
        context."""
        return verify_tokens(self, prompt, tokens)

    def generate(self, prompt: str | Sequence[int], **kwargs: Any) -> GenerationResult:
        return collect(self.stream(prompt, **kwargs))

    def chat_stream(self, messages: Sequence[dict[str, Any]], **kwargs: Any
                    ) -> Iterator[StreamEvent]:
        return self.stream(self.apply_chat_template(messages), **kwargs)

    def chat(self, messages: Sequence[dict[str, Any]], **kwargs: Any) -> GenerationResult:
        return collect(self.chat_stream(messages, **kwargs))


def collect(events: Iterator[StreamEvent]) -> GenerationResult:
    parts: list[str] = []
    ids: list[int] = []
    lps: list[TokenLogprob] | None = None
    for ev in events:
        parts.append(ev.text)
        ids.extend(ev.token_ids)
        if ev.logprobs is not None:
            lps = (lps or []) + ev.logprobs
        if ev.finish_reason is not None:
            assert ev.stats is not None
            return GenerationResult("".join(parts), ids, ev.finish_reason, ev.stats, lps)
    raise RuntimeError("the generation ended without a finish event")
