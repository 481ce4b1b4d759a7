"""The engine: a token-only generation loop over one model and one llama.cpp context, for one
or several requests at a time.

Contract:
- `Engine._generation` is the only generation loop (one request, a coroutine); it reads like
  the method: prefill, then emit -> propose -> verify -> walk -> commit (the numbered phases
  in its body). A scheduler step (`_gather`, then `_run_pass`) decodes what every active
  request needs in one forward pass; events are delivered between the two halves.
  `stream()`, `generate()`, `generate_many()`, `submit()`, `chat()`, the CLI, the server,
  the UI and the benchmark all consume its events.
- Several requests (`parallel` slots) share each forward pass: every decoding request's tree
  or plain step, plus at most one chunk of a prompt being prefilled, so a long prompt never
  freezes the others; each request's controller plans against the cost of the whole batch.
- Every mode emits the tokens plain decoding would emit: a draft only saves forward passes.
  Greedy outputs equal plain greedy outputs except where the model's top two logits are
  nearly tied (batched kernels round differently); seeded sampling draws one sample per
  emitted token from the same generator in the same order.
- Stop strings, end-of-generation tokens and max_tokens cut exactly where plain decoding cuts
  (`emit.Emitter`).
- A request whose prompt starts with tokens a slot already holds reuses them (KV cache and
  hidden-state index are trimmed to the common prefix; only new tokens are prefilled); when
  another slot holds a longer prefix, its KV cells and index rows are copied.
- What to draft and whether it pays is the `Speculator`'s business (pure logic, spec/); the
  engine only runs it.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from array import array
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import store
from ..config import SamplingParams, SRSDConfig
from ..llama import omp
from ..llama.backend import Backend, ContextFullError, DecodeError
from ..llama.chat import render_chat
from ..llama.grammar import Constraint, ConstraintSpec, Forcing, GrammarState, prepare_kernels
from ..llama.graph_argmax import provide_draw
from ..llama.models import resolve_model
from ..llama.tools import tool_style
from ..spec.acceptance import AcceptanceModel
from ..spec.cost import CostModel
from ..spec.draft import GRAMMAR, DraftInput
from ..spec.index import VectorIndex
from ..spec.kernels import draw_functions
from ..spec.planner import Plan
from ..spec.sampling import (
    MAX_TOP_LOGPROBS,
    ConstrainedSampler,
    Sampler,
    TokenLogprob,
    token_logprob,
)
from ..spec.speculator import TEXT_SOURCES, Request, Speculator
from ..spec.tree import TokenTree, TreeLayout
from ..spec.verify import walk_tree
from .calibrate import CALIBRATED_FIELDS, calibrate_first_use, load_calibration_file
from .emit import Emitter, check_stop
from .profile import load_cost_model, save_cost_model
from .replay import replayed_stats
from .slots import Slot, Work, pick
from .stats import GenerationStats
from .verify import VERIFY_CHUNKS, VerifyReport, verify_tokens


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


CHUNK_MIN, CHUNK_MAX = 16, 512  # automatic prompt chunks while other requests decode
FORCED_CHARS = 64  # characters a grammar may force per step (drafted, then verified)
MAX_CONSTRAINTS = 16  # compiled grammars kept per engine
FORCED_MEMO = 1024  # tokenizations of grammar-forced text kept per engine


class Engine:
    """One model, one context, `parallel` requests at a time."""

    def __init__(self, backend: Backend, config: SRSDConfig, cost: CostModel | None = None,
                 acceptance: AcceptanceModel | None = None) -> None:
        self.backend = backend
        self.config = config
        self.speculator = Speculator(config, cost, acceptance)
        if backend.graph_sampling:  # the host's draw, for draws in llama.cpp's graph
            fns = draw_functions()
            if fns is not None:
                provide_draw(*fns)
        n_slots = config.slots
        per_slot = backend.n_ctx // n_slots
        self.slots = [Slot(i * (config.max_branches + 1), per_slot, backend.n_embd,
                           config.index_backend) for i in range(n_slots)]
        self._acceptance_name: str | None = None  # where learned acceptance is kept
        self._profile: tuple[str, str] | None = None  # (file, key) of the cost profile
        self._lock = threading.RLock()  # one scheduler at a time (inline or the worker)
        self._worker: threading.Thread | None = None  # submit()'s scheduler thread
        self._worker_lock = threading.Lock()
        self._inbox: queue.Queue[_Job | None] = queue.Queue()
        self._tick = 0  # requests admitted, for least-recently-used slots
        self._constraints: dict[str, Constraint] = {}  # compiled grammars, by GBNF text
        self._forced_memo: dict[str, tuple[int, ...]] = {}  # forced text -> its tokens
        # drafting's tokenizer of short texts (backend.text_tokenizer: built here, not in
        # the first request's steps)
        self._text_tokens: Callable[[str], list[int]] = (
            backend.text_tokenizer() if hasattr(backend, "text_tokenizer") else
            lambda text: backend.tokenize(text, add_bos=False, special=False))
        # a recurrent or hybrid model cannot roll back part of a sequence: plain steps only
        self.plain_only = not getattr(backend, "can_speculate", True)
        if self.plain_only:
            print(f"srsd-local: {backend.name} keeps a recurrent state that cannot roll back "
                  "part of a sequence: every mode decodes plainly (no speculation)",
                  file=sys.stderr)

    @classmethod
    def load(cls, model: str | Path | None = None, *, learned: bool = True,
             calibrate: bool = True, **config: Any) -> Engine:
        """Load a model (see `resolve_model`: a path, a Hugging Face REPO[:QUANT|FILE], an id
        of `srsd-local models`, or the default); `config` takes SRSDConfig fields. The
        acceptance model starts from what earlier runs learned (`learned=False`: from the
        model's calibration only, as benchmarks do for repeatable results). A model without a
        stored calibration gets a short one first (`calibrate_first_use`, progress on
        stderr), unless `calibrate=False` or layer, top_k and draft_depth are all given."""
        cfg = config.pop("config", None) or SRSDConfig()
        path = resolve_model(model)
        calibration = load_calibration_file(path)
        if calibration is None and calibrate and not set(CALIBRATED_FIELDS) <= set(config):
            calibration = calibrate_first_use(
                lambda **kw: cls.load(path, learned=False, calibrate=False, **kw), path,
                cfg.with_(**config))
        calibration = calibration or {}
        calibrated = {k: calibration[k] for k in CALIBRATED_FIELDS if k in calibration}
        cfg = cfg.with_(**{k: v for k, v in calibrated.items() if k not in config}, **config)
        acceptance = AcceptanceModel()
        name = f"{store.file_key(path)}.json"
        saved = store.read_json("acceptance", name) if learned else None
        if isinstance(saved, list):  # what earlier runs learned (seed included)
            acceptance.load_json(saved)
        if calibration.get("acceptance"):  # kinds of nodes no earlier run saw (a draft
            # source added since) start from the seeds too
            acceptance.seed(calibration["acceptance"], missing_only=True)
        backend = Backend(path, cfg, capture_layer=cfg.layer)
        try:
            cost, profile = None, None
            if cfg.adaptive:
                cost, *profile = load_cost_model(backend, cfg)
            engine = cls(backend, cfg, cost, acceptance)
            # the grammar checks' build, loaded now: not in a first grammar request's steps
            # (the first use on a machine compiles it)
            prepare_kernels()
        except BaseException:
            backend.close()
            raise
        # learned=False leaves the user's learned state (and corrected profile) alone
        if learned:
            engine._acceptance_name = name
            engine._profile = tuple(profile) if profile else None
        omp.release()  # (the profile's passes ran here; requests may decode elsewhere)
        return engine

    def reconfigure(self, **changes: Any) -> None:
        """Change retrieval / tree settings between generations (validated; the layer and
        context settings need a new Engine)."""
        fixed = {"layer", "n_ctx", "n_batch", "n_ubatch", "n_seq_max", "n_threads",
                 "n_gpu_layers", "index_backend", "parallel", "rpc_servers",
                 "tensor_split"} & set(changes)
        if fixed:
            raise ValueError(f"{sorted(fixed)} cannot change on a loaded engine; load a new one")
        self.config = self.config.with_(**changes)
        self.speculator.reconfigure(self.config)

    def close(self) -> None:
        """Free the model; what was learned (acceptance counts, the step-cost profile as
        corrected by real steps) is kept for the next load. Submitted requests still
        running end with an error."""
        if self._worker is not None:
            self._inbox.put(None)
            self._worker.join(timeout=30)
            self._worker = None
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
    def placement(self) -> list[dict[str, str]] | None:
        """Which device holds which layers ({device, description, where, layers}; where is
        "local" or an RPC worker's HOST:PORT), when known."""
        return getattr(self.backend, "placement", None)

    @property
    def repacked_weights(self) -> bool:
        """Whether the model's weights were loaded in llama.cpp's repacked CPU layouts (not
        where the CPU backend's AMX layout would crash: see llama/cpubufs.py)."""
        return getattr(self.backend, "extra_bufts", True)

    @property
    def model_path(self) -> str:
        return self.backend.model_path

    @property
    def n_ctx(self) -> int:
        """Context tokens each request can use."""
        return self.slots[0].n_ctx

    @property
    def parallel(self) -> int:
        """Requests decoded side by side."""
        return len(self.slots)

    @property
    def index(self) -> VectorIndex:
        """The first slot's hidden-state index (single-request use)."""
        return self.slots[0].index

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

    def apply_chat_template(self, messages: Sequence[dict[str, Any]],
                            tools: Sequence[dict[str, Any]] | None = None) -> str:
        """The prompt of a conversation, by the model's chat template; OpenAI-style `tools`
        are rendered by a template that supports them (else a ValueError says so)."""
        return render_chat(self.backend, messages, tools=tools)

    def tool_style(self) -> str | None:
        """How the model's chat template offers tools: "tagged" (calls in <tool_call> tags),
        "json" (calls as bare JSON) or None (it does not render tools)."""
        return tool_style(self.backend.chat_template())

    def forget_outputs(self) -> None:
        """Empty the n-gram pool that earlier generations filled (their outputs are drafted
        from across requests); a benchmark calls it so that no run drafts from another run's
        output of the same prompt."""
        with self._lock:
            self.speculator.forget_outputs()

    @property
    def sample_threads(self) -> int:
        """Threads a sampled row is drawn on (Backend.sample_threads)."""
        return getattr(self.backend, "sample_threads", 1)

    def reset(self) -> None:
        """Forget every slot's context (KV cache and index): the next call prefills from
        scratch. Not while requests are running."""
        with self._lock:  # the scheduler thread finishes its step (and frees slots) first
            if any(s.busy for s in self.slots):
                raise RuntimeError("reset() while requests are running")
            self.backend.clear()
            for slot in self.slots:
                slot.forget()

    # -- requests ---------------------------------------------------------------------------
    def _check_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        be = self.backend
        tokens = be.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not tokens:
            raise ValueError("the prompt is empty after tokenization")
        bad = [t for t in tokens if not 0 <= t < be.n_vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of range: accepted are 0.."
                             f"{be.n_vocab - 1} (the model's vocabulary)")
        if len(tokens) >= self.n_ctx:
            raise ContextFullError(f"context is full: the prompt has {len(tokens)} tokens, "
                                   f"n_ctx={self.n_ctx}")
        return tokens

    def _job(self, prompt: str | Sequence[int], max_tokens: int = 256,
             temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
             seed: int | None = None, stop: str | Sequence[str] | None = None,
             mode: str | None = None, logprobs: int | None = None, grammar: str | None = None,
             json_schema: Any = None) -> _Job:
        """A validated request (every argument error is raised here, before it runs)."""
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
        return _Job(tokens, max_tokens, params, req, stops, logprobs,
                    self.constraint(grammar, json_schema), self.sample_threads)

    def constraint(self, grammar: str | None = None, json_schema: Any = None
                   ) -> GrammarState | None:
        """A fresh position at the start of a GBNF grammar or a JSON schema (None for
        neither); a bad one raises GrammarError (a ValueError) saying what is wrong."""
        spec = ConstraintSpec.make(grammar, json_schema)
        if spec is None:
            return None
        with self._worker_lock:
            compiled = self._constraints.pop(spec.gbnf, None) or Constraint(self.backend, spec)
            self._constraints[spec.gbnf] = compiled  # most recently used last
            while len(self._constraints) > MAX_CONSTRAINTS:
                del self._constraints[next(iter(self._constraints))]
            return compiled.start()

    def stream(self, prompt: str | Sequence[int], max_tokens: int = 256,
               temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
               min_p: float = 0.0, seed: int | None = None,
               stop: str | Sequence[str] | None = None,
               mode: str | None = None, logprobs: int | None = None,
               grammar: str | None = None, json_schema: Any = None
               ) -> Iterator[StreamEvent]:
        """Generate from `prompt` (text, or token ids including BOS); yields StreamEvents.

        `logprobs`: None (off), or how many most likely alternatives to report with each
        emitted token's log-probability (0..20); with speculation they come from the rows the
        verification pass computed anyway. `grammar` (GBNF, llama.cpp's grammar format) or
        `json_schema` (a dict or JSON text) constrains the output: every token is chosen from
        the tokens the constraint admits, and what it forces is drafted. While `submit()`
        serves requests from its thread, this submits too (the request then shares batches
        with the others)."""
        job = self._job(prompt, max_tokens, temperature, top_p, top_k, min_p, seed, stop, mode,
                        logprobs, grammar, json_schema)
        if self._worker is not None:
            yield from self._follow(self._enqueue(job))
            return
        with self._on_this_thread():
            self._admit(job)
            try:
                while True:
                    step = self._gather([job])
                    t_out = time.perf_counter()
                    yield from job.drain()  # before the pass: no token waits for a decode
                    job.outside += time.perf_counter() - t_out  # the caller's time
                    if job.error is not None:
                        raise job.error
                    if job.done:
                        return
                    self._run_pass(step)
            finally:
                self._retire(job)

    def generate(self, prompt: str | Sequence[int], **kwargs: Any) -> GenerationResult:
        return collect(self.stream(prompt, **kwargs))

    def verify_output(self, prompt: str | Sequence[int], tokens: Sequence[int],
                      grammar: str | None = None, json_schema: Any = None) -> VerifyReport:
        """Check a greedy output of `prompt` against plain decoding at every position, with
        the rounding noise measured in the same call (see engine/verify.py); with `grammar`
        or `json_schema`, against plain constrained decoding. Resets the context."""
        state = self.constraint(grammar, json_schema)
        # the noise is measured in batches of the sizes a pass has here: with several slots,
        # up to every slot's largest tree (bigger batches round differently)
        cfg = self.config
        chunks = VERIFY_CHUNKS if len(self.slots) == 1 else (
            *VERIFY_CHUNKS, min(len(self.slots) * (cfg.max_nodes + 1), self.backend.n_batch))
        with self._on_this_thread():  # (several slots: their cells interleave in the cache)
            return verify_tokens(self, prompt, tokens, chunks=chunks, constraint=state,
                                 interleave=len(self.slots) > 1)

    def replayed_stats(self, prompt: str | Sequence[int], **kwargs: Any) -> GenerationStats:
        """`generate(prompt, **kwargs)` recorded, then replayed without running the model:
        the stats of the replay, whose host times are the engine's work between forward
        passes on caches no pass flushed (see engine/replay.py). The learned state is left as
        it was; the context is reset."""
        return replayed_stats(self, prompt, **kwargs)

    def generate_many(self, prompts: Sequence[str | Sequence[int] | dict[str, Any]],
                      **kwargs: Any) -> list[GenerationResult]:
        """Generate for every prompt, up to `parallel` at a time in shared batches; results
        in the order of `prompts`. An item may be a dict {"prompt": ..., **settings} whose
        settings override `kwargs` for that request (mode, max_tokens, stop, seed, ...).
        Every output is what `generate` would give alone (greedy: up to rounding noise)."""
        jobs = [self._job(**{**kwargs, **p}) if isinstance(p, dict) else self._job(p, **kwargs)
                for p in prompts]
        if self._worker is not None:
            return [collect(self._follow(self._enqueue(j))) for j in jobs]
        events: dict[int, list[StreamEvent]] = {id(j): [] for j in jobs}
        waiting = list(jobs)
        with self._on_this_thread():
            active: list[_Job] = []
            try:
                while waiting or active:
                    while waiting and len(active) < len(self.slots):
                        active.append(self._admit(waiting.pop(0)))
                    step = self._gather(active)
                    for j in active:
                        events[id(j)].extend(j.drain())
                        if j.error is not None:
                            raise j.error
                    for j in [j for j in active if j.done]:
                        active.remove(j)
                        self._retire(j)
                    self._run_pass(step)
            finally:
                for j in active:
                    self._retire(j)
        return [collect(iter(events[id(j)])) for j in jobs]

    def submit(self, prompt: str | Sequence[int], **kwargs: Any) -> Iterator[StreamEvent]:
        """Thread-safe: queue a request for the engine's scheduler thread (started on first
        use) and return its events as an iterator. Requests submitted from several threads
        are decoded side by side in shared batches, up to `parallel` at a time (the rest
        wait); closing the iterator cancels the request within one step. Argument errors
        are raised here."""
        job = self._job(prompt, **kwargs)
        return self._follow(self._enqueue(job))

    # -- scheduling -------------------------------------------------------------------------
    def _admit(self, job: _Job) -> _Job:
        """Give a request a slot (the one holding the longest prefix of its prompt) and start
        its generation coroutine."""
        prompt = np.asarray(job.tokens, dtype=np.int32)
        slot, donor, shared = pick(self.slots, prompt)
        if self.plain_only:  # a recurrent state cannot be cut back or shared
            donor, shared = None, 0
        if donor is not None:  # (what the slot's own cells offer: see _prefill)
            shared = self.backend.continuable(donor.base, shared)
        if donor is not None and shared > self.backend.continuable(
                slot.base, slot.common_prefix(prompt)):
            self.backend.seq_copy(donor.base, slot.base, shared)  # prefix sharing
            slot.forget()
            slot.index.copy_from(donor.index, shared)
            slot.ctx[:shared] = donor.ctx[:shared]
            slot.n_past = shared
        slot.busy = True
        self._tick += 1
        slot.last_used = self._tick
        job.slot = slot
        job.gen = self._generation(job)
        return job

    def _retire(self, job: _Job) -> None:
        """Free the request's slot (its context stays for reuse); a generation that did not
        finish is closed, which removes whatever tree it had in the cache."""
        if job.gen is not None and not job.done:
            job.gen.close()  # a forked tree is abandoned inside
            job.done = True
        if job.slot is not None:
            slot = job.slot
            # nothing past the committed context stays in the cache (a step decoded for a
            # request that stopped before committing it)
            self.backend.seq_trim(slot.base, slot.n_past)
            slot.busy = False

    def _gather(self, jobs: list[_Job]) -> _Pass:
        """The first half of a scheduler step: every active request processes the rows of
        its last Work and says what it needs next (at most one of them a prompt chunk when
        others decode). Its events are ready after this, before the pass runs. A request
        that fails gets its exception; the others continue."""
        t0 = time.perf_counter()
        if len(jobs) == 1 and jobs[0].decoding:  # one request decoding: its next Work
            return self._gather_one(jobs[0], t0)
        works: list[tuple[_Job, Work]] = []
        offset, gain, chunk_taken = 0, 0.0, False
        decoding = sum(1 for j in jobs if j.decoding and not j.done)
        # decoding requests plan first; a prompt chunk then fits what is left of the step
        for job in sorted(jobs, key=lambda j: not j.decoding):
            if job.done:
                continue
            if job.cancelled:
                self._retire(job)
                continue
            job.batch_offset, job.batch_gain, job.solo = offset, gain, False
            job.may_prefill_all = decoding == 0 or (decoding == 1 and job.decoding)
            job.may_prefill = not chunk_taken
            if not job.decoding:
                job.chunk = self._chunk_size(offset)
            work = self._resume(job)
            if work is None or not len(work):  # done, failed, or waiting to prefill
                continue
            works.append((job, work))
            offset += len(work)
            gain += job.expected_tokens
            chunk_taken = chunk_taken or work.prefill
        return _Pass(works, t0)

    def _gather_one(self, job: _Job, t0: float) -> _Pass:
        """`_gather` for a single request that is decoding (no prompt chunk to fit, nobody
        else's tokens in the pass): the most frequent case, without the general loop."""
        if job.done:
            return _Pass([], t0)
        if job.cancelled:
            self._retire(job)
            return _Pass([], t0)
        job.batch_offset, job.batch_gain = 0, 0.0
        job.may_prefill_all = job.may_prefill = job.solo = True
        work = self._resume(job)
        return _Pass([(job, work)] if work is not None and len(work) else [], t0)

    @staticmethod
    def _resume(job: _Job) -> Work | None:
        """The request's next Work, or None where it finished or failed (then it is marked
        done or gets its exception; the others continue)."""
        try:
            return next(job.gen)
        except StopIteration:
            job.done = True
        except BaseException as exc:  # noqa: BLE001 - delivered to the request's caller
            job.fail(exc)
        return None

    def _run_pass(self, step: _Pass) -> None:
        """The second half: every Work of the step in one forward pass; the rows go back to
        their requests (resumed by the next `_gather`)."""
        works, t0 = step.works, step.t0
        if not works:
            return
        be = self.backend
        if len(works) == 1:
            job, w = works[0]
            if len(w) == 1 and w.flags[0] and len(w.seq_ids[0]) == 1:
                self._plain_pass(job, w, t0)
                return
        # what the cost model learns from the pass, but its time, is known before it (worked
        # out now: the pass flushes the caches)
        if len(works) == 1:  # (one request's tree: no sums over requests)
            job, w = works[0]
            learn = self.config.adaptive and not w.prefill
            n, ctx = len(w), job.slot.n_past
        else:
            learn = self.config.adaptive and not any(w.prefill for _, w in works)
            n = sum(len(w) for _, w in works)
            ctx = sum(j.slot.n_past * len(w) for j, w in works) // n
        d0 = be.decode_seconds
        replay = be.replay  # (a recorded or replayed generation: see replay.py)
        if replay is not None:
            replay.take_seconds()
        try:
            self._decode_together([w for _, w in works])
        except BaseException as exc:  # noqa: BLE001 - every request in the pass failed
            for job, _ in works:
                job.fail(exc, throw=True)
            return
        dt = be.decode_seconds - d0
        for _, w in works:
            w.decode_seconds = dt
        if learn:
            # replayed: what the recorded passes took, so that the decisions repeat
            seconds = (time.perf_counter() - t0 if replay is None else
                       replay.take_seconds())
            self.speculator.observe_cost(n, seconds, ctx)

    def _plain_pass(self, job: _Job, w: Work, t0: float) -> None:
        """`_run_pass` for a plain step of one request (the most frequent pass, and the one
        whose host time matters most): the token in one compiled call where there is one,
        no sums over requests."""
        be = self.backend
        d0, ctx, replay = be.decode_seconds, job.slot.n_past, be.replay
        if replay is not None:  # (a recorded or replayed generation: see replay.py)
            replay.take_seconds()
        try:
            out = (be.step_at(int(w.tokens[0]), int(w.positions[0]), w.seq_ids[0][0],
                              w.capture, w.stage) if w.run == 1 else
                   be.step_run(int(w.tokens[0]), int(w.positions[0]), w.seq_ids[0][0],
                               w.run, w.capture, w.stage, w.capture_from, w.draws, w.check))
        except BaseException as exc:  # noqa: BLE001 - delivered to the request's caller
            job.fail(exc, throw=True)
            return
        w.logits, w.hidden, w.sampled, w.staged = out.logits, out.hidden, out.sampled, \
            out.staged
        w.rejected = out.rejected
        w.decode_seconds = be.decode_seconds - d0
        if self.config.adaptive and not w.prefill:
            # replayed: what the recorded pass took, so that the decisions repeat
            seconds = (time.perf_counter() - t0 if replay is None else
                       replay.take_seconds())
            if w.run == 1:
                self.speculator.observe_plain_cost(seconds, ctx)
            else:  # (a run: each of its steps took its share)
                k = len(out.sampled)
                self.speculator.observe_plain_cost(seconds / k, ctx + (k - 1) // 2, k)

    def _chunk_size(self, decoding_tokens: int) -> int:
        """Prompt tokens to prefill next to `decoding_tokens` of other requests: the
        configured chunk, else as many as keep the pass within twice its cost without them
        (the others' inter-token gap), by the cost model."""
        if self.config.prefill_chunk:
            return self.config.prefill_chunk
        return self.speculator.cost.largest_within(decoding_tokens, 2.0, CHUNK_MIN, CHUNK_MAX)

    def _set_capture(self, on: bool) -> None:
        if self.backend.capture is not None:
            self.backend.capture.enabled = on

    def _decode_together(self, works: list[Work]) -> None:
        """One batch for several Works (split into llama_decode calls of n_batch by the
        backend); each Work gets its own logits and hidden rows back."""
        self._set_capture(any(w.capture or w.prefill for w in works))
        if len(works) == 1:  # its rows are the pass's, as they come (no slices)
            w = works[0]
            out = self.backend.decode(w.tokens, positions=w.positions, seq_ids=w.seq_ids,
                                      want_logits=w.flags)
            w.logits, w.sampled, w.hidden = out.logits, out.sampled, out.hidden
            return
        tokens = np.concatenate([np.asarray(w.tokens, dtype=np.int32) for w in works])
        positions = np.concatenate([np.asarray(w.positions, np.int32) for w in works])
        seq_ids = [ids for w in works for ids in w.seq_ids]
        flags = np.concatenate([np.asarray(w.flags, np.int8) for w in works])
        rows = [int(np.count_nonzero(w.flags)) for w in works]  # (before the pass flushes
        out = self.backend.decode(tokens, positions=positions, seq_ids=seq_ids,  # caches)
                                  want_logits=flags)
        row = tok = 0
        for w, k in zip(works, rows):
            w.logits = out.logits[row: row + k]
            w.sampled = None if out.sampled is None else out.sampled[row: row + k]
            w.hidden = None if out.hidden is None else out.hidden[tok: tok + len(w)]
            row, tok = row + k, tok + len(w)

    @contextmanager
    def _on_this_thread(self) -> Iterator[None]:
        """The engine's lock, for work that decodes on the caller's thread rather than the
        scheduler thread's; when done, the thread lets its OpenMP pool go (the next pass may
        come from another thread: see llama/omp.py)."""
        with self._lock:
            try:
                yield
            finally:
                omp.release()

    # -- worker thread (submit) -------------------------------------------------------------
    def _enqueue(self, job: _Job) -> _Job:
        with self._worker_lock:
            if self._worker is None:
                omp.release()  # this thread may have decoded: from now on the scheduler does
                self._worker = threading.Thread(target=self._serve, name="srsd-scheduler",
                                                daemon=True)
                self._worker.start()
            job.queue = queue.Queue()
            self._inbox.put(job)
        return job

    def _follow(self, job: _Job) -> Iterator[StreamEvent]:
        """A submitted request's events, as the worker delivers them; closing this
        iterator cancels the request."""
        try:
            while True:
                item = job.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            job.cancelled = True

    def _serve(self) -> None:
        """The worker thread: admit queued requests into free slots, run scheduler steps,
        deliver events. Stops when the engine closes."""
        active: list[_Job] = []
        waiting: list[_Job] = []
        while True:
            block = not active and not waiting
            try:
                while True:
                    item = self._inbox.get(block=block)
                    block = False
                    if item is None:
                        for j in active + waiting:
                            j.queue.put(RuntimeError("the engine was closed"))
                        for j in active:
                            self._retire(j)
                        return
                    waiting.append(item)
            except queue.Empty:
                pass
            with self._lock:
                waiting = [j for j in waiting if not j.cancelled]
                while waiting and len(active) < len(self.slots):
                    active.append(self._admit(waiting.pop(0)))
                if not active:
                    continue
                step = self._gather(active)
                for j in active:  # events go out before the pass
                    for ev in j.drain():
                        j.queue.put(ev)
                    if j.done and j.error is not None:
                        j.queue.put(j.error)
                for j in [j for j in active if j.done or j.cancelled]:
                    active.remove(j)
                    self._retire(j)
                step.works = [(j, w) for j, w in step.works if not j.done]
                try:
                    self._run_pass(step)
                except BaseException as exc:  # noqa: BLE001 - a failure outside the pass
                    for job, _ in step.works:  # itself fails the step's requests, never
                        job.fail(exc, throw=True)  # the worker thread they all wait on

    # -- the generation loop ----------------------------------------------------------------
    def _prefill(self, job: _Job) -> Generator[Work, None, tuple[np.ndarray, int]]:
        """Reuse the slot's common prefix, prefill the rest (in chunks while other requests
        decode); return (last logits row, reused tokens).

        The prompt is always prefilled with capture on, so its hidden rows are indexed
        whatever the mode. When the slot already holds the whole prompt and the logits after
        it were kept from its prefill, nothing is decoded at all: repeated prompts start
        from the very same numbers whatever mode asks (batched and one-token passes round
        differently, so re-decoding the last token would not)."""
        slot, tokens = job.slot, job.tokens
        n = len(tokens)
        common = slot.common_prefix(np.asarray(tokens, dtype=np.int32))
        if self.plain_only:  # a recurrent state cannot be cut back to a common prefix
            common = 0
        # (not where the sliding-window cache lost what the window at `common` needs: all
        # of the prompt is decoded again)
        common = self.backend.continuable(slot.base, common)
        saved = slot.prompt_end
        if common == n and saved is not None and saved[0] == n - 1:
            self._cut(slot, n)
            slot.last_hidden = saved[2]
            return saved[1], n
        common = min(common, n - 1)  # decode at least one token, for its logits
        self._cut(slot, common)
        pos = common
        while True:
            while not (job.may_prefill or job.may_prefill_all):
                yield Work([], np.zeros(0, np.int32), [], np.zeros(0, np.int8), False, True)
            size = n - pos if job.may_prefill_all else min(job.chunk, n - pos)
            part = tokens[pos: pos + size]
            last = pos + size == n
            flags = np.zeros(size, dtype=np.int8)
            flags[-1] = last
            ids = [[slot.base]] * size
            # a main sequence sampled in the graph gets no logits copied out; the prompt's
            # last chunk is put on the slot's (empty) branch 1 first, which has no sampler,
            # so that its last row is not sampled and its logits are copied out (kept for a
            # repeat of the prompt in any mode). (A row whose first sequence has a sampler
            # and another has none gets neither its token nor its logits right from
            # llama.cpp, which also wants sequences that share rows to share the cells
            # before them: the branch gets the main sequence's first.)
            aux = slot.base + 1 if last and slot.base in self.backend.graph_seqs else None
            if aux is not None:
                ids = [[aux, slot.base]] * size
                self.backend.seq_copy(slot.base, aux, pos)
            w = Work(part, np.arange(pos, pos + size, dtype=np.int32), ids, flags, True,
                     prefill=True)
            try:
                yield w
            finally:
                if aux is not None:  # (branch 1 is empty outside a tree)
                    self.backend.seq_trim(aux, 0)
            slot.ctx[pos: pos + size] = part
            if w.hidden is not None:
                slot.index.add(w.hidden, pos)
                slot.last_hidden = w.hidden[-1].copy()
            pos += size
            slot.n_past = pos
            if last:
                logits = w.logits[-1].copy()
                slot.prompt_end = (n - 1, logits, slot.last_hidden)
                return logits, common

    def _cut(self, slot: Slot, n: int) -> None:
        """The slot's context (KV cells, tokens, index) cut back to its first n tokens."""
        if n == 0:
            self.backend.seq_trim(slot.base, 0)
            slot.forget()
            return
        if n < slot.n_past:
            self.backend.seq_trim(slot.base, n)
        slot.n_past = min(slot.n_past, n)
        slot.index.truncate(n)
        slot.text.cut(n)

    def _generation(self, job: _Job) -> Generator[Work, None, None]:
        """One request, as a coroutine the scheduler drives: it yields what the next forward
        pass must decode for it and finds the rows in that Work when resumed.

        1. prefill (reusing what the slot already holds), sample the first token x;
        then each step: 2. emit, 3. propose a tree rooted at x, 4. verify it in the shared
        forward pass and walk it, 5. commit the accepted path (KV cache, context, index),
        learn."""
        be, slot, req, sampler = self.backend, job.slot, job.req, job.sampler
        stats = job.stats
        emit = Emitter(be.piece, be.is_eog, job.max_tokens, job.stops)
        n_lp = job.logprobs
        # trees verified by llama.cpp's greedy sampler: plain argmax only (no constraint, no
        # log-probabilities, nothing that reshapes the logits)
        in_graph = (be.graph_sampling and type(sampler) is Sampler and sampler.params.greedy
                    and n_lp is None)
        # greedy under a grammar: the argmax taken in the graph as well, each row copied out
        # too (`kept`; read where the grammar rejects the argmax); not in a replayed
        # generation (its recording holds no such rows)
        kept = (be.graph_sampling and type(sampler) is ConstrainedSampler and
                sampler.params.greedy and n_lp is None and be.replay is None)
        # sampled at a temperature alone (the compiled draw): plain steps drawn in the graph
        # with the uniform draw the host would use (`draw`: see sample_main), trees on the
        # sampled branch ids with their rows kept, drawn on the host
        draw = (type(sampler) is Sampler and sampler.drawn_compiled and n_lp is None and
                be.replay is None and be.can_draw)
        # a tree of several branches sampled in the graph lives on the slot's sampled
        # branch ids
        branches = self.config.graph_branch_base(slot.base // (self.config.max_branches + 1))
        if be.graph_sampling and not be.keep_rows(
                range(branches, branches + self.config.max_branches), kept or draw):
            kept = draw = False  # (llama.cpp refused: those ids are back to their argmax)
        in_graph = in_graph or kept
        # the slot's main sequence is then sampled in the graph: plain steps and chains come
        # back as token ids (a tree's rows on its other branches are copied out)
        main_graph = be.sample_main(slot.base, in_graph or draw, keep=kept,
                                    draw=sampler.params.temperature if draw else None)
        drawing = be.draw_state(slot.base) if draw and main_graph else None
        draw = drawing is not None
        graph_first = branches if in_graph or draw else slot.base
        # greedy under a grammar (kept): a run's tokens checked against the grammar in the
        # run itself, each taken where admitted (the run stops at one it rejects, whose row
        # is then searched; a drafting request's run also stops where the grammar forces
        # what comes next, which it drafts)
        check = (job.forcing.state.run_check(stop_forced=not self.plain_only)
                 if kept and main_graph and be.can_run(slot.base) else None)
        # plain steps whose token the graph takes (greedy or drawn), with no stop string to
        # watch: a plain step of this request alone in its pass may go on as a run of them
        # in one compiled call, as long as nothing is to be drafted in between and what is
        # to be checked is checked in the run
        runs = (self.config.plain_run if main_graph and (job.forcing is None or check is not None)
                and not job.stops and be.can_run(slot.base) else 1)

        # 1. prefill
        t0 = time.perf_counter()
        last_logits, stats.reused_prompt_tokens = yield from self._prefill(job)
        job.decoding = True
        if not self.plain_only:  # what drafting reads of the prompt, made now (prompt time):
            # not at the first drafting step, whose host time it would be
            n = slot.n_past
            if req.uses_text:
                slot.text.sync(slot.ctx[:n], be.piece)
            self.speculator.prepare(req, slot.ctx[:n])
            if main_graph and not draw and self.speculator.room(req, slot.n_ctx - n - 2):
                # the branch ids of its trees (the main sequence's branch 0 and the sampled
                # branch ids) get the prompt's cells now: a tree's fork then copies only
                # what the main sequence got since (each copy scans every cell of the
                # cache, and copying the prompt's cells into an id used for the first time
                # took 0.1-0.2 ms of a step's host time)
                be.seq_share(slot.base, self.config.max_branches + 1, graph_first, True)
        x = sampler(last_logits)
        forcing = job.forcing
        if forcing is not None:
            forcing.emitted(be.piece(x).decode("utf-8", "replace"))
        t1 = time.perf_counter()
        stats.prompt_seconds = t1 - t0
        if job.max_tokens == 0:
            job.emit(StreamEvent("", [], [], "length", stats, [] if n_lp is not None else None))
            return
        pending, drafted = [x], [False]  # x: chosen, not yet in the KV cache
        # host time of a step: from the end of the last one (emitting included)
        t_end, out_end = t1, job.outside
        # per pending token, when asked for: its log-probability from the row it was drawn from
        lps = None if n_lp is None else [token_logprob(last_logits, x, n_lp)]
        while True:
            # 2. emit, applying EOS / stop strings / max_tokens token by token
            out = emit.push(pending, drafted, out_of_room=slot.n_past >= slot.n_ctx)
            stats.tokens = emit.count
            ev_lps = None if lps is None else lps[: len(out.token_ids)]
            if out.finish_reason is not None:
                stats.seconds = time.perf_counter() - t1
                job.emit(StreamEvent(out.text, out.token_ids, out.drafted, out.finish_reason,
                                     stats, ev_lps))
                return
            job.emit(StreamEvent(out.text, out.token_ids, out.drafted, logprobs=ev_lps))

            # 3. propose: a tree rooted at x that pays for itself, or None (plain step)
            n = slot.n_past
            ta = time.perf_counter()
            room = 0 if self.plain_only else self.speculator.room(req, slot.n_ctx - n - 2)
            drafting = room > 0  # (else no step of this generation drafts from now on)
            plan, checked = None, 0  # checked: nodes of the candidate tree the grammar
            # admitted before the pass (see _constrain_draft)
            if room and forcing is None and req.copy_at is not None:  # a copy run goes
                # on: its chain, no drafting (not in one: nothing to slice or look up)
                plan = self.speculator.follow(req, slot.ctx[:n], x, room,
                                              offset=job.batch_offset, gain=job.batch_gain)
            forced = forcing.next_text() if room and plan is None and forcing is not None \
                else ""  # (what the grammar forces next: always drafted)
            if plan is not None or (room and not forced and self.speculator.skips(req)):
                room = 0  # no draft this step: its input is not even prepared
            if room:
                inp = DraftInput(slot.ctx[:n], x, slot.last_hidden,
                                 slot.index if req.uses_index else None)
                if forcing is None:  # (under a grammar every source runs)
                    inp.skip = self.speculator.sources_off(req)
                if req.uses_text and inp.skip & TEXT_SOURCES != TEXT_SOURCES:
                    root = be.piece(x)
                    inp.text = bytes(slot.text.sync(inp.tokens, be.piece)) + root
                    inp.flat = slot.text.flat_with(root)
                    inp.ends = slot.text.ends
                    inp.tokenize, inp.piece = self._tokenize_text, be.piece
                admitted = None if forcing is None else \
                    self._constrain_draft(inp, forcing, forced)
                plan = self.speculator.propose(req, inp, room, offset=job.batch_offset,
                                               gain=job.batch_gain)
                if admitted:
                    checked = admitted[0]
            job.expected_tokens = 1.0 if plan is None else 1.0 + plan.expected_accepted
            tb = time.perf_counter()

            # 4. verify in the shared forward pass and walk the tree
            if plan is None:
                run = 1
                if runs > 1 and job.solo:  # this step, and those the controller skips
                    # after it (all, where nothing drafts), within max_tokens and the context
                    run = min(1 + req.skip if drafting else runs, runs,
                              job.max_tokens - emit.count, slot.n_ctx - n)
                w = Work([x], [n], [[slot.base]], [1],  # no arrays: hot path
                         self.speculator.indexes(req), run=run,
                         check=check if run > 1 else None)
                if run > 1 and not req.greedy and req.uses_index:  # a sampled request's
                    # row is captured at the last step its back-off skips (the query of its
                    # next drafting), as step by step
                    w.capture, w.capture_from = True, req.skip
                if w.capture:  # its rows straight into the index
                    w.stage = slot.index.stage_address(run)
                if draw:  # the draws its rows take, drawn now
                    if run == 1:
                        drawing.u = sampler.uniform()
                    else:
                        w.draws = array("d", [sampler.uniform() for _ in range(run)])
                yield w
                got = w.sampled  # (in a batch with other requests: -1 for this row
                path, path_tokens = [0], [x]  # where this request's rows are not sampled)
                if run > 1:  # the run's steps: each decoded the token the last one took
                    k = len(got)
                    path, path_tokens, y = list(range(k)), [x, *got[: k - 1]], got[k - 1]
                    if w.rejected:  # (by the grammar: the best admitted token of its row)
                        y = sampler(w.logits[0], y, top_rejected=True)
                elif draw:
                    if got is None or got[0] < 0:
                        raise DecodeError("llama.cpp's graph drew no token for a sampled row")
                    y = int(got[0])
                elif got is None or got[0] < 0:
                    y = sampler(w.logits[0])
                else:  # (kept: the argmax checked against the grammar, else its row read)
                    y = sampler(w.logits[0], int(got[0])) if kept else int(got[0])
            else:
                lay = plan.tree.layout()
                nb = lay.n_branches
                # sampled in the graph: where the main sequence is sampled (not drawn), its
                # branch 0 on the main sequence and the others on the sampled branch ids (a
                # chain: no fork; each llama.cpp call of the fork and the commit scans every
                # cell of the cache, one per branch id), a drawn tree all on the sampled
                # branch ids (never on the main sequence's unsampled branch ids: a row whose
                # first sequence has a sampler and another has none gets neither its token
                # nor its logits right)
                on_main = main_graph and not draw
                chain = on_main and nb == 1
                graph = (in_graph or draw) and not chain
                first = graph_first if graph else slot.base
                seqs = be.branch_seqs(slot.base, nb, first, on_main)
                be.seq_fork(slot.base, nb, first, on_main)
                try:
                    w = _tree_work(lay, n, seqs, plan.pad, req.uses_index)
                    yield w
                    if draw:  # (rows kept on the sampled branch ids: drawn on the host)
                        path, y = walk_tree(plan.tree, w.logits.__getitem__, sampler)
                    elif kept and (graph or chain):
                        path, y = walk_tree(plan.tree, _node, _checked_draw(
                            sampler, plan, checked, w.logits, _graph_rows(w)))
                    elif checked and sampler.params.greedy:  # (under a grammar)
                        path, y = walk_tree(plan.tree, _node, _checked_draw(
                            sampler, plan, checked, w.logits))
                    elif graph or chain:
                        path, y = walk_tree(plan.tree, _graph_rows(w), int)
                    else:
                        path, y = walk_tree(plan.tree, w.logits.__getitem__, sampler)
                except BaseException:  # nothing of the tree may stay in the cache
                    be.seq_abandon(slot.base, nb, n, first, on_main)
                    raise
                be.seq_commit(slot.base, seqs[lay.seq_ids[path[-1]][0]], n, n + len(path),
                              nb, first, on_main)
                path_tokens = [plan.tree.tokens[i] for i in path]
            tc = time.perf_counter()

            # 5. commit: context tokens and hidden-state index; learn from the outcome
            slot.n_past = n + len(path)
            if len(path) == 1:
                slot.ctx[n] = x
            else:
                slot.ctx[n: n + len(path)] = path_tokens
            if w.staged or w.run > 1:  # a plain step's rows, in the index's pending rows
                at = n + w.capture_from  # already (those of a run's captured steps)
                if w.staged:
                    slot.last_hidden = slot.index.add_staged(at, w.staged)
                if w.hidden is not None:  # (a run's last row, where it was not staged)
                    slot.last_hidden = slot.index.add_path(w.hidden, [0], at + w.staged)
            elif req.uses_index and w.hidden is not None:  # (the rows are this step's own,
                # a tree's a view of the capture's buffer; the last row's copy in the index)
                slot.last_hidden = slot.index.add_path(w.hidden, path, n)
            self.speculator.observe(req, plan, path)
            td = time.perf_counter()
            host = (td - t_end) - w.decode_seconds - (job.outside - out_end)
            t_end, out_end = td, job.outside
            if plan is None:
                stats.observe_plain(tb - ta, tc - tb, td - tc, host, len(path))
            else:  # the forecast (if the controller made one) covers the drafted nodes
                t = plan.tree
                stats.observe_step(len(t), len(path) - 1, drafted=t.n_draft,
                                   forecast=plan.probs[1:],
                                   forecast_depths=t.depths[1:len(plan.probs)],
                                   draft=tb - ta, verify=tc - tb, index=td - tc, host=host,
                                   forced=sum(1 for i in path[1:] if t.origin[i] & GRAMMAR))
            pending = path_tokens[1:] + [y]
            if forcing is not None:
                forcing.emitted(b"".join(be.piece(t) for t in pending).decode("utf-8",
                                                                              "replace"))
            drafted = [plan is not None] * (len(path) - 1) + [False]
            if n_lp is not None:  # pending[i] was drawn from the row of node path[i]
                lps = [token_logprob(w.logits[node], tok, n_lp)
                       for node, tok in zip(path, pending)]
            x = y

    def _tokenize_text(self, text: str | bytes) -> list[int]:
        """Tokens of a piece of output-to-be (no BOS, special-token text left as text)."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", "ignore")
        return self._text_tokens(text)

    def _forced_tokens(self, text: str) -> tuple[int, ...]:
        """`_tokenize_text` of text a grammar forces, remembered: a schema's keys and
        punctuation recur in every object, and a tokenizer call right after a forward pass
        costs about 0.1-0.3 ms on a CPU."""
        got = self._forced_memo.get(text)
        if got is None:
            if len(self._forced_memo) >= FORCED_MEMO:
                self._forced_memo.clear()
            got = self._forced_memo[text] = tuple(self._tokenize_text(text))
        return got

    def _constrain_draft(self, inp: DraftInput, forcing: Forcing, text: str) -> list[int]:
        """Under a grammar: draft what it forces next (`text`, its `next_text()`), let it
        veto drafted nodes, and add what it forces after a drafted leaf to that leaf's
        branch. Returns a list whose one item becomes, once the tree is drafted, how many of
        its first nodes the grammar admitted along their paths (the root and the drafted
        nodes it did not veto; what it forces after a leaf follows them, unchecked)."""
        be, depth, state = self.backend, self.config.draft_depth, forcing.state
        if text:
            inp.forced = self._forced_tokens(text)
        admitted = [0]

        def constrain(tree: TokenTree, budget: int) -> TokenTree:
            keep, leaves = state.prune(tree.tokens, tree.parents)
            where: dict[int, int] = {}
            out = tree.subtree(keep, where)
            admitted[0] = len(out)
            for old, after in sorted(leaves.items(), key=lambda kv: -tree.weights[kv[0]]):
                if out.n_draft >= budget:
                    break
                room = min(budget - out.n_draft, depth - tree.depths[old])
                if room <= 0:
                    continue
                tail = forcing.after(after, be.piece(tree.tokens[old]).decode(
                    "utf-8", "replace")[-1:])
                if tail:
                    toks = list(self._forced_tokens(tail)[:room])
                    out.extend(where[old], toks, GRAMMAR)
            return out

        inp.constrain = constrain
        return admitted

    def chat_stream(self, messages: Sequence[dict[str, Any]],
                    tools: Sequence[dict[str, Any]] | None = None, **kwargs: Any
                    ) -> Iterator[StreamEvent]:
        return self.stream(self.apply_chat_template(messages, tools=tools), **kwargs)

    def chat(self, messages: Sequence[dict[str, Any]],
             tools: Sequence[dict[str, Any]] | None = None, **kwargs: Any) -> GenerationResult:
        """`tools` are rendered by the chat template; `srsd_local.llama.tools` parses the
        calls out of the text (`parse_tool_calls`) and forces one (`tool_call_grammar`)."""
        return collect(self.chat_stream(messages, tools=tools, **kwargs))


@dataclass
class _Pass:
    """One scheduler step's Works, and when the step began."""

    works: list[tuple[_Job, Work]]
    t0: float


class _Job:
    """One request: its validated settings, its generation coroutine and slot, and the
    events it produced that the caller has not taken yet."""

    def __init__(self, tokens: list[int], max_tokens: int, params: SamplingParams,
                 req: Request, stops: list[str], logprobs: int | None,
                 grammar: GrammarState | None = None, threads: int = 1) -> None:
        self.tokens, self.max_tokens, self.params = tokens, max_tokens, params
        self.req, self.stops, self.logprobs = req, stops, logprobs
        # under an output constraint: its position (advanced by the sampler) drives the drafts
        self.forcing = None if grammar is None else Forcing(grammar, FORCED_CHARS)
        # (a row is drawn on the decode's threads: idle between forward passes)
        self.sampler = (Sampler(params, threads) if grammar is None else
                        ConstrainedSampler(params, grammar, threads))
        self.stats = GenerationStats(mode=req.mode, prompt_tokens=len(tokens), steps=1)
        self.slot: Slot | None = None
        self.gen: Generator[Work, None, None] | None = None
        self.events: list[StreamEvent] = []
        self.error: BaseException | None = None
        self.done = self.cancelled = self.decoding = False
        self.queue: queue.Queue | None = None  # submit(): where the worker puts events
        # set by the scheduler before each resume
        self.batch_offset, self.batch_gain = 0, 0.0
        self.may_prefill = self.may_prefill_all = True
        self.solo = False  # alone in the next pass (its plain steps may go as a run)
        self.chunk = CHUNK_MAX  # prompt tokens this request may prefill in the next pass
        self.expected_tokens = 1.0  # what this request's Work is expected to emit
        self.outside = 0.0  # seconds its caller spent on its events (not engine overhead)

    def emit(self, event: StreamEvent) -> None:
        self.events.append(event)

    def drain(self) -> list[StreamEvent]:
        """Events produced since the last call (a failed request's `error` comes after
        them)."""
        out, self.events = self.events, []
        return out

    def fail(self, exc: BaseException, throw: bool = False) -> None:
        """The request ends with `exc`; with `throw`, inside its coroutine first (so it can
        undo a tree it had forked)."""
        if throw and self.gen is not None:
            try:
                self.gen.throw(exc)
            except BaseException:  # noqa: BLE001 - it re-raises: that is the point
                pass
        self.error = exc
        self.done = True


def _tree_work(lay: TreeLayout, n: int, seqs: list[int], pad: int, capture: bool) -> Work:
    """The Work that verifies a tree laid out from position n, branch b on sequence
    seqs[b], with `pad` dummy rows after it: copies of the root on branch 0 at the positions
    after its leaf, logits wanted (a step is cheaper with more rows where the matrix kernels
    take them in tiles: see cost.py). No node attends to them (they come later in their
    sequence) and committing the tree drops them with the rest of the branches."""
    ids = [[seqs[b] for b in ids] for ids in lay.seq_ids]
    tokens, positions = lay.tokens, array("i", [n + d for d in lay.depths])
    if pad:  # (arrays, not numpy: the backend fills such a batch in one compiled call)
        leaf = next(node for node, b in lay.leaf_branch.items() if b == 0)
        after = n + lay.depths[leaf] + 1
        tokens = tokens + array("i", [tokens[0]]) * pad
        positions.extend(range(after, after + pad))
        ids += [[seqs[0]]] * pad
    return Work(tokens, positions, ids, array("b", [1]) * len(tokens), capture)


def _graph_rows(w: Work) -> Callable[[int], int]:
    """The tree walk's row lookup for a tree sampled in llama.cpp's graph: the token it took
    at each node."""
    got = w.sampled
    if got is None or len(got) != len(w.tokens):
        raise DecodeError("llama.cpp returned no in-graph sampled tokens for a tree "
                          "(sample_in_graph)")
    toks = got.tolist()  # (one call; the walk reads a few rows, each checked)

    def row(node: int) -> int:
        t = toks[node]
        if t < 0:
            raise DecodeError(f"llama.cpp returned no in-graph sampled token for tree row "
                              f"{node} (sample_in_graph)")
        return t

    return row


def _node(node: int) -> int:
    return node


def _checked_draw(sampler: ConstrainedSampler, plan: Plan, checked: int, logits: np.ndarray,
                  tops: Callable[[int], int] | None = None) -> Callable[[int], int]:
    """The tree walk's draw at a node of a greedy request's tree under a grammar: the row's
    argmax (`tops(node)`: taken in llama.cpp's graph, the rows kept; else found in the row)
    where the grammar admits it, else the best admitted token of the node's row. An argmax
    that is the token of a child the grammar admitted before the pass (a node of the
    candidate tree below `checked`: see _constrain_draft) is taken without asking the
    grammar again: its check cost 40 us a node on a CPU, right after the pass."""
    tree, source = plan.tree, plan.source

    def draw(node: int) -> int:
        top = int(np.argmax(logits[node])) if tops is None else tops(node)
        child = tree.child(node, top)
        if child is not None and (source[child] if source else child) < checked:
            return sampler.take(top)
        return sampler(logits[node], top)

    return draw


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
