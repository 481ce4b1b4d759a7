"""Side-by-side benchmark: every mode on every prompt, one process, one model.

Modes are interleaved per prompt so machine noise hits all of them alike; one warm-up pass
per mode is excluded from timing. Speed-ups are ratios of totals (tokens / seconds) within
one run. `lcp-pld` is the external peer: llama-cpp-python's own prompt lookup decoding
(`Llama(..., draft_model=LlamaPromptLookupDecoding())`) on the same GGUF.
"""

from __future__ import annotations

import json
import os
import platform
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from datetime import date
from importlib import resources
from pathlib import Path
from typing import Any

from .config import MODES

BUILTIN_WORKLOADS = ("code_edit", "text_edit", "humaneval", "code_continue", "open")
PEER_MODES = ("lcp-pld",)
ALL_MODES = MODES + PEER_MODES


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    category: str
    prompt: str
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None


def _parse_line(line: str, where: str) -> BenchPrompt:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc.msg})") from exc
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected an object with id, category, prompt, max_tokens")
    need = {"id": str, "category": str, "prompt": str, "max_tokens": int}
    for key, typ in need.items():
        if key not in obj:
            raise ValueError(f"{where}: missing {key!r} (required: {', '.join(need)})")
        if not isinstance(obj[key], typ) or isinstance(obj[key], bool):
            raise ValueError(f"{where}: {key!r} must be a {typ.__name__}")
    if obj["max_tokens"] < 1:
        raise ValueError(f"{where}: 'max_tokens' must be >= 1")
    temp = obj.get("temperature", 0.0)
    if isinstance(temp, bool) or not isinstance(temp, (int, float)) or temp < 0:
        raise ValueError(f"{where}: 'temperature' must be a number >= 0")
    seed = obj.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ValueError(f"{where}: 'seed' must be an integer >= 0")
    return BenchPrompt(obj["id"], obj["category"], obj["prompt"], obj["max_tokens"],
                       float(temp), seed)


def load_workload(spec: str) -> list[BenchPrompt]:
    """A built-in workload name, 'all', or a path to a JSONL file."""
    if spec == "all":
        return [p for name in BUILTIN_WORKLOADS for p in load_workload(name)]
    if spec in BUILTIN_WORKLOADS:
        text = resources.files("srsd_local.workloads").joinpath(f"{spec}.jsonl").read_text(
            encoding="utf-8")
        where = f"workload {spec}"
    else:
        path = Path(spec)
        if not path.is_file():
            raise ValueError(f"unknown workload {spec!r}: accepted are "
                             f"{', '.join(BUILTIN_WORKLOADS)}, all, or a path to a .jsonl file")
        text = path.read_text(encoding="utf-8")
        where = str(path)
    prompts = [_parse_line(line, f"{where} line {i}")
               for i, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not prompts:
        raise ValueError(f"{where}: no prompts")
    return prompts


def parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in ALL_MODES]
    if bad or not modes:
        raise ValueError(f"unknown mode(s) {bad or text!r}: accepted are {', '.join(ALL_MODES)}")
    if "ar" not in modes:
        modes.insert(0, "ar")  # every speed-up is relative to plain decoding
    return modes


@dataclass
class RunRecord:
    prompt_id: str
    category: str
    mode: str
    repeat: int
    tokens: int
    seconds: float
    steps: int
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_depth: list[int] = field(default_factory=list)
    predicted_per_depth: list[float] = field(default_factory=list)
    drafts: int = 0
    time_draft: float = 0.0
    time_verify: float = 0.0
    time_index: float = 0.0
    identical_to_ar: bool | None = None
    token_ids: list[int] = field(default_factory=list)


