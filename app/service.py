"""The service shared by the HTTP API and the UI: the engines (one model resident by default,
up to `max_models`), loaded in the background, behind one bounded FIFO queue, and the metrics
of what they generated.

- Parallel: up to `engine.parallel` requests of a model generate at once (`Engine.submit`:
  they share forward passes); the others wait in one bounded FIFO queue (429 when full), and
  a request never overtakes an earlier one. With parallel 1: one at a time, as before.
- Models: a request naming another model (an id of GET /v1/models, see `_target`) loads it
  when its turn comes: the load is queued like a generation and starts once the running
  requests have finished. With `max_models` > 1 several models stay resident, the least
  recently used evicted beyond that. A failed load is a 503 for its request (the log says
  why) and the previous model keeps serving. The model loaded last is the *current* one:
  requests that name no model go to it. Paths are not accepted as model names.
- Each request's engine events are moved onto the event loop by one thread (`_Pump`); between
  events the caller may check whether its client went away, so a dropped client stops its
  generation within one step (closing the engine's iterator cancels the request).
- Shutdown (`shutdown`, on SIGTERM): queued requests get 503 at once, running ones at their
  next step; new ones get 503.
- A model that fails to load at startup is reported to `on_load_error` (the server exits);
  clients and /health only learn that it failed, never the path or the file's bytes.
- An unexpected engine error fails its request (500) and resets that engine's context once
  its running requests are done (new ones wait meanwhile), so the next request does not
  inherit what the error left behind.
- Only the public Engine API is used (n_ctx, parallel, model_path, tokenize, submit, reset,
  ...).
- Metrics: every finished generation's GenerationStats is merged into one running total
  (`GenerationStats.merge`), and Prometheus reads its counters from that total; gauges say
  how many slots are busy, how many there are, and how many requests wait.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import re
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import GenerationStats
from ..llama.grammar import GrammarError
from ..llama.tools import ToolsUnsupportedError, forced_names, tool_call_grammar, tools_active
from .errors import APIError, shutting_down

log = logging.getLogger("srsd_local.app")


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
    model: str | None = None  # None: the current model
    logprobs: int | None = None  # None: off; else the alternatives to report per token
    grammar: str | None = None  # GBNF the output must follow
    json_schema: Any = None  # a JSON schema the output must satisfy
    constraint_param: str | None = None  # the request field the constraint came from
    tools: list[dict] | None = None  # OpenAI tools (validated), for the chat template
    tool_choice: Any = None  # "none" | "auto" | "required" | {type, function: {name}} | None

    @property
    def tools_active(self) -> bool:
        """The tools are offered to the model and its output is parsed for calls."""
        return self.kind == "chat" and tools_active(self.tools, self.tool_choice)


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
    """HTTP request counts, the queue and slot gauges, and the running total of generation
    stats."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge  # noqa: PLC0415

        self.registry = r = CollectorRegistry()
        self.requests = Counter("srsd_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.queue_length = Gauge("srsd_queue_length", "Requests waiting for the engine",
                                  registry=r)
        self.requests_waiting = Gauge("srsd_requests_waiting", "Requests waiting in the queue "
                                      "(the same as srsd_queue_length)", registry=r)
        self.slots_busy = Gauge("srsd_slots_busy", "Requests generating now (or the slots "
                                "held by a model load or an engine reset)", registry=r)
        self.slots_total = Gauge("srsd_slots_total", "Requests the resident models can "
                                 "generate at once (the sum of their --parallel)", registry=r)
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


# -- resident models and the queue in front of them -----------------------------------------------
RETRY_AFTER_S = 2  # the Retry-After of a 429: a guess; a generation takes seconds
RESET_WAIT_S = 5.0  # how long a reset waits for cancelled requests to leave the engine
CATALOG_TTL_S = 10.0  # how long the list of models found on disk is reused


def model_key(path: str | os.PathLike) -> str:
    """A model's identity: its file's absolute path (symlinks not followed: a link under
    another name is another model, as `srsd-local models` lists it)."""
    return os.path.abspath(os.fspath(path))


@dataclass(eq=False)
class Resident:
    """A loaded model: its engine, the id it is listed under, and the requests on it."""

    engine: Any
    model_id: str
    key: str  # model_key of its file
    holders: int = 0  # requests generating on it (a reset in progress counts as one)
    last_used: int = 0
    needs_reset: bool = False  # an engine error: reset once its requests are done

    @property
    def parallel(self) -> int:
        return max(1, int(self.engine.parallel))


