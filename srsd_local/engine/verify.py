"""Check an output against plain greedy decoding at every position.

`verify_tokens(engine, prompt, tokens)` feeds the output back through the model one token at
a time, as plain decoding runs, and at every position reports whether the emitted token is
plain decoding's argmax there and, where it is not, the logit gap (argmax logit minus the
emitted token's logit). Positions after a difference are checked too: the prefix is always
the output's own tokens.

A gap is a real disagreement only if it is larger than rounding can make it. Batched passes
(a speculative tree, a prompt) use other kernels and summation orders than one-token passes,
so the same prefix gives slightly different logits. The tolerance is measured in the same
run: the output is decoded again in batches of several sizes (`chunks`: 4, 8, 16 and 32 tokens
per pass, the sizes speculative trees have) and compared with the one-token rows at each
position's top candidates and emitted token. `drift` is the
largest logit difference seen; `noise` the largest change of a gap between the position's
top token and another candidate (how far rounding moved the gaps this check is about). A
mismatch whose gap is within `noise` is a near-tie that rounding can flip.

An engine serving several requests at once lays their cells out interleaved in the KV cache
(each request's prompt and steps between the others'), and attention then sums over its own
cells in other groupings: with `interleave`, the noise is also measured with the context
decoded again in chunks of INTERLEAVE_CHUNK alternating with another sequence's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..spec.sampling import best_allowed

TOP = 8  # candidates per position at which one-token and batched rows are compared
INTERLEAVE_CHUNK = 16  # tokens per chunk when another sequence's cells are interleaved


@dataclass
class VerifyReport:
    positions: int  # positions checked (every emitted token)
    mismatches: list[int] = field(default_factory=list)  # positions not equal to plain argmax
    gaps: list[float] = field(default_factory=list)  # logit gap at each mismatch
    plain_tokens: list[int] = field(default_factory=list)  # plain argmax at each mismatch
    drift: float = 0.0  # largest |one-token - batched| logit difference measured
    noise: float = 0.0  # largest change of a top-token gap between the two passes
    # the drift of each batched layout alone: "4", "8", ... (batch sizes), "interleaved"
    drift_by_layout: dict[str, float] = field(default_factory=dict)

    @property
    def worst_gap(self) -> float:
        return max(self.gaps, default=0.0)

    @property
    def beyond_noise(self) -> list[int]:
        """Mismatching positions whose gap exceeds the measured noise."""
        return [p for p, g in zip(self.mismatches, self.gaps) if g > self.noise]

    @property
    def ok(self) -> bool:
        return not self.beyond_noise

    def summary(self) -> str:
        verdict = "ok" if self.ok else f"{len(self.beyond_noise)} beyond noise"
        return (f"{self.positions} positions, {len(self.mismatches)} mismatches "
                f"(worst gap {self.worst_gap:.3f}), noise {self.noise:.3f}: {verdict}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(worst_gap=self.worst_gap, beyond_noise=self.beyond_noise, ok=self.ok)
        return d


VERIFY_CHUNKS = (4, 8, 16, 32)  # batch sizes the rounding noise is measured in


def verify_tokens(engine: Any, prompt: str | Sequence[int], tokens: Sequence[int],
                  chunks: Sequence[int] = VERIFY_CHUNKS, constraint: Any = None,
                  interleave: bool = False
                  ) -> VerifyReport:
    """Check `tokens` (an output of `prompt`, greedy) against plain greedy decoding at every
    position (see the module docstring); with `constraint` (a grammar position at the start
    of the output, see llama/grammar.py), against plain constrained decoding: plain's token
    is then the best token the grammar admits. Uses the engine's context: it is reset before
    and after, so the next generation prefills from scratch."""
    if not chunks or any(c < 1 for c in chunks):
        raise ValueError(f"chunks={chunks!r}: accepted are batch sizes >= 1")
    be = engine.backend
    prompt_ids = engine._check_prompt(prompt)
    tokens = [int(t) for t in tokens]
    bad = [t for t in tokens if not 0 <= t < be.n_vocab]
    if bad:
        raise ValueError(f"output token id {bad[0]} is out of range: accepted are 0.."
                         f"{be.n_vocab - 1}")
    if len(prompt_ids) + len(tokens) > be.n_ctx:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + output ({len(tokens)}) exceed "
                         f"the context (n_ctx={be.n_ctx})")
    report = VerifyReport(positions=len(tokens))
    if not tokens:
        return report
    capture = be.capture
    was_enabled = capture.enabled if capture is not None else False
    if capture is not None:
        capture.enabled = False
    engine.reset()
    try:
        first = be.decode(prompt_ids, want_logits="last").logits[-1].copy()
        # one token at a time: position i's row is the logits after prompt + tokens[:i]
        cand: list[np.ndarray] = []  # ids compared with the batched pass, per position >= 1
        one_vals: list[np.ndarray] = []
        for i, tok in enumerate(tokens):
            row = first if i == 0 else be.step(tokens[i - 1]).logits[0]
            if constraint is None:
                top = int(np.argmax(row))
            else:
                top = best_allowed(row, constraint)
                if not constraint.allows(tok):
                    raise ValueError(f"output token {tok} at position {i} is not admitted by "
                                     "the grammar: this output does not satisfy it")
                constraint.accept(tok)
            if top != tok:
                report.mismatches.append(i)
                report.gaps.append(float(row[top] - row[tok]))
                report.plain_tokens.append(top)
            if i > 0:  # the top token first, then the other candidates
                ids = np.argpartition(row, -TOP)[-TOP:]
                ids = np.concatenate(([top], ids[ids != top], [tok] if tok != top else []))
                cand.append(ids.astype(np.int64))
                one_vals.append(row[cand[-1]].astype(np.float64))
        # the same prefixes in batches of each size: the rounding noise of this run
        rest = tokens[:-1]
        noise = 0.0
        by_layout = report.drift_by_layout  # (the largest of them: the report's drift)
        layout = ""

        def compare(k: int, row: np.ndarray) -> None:  # row: position k + 1's, batched
            nonlocal noise
            delta = row[cand[k]].astype(np.float64) - one_vals[k]
            d = float(np.abs(delta).max())
            by_layout[layout] = max(by_layout.get(layout, 0.0), d)
            noise = max(noise, float(np.abs(delta[1:] - delta[0]).max(initial=0.0)))

        for chunk in chunks:
            layout = str(chunk)
            be.trim(len(prompt_ids))
            for s in range(0, len(rest), chunk):
                part = rest[s: s + chunk]
                rows = be.decode(part, want_logits="all").logits
                for j in range(len(part)):
                    compare(s + j, rows[j])
        if interleave and rest:  # the whole context again, sequence 1's cells between
            be.clear()  # sequence 0's (its rows are not read)
            ids, n0 = [*prompt_ids, *rest], len(prompt_ids)
            layout = "interleaved"
            for s in range(0, len(ids), INTERLEAVE_CHUNK):
                part = ids[s: s + INTERLEAVE_CHUNK]
                m, at = len(part), list(range(s, s + len(part)))
                be.decode(part, positions=at, seq_ids=[[1]] * m, want_logits="none")
                flags = [s + j >= n0 for j in range(m)]  # the output's prefix: its rows
                rows = be.decode(part, positions=at, seq_ids=[[0]] * m,
                                 want_logits=flags).logits
                for r, j in enumerate(j for j in range(m) if flags[j]):
                    compare(s + j - n0, rows[r])
        report.drift, report.noise = max(by_layout.values(), default=0.0), noise
    finally:
        engine.reset()
        if capture is not None:
            capture.enabled = was_enabled
    return report
