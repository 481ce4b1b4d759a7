"""`srsd-local bench --concurrency 1,2,4,8`: several clients at once.

For each level c, c client threads take the workload's prompts from one shared list (each
prompt once) and send them one after another; the engine serves them through
`Engine.submit` (shared batches, `parallel` = the highest level), llama-server peers through
their HTTP API started with `--parallel` = the highest level. Reported per mode and level:
total tokens/s (all tokens / wall time of the level), mean per-request tokens/s (tokens after
the first / time after the first), median time to first token, and the total's ratio to the
same mode with one client.

Interference: while one request decodes, a ~2k-token prompt arrives; the first request's
worst gap between emitted events during that prefill, over its median gap, with the prompt
prefilled in chunks next to its steps (`prefill_chunk` automatic) and in one piece (chunking
off).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .peers import Peer
from .workloads import BenchPrompt, load_workload


@dataclass
class Timing:
    prompt_id: str
    tokens: int
    submitted: float
    first: float | None  # first emitted token
    finished: float

    @property
    def per_request_tps(self) -> float | None:
        if self.first is None or self.tokens < 2 or self.finished <= self.first:
            return None
        return (self.tokens - 1) / (self.finished - self.first)


@dataclass
class Level:
    mode: str
    clients: int
    wall: float
    timings: list[Timing] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(t.tokens for t in self.timings)

    def summary(self) -> dict[str, Any]:
        per = [t.per_request_tps for t in self.timings if t.per_request_tps is not None]
        ttft = [t.first - t.submitted for t in self.timings if t.first is not None]
        return {"mode": self.mode, "clients": self.clients, "requests": len(self.timings),
                "tokens": self.tokens, "wall": self.wall,
                "total_tps": self.tokens / self.wall if self.wall > 0 else 0.0,
                "per_request_tps": statistics.mean(per) if per else None,
                "ttft_median": statistics.median(ttft) if ttft else None}


def _engine_client(engine: Any, mode: str) -> Callable[[BenchPrompt], Timing]:
    def one(p: BenchPrompt) -> Timing:
        t0 = time.perf_counter()
        first, n = None, 0
        for ev in engine.submit(p.prompt, max_tokens=p.max_tokens, temperature=p.temperature,
                                seed=p.seed, mode=mode):
            if ev.token_ids and first is None:
                first = time.perf_counter()
            n += len(ev.token_ids)
        return Timing(p.id, n, t0, first, time.perf_counter())
    return one


def _peer_client(peer: Peer) -> Callable[[BenchPrompt], Timing]:
    def one(p: BenchPrompt) -> Timing:
        t0 = time.perf_counter()
        res = peer.run(p)
        t1 = time.perf_counter()
        # no streaming: the first token came when generation (res.seconds long) began
        return Timing(p.id, res.tokens, t0, t1 - res.seconds, t1)
    return one


def run_level(client: Callable[[BenchPrompt], Timing], prompts: Sequence[BenchPrompt],
              clients: int, mode: str) -> Level:
    """`clients` threads send `prompts` (each once, shared list) one after another."""
    todo = list(prompts)
    lock = threading.Lock()
    out: list[Timing] = []
    errors: list[BaseException] = []

    def worker() -> None:
        while True:
            with lock:
                if not todo or errors:
                    return
                p = todo.pop(0)
            try:
                t = client(p)
            except BaseException as exc:  # noqa: BLE001 - re-raised by the caller
                with lock:
                    errors.append(exc)
                return
            with lock:
                out.append(t)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return Level(mode, clients, time.perf_counter() - t0, out)


def long_prompt(n_tokens: int, tokenize: Callable[[str], list[int]]) -> list[int]:
    """`n_tokens` token ids of public text: the code_continue and code_edit prompts
    (CPython's standard library) joined, cut to length."""
    text = ""
    for p in [p for name in ("code_continue", "code_edit") for p in load_workload(name)]:
        text += p.prompt + "\n\n"
        ids = tokenize(text)
        if len(ids) >= n_tokens:
            return ids[:n_tokens]
    return tokenize(text)


def interference(engine: Any, victim: BenchPrompt, intruder: list[int], mode: str,
                 chunk: int) -> dict[str, Any]:
    """The victim decodes; after its 16th token the intruder's prompt arrives (prefilled with
    `prefill_chunk=chunk`, 0: automatic). The victim's worst gap between events while the
    intruder's prompt is prefilled, and its median gap."""
    engine.reset()  # no slot may hold the intruder's prompt from an earlier run
    engine.reconfigure(prefill_chunk=chunk)
    stamps: list[float] = []
    arrived = threading.Event()
    prefilled: dict[str, float] = {}
    failed: list[BaseException] = []

    def intrude() -> None:
        arrived.wait()
        prefilled["start"] = time.perf_counter()
        try:
            for ev in engine.submit(intruder, max_tokens=4, mode="ar"):
                if ev.token_ids and "end" not in prefilled:
                    prefilled["end"] = time.perf_counter()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            failed.append(exc)

    th = threading.Thread(target=intrude)
    th.start()
    n = 0
    for ev in engine.submit(victim.prompt, max_tokens=victim.max_tokens, mode=mode):
        if ev.token_ids:
            stamps.append(time.perf_counter())
            n += len(ev.token_ids)
            if n >= 16:
                arrived.set()
    arrived.set()
    th.join()
    engine.reconfigure(prefill_chunk=0)
    if failed:
        raise failed[0]
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    start, end = prefilled.get("start", 0.0), prefilled.get("end", float("inf"))
    during = [b - a for a, b in zip(stamps, stamps[1:]) if b > start and a < end]
    med = statistics.median(gaps) if gaps else 0.0
    worst = max(during) if during else 0.0
    return {"chunk": chunk or "auto", "median_gap": med, "worst_gap_during_prefill": worst,
            "ratio": worst / med if med else None, "prefill_seconds": end - start}


def run_concurrency(engine: Any, prompts: Sequence[BenchPrompt], levels: Sequence[int],
                    modes: Sequence[str], peers: dict[str, Peer]) -> dict[str, Any]:
    results: list[Level] = []
    warm = BenchPrompt("warm-up", "warm-up", prompts[0].prompt, 8)
    for mode in modes:
        client = _peer_client(peers[mode]) if mode in peers else _engine_client(engine, mode)
        client(warm)
        for c in levels:
            if mode not in peers:  # no level may draft from an earlier level's outputs
                engine.forget_outputs()
            results.append(run_level(client, prompts, c, mode))
    rows = [lv.summary() for lv in results]
    for r in rows:
        base = next(x for x in rows if x["mode"] == r["mode"] and x["clients"] == levels[0])
        r["vs_one_client"] = r["total_tps"] / base["total_tps"] if base["total_tps"] else None
    intruder = long_prompt(min(2000, engine.n_ctx - 16), engine.tokenize)
    victim = prompts[0]
    inter = [interference(engine, victim, intruder, modes[0] if modes[0] not in peers
                          else "srsd", chunk) for chunk in (0, 1 << 20)]
    return {"levels": rows, "interference": inter,
            "timings": [asdict(t) | {"mode": lv.mode, "clients": lv.clients}
                        for lv in results for t in lv.timings]}


def concurrency_table(data: dict[str, Any]) -> str:
    lines = ["| mode | clients | total tokens/s | vs 1 client | per-request tokens/s | "
             "median time to first token (s) |", "|---|---|---|---|---|---|"]
    for r in data["levels"]:
        per = "-" if r["per_request_tps"] is None else f"{r['per_request_tps']:.1f}"
        ttft = "-" if r["ttft_median"] is None else f"{r['ttft_median']:.2f}"
        vs = "-" if r["vs_one_client"] is None else f"{r['vs_one_client']:.2f}x"
        lines.append(f"| {r['mode']} | {r['clients']} | {r['total_tps']:.1f} | {vs} | {per} | "
                     f"{ttft} |")
    lines += ["", "| prompt chunks | victim's median gap (ms) | worst gap during the 2k-token "
              "prefill (ms) | worst / median | prefill took (s) |", "|---|---|---|---|---|"]
    for r in data["interference"]:
        chunk = "automatic" if r["chunk"] == "auto" else "off (one piece)"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.1f}x"
        lines.append(f"| {chunk} | {r['median_gap'] * 1000:.1f} | "
                     f"{r['worst_gap_during_prefill'] * 1000:.1f} | {ratio} | "
                     f"{r['prefill_seconds']:.2f} |")
    return "\n".join(lines)