class LcpPeer:
    """llama-cpp-python's prompt lookup decoding on the same GGUF (the external peer)."""

    def __init__(self, model_path: str, n_ctx: int, n_threads: int, n_gpu_layers: int) -> None:
        from llama_cpp import Llama  # noqa: PLC0415
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding  # noqa: PLC0415

        self.llm = Llama(model_path=model_path, n_ctx=n_ctx, n_threads=n_threads,
                         n_threads_batch=n_threads, n_gpu_layers=n_gpu_layers,
                         logits_all=True, verbose=False,
                         draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10))

    def run(self, p: BenchPrompt) -> tuple[list[int], float]:
        from llama_cpp import llama_cpp  # noqa: PLC0415

        llm = self.llm
        tokens = llm.tokenize(p.prompt.encode("utf-8"), add_bos=True, special=True)
        if p.seed is not None:
            llm.set_seed(p.seed)
        out: list[int] = []
        t_first = None
        for tok in llm.generate(tokens, temp=p.temperature, top_k=0, top_p=1.0, min_p=0.0,
                                repeat_penalty=1.0, reset=True):
            if llama_cpp.llama_vocab_is_eog(llm._model.vocab, tok):
                break
            out.append(tok)
            if t_first is None:
                t_first = time.perf_counter()
            if len(out) >= p.max_tokens:
                break
        seconds = time.perf_counter() - t_first if t_first is not None else 0.0
        return out, seconds


def _record_from_stats(p: BenchPrompt, mode: str, repeat: int, res) -> RunRecord:
    s = res.stats
    return RunRecord(p.id, p.category, mode, repeat, s.tokens, s.seconds, s.steps,
                     s.draft_tokens, s.accepted_tokens, list(s.accepted_per_depth),
                     list(s.predicted_per_depth), s.drafts, s.time_draft, s.time_verify,
                     s.time_index, token_ids=list(res.token_ids))


def run_bench(engine, prompts: list[BenchPrompt], modes: list[str], repeats: int = 1,
              peer: LcpPeer | None = None, progress: bool = True) -> list[RunRecord]:
    from tqdm import tqdm  # noqa: PLC0415

    def one(p: BenchPrompt, mode: str, repeat: int) -> RunRecord:
        if mode == "lcp-pld":
            assert peer is not None
            ids, secs = peer.run(p)
            return RunRecord(p.id, p.category, mode, repeat, len(ids), secs, 0, token_ids=ids)
        res = engine.generate(p.prompt, max_tokens=p.max_tokens, temperature=p.temperature,
                              seed=p.seed, mode=mode)
        return _record_from_stats(p, mode, repeat, res)

    warm = BenchPrompt("warm-up", "warm-up", prompts[0].prompt, min(16, prompts[0].max_tokens))
    for mode in modes:  # excluded from timing
        one(warm, mode, -1)
    records: list[RunRecord] = []
    bar = tqdm(total=len(prompts) * len(modes) * repeats, desc="bench", unit="run",
               disable=not progress, file=None)
    for p in prompts:
        for r in range(repeats):
            ar_ids = None
            for mode in modes:
                bar.set_postfix_str(f"{p.id} {mode}")
                rec = one(p, mode, r)
                if mode == "ar":
                    ar_ids = rec.token_ids
                elif ar_ids is not None and p.temperature == 0.0:
                    rec.identical_to_ar = rec.token_ids == ar_ids
                records.append(rec)
                bar.update(1)
    bar.close()
    return records


# -- aggregation -------------------------------------------------------------------------------
def _aggregate(recs: Iterable[RunRecord]) -> dict[str, Any]:
    recs = list(recs)
    tokens = sum(r.tokens for r in recs)
    seconds = sum(r.seconds for r in recs)
    steps = sum(r.steps for r in recs)
    drafted = sum(r.draft_tokens for r in recs)
    accepted = sum(r.accepted_tokens for r in recs)
    same = [r.identical_to_ar for r in recs if r.identical_to_ar is not None]
    def per_depth(lists: Iterable[list]) -> list:
        out: list = []
        for values in lists:
            for d, n in enumerate(values):
                if d >= len(out):
                    out.append(0)
                out[d] += n
        return out

    depth = per_depth(r.accepted_per_depth for r in recs)
    predicted = per_depth(r.predicted_per_depth for r in recs)
    drafts = sum(r.drafts for r in recs)
    return {
        "runs": len(recs), "tokens": tokens, "seconds": seconds,
        "tokens_per_second": tokens / seconds if seconds else 0.0,
        "mean_accepted_length": tokens / steps if steps else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "draft_tokens": drafted, "accepted_tokens": accepted, "drafts": drafts,
        "accepted_per_depth": depth,
        "accepted_rate_per_depth": [n / drafts for n in depth] if drafts else [],
        # the controller's forecast for the same trees (modes with the controller only)
        "predicted_rate_per_depth": [n / drafts for n in predicted] if drafts else [],
        "share_draft": sum(r.time_draft for r in recs) / seconds if seconds else 0.0,
        "share_verify": sum(r.time_verify for r in recs) / seconds if seconds else 0.0,
        "share_index": sum(r.time_index for r in recs) / seconds if seconds else 0.0,
        "identical_to_ar": (sum(same), len(same)) if same else None,
    }


