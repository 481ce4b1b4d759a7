"""Benchmark results: per-run records, totals per mode and category, the markdown table, the
plot and the docs/benchmarks.md section (its format is described at the top of that file).

Totals are `GenerationStats.total` of the runs' stats (srsd_local/engine/stats.py): speed-ups
are ratios of totals (tokens / seconds) measured in the same run, never means of ratios. Peers
(srsd_local/bench/peers.py) report their runs as GenerationStats too, with draft counts from
their own timings and no step count.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

from ..engine.stats import GenerationStats

SPEC_PEER = "llama-server-spec"  # the second reference column, when that mode ran
CUT = "cut at max_tokens"  # how an invalid output's reason begins when the limit cut it


@dataclass
class RunRecord:
    """One generation of one prompt in one mode."""

    prompt_id: str
    category: str
    mode: str
    repeat: int
    stats: GenerationStats
    token_ids: list[int] | None = None  # None: the peer could not return them
    identical_to_ar: bool | None = None  # greedy prompts only
    peer: bool = False
    verify: dict[str, Any] | None = None  # VerifyReport.to_dict() (greedy, when checked)
    verify_error: str | None = None  # why the check of this output failed (then no report)
    # the output was generated under the prompt's JSON schema (c-loop ignores it: its
    # output is checked against unconstrained plain decoding)
    follows_schema: bool = True
    valid: bool | None = None  # the output satisfies the prompt's JSON schema (when it has one)
    invalid_reason: str | None = None
    # the same generation replayed without the forward passes (--host-replay): its host times
    replay: GenerationStats | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"prompt_id": self.prompt_id, "category": self.category, "mode": self.mode,
                "repeat": self.repeat, "peer": self.peer, "tokens": self.stats.tokens,
                "seconds": self.stats.seconds, "identical_to_ar": self.identical_to_ar,
                "token_ids": self.token_ids, "stats": self.stats.to_dict(),
                "verify": self.verify, "verify_error": self.verify_error,
                "follows_schema": self.follows_schema, "valid": self.valid,
                "invalid_reason": self.invalid_reason,
                "replay_stats": None if self.replay is None else self.replay.to_dict()}


def verify_totals(reports: Iterable[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Positions checked against plain decoding, mismatches, those beyond the measured
    rounding noise, the worst mismatch gap and the largest noise, over several reports."""
    reps = [r for r in reports if r is not None]
    if not reps:
        return None
    return {"outputs": len(reps), "positions": sum(r["positions"] for r in reps),
            "mismatches": sum(len(r["mismatches"]) for r in reps),
            "beyond_noise": sum(len(r["beyond_noise"]) for r in reps),
            "worst_gap": max(r["worst_gap"] for r in reps),
            "noise": max(r["noise"] for r in reps)}


def _verify_cell(v: dict[str, Any] | None, errors: int = 0) -> str:
    failed = [f"{errors} output(s) not checked: the check failed"] if errors else []
    if v is None:
        return failed[0] if failed else "-"
    cell = f"{v['positions']} / {v['mismatches']} / {v['worst_gap']:.2f} / {v['noise']:.2f}"
    notes = ([f"{v['beyond_noise']} beyond noise"] if v["beyond_noise"] else []) + failed
    return cell + (f" ({'; '.join(notes)})" if notes else "")


