"""The controller's plans in hindsight: for every candidate tree the drafters made, how far
the model's output went on to follow it, against what the controller verified of it.

    python scripts/plan_hindsight.py [--workload text_edit,code_edit] [--per-category 8]
        [--mode srsd] [--n-ctx 4096]

Each prompt is generated once with its own settings (one engine for all, so the learned
state carries over from prompt to prompt as in `srsd-local bench`). Every candidate tree the
controller was given (a merged draft or a copy run's chain) is kept with the context length
it was drafted at; after the generation each one is walked along the tokens the model
emitted after its root: "followed" is how many of its tokens in a row the output took, down
one path. Printed per category, as a markdown table: candidates, how many the controller
declined, how many of those the output followed for 4 and for 8 tokens or more, and for the
verified ones the mean tokens followed in the candidate and in the plan (what the verified
sub-tree could yield). A declined candidate the output followed far, or a plan that yields
much less than its candidate, is where a better forecast would have paid; on a CPU with
steep batch costs the controller is right to cut plans short when its forecast is
uncertain, so the table shows where the forecast, not the drafting, stands in the way.

A dev tool for the acceptance model's work; `srsd-local bench` measures speed.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from dataclasses import dataclass

from srsd_local import Engine
from srsd_local.bench.workloads import first_per_category, load_workload
from srsd_local.spec import speculator as speculator_mod
from srsd_local.spec.tree import TokenTree


@dataclass
class Candidate:
    at: int  # context length when drafted: the root is the token at this position
    tree: TokenTree  # the candidate the controller was given
    plan: TokenTree | None  # what it verified of it (None: declined)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="text_edit,code_edit")
    ap.add_argument("--per-category", type=int, default=8)
    ap.add_argument("--mode", default="srsd")
    ap.add_argument("--n-ctx", type=int, default=4096)
    args = ap.parse_args()

    seen: list[Candidate] = []
    decide = speculator_mod.Speculator._decide

    def recording(self, tree, req, room, ctx, offset, gain, copy_from=None):
        plan = decide(self, tree, req, room, ctx, offset, gain, copy_from)
        seen.append(Candidate(ctx, tree, None if plan is None else plan.tree))
        return plan

    speculator_mod.Speculator._decide = recording
    rows: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    with Engine.load(n_ctx=args.n_ctx) as eng:
        for spec in args.workload.split(","):
            for p in first_per_category(load_workload(spec), args.per_category):
                seen.clear()
                eng.reset()
                eng.generate(p.prompt, max_tokens=p.max_tokens, mode=args.mode,
                             temperature=p.temperature, seed=p.seed, **p.constraint)
                slot = eng.slots[0]
                ctx = slot.ctx[: slot.n_past].tolist()
                r = rows[p.category]
                for c in seen:
                    if c.at >= len(ctx) or ctx[c.at] != c.tree.tokens[0]:
                        continue  # (not on the context the generation kept)
                    after = ctx[c.at + 1:]
                    got = len(c.tree.follow(after))
                    r["candidates"] += 1
                    if c.plan is None:
                        r["declined"] += 1
                        r["declined, followed >= 4"] += got >= 4
                        r["declined, followed >= 8"] += got >= 8
                    else:
                        r["verified"] += 1
                        r["followed in candidate"] += got
                        r["followed in plan"] += len(c.plan.follow(after))
    speculator_mod.Speculator._decide = decide

    cols = ["candidates", "declined", "declined, followed >= 4", "declined, followed >= 8",
            "verified", "mean followed in candidate", "mean followed in plan"]
    print("| category | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for cat, r in rows.items():
        v = max(r["verified"], 1)
        vals = [int(r[k]) for k in cols[:5]] + [f"{r['followed in candidate'] / v:.1f}",
                                                f"{r['followed in plan'] / v:.1f}"]
        print(f"| {cat} | " + " | ".join(str(x) for x in vals) + " |")


if __name__ == "__main__":
    main()