@dataclass
class Grant:
    """What a request got from the queue: a slot of `resident` (a holder taken), or the turn
    to load the model `load` (the queue waits until it is loaded or failed)."""

    resident: Resident | None
    load: str | None = None


@dataclass(eq=False)
class _Waiter:
    fut: asyncio.Future
    target: str | None  # the model key it wants; None: the current model when its turn comes


class EnginePool:
    """The resident models and one FIFO queue for all of them: a request runs when its model
    has a free slot (`parallel`) and nobody is before it; a model load runs when nothing runs.
    Up to `max_queue` waiters (429 beyond). `close` (shutdown) fails every waiter with 503
    and refuses new ones. Used on the event loop only (the first model is installed before
    any request can be queued)."""

    def __init__(self, max_queue: int, max_models: int, metrics: Metrics) -> None:
        self.max_queue, self.max_models, self.metrics = max_queue, max_models, metrics
        self.residents: dict[str, Resident] = {}
        self.current: str | None = None  # the model key of requests that name none
        self.loading: str | None = None  # the model key being loaded: the queue waits
        self.closing = False
        self.on_reset: Callable[[Resident], None] = lambda res: None
        self._waiters: deque[_Waiter] = deque()
        self._tick = 0

    # -- state ------------------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def slots_busy(self) -> int:
        return sum(r.holders for r in self.residents.values())

    @property
    def slots_total(self) -> int:
        return sum(r.parallel for r in self.residents.values())

    @property
    def busy(self) -> bool:
        """Anything running: a generation, a load or a reset."""
        return self.loading is not None or self.slots_busy > 0

    def _gauges(self) -> None:
        m = self.metrics
        m.queue_length.set(len(self._waiters))
        m.requests_waiting.set(len(self._waiters))
        m.slots_busy.set(self.slots_busy)
        m.slots_total.set(self.slots_total)

    def _touch(self, res: Resident) -> None:
        self._tick += 1
        res.last_used = self._tick

    # -- granting -----------------------------------------------------------------------
    def _try(self, target: str | None) -> Grant | None:
        if self.loading is not None:
            return None
        key = self.current if target is None else target
        if key is None:
            return None
        res = self.residents.get(key)
        if res is not None:
            if res.needs_reset or res.holders >= res.parallel:
                return None
            res.holders += 1
            self._touch(res)
            return Grant(res)
        if self.slots_busy:  # a load waits until the running requests have finished
            return None
        self.loading = key
        return Grant(None, key)

    async def acquire(self, target: str | None) -> Grant:
        if self.closing:
            raise shutting_down()
        if not self._waiters and (grant := self._try(target)) is not None:
            self._gauges()
            return grant
        if len(self._waiters) >= self.max_queue:
            raise APIError(429, f"the server is busy: {len(self._waiters)} requests are "
                           f"waiting (--max-queue {self.max_queue}); retry later",
                           type_="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        w = _Waiter(asyncio.get_running_loop().create_future(), target)
        self._waiters.append(w)
        self._gauges()
        try:
            return await w.fut  # a Grant; an exception: shutdown
        except asyncio.CancelledError:
            if w.fut.done() and not w.fut.cancelled() and w.fut.exception() is None:
                self.give_back(w.fut.result())  # granted as the client went away
            elif w in self._waiters:
                self._waiters.remove(w)
                self._dispatch()  # it may have been the one the others waited behind
            raise
        finally:
            self._gauges()

    def _dispatch(self) -> None:
        """Grant the waiters at the head of the queue what is free now, in order."""
        while self._waiters:
            w = self._waiters[0]
            if w.fut.done():
                self._waiters.popleft()
                continue
            grant = self._try(w.target)
            if grant is None:
                break
            self._waiters.popleft()
            w.fut.set_result(grant)
        self._gauges()

    def give_back(self, grant: Grant) -> None:
        """A grant its request did not use."""
        if grant.resident is not None:
            self.release(grant.resident)
        else:
            self.loading = None
            self._dispatch()

    def release(self, res: Resident) -> None:
        res.holders -= 1
        if res.holders == 0 and res.needs_reset and res.key in self.residents:
            self._reset(res)
        self._dispatch()

    def mark_failed(self, res: Resident) -> None:
        """An engine error on `res`: reset it once its requests are done, none start before."""
        if res.needs_reset:
            return
        res.needs_reset = True
        if res.holders == 0 and res.key in self.residents:
            self._reset(res)

    def _reset(self, res: Resident) -> None:
        res.holders = 1  # the reset holds the engine; `reset_done` lets go
        self._gauges()
        self.on_reset(res)

    def reset_done(self, res: Resident) -> None:
        res.needs_reset = False
        self.release(res)

    # -- models -----------------------------------------------------------------------------
    def install(self, res: Resident, take: bool = False) -> list[Resident]:
        """A loaded model becomes resident and current (with `take`, one of its slots is
        taken for the request that loaded it); the least recently used ones beyond
        `max_models` are returned for closing. Ends the load."""
        self.residents[res.key] = res
        self.current = res.key
        self._touch(res)
        if take:
            res.holders += 1
        evicted = []
        while len(self.residents) > self.max_models:
            idle = [r for r in self.residents.values() if r is not res and r.holders == 0]
            if not idle:
                break
            old = min(idle, key=lambda r: r.last_used)
            del self.residents[old.key]
            evicted.append(old)
        if self.loading == res.key:
            self.loading = None
        self._dispatch()
        return evicted

    def load_failed(self) -> None:
        self.loading = None
        self._dispatch()

    def close(self) -> None:
        """Refuse new requests and answer every waiting one 503 (running ones stop at their
        next step: `Service.events` checks `closing`)."""
        self.closing = True
        while self._waiters:
            w = self._waiters.popleft()
            if not w.fut.done():
                w.fut.set_exception(shutting_down())
        self._gauges()


_END = object()


class _Pump:
    """One request's engine events (a blocking iterator, `Engine.submit`'s) moved onto the
    event loop by a thread of its own. `stop` cancels: the iterator is closed after the event
    in flight (within one engine step). `on_end` runs on the loop once the engine has let go
    of the request (its iterator closed)."""

    def __init__(self, events: Iterator[Any], on_end: Callable[[], None]) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self._events, self._on_end = events, on_end
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="srsd-request", daemon=True).start()

    def _send(self, fn: Callable, *args: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody listens any more
            pass

    def _run(self) -> None:
        try:
            for ev in self._events:
                self._send(self.queue.put_nowait, ev)
                if self._stop.is_set() or ev.finish_reason is not None:
                    break
        except BaseException as exc:  # noqa: BLE001 - delivered to the request
            self._send(self.queue.put_nowait, exc)
        finally:
            try:
                close = getattr(self._events, "close", None)
                if close is not None:
                    close()  # cancels the request in the engine
            except Exception:  # noqa: BLE001
                log.exception("closing a request's events failed")
            self._send(self.queue.put_nowait, _END)
            self._send(self._on_end)

    async def get(self) -> Any:
        return await self.queue.get()

    def stop(self) -> None:
        self._stop.set()


async def never_disconnected() -> bool:
    return False


LOAD_FAILED = "the model failed to load; the server's log says why"
_BYTES = re.compile(r"""(?<!\w)b('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")""")


def redact(message: str) -> str:
    """`message` without the bytes literals an error may quote from a file (its first
    bytes, say): the server never echoes a file's contents."""
    return _BYTES.sub("<bytes not shown>", message)


@dataclass
class Served:
    """Which model serves a request: filled in by `Service.events` before its first event."""

    model_id: str | None = None
    engine: Any = None


@dataclass
class ModelInfo:
    """One model of GET /v1/models."""

    id: str
    loaded: bool


class Service:
    """Holds the engines (the first loaded in the background) and serves requests.

    load: builds the startup engine. load_model(path): builds the engine of another model
    (None: no switching; only the startup model is served). list_models(): the models found
    on this machine (objects with `id`, `path` and `problem`, as `srsd_local.list_models`
    gives). resolve(name): the file of a model name (`srsd_local.resolve_model` without
    downloads); both default to srsd_local's when load_model is given."""

    def __init__(self, load: Callable[[], Any], model_id: str | None = None,
                 api_key: str | None = None, mode: str | None = None, max_queue: int = 16,
                 on_load_error: Callable[[str], None] | None = None,
                 load_model: Callable[[Path], Any] | None = None,
                 list_models: Callable[[], list[Any]] | None = None,
                 resolve: Callable[[str], Path] | None = None, max_models: int = 1) -> None:
        if max_queue < 1:
            raise ValueError(f"--max-queue {max_queue}: accepted is an integer >= 1")
        if max_models < 1:
            raise ValueError(f"--max-models {max_models}: accepted is an integer >= 1")
        self.load_error: str | None = None  # for the log only (redacted), never for clients
        self.alias = model_id
        self.api_key = api_key
        self.mode = mode
        self.metrics = Metrics()
        self.max_queue = max_queue
        self.max_models = max_models
        self.on_load_error = on_load_error
        self._load = load
        self._load_model = load_model
        if load_model is not None and (list_models is None or resolve is None):
            from .. import list_models as found  # noqa: PLC0415
            from .. import resolve_model  # noqa: PLC0415

            list_models = list_models or (lambda: found(headers=False))
            resolve = resolve or (lambda name: resolve_model(name, download=False))
        self._list_models = list_models
        self._resolve = resolve
        self._catalog_cache: tuple[float, list[Any]] | None = None
        self._names: dict[str, str] = {}  # a name that picked a model -> its key
        self._ids: dict[str, str] = {}  # model key -> the id it is listed under
        self._loop: asyncio.AbstractEventLoop | None = None
        self.pool = EnginePool(max_queue, max_models, self.metrics)
        self.pool.on_reset = self._start_reset
        self._started = False
        self.ready = threading.Event()

    async def start(self) -> None:
        """Bind to the running event loop and start loading the model."""
        if not self._started:
            self._started = True
            self._loop = asyncio.get_running_loop()
            self.start_loading()

    def start_loading(self) -> None:
        def work() -> None:
            try:
                eng = self._load()
                key = model_key(eng.model_path)
                model_id = self.alias or Path(eng.model_path).stem
                self._remember(key, model_id, eng)
                self.pool.install(Resident(eng, model_id, key))  # before any request queues
            except Exception as exc:  # /health and every request answer 503
                self.load_error = redact(str(exc)) or type(exc).__name__
                if self.on_load_error is not None:
                    self.on_load_error(self.load_error)
            finally:
                self.ready.set()

        threading.Thread(target=work, name="model-loader", daemon=True).start()

    def _remember(self, key: str, model_id: str, engine: Any, *names: str | None) -> None:
        """The names that pick the model of `key` from now on (also once it is evicted)."""
        self._ids.setdefault(key, model_id)
        path = Path(engine.model_path)
        for name in (model_id, path.name, path.stem, engine.model_name, *names):
            if name:
                self._names.setdefault(name, key)

    # -- state ------------------------------------------------------------------------------
    def _current(self) -> Resident | None:
        key = self.pool.current
        return None if key is None else self.pool.residents.get(key)

    @property
    def engine(self) -> Any:
        """The current model's engine (None while the first one loads)."""
        res = self._current()
        return None if res is None else res.engine

    @property
    def model_id(self) -> str | None:
        """The current model's id (before it loaded: the alias, if given)."""
        res = self._current()
        return self.alias if res is None else res.model_id

    @property
    def loading_model(self) -> str | None:
        """The id of the model being loaded for a switch, if one is."""
        key = self.pool.loading
        return None if key is None else self._ids.get(key, Path(key).stem)

    @property
    def closing(self) -> bool:
        return self.pool.closing

    def shutdown(self) -> None:
        """On the event loop: new and queued requests get 503, running generations stop at
        their next step (a stream ends with an error event)."""
        self.pool.close()

    def request_shutdown(self) -> None:
        """`shutdown` from any thread or a signal handler."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.shutdown)

    def model_ids(self) -> set[str]:
        """The names that pick a resident model."""
        return {n for n, k in self._names.items() if k in self.pool.residents}

    def check_ready(self) -> None:
        if self.closing:
            raise shutting_down()
        if self.load_error:
            raise APIError(503, LOAD_FAILED, type_="server_error", code="model_load_failed")
        if self.engine is None:
            raise APIError(503, "the model is still loading", type_="server_error",
                           code="model_loading")

    # -- models -----------------------------------------------------------------------------
    async def _catalog(self) -> list[Any]:
        """The models found on this machine, usable or not (cached for CATALOG_TTL_S)."""
        if self._list_models is None:
            return []
        now = time.monotonic()
        if self._catalog_cache is not None and now - self._catalog_cache[0] < CATALOG_TTL_S:
            return self._catalog_cache[1]
        try:
            entries = await asyncio.to_thread(self._list_models)
        except Exception:  # noqa: BLE001 - a listing problem must not fail requests
            log.exception("listing the models on disk failed")
            entries = []
        self._catalog_cache = (now, entries)
        return entries

    async def models(self) -> list[ModelInfo]:
        """GET /v1/models: the resident models (the current one first), then every other
        usable model found on this machine; each file once."""
        pool = self.pool
        res = sorted(pool.residents.values(),
                     key=lambda r: (r.key != pool.current, -r.last_used))
        out = [ModelInfo(r.model_id, True) for r in res]
        keys, ids = {r.key for r in res}, {r.model_id for r in res}
        for e in await self._catalog():
            key = model_key(e.path)
            model_id = self._ids.get(key, e.id)
            if getattr(e, "problem", None) or key in keys or model_id in ids:
                continue
            keys.add(key)
            ids.add(model_id)
            out.append(ModelInfo(model_id, False))
        return out

    def _not_found(self, name: str, why: str = "") -> APIError:
        return APIError(404, f"model {name!r} not found{why}; accepted: an id of GET "
                        f"/v1/models (the current model is {self.model_id!r})",
                        param="model", code="model_not_found")

    async def _target(self, name: str | None) -> str | None:
        """The model key a request's `model` names (None: the current model). Accepted: the
        id, file name or file stem of a model loaded before, an id of `list_models`, and
        what `resolve` accepts except paths (a client must not make the server open any file
        it names); else 404."""
        if name is None:
            return None
        if not isinstance(name, str) or not name:
            raise self._not_found(str(name))
        if name in self._names:
            return self._names[name]
        if self._load_model is None:
            raise self._not_found(name)
        for e in await self._catalog():
            if e.id == name:
                if getattr(e, "problem", None):  # the listing's own words: no file content
                    raise self._not_found(name, f" (it cannot be used: {redact(e.problem)})")
                return model_key(e.path)
        if name.startswith(("/", "~", ".")) or "\\" in name or os.path.exists(name):
            raise self._not_found(name, " (paths are not accepted here)")
        try:
            path = await asyncio.to_thread(self._resolve, name)
        except Exception as exc:  # noqa: BLE001 - unknown, ambiguous, not downloaded, ...
            log.info("model %r not resolved: %s", name, redact(str(exc)))
            raise self._not_found(name) from None
        key = model_key(path)
        self._ids.setdefault(key, name)
        return key

    def _load_blocking(self, key: str) -> Resident:
        """Load the model of `key` (on a worker thread)."""
        assert self._load_model is not None
        eng = self._load_model(Path(key))
        model_id = self._ids.get(key) or Path(key).stem
        self._remember(key, model_id, eng)
        return Resident(eng, model_id, key)

    async def _load_granted(self, key: str) -> Resident:
        """Load the model of `key` (the queue granted the turn): installed as the current
        model, one of its slots taken for the caller. A failure is a 503 and the previous
        model keeps serving; a caller that goes away meanwhile leaves the load to finish."""
        pool = self.pool
        loop = asyncio.get_running_loop()
        name = self._ids.get(key, Path(key).stem)
        ticket: dict[str, Any] = {"wanted": True, "resident": None}
        log.warning("loading model %r (%s)", name, key)

        def done(fut: asyncio.Future) -> None:  # on the loop, before the caller resumes
            if fut.cancelled() or fut.exception() is not None:
                exc = None if fut.cancelled() else fut.exception()
                log.error("model %r failed to load: %s", name, redact(str(exc)))
                pool.load_failed()
                return
            res = fut.result()
            take = ticket["wanted"] and not pool.closing
            for old in pool.install(res, take=take):
                log.warning("model %r unloaded (--max-models %d)", old.model_id,
                            self.max_models)
                loop.run_in_executor(None, old.engine.close)
            if take:
                ticket["resident"] = res
            log.warning("model %r loaded", res.model_id)

        fut = loop.run_in_executor(None, self._load_blocking, key)
        fut.add_done_callback(done)
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            ticket["wanted"] = False
            if ticket["resident"] is not None:
                pool.release(ticket["resident"])
            raise
        except Exception as exc:
            raise APIError(503, f"model {name!r} could not be loaded; "
                           f"{self.model_id!r} keeps serving (the server's log says why)",
                           type_="server_error", param="model",
                           code="model_load_failed") from exc
        if ticket["resident"] is None:  # shutting down meanwhile
            raise shutting_down()
        return ticket["resident"]

    async def _hold(self, name: str | None) -> Resident:
        """A slot of the model `name` (None: the current one), loading it if needed."""
        target = await self._target(name)
        grant = await self.pool.acquire(target)
        if grant.resident is not None:
            return grant.resident
        return await self._load_granted(grant.load)

    async def use_model(self, name: str) -> str:
        """Make `name` the current model (loading it, queued like a generation); its id."""
        self.check_ready()
        res = await self._hold(name)
        self.pool.current = res.key
        self.pool.release(res)
        return res.model_id

    # -- generation ------------------------------------------------------------------------
    def _prepare(self, eng: Any, req: GenRequest) -> tuple[list[int], dict[str, Any]]:
        param = "messages" if req.kind == "chat" else "prompt"
        tools = req.tools if req.tools_active else None
        try:
            if req.kind == "chat":
                tokens: list[int] = eng.tokenize(eng.apply_chat_template(req.messages,
                                                                         tools=tools))
            elif isinstance(req.prompt, str):
                tokens = eng.tokenize(req.prompt)
            else:
                tokens = list(req.prompt)  # token ids: the engine checks the range
        except ToolsUnsupportedError as exc:
            raise APIError(400, str(exc), param="tools" if tools else param,
                           code="unsupported_parameter") from exc
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
                      mode=req.mode or self.mode, logprobs=req.logprobs)
        if req.grammar is not None or req.json_schema is not None:
            kwargs.update(grammar=req.grammar, json_schema=req.json_schema)
        elif tools and forced_names(tools, req.tool_choice):
            try:  # the call is forced: a grammar in the template's format
                kwargs["grammar"] = tool_call_grammar(tools, req.tool_choice,
                                                      tagged=eng.tool_style() == "tagged")
            except GrammarError as exc:
                raise APIError(400, str(exc), param="tools", code="invalid_value") from exc
        return tokens, kwargs

    async def events(self, req: GenRequest, disconnected: Callable[[], Awaitable[bool]],
                     served: Served | None = None) -> AsyncIterator[Any]:
        """Engine events for one request, holding a slot of its model throughout (`served`
        says which model, before the first event)."""
        pool = self.pool
        self.check_ready()
        res = await self._hold(req.model)
        pump: _Pump | None = None
        failed = False
        try:
            if served is not None:
                served.model_id, served.engine = res.model_id, res.engine
            tokens, kwargs = self._prepare(res.engine, req)
            # the other fields were validated by the schemas: what the engine still refuses
            # (token ids out of range, an empty prompt) is about the prompt
            param: str | None = "messages" if req.kind == "chat" else "prompt"
            try:
                it = res.engine.submit(tokens, **kwargs)
            except GrammarError as exc:
                where = req.constraint_param or ("tools" if req.tools_active else "grammar")
                raise APIError(400, str(exc), param=where, code="invalid_value") from exc
            except ValueError as exc:
                raise APIError(400, str(exc), param=param, code="invalid_value") from exc
            pump = _Pump(it, lambda: pool.release(res))  # the slot is the pump's now
            while True:
                if pool.closing:  # shutdown: stop at this step
                    raise shutting_down()
                item = await pump.get()
                if item is _END:
                    return
                if isinstance(item, ValueError):
                    raise APIError(400, str(item), param=param, code="invalid_value") from item
                if isinstance(item, BaseException):
                    failed = True  # an engine error: its context may be inconsistent now
                    raise item
                param = None
                if item.stats is not None:
                    self.metrics.record(item.stats)
                yield item
                if item.finish_reason is not None:
                    return
                if await disconnected():
                    return
        finally:
            # nothing here awaits: a cancelled task may not await again
            if failed:
                pool.mark_failed(res)
            if pump is not None:
                pump.stop()  # the slot is released once the engine has let go
            else:
                pool.release(res)

    def _start_reset(self, res: Resident) -> None:
        """After an unexpected engine error (answered 500) the next request on that engine
        starts from a clean context rather than from one the error may have left
        inconsistent. Runs once the engine's requests are done (a cancelled one may still be
        leaving it: retried for RESET_WAIT_S)."""

        def work() -> None:
            deadline = time.monotonic() + RESET_WAIT_S
            while True:
                try:
                    res.engine.reset()
                    log.warning("engine error: the context of %r was reset (see the "
                                "traceback above)", res.model_id)
                    return
                except RuntimeError as exc:  # a request is still leaving the engine
                    if time.monotonic() > deadline:
                        log.error("engine error, and its context could not be reset: %s", exc)
                        return
                    time.sleep(0.01)
                except Exception as exc:  # noqa: BLE001
                    log.error("engine error, and its context could not be reset: %s", exc)
                    return

        loop = asyncio.get_running_loop()
        loop.run_in_executor(None, work).add_done_callback(
            lambda _f: self.pool.reset_done(res))