# -- aggregation -------------------------------------------------------------------------------
def aggregate(recs: Iterable[RunRecord], mode: str) -> dict[str, Any]:
    """Totals of one mode's runs (via GenerationStats.merge) and the rates derived from them;
    a rate that does not apply (no steps, no drafts, a peer's phase times) is None."""
    recs = list(recs)
    t = GenerationStats.total((r.stats for r in recs), mode=mode)
    peer = any(r.peer for r in recs)
    same = [r.identical_to_ar for r in recs if r.identical_to_ar is not None]
    valid = [r.valid for r in recs if r.valid is not None]
    plain_steps = len(t.tree_sizes) - t.drafts
    secs = t.seconds
    replays = [r.replay for r in recs if r.replay is not None]
    rt = GenerationStats.total(replays, mode=mode) if replays else None

    def share(x: float) -> float | None:
        return None if peer else (x / secs if secs else 0.0)

    return {
        "runs": len(recs), "peer": peer, "tokens": t.tokens, "seconds": secs, "steps": t.steps,
        "tokens_per_second": t.tokens_per_second,
        "mean_accepted_length": t.mean_accepted_length if t.steps else None,
        "acceptance_rate": t.acceptance_rate if t.draft_tokens else None,
        "draft_tokens": t.draft_tokens, "accepted_tokens": t.accepted_tokens, "drafts": t.drafts,
        "accepted_per_depth": list(t.accepted_per_depth),
        "accepted_rate_per_depth": [n / t.drafts for n in t.accepted_per_depth]
        if t.drafts else [],
        # the controller's forecast for the same trees (modes with the controller only)
        "predicted_rate_per_depth": [n / t.drafts for n in t.predicted_per_depth]
        if t.drafts else [],
        "share_draft": share(t.time_draft), "share_verify": share(t.time_verify),
        "share_index": share(t.time_index),
        "host_ms_plain": t.host_ms_plain if plain_steps > 0 else None,
        "host_ms_tree": t.host_ms_tree if t.drafts else None,
        "host_ms_tree16": t.host_ms_tree16 if t.trees16 else None,
        # replayed without the forward passes (caches not flushed by a pass)
        "replay_host_ms_plain": rt.host_ms_plain
        if rt is not None and len(rt.tree_sizes) > rt.drafts else None,
        "replay_host_ms_tree16": rt.host_ms_tree16 if rt is not None and rt.trees16 else None,
        "prompt_tokens": t.prompt_tokens, "prompt_seconds": t.prompt_seconds,
        "identical_to_ar": (sum(same), len(same)) if same else None,
        "forced_tokens": None if peer else t.forced_tokens,
        "valid": (sum(valid), len(valid)) if valid else None,
        # invalid because max_tokens cut them before the JSON closed (a model's loop)
        "valid_cut": sum(1 for r in recs if r.valid is False and
                         (r.invalid_reason or "").startswith(CUT)),
        "verify": verify_totals(r.verify for r in recs),
        "verify_errors": sum(1 for r in recs if r.verify_error is not None),
    }


def summarise(records: Sequence[RunRecord], modes: Sequence[str]) -> dict[str, Any]:
    def block(recs: list[RunRecord]) -> dict[str, Any]:
        out = {m: aggregate((r for r in recs if r.mode == m), m) for m in modes}
        for ref, key in (("ar", "speedup_vs_ar"), (SPEC_PEER, "speedup_vs_llama_server_spec")):
            if ref not in out:
                continue
            base = out[ref]["tokens_per_second"]
            for m in modes:
                out[m][key] = out[m]["tokens_per_second"] / base if base else None
        return out

    cats = sorted({r.category for r in records})
    return {
        "modes": block(list(records)),
        "categories": {c: block([r for r in records if r.category == c]) for c in cats},
        "prompts": [r.to_dict() for r in records],
    }


# -- presentation ------------------------------------------------------------------------------
def _fmt(v: float | None, spec: str = ".2f", none: str = "-") -> str:
    return none if v is None else format(v, spec)