def summarise(records: list[RunRecord], modes: list[str]) -> dict[str, Any]:
    def block(recs: list[RunRecord]) -> dict[str, Any]:
        out = {m: _aggregate(r for r in recs if r.mode == m) for m in modes}
        base = out.get("ar", {}).get("tokens_per_second") or 0.0
        for m in modes:
            out[m]["speedup_vs_ar"] = out[m]["tokens_per_second"] / base if base else None
        return out

    cats = sorted({r.category for r in records})
    return {
        "modes": block(records),
        "categories": {c: block([r for r in records if r.category == c]) for c in cats},
        "prompts": [asdict(r) for r in records],
    }


def machine_info(engine, n_threads: int) -> dict[str, Any]:
    import llama_cpp  # noqa: PLC0415

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            m = re.search(r"model name\s*:\s*(.+)", f.read())
            cpu = m.group(1).strip() if m else cpu
    except OSError:
        pass
    from .backend import gpu_offload_supported  # noqa: PLC0415
    from .index import gpu_available  # noqa: PLC0415

    return {
        "cpu": cpu, "cores": os.cpu_count(), "threads": n_threads,
        "platform": platform.platform(), "python": platform.python_version(),
        "llama_cpp_python": llama_cpp.__version__,
        "gpu_offload": gpu_offload_supported(), "n_gpu_layers": engine.config.n_gpu_layers,
        "faiss_gpu": gpu_available(), "index_backend": engine.index.backend,
        "model": engine.model_name, "model_file": Path(engine.backend.model_path).name,
    }


# -- presentation ------------------------------------------------------------------------------
def _fmt(v, spec: str = ".2f", none: str = "-") -> str:
    return none if v is None else format(v, spec)


def table(summary: dict[str, Any], modes: list[str]) -> str:
    head = ("| category | mode | tokens/s | speedup vs ar | tokens/step | acceptance | "
            "draft / verify / index time | same as ar |")
    lines = [head, "|" + "---|" * 8]
    blocks = [(c, b) for c, b in summary["categories"].items()] + [("overall",
                                                                     summary["modes"])]
    for cat, block in blocks:
        for m in modes:
            a = block[m]
            same = a["identical_to_ar"]
            shares = ("-" if m == "lcp-pld" else
                      f"{a['share_draft']:.0%} / {a['share_verify']:.0%} / {a['share_index']:.0%}")
            lines.append(
                f"| {cat} | {m} | {a['tokens_per_second']:.1f} | {_fmt(a['speedup_vs_ar'])}x "
                f"| {_fmt(a['mean_accepted_length'])} | {_fmt(a['acceptance_rate'], '.0%')} | "
                f"{shares} | {'-' if same is None else f'{same[0]}/{same[1]}'} |")
    return "\n".join(lines)


