"""The service shared by the HTTP API and the UI: one Engine, loaded in the background, behind
one bounded FIFO queue, and the metrics of what it generated.

- One engine, one generation at a time: requests wait in a bounded FIFO queue (429 when
  full) and a request never interrupts another.
- Generation runs step by step on one worker thread; between steps the caller may check
  whether its client went away, so a dropped client stops its generation within one step.
- Shutdown (`shutdown`, on SIGTERM): queued requests get 503 at once, the running one at
  its next step; new ones get 503.
- A model that fails to load is reported to `on_load_error` (the server exits); clients and
  /health only learn that it failed, never the path or the file's bytes.
- An unexpected engine error fails its request (500) and resets the engine's context, so the
  next request does not inherit what the error left behind.
- Only the public Engine API is used (n_ctx, model_path, tokenize, stream, reset, ...).
- Metrics: every finished generation's GenerationStats is merged into one running total
  (`GenerationStats.merge`), and Prometheus reads its counters from that total.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import threading
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import GenerationStats
from .errors import APIError, shutting_down


@dataclass
class GenRequest:
    """One validated generation request (built by the HTTP schemas or by the UI)."""

    kind: str  # "completion" | "chat"
    prompt: str | list[int] | None
    messages: list[dict] | None
    max_tokens: int | None  # None: as many as the context leaves room for
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = dataclasses.field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    mode: str | None = None  # None: the service's default mode
    model: str | None = None


# -- metrics --------------------------------------------------------------------------------------
# (Prometheus name, help, GenerationStats field): counters read from the running total
TOTAL_COUNTERS = (
    ("srsd_generations", "Generations finished", None),
    ("srsd_prompt_tokens", "Prompt tokens", "prompt_tokens"),
    ("srsd_reused_prompt_tokens", "Prompt tokens reused from the context", "reused_prompt_tokens"),
    ("srsd_prompt_seconds", "Seconds spent processing prompts", "prompt_seconds"),
    ("srsd_generated_tokens", "Generated tokens", "tokens"),
    ("srsd_generation_seconds", "Seconds spent generating (prompts excluded)", "seconds"),
    ("srsd_steps", "Forward passes that produced tokens", "steps"),
    ("srsd_drafts", "Speculative trees verified", "drafts"),
    ("srsd_draft_tokens", "Drafted tokens verified", "draft_tokens"),
    ("srsd_accepted_tokens", "Drafted tokens accepted", "accepted_tokens"),
)


class Metrics:
    """HTTP request counts, the queue length, and the running total of generation stats."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge  # noqa: PLC0415

        self.registry = r = CollectorRegistry()
        self.requests = Counter("srsd_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.queue_length = Gauge("srsd_queue_length", "Requests waiting for the engine",
                                  registry=r)
        self.total = GenerationStats(mode="ar")
        self.generations = 0
        self.last_tokens_per_second = 0.0
        self._lock = threading.Lock()
        r.register(_TotalCollector(self))

    def record(self, stats: GenerationStats) -> None:
        """Add one finished generation to the running total."""
        # the per-step lists would only grow: the total keeps counts and per-depth sums
        counts = dataclasses.replace(stats, tokens_per_step=[], tree_sizes=[])
        with self._lock:
            self.total.merge(counts)
            self.generations += 1
            self.last_tokens_per_second = stats.tokens_per_second

    def snapshot(self) -> tuple[GenerationStats, int, float]:
        with self._lock:
            return (dataclasses.replace(self.total,
                                        accepted_per_depth=list(self.total.accepted_per_depth)),
                    self.generations, self.last_tokens_per_second)

    def render(self) -> bytes:
        from prometheus_client import generate_latest  # noqa: PLC0415

        return generate_latest(self.registry)