def _blocks(summary: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return list(summary["categories"].items()) + [("overall", summary["modes"])]


def table(summary: dict[str, Any], modes: Sequence[str]) -> str:
    """tokens/s, speed-ups, tokens per step, acceptance (drafted tokens accepted: tree nodes
    for the engine, draft_n_accepted / draft_n for llama-server), host ms per plain step and
    per verified tree, greedy outputs identical to ar, and the check against plain decoding at
    every position: positions checked / mismatches / worst mismatch gap / rounding noise."""
    spec = SPEC_PEER in modes
    constrained = any(b[m]["valid"] is not None for _, b in _blocks(summary) for m in modes)
    replayed = any(b[m]["replay_host_ms_plain"] is not None or
                   b[m]["replay_host_ms_tree16"] is not None
                   for _, b in _blocks(summary) for m in modes)
    cols = ["category", "mode", "tokens/s", "speedup vs ar"]
    cols += [f"speedup vs {SPEC_PEER}"] if spec else []
    cols += ["tokens/step", "acceptance", "host ms / plain step", "host ms / tree",
             "host ms / 9-16-node tree"]
    cols += ["replayed: host ms / plain step", "replayed: host ms / 9-16-node tree"] \
        if replayed else []
    cols += ["same as ar", "checked / mismatches / worst gap / noise"]
    cols += ["grammar-forced tokens", "valid outputs"] if constrained else []
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for cat, block in _blocks(summary):
        for m in modes:
            a = block[m]
            same = a["identical_to_ar"]
            cells = [cat, m, f"{a['tokens_per_second']:.1f}", f"{_fmt(a['speedup_vs_ar'])}x"]
            if spec:
                cells.append(f"{_fmt(a['speedup_vs_llama_server_spec'])}x")
            cells += [_fmt(a["mean_accepted_length"]), _fmt(a["acceptance_rate"], ".0%"),
                      _fmt(a["host_ms_plain"], ".3f"), _fmt(a["host_ms_tree"], ".3f"),
                      _fmt(a["host_ms_tree16"], ".3f")]
            if replayed:
                cells += [_fmt(a["replay_host_ms_plain"], ".3f"),
                          _fmt(a["replay_host_ms_tree16"], ".3f")]
            cells += ["-" if same is None else f"{same[0]}/{same[1]}",
                      _verify_cell(a["verify"], a.get("verify_errors", 0))]
            if constrained:
                v, cut = a["valid"], a.get("valid_cut", 0)
                cells += [_fmt(a["forced_tokens"], "d"), "-" if v is None else
                          f"{v[0]}/{v[1]}" + (f" ({cut} cut at max_tokens)" if cut else "")]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(summary: dict[str, Any], modes: Sequence[str], path: str) -> None:
    """Speed-up vs ar by category and mode (peers included), acceptance by mode, and accepted
    per depth for the engine's drafting modes."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    blocks = _blocks(summary)
    cats = [c for c, _ in blocks]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(18, 4.8),
                                        gridspec_kw={"width_ratios": [3, 1.3, 1.5]})
    w = 0.8 / len(modes)
    x = np.arange(len(cats))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color = {m: colors[i % len(colors)] for i, m in enumerate(modes)}
    for i, m in enumerate(modes):
        ax1.bar(x + i * w, [b[m]["speedup_vs_ar"] or 0 for _, b in blocks], w, label=m,
                color=color[m])
    top = max([b[m]["speedup_vs_ar"] or 0 for _, b in blocks for m in modes] + [1.0])
    ax1.set_ylim(0, top * 1.3)  # room for the legend above the bars
    ax1.axhline(1.0, color="black", lw=0.8)
    ax1.set_xticks(x + w * (len(modes) - 1) / 2, cats, rotation=20)
    ax1.set_ylabel("speed-up vs ar (tokens/s ratio)")
    ax1.set_title("Speed-up by category and mode")
    ax1.legend(fontsize=7, ncol=min(len(modes), 4), loc="upper left")
    overall = summary["modes"]
    drafting = [m for m in modes if overall[m]["acceptance_rate"] is not None]
    ax2.bar(range(len(drafting)), [overall[m]["acceptance_rate"] for m in drafting],
            color=[color[m] for m in drafting])
    ax2.set_xticks(range(len(drafting)), drafting, rotation=30, ha="right", fontsize=8)
    ax2.set_ylim(0, 1)
    ax2.set_ylabel("drafted tokens accepted")
    ax2.set_title("Acceptance (overall)")
    for m in modes:
        rates = overall[m]["accepted_rate_per_depth"]
        if rates:
            ax3.plot(range(1, len(rates) + 1), rates, marker="o", label=m, color=color[m])
    ax3.set_xlabel("draft depth")
    ax3.set_ylabel("share of verified trees accepted to this depth")
    ax3.set_title("Accepted per depth")
    ax3.set_ylim(0, 1)
    if ax3.lines:
        ax3.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def calibration_table(summary: dict[str, Any], mode: str = "srsd", depths: int = 8) -> str:
    """Predicted vs measured share of verified trees accepted to each depth, per category."""
    head = (f"Controller calibration ({mode}): predicted / measured share of verified trees "
            f"accepted to depth d\n\n| category | " +
            " | ".join(f"d={d}" for d in range(1, depths + 1)) + " |\n|" + "---|" * (depths + 1))
    rows = []
    for cat, block in _blocks(summary):
        a = block.get(mode)
        if not a or not a["accepted_rate_per_depth"] or not any(a["predicted_rate_per_depth"]):
            continue  # no forecasts (plain decoding, or the controller was off)
        pred, acc = a["predicted_rate_per_depth"], a["accepted_rate_per_depth"]
        cells = [f"{pred[d] if d < len(pred) else 0.0:.0%} / {acc[d] if d < len(acc) else 0.0:.0%}"
                 for d in range(depths)]
        rows.append(f"| {cat} | " + " | ".join(cells) + " |")
    return head + "\n" + "\n".join(rows) if rows else ""


def doc_section(summary: dict[str, Any], modes: Sequence[str], machine: dict[str, Any],
                command: str, label: str, workload: str) -> str:
    o = summary["modes"]
    lines = [f"## {label}: {workload}", "",
             f"- date: {date.today().isoformat()}",
             f"- machine: {machine['cpu']}, {machine['cores']} cores, {machine['threads']} "
             f"threads; GPU offload: {machine['gpu_offload']} (n_gpu_layers "
             f"{machine['n_gpu_layers']}); index: {machine['index_backend']}"
             + ("; weights not repacked (llama.cpp's extra buffer types off)"
                if machine.get("repacked_weights") is False else "")
             + (f"; greedy requests sampled in the graph ({machine['graph_sampler']})"
                if machine.get("graph_sampler") else ""),
             f"- model: {machine['model']} ({machine['model_file']}); llama-cpp-python "
             f"{machine['llama_cpp_python']}",
             f"- command: `{command}`"]
    for mode, peer in summary.get("peers", {}).items():
        if peer.get("command"):
            lines.append(f"- {mode}: `{peer['command']}`")
    lines += ["", "Overall speed-up vs ar: " + ", ".join(
        f"{m} {_fmt(o[m]['speedup_vs_ar'])}x" for m in modes if m != "ar"), ""]
    if SPEC_PEER in modes:
        lines += [f"Overall speed-up vs {SPEC_PEER}: " + ", ".join(
            f"{m} {_fmt(o[m]['speedup_vs_llama_server_spec'])}x" for m in modes
            if m != SPEC_PEER), ""]
    lines += [table(summary, modes), "",
              "acceptance: drafted tokens accepted (tree nodes for pld / srsd / hybrid; "
              "`draft_n_accepted / draft_n` from llama-server's timings). host ms: time outside "
              "llama_decode (from the end of one step to the end of the next, emitting "
              "included) per plain step, per verified tree, and per verified tree of 9-16 "
              "nodes; replayed (with --host-replay): the same host times when each greedy or "
              "seeded generation is run again with its forward passes served from a "
              "recording, so that no pass flushes the caches between steps (as on a GPU).",
              "",
              calibration_table(summary), ""]
    return "\n".join(lines)


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