def plot(summary: dict[str, Any], modes: list[str], path: str) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    cats = list(summary["categories"]) + ["overall"]
    blocks = [summary["categories"][c] for c in cats[:-1]] + [summary["modes"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    w = 0.8 / len(modes)
    x = np.arange(len(cats))
    for i, m in enumerate(modes):
        ax1.bar(x + i * w, [b[m]["speedup_vs_ar"] or 0 for b in blocks], w, label=m)
    ax1.axhline(1.0, color="black", lw=0.8)
    ax1.set_xticks(x + w * (len(modes) - 1) / 2, cats, rotation=20)
    ax1.set_ylabel("speed-up vs ar (tokens/s ratio)")
    ax1.set_title("Speed-up by category and mode")
    ax1.legend(fontsize=8)
    for m in modes:
        rates = summary["modes"][m]["accepted_rate_per_depth"]
        if rates:
            ax2.plot(range(1, len(rates) + 1), rates, marker="o", label=m)
    ax2.set_xlabel("draft depth")
    ax2.set_ylabel("share of verified trees accepted to this depth")
    ax2.set_title("Accepted per depth")
    ax2.set_ylim(0, 1)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_doc(path: str, label: str, body: str) -> None:
    """Replace (or append) the section of `label` in a markdown file."""
    start, end = f"<!-- bench:{label} -->", f"<!-- /bench:{label} -->"
    p = Path(path)
    old = p.read_text(encoding="utf-8") if p.exists() else "# Benchmarks\n"
    section = f"{start}\n{body.rstrip()}\n{end}"
    if start in old and end in old:
        new = old[: old.index(start)] + section + old[old.index(end) + len(end):]
    else:
        new = old.rstrip() + "\n\n" + section + "\n"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(new, encoding="utf-8")


def doc_section(summary: dict[str, Any], modes: list[str], machine: dict[str, Any],
                command: str, label: str, workload: str) -> str:
    o = summary["modes"]
    lines = [f"## {label}: {workload}", "",
             f"- date: {date.today().isoformat()}",
             f"- machine: {machine['cpu']}, {machine['cores']} cores, {machine['threads']} "
             f"threads; GPU offload: {machine['gpu_offload']} (n_gpu_layers "
             f"{machine['n_gpu_layers']}); index: {machine['index_backend']}",
             f"- model: {machine['model']} ({machine['model_file']}); llama-cpp-python "
             f"{machine['llama_cpp_python']}",
             f"- command: `{command}`", "",
             "Overall speed-up vs ar: " + ", ".join(
                 f"{m} {_fmt(o[m]['speedup_vs_ar'])}x" for m in modes if m != "ar"), "",
             table(summary, modes), "",
             calibration_table(summary), ""]
    return "\n".join(lines)


def calibration_table(summary: dict[str, Any], mode: str = "srsd", depths: int = 8) -> str:
    """Predicted vs measured share of verified trees accepted to each depth, per category."""
    head = (f"Controller calibration ({mode}): predicted / measured share of verified trees "
            f"accepted to depth d\n\n| category | " +
            " | ".join(f"d={d}" for d in range(1, depths + 1)) + " |\n|" + "---|" * (depths + 1))
    rows = []
    for cat, block in list(summary["categories"].items()) + [("overall", summary["modes"])]:
        a = block.get(mode)
        if not a or not a["accepted_rate_per_depth"] or not any(a["predicted_rate_per_depth"]):
            continue  # no forecasts (plain decoding, or the controller was off)
        cells = []
        for d in range(depths):
            pr = a["predicted_rate_per_depth"][d] if d < len(a["predicted_rate_per_depth"]) \
                else 0.0
            ac = a["accepted_rate_per_depth"][d] if d < len(a["accepted_rate_per_depth"]) else 0.0
            cells.append(f"{pr:.0%} / {ac:.0%}")
        rows.append(f"| {cat} | " + " | ".join(cells) + " |")
    return head + "\n" + "\n".join(rows) if rows else ""


def main_bench(args, engine_factory: Callable[..., Any]) -> int:
    import sys  # noqa: PLC0415

    prompts = load_workload(args.workload)
    if args.max_prompts:
        by_cat: dict[str, list[BenchPrompt]] = {}
        for p in prompts:
            by_cat.setdefault(p.category, []).append(p)
        prompts = [p for ps in by_cat.values() for p in ps[: args.max_prompts]]
    modes = parse_modes(args.modes)
    if args.repeats < 1:
        raise ValueError(f"--repeats {args.repeats}: accepted is an integer >= 1")
    engine = engine_factory()
    peer = None
    if "lcp-pld" in modes:
        peer = LcpPeer(engine.backend.model_path, engine.backend.n_ctx,
                       engine.config.threads, engine.config.n_gpu_layers)
    records = run_bench(engine, prompts, modes, args.repeats, peer)
    summary = summarise(records, modes)
    summary["machine"] = machine_info(engine, engine.config.threads)
    summary["config"] = engine.config.to_dict()
    summary["workload"] = args.workload
    command = "srsd-local " + " ".join(sys.argv[1:])
    summary["command"] = command
    print(table(summary, modes))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=1), encoding="utf-8")
    if args.plot:
        plot(summary, modes, args.plot)
    if args.doc:
        write_doc(args.doc, args.label, doc_section(summary, modes, summary["machine"],
                                                    command, args.label, args.workload))
    engine.close()
    return 0