class _TotalCollector:
    """Prometheus collector over `Metrics.total` (read at scrape time)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self) -> list:
        return []  # collected at scrape time only

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (  # noqa: PLC0415
            CounterMetricFamily,
            GaugeMetricFamily,
        )

        total, generations, last_tps = self.metrics.snapshot()
        for name, help_, attr in TOTAL_COUNTERS:
            value = generations if attr is None else getattr(total, attr)
            yield CounterMetricFamily(name, help_, value=value)
        per_pos = CounterMetricFamily("srsd_accepted_per_position",
                                      "Accepted drafted tokens by draft position",
                                      labels=["position"])
        for d, n in enumerate(total.accepted_per_depth, 1):
            per_pos.add_metric([str(d)], n)
        yield per_pos
        yield GaugeMetricFamily("srsd_tokens_per_second", "Generation speed of the last request",
                                value=last_tps)


# -- the engine slot: FIFO, bounded, closable --------------------------------------------------
RETRY_AFTER_S = 2  # the Retry-After of a 429: a guess; a generation takes seconds


class EngineSlot:
    """One engine, one holder at a time; up to `max_queue` waiters in arrival order (429
    beyond). `close` (shutdown) fails every waiter with 503 and refuses new ones."""

    def __init__(self, max_queue: int, metrics: Metrics) -> None:
        self.max_queue = max_queue
        self.metrics = metrics
        self.busy = False
        self.closing = False
        self._waiters: deque[asyncio.Future] = deque()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def _gauge(self) -> None:
        self.metrics.queue_length.set(len(self._waiters))

    async def acquire(self) -> None:
        if self.closing:
            raise shutting_down()
        if not self.busy:  # waiters exist only while the slot is busy
            self.busy = True
            return
        if len(self._waiters) >= self.max_queue:
            raise APIError(429, f"the server is busy: {len(self._waiters)} requests are "
                           f"waiting (--max-queue {self.max_queue}); retry later",
                           type_="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._gauge()
        try:
            await fut  # a result: the slot was handed over; an exception: shutdown
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release()  # handed the slot as the client went away: pass it on
            elif fut in self._waiters:
                self._waiters.remove(fut)
            raise
        finally:
            self._gauge()

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot stays busy: handed to the next in line
                self._gauge()
                return
        self.busy = False
        self._gauge()

    def close(self) -> None:
        """Refuse new requests and answer every waiting one 503 (the running one stops at
        its next step: `Service.events` checks `closing`)."""
        self.closing = True
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_exception(shutting_down())
        self._gauge()

    async def run(self, fn: Callable, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, fn, *args)


_END = object()


def _next(gen: Iterator) -> Any:
    return next(gen, _END)


async def never_disconnected() -> bool:
    return False


LOAD_FAILED = "the model failed to load; the server's log says why"
_BYTES = re.compile(r"""(?<!\w)b('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")""")


def redact(message: str) -> str:
    """`message` without the bytes literals an error may quote from a file (its first
    bytes, say): the server never echoes a file's contents."""
    return _BYTES.sub("<bytes not shown>", message)


class Service:
    """Holds the engine (loaded in the background) and serves requests."""

    def __init__(self, load: Callable[[], Any], model_id: str | None = None,
                 api_key: str | None = None, mode: str | None = None, max_queue: int = 16,
                 on_load_error: Callable[[str], None] | None = None) -> None:
        if max_queue < 1:
            raise ValueError(f"--max-queue {max_queue}: accepted is an integer >= 1")
        self.engine = None
        self.load_error: str | None = None  # for the log only (redacted), never for clients
        self.model_id = model_id
        self.api_key = api_key
        self.mode = mode
        self.metrics = Metrics()
        self.max_queue = max_queue
        self.on_load_error = on_load_error
        self._load = load
        self._loop: asyncio.AbstractEventLoop | None = None
        self.slot: EngineSlot | None = None
        self.ready = threading.Event()

    async def start(self) -> None:
        """Create the queue (on the running event loop) and start loading the model."""
        if self.slot is None:
            self._loop = asyncio.get_running_loop()
            self.slot = EngineSlot(self.max_queue, self.metrics)
            self.start_loading()

    def start_loading(self) -> None:
        def work() -> None:
            try:
                eng = self._load()
                if self.model_id is None:
                    self.model_id = Path(eng.model_path).stem
                self.engine = eng
            except Exception as exc:  # /health and every request answer 503
                self.load_error = redact(str(exc)) or type(exc).__name__
                if self.on_load_error is not None:
                    self.on_load_error(self.load_error)
            finally:
                self.ready.set()

        threading.Thread(target=work, name="model-loader", daemon=True).start()

    # -- shutdown --------------------------------------------------------------------------
    @property
    def closing(self) -> bool:
        return self.slot is not None and self.slot.closing

    def shutdown(self) -> None:
        """On the event loop: new and queued requests get 503, the running generation stops
        at its next step (a stream ends with an error event)."""
        if self.slot is not None:
            self.slot.close()

    def request_shutdown(self) -> None:
        """`shutdown` from any thread or a signal handler."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.shutdown)

    def model_ids(self) -> set[str]:
        eng = self.engine
        ids = {self.model_id}
        if eng is not None:
            ids |= {Path(eng.model_path).name, eng.model_name}
        return ids

    def check_ready(self) -> None:
        if self.closing:
            raise shutting_down()
        if self.load_error:
            raise APIError(503, LOAD_FAILED, type_="server_error", code="model_load_failed")
        if self.engine is None:
            raise APIError(503, "the model is still loading", type_="server_error",
                           code="model_loading")

    # -- generation ------------------------------------------------------------------------
    def _prepare(self, req: GenRequest) -> tuple[str | list[int], dict[str, Any]]:
        eng = self.engine
        if req.model is not None and req.model not in self.model_ids():
            raise APIError(404, f"model {req.model!r} not found; this server serves "
                           f"{self.model_id!r} (GET /v1/models)", param="model",
                           code="model_not_found")
        param = "messages" if req.kind == "chat" else "prompt"
        try:
            if req.kind == "chat":
                tokens: list[int] = eng.tokenize(eng.apply_chat_template(req.messages))
            elif isinstance(req.prompt, str):
                tokens = eng.tokenize(req.prompt)
            else:
                tokens = list(req.prompt)  # token ids: Engine.stream checks the range
        except ValueError as exc:
            raise APIError(400, str(exc), param=param, code="invalid_value") from exc
        n_ctx, n = eng.n_ctx, len(tokens)
        what = "the messages are" if req.kind == "chat" else "the prompt is"
        if n >= n_ctx:
            raise APIError(400, f"{what} {n} tokens and this model's context is {n_ctx} "
                           "tokens, which leaves no room to generate; shorten the "
                           f"{param} to at most {n_ctx - 1} tokens", param=param,
                           code="context_length_exceeded")
        max_tokens = req.max_tokens if req.max_tokens is not None else n_ctx - n
        if n + max_tokens > n_ctx:
            raise APIError(400, f"this model's context is {n_ctx} tokens; {what} {n} tokens "
                           f"and max_tokens is {max_tokens} (together {n + max_tokens}); "
                           f"lower max_tokens to at most {n_ctx - n} or shorten the {param}",
                           param="max_tokens", code="context_length_exceeded")
        kwargs = dict(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                      top_k=req.top_k, min_p=req.min_p, seed=req.seed, stop=req.stop or None,
                      mode=req.mode or self.mode)
        return tokens, kwargs

    async def events(self, req: GenRequest, disconnected: Callable[[], Awaitable[bool]]
                     ) -> AsyncIterator[Any]:
        """Engine events for one request, holding the engine slot throughout."""
        assert self.slot is not None, "Service.start() was not awaited"
        slot = self.slot
        await slot.acquire()
        gen, failed = None, False
        try:
            tokens, kwargs = self._prepare(req)
            gen = self.engine.stream(tokens, **kwargs)
            # the other fields were validated by the schemas: what Engine.stream still
            # refuses (token ids out of range, an empty prompt) is about the prompt
            param: str | None = "messages" if req.kind == "chat" else "prompt"
            while True:
                if slot.closing:  # shutdown: stop at this step
                    raise shutting_down()
                try:
                    ev = await slot.run(_next, gen)
                except ValueError as exc:
                    raise APIError(400, str(exc), param=param, code="invalid_value") from exc
                except Exception:
                    failed = True  # an engine error: its context may be inconsistent now
                    raise
                param = None
                if ev is _END:
                    return
                if ev.stats is not None:
                    self.metrics.record(ev.stats)
                yield ev
                if ev.finish_reason is not None:
                    return
                if await disconnected():
                    return
        finally:
            # close the generation on the engine thread (after a step in flight, FIFO) and
            # free the slot without awaiting anything: a cancelled task may not await again
            loop = asyncio.get_running_loop()
            if gen is not None:
                loop.run_in_executor(slot.executor, gen.close)
            if failed:  # before the next request's steps (FIFO)
                loop.run_in_executor(slot.executor, self._reset_engine)
            slot.release()

    def _reset_engine(self) -> None:
        """After an unexpected engine error (answered 500) the next request starts from a
        clean context rather than from one the error may have left inconsistent."""
        log = logging.getLogger("srsd_local.app")
        try:
            self.engine.reset()
            log.warning("engine error: its context was reset (see the traceback above)")
        except Exception as exc:
            log.error("engine error, and its context could not be reset: %s", exc)
