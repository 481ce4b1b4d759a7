"""Where the engine's host time goes, component by component, in the steps that verify a tree.

    python scripts/host_breakdown.py [--workload code_edit,text_edit,humaneval,code_continue]
        [--per-category 3] [--repeat 2] [--mode srsd] [--n-ctx 4096] [--replay]
        [--sample-in-graph | --no-sample-in-graph]

Each prompt is generated `--repeat` times from the same learned state (with the prompt's
own settings: max_tokens, temperature and seed, JSON schema); the named functions of the
drafting, planning, walk and commit are timed around every call (the timers add a few
microseconds per call, so the totals are slightly high). Printed: one markdown table, per
component its calls, milliseconds per call and in all (drafting runs in the steps that
verify a tree and in those where nothing was found or the controller declined; the walk,
fork and commit only in the former); the walk's row reads (the model's token after each
accepted node: one logits row read each) in microseconds per row; the KV-cell bookkeeping
(fork and commit) per tree by its number of branches (each of llama.cpp's memory calls scans
every cell of the cache, one call per branch and sequence); and the host time per tree step
as the engine's own stats measure it, for comparison.

With `--replay`, every generation is recorded once and the timed runs are replays (each
llama_decode call served from the recording, see srsd_local/engine/replay.py): the same code
on caches no forward pass has flushed, as between a GPU's steps. `--sample-in-graph` runs the
engine with llama.cpp's in-graph greedy sampler for every greedy tree (the configuration
meant for GPUs: a greedy tree's rows come back as token ids, so the walk reads no logits
rows), `--no-sample-in-graph` for none; by default the engine decides per tree where the
logits are computed on the CPU. Rows the walk took from the graph are counted apart.

A dev tool for finding what to make cheaper; `srsd-local bench` measures the host time per
step that the project's budget is about.
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib
import time
from collections import Counter, defaultdict

from srsd_local import Engine
from srsd_local.bench.workloads import first_per_category, load_workload
from srsd_local.llama.replay import PassReplay

# (module, attribute path, label): timed around every call
COMPONENTS = [
    ("srsd_local.spec.speculator", "Speculator.propose", "drafting and planning (all)"),
    ("srsd_local.spec.draft", "Drafter.draft", "  drafting (sources, merge, prune)"),
    ("srsd_local.spec.retrieval", "SemanticDrafter.propose", "    hidden-state retrieval"),
    ("srsd_local.spec.index", "VectorIndex._flush", "      index: store pending rows"),
    ("srsd_local.spec.ngram_mod", "NgramModDrafter.propose", "    n-gram pool"),
    ("srsd_local.spec.textlookup", "TextLookupDrafter.propose", "    text lookup"),
    ("srsd_local.spec.textlookup", "TokenCache.tokens", "      tokenizer calls"),
    ("srsd_local.spec.analogy", "AnalogyDrafter.propose", "    analogy"),
    ("srsd_local.spec.listcopy", "ListCopyDrafter.propose", "    list copy"),
    ("srsd_local.spec.speculator", "Speculator._plan", "  planning (controller)"),
    ("srsd_local.spec.speculator", "Speculator._settle", "  learning unverified nodes"),
    ("srsd_local.spec.speculator", "Speculator.follow", "copy-run chains"),
    ("srsd_local.spec.textlookup", "ContextText.sync", "context text kept in step"),
    ("srsd_local.spec.tree", "TokenTree.layout", "tree layout"),
    ("srsd_local.llama.backend", "Backend.seq_fork", "KV: fork branches"),
    ("srsd_local.engine.engine", "walk_tree", "walk (row reads)"),
    ("srsd_local.llama.backend", "Backend.seq_commit", "KV: commit the path"),
    ("srsd_local.spec.speculator", "Speculator.observe", "learning verified nodes"),
    ("srsd_local.engine.emit", "Emitter.push", "emitting text"),
    ("srsd_local.engine.engine", "Engine._constrain_draft", "grammar: drafts constrained"),
    ("srsd_local.llama.grammar", "GrammarState.prune", "grammar: drafted nodes checked"),
    ("srsd_local.llama.grammar", "Forcing.after", "grammar: forced text after a leaf"),
    ("srsd_local.llama.grammar", "Forcing.next_text", "grammar: forced text after the root"),
    ("srsd_local.engine.engine", "Engine._tokenize_text", "grammar: forced text tokenized"),
    ("srsd_local.spec.sampling", "ConstrainedSampler.__call__", "grammar: constrained sampling"),
    ("srsd_local.llama.grammar", "GrammarState.take_if_admitted",
     "  grammar: argmax checked and taken"),
    ("srsd_local.spec.sampling", "best_allowed", "  grammar: argmax rejected, best admitted"),
    ("srsd_local.spec.sampling", "ConstrainedSampler.take", "grammar: argmax taken unchecked"),
]


def _timed(fn, label: str, totals: dict, calls: Counter):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - t0
            calls[label] += 1
    return wrapper


def install(totals: dict, calls: Counter) -> None:
    """Wrap every component (a function imported by name elsewhere is wrapped there too)."""
    for mod_name, attr, label in COMPONENTS:
        mod = importlib.import_module(mod_name)
        owner_name, _, name = attr.rpartition(".")
        owner = getattr(mod, owner_name) if owner_name else mod
        setattr(owner, name, _timed(getattr(owner, name), label, totals, calls))


def install_kv_split(kv: dict[int, list[float]]) -> None:
    """Time the KV-cell bookkeeping of each tree (fork and commit) per number of branches:
    kv[branches] = [trees, fork seconds, commit seconds]. (Each llama.cpp memory call scans
    every cell of the cache, so its cost grows with the branches and the context size.)"""
    from srsd_local.llama.backend import Backend  # noqa: PLC0415

    for name, col in (("seq_fork", 1), ("seq_commit", 2)):
        fn = getattr(Backend, name)

        def wrapper(self, base, *args, _fn=fn, _col=col, **kwargs):
            # seq_fork(base, n_branches, first); seq_commit(base, winner, start,
            # keep_until, n_branches, first)
            branches = args[0] if _col == 1 else args[3]
            t0 = time.perf_counter()
            try:
                return _fn(self, base, *args, **kwargs)
            finally:
                row = kv.setdefault(branches, [0, 0.0, 0.0])
                row[_col] += time.perf_counter() - t0
                row[0] += _col == 1

        setattr(Backend, name, functools.wraps(fn)(wrapper))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="code_edit,text_edit,humaneval,code_continue")
    ap.add_argument("--per-category", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--mode", default="srsd")
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--replay", action="store_true")
    ap.add_argument("--sample-in-graph", dest="sample_in_graph", action="store_true",
                    default=None)
    ap.add_argument("--no-sample-in-graph", dest="sample_in_graph", action="store_false")
    args = ap.parse_args()

    totals: dict[str, float] = defaultdict(float)
    calls: Counter = Counter()
    # per kind of walk (rows copied out / tokens from the graph): rows visited, seconds
    walks: dict[str, list[float]] = {"copied": [0, 0, 0.0], "graph": [0, 0, 0.0]}
    install(totals, calls)
    kv: dict[int, list[float]] = {}
    install_kv_split(kv)
    from srsd_local.engine import engine as engine_mod  # noqa: PLC0415 (wrapped above)
    walk = engine_mod.walk_tree

    def counting_walk(tree, row, sample):
        t0 = time.perf_counter()
        path, y = walk(tree, row, sample)
        w = walks["graph" if sample is int else "copied"]  # (the engine's graph walk)
        w[0] += 1
        w[1] += len(path)
        w[2] += time.perf_counter() - t0
        return path, y
    engine_mod.walk_tree = counting_walk

    eng = Engine.load(n_ctx=args.n_ctx, sample_in_graph=args.sample_in_graph)
    prompts = [p for spec in args.workload.split(",")
               for p in first_per_category(load_workload(spec), args.per_category)]
    learned = copy.deepcopy(eng.speculator)
    recordings: dict[str, PassReplay] = {}
    tree_steps, host_tree = 0, 0.0
    for rep in range(args.repeat + (1 if args.replay else 0)):
        timed = not args.replay or rep > 0
        for p in prompts:
            eng.speculator = copy.deepcopy(learned)
            eng.forget_outputs()
            eng.reset()
            if args.replay:
                rec = recordings.setdefault(p.id, PassReplay())
                rec.serving = rep > 0
                eng.backend.replay = rec
            try:
                out = eng.generate(p.prompt, max_tokens=p.max_tokens, mode=args.mode,
                                   temperature=p.temperature, seed=p.seed, **p.constraint)
            finally:
                eng.backend.replay = None
            if timed:
                tree_steps += out.stats.drafts
                host_tree += out.stats.host_tree
        if not timed:  # the recording run: its times are not counted
            totals.clear()
            calls.clear()
            for w in walks.values():
                w[:] = [0, 0, 0.0]
            kv.clear()
    eng.close()
    if not tree_steps:
        raise SystemExit("no step verified a tree: nothing to break down")
    kind = ("replayed" if args.replay else "real") + (
        {True: ", in-graph sampling", False: ", rows copied out"}.get(args.sample_in_graph,
                                                                      ", engine's choice"))
    print(f"{len(prompts)} prompts x {args.repeat}, mode {args.mode}, {kind} runs: "
          f"{tree_steps} steps verified a tree, host time per such step "
          f"{1e3 * host_tree / tree_steps:.3f} ms (the engine's stats)\n")
    print("| component | calls | ms per call | ms in all |")
    print("|---|---:|---:|---:|")
    for _, _, label in COMPONENTS:
        n = calls[label]
        if n:
            print(f"| {label} | {n} | {1e3 * totals[label] / n:.3f} | "
                  f"{1e3 * totals[label]:.1f} |")
    print("\n| branches | trees | KV: fork, ms per tree | KV: commit, ms per tree |")
    print("|---:|---:|---:|---:|")
    for branches in sorted(kv):
        n, fork, commit = kv[branches]
        if n:
            print(f"| {branches} | {n:.0f} | {1e3 * fork / n:.3f} | {1e3 * commit / n:.3f} |")
    for kind, (n, rows, seconds) in walks.items():
        if n:
            print(f"\nwalk, rows {kind}: {n} trees, {rows / n:.1f} rows visited per tree, "
                  f"{1e6 * seconds / rows:.1f} us per row")


if __name__ == "__main__":
    main()
