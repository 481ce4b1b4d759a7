"""The output contract on the real default model: greedy output equals plain decoding at every
position up to the rounding noise measured in the same run (`Engine.verify_output`), and
sampled output has plain sampling's distribution."""

from __future__ import annotations

import math

import numpy as np
import pytest
from text_data import edit_prompt

from srsd_local.bench.workloads import first_per_category, load_workload
from srsd_local.config import MODES

pytestmark = pytest.mark.model

PROMPTS = first_per_category(load_workload("all"), 2)  # two of each category


@pytest.mark.slow
def test_every_mode_equals_plain_decoding_at_every_position(engine):
    assert len({p.category for p in PROMPTS}) == 6 and len(PROMPTS) == 12
    checked: dict[tuple[str, tuple[int, ...]], object] = {}
    failures, positions = [], 0
    for p in PROMPTS:
        outs = {m: engine.generate(p.prompt, max_tokens=128, mode=m, **p.constraint)
                for m in MODES}  # json prompts: constrained to their schema
        plain = outs["ar"]
        for mode, out in outs.items():
            key = (p.id, tuple(out.token_ids))
            if key not in checked:
                checked[key] = engine.verify_output(p.prompt, out.token_ids, **p.constraint)
            rep = checked[key]
            positions += rep.positions
            assert rep.positions == len(out.token_ids)
            if not rep.ok:
                failures.append(f"{p.id} [{mode}] {rep.summary()} at {rep.beyond_noise}")
            if out.token_ids == plain.token_ids:
                assert out.finish_reason == plain.finish_reason, (p.id, mode)
                assert out.stats.tokens == plain.stats.tokens, (p.id, mode)
    assert not failures, "\n".join(failures)
    assert positions >= 10 * len(MODES) * 64  # most outputs run to 128 tokens (json: less)


def test_verify_finds_a_wrong_token_and_measures_noise(engine):
    prompt = edit_prompt()
    out = engine.generate(prompt, max_tokens=48, mode="srsd")
    rep = engine.verify_output(prompt, out.token_ids)
    assert rep.ok and rep.positions == 48 and rep.noise > 0 and rep.drift > 0
    # plant a token plain decoding would never pick at position 20: it is found there, and
    # every later position is still checked (against the planted prefix)
    bad = list(out.token_ids)
    bad[20] = 1000 if bad[20] != 1000 else 1001
    rep = engine.verify_output(prompt, bad)
    assert 20 in rep.mismatches and 20 in rep.beyond_noise and not rep.ok
    assert rep.positions == 48 and rep.gaps[rep.mismatches.index(20)] > rep.noise


def _tv_bound(k: int, n: int, delta: float = 1e-3) -> float:
    """A bound on the total-variation distance of two empirical distributions of n draws
    each from the same distribution over k outcomes, exceeded with probability < delta:
    E[TV] <= sqrt(2k/n)/2 (Cauchy-Schwarz on the per-outcome deviations), and one draw
    changes TV by at most 1/n, so McDiarmid adds sqrt(ln(1/delta)/n)."""
    return 0.5 * math.sqrt(2 * k / n) + math.sqrt(math.log(1 / delta) / n)


def test_sampled_tokens_have_plain_distribution_over_seeds(engine):
    prompt = edit_prompt()
    n = 120
    kw = dict(max_tokens=4, temperature=0.9, top_p=0.95)
    # fixed trees (no controller): every drafted tree is verified, whatever the controller
    # learned in earlier tests, so the speculative side really samples through trees
    engine.reconfigure(adaptive=False)
    try:
        seqs = {m: [engine.generate(prompt, seed=s, mode=m, **kw).token_ids for s in range(n)]
                for m in ("ar", "srsd")}
        drafted = sum(engine.generate(prompt, seed=s, mode="srsd", **kw).stats.accepted_tokens
                      for s in range(10))
    finally:
        engine.reconfigure(adaptive=True)
    for pos in (1, 2, 3):
        a = [s[pos] for s in seqs["ar"] if len(s) > pos]
        b = [s[pos] for s in seqs["srsd"] if len(s) > pos]
        cats = sorted(set(a) | set(b))
        pa = np.array([a.count(c) for c in cats]) / len(a)
        pb = np.array([b.count(c) for c in cats]) / len(b)
        tv = 0.5 * float(np.abs(pa - pb).sum())
        assert tv <= _tv_bound(len(cats), min(len(a), len(b))), (pos, tv, cats)
    assert drafted > 0, "the edit prompt must accept drafts, or nothing was tested"


def test_logprobs_of_speculative_tokens_match_plain_ones(engine):
    prompt = edit_prompt()
    plain = engine.generate(prompt, max_tokens=40, mode="ar", logprobs=2)
    spec = engine.generate(prompt, max_tokens=40, mode="srsd", logprobs=2)
    assert spec.stats.accepted_tokens > 0 and len(spec.logprobs) == len(spec.token_ids)
    rep = engine.verify_output(prompt, spec.token_ids)
    same = next((i for i, (a, b) in enumerate(zip(plain.token_ids, spec.token_ids)) if a != b),
                len(spec.token_ids))
    for a, b in zip(plain.logprobs[:same], spec.logprobs[:same]):
        # a log-probability moves by at most twice the largest logit drift measured
        assert abs(a.logprob - b.logprob) <= 2 * rep.drift + 1e-4
        assert b.top[0][0] == b.token or b.top[0][1] - b.logprob <= rep.noise
