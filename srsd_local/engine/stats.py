"""Generation statistics: one dataclass, filled by `observe_step` (the engine, once per
forward pass) and combined by `merge` (the benchmark's totals, the server's metrics)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any


def add_per_depth(acc: list, values: Iterable, depths: Iterable[int]) -> None:
    """acc[d-1] += value for each (value, depth d), growing acc as needed."""
    for v, d in zip(values, depths):
        while len(acc) < d:
            acc.append(0)
        acc[d - 1] += v


@dataclass
class GenerationStats:
    mode: str = "ar"
    prompt_tokens: int = 0
    reused_prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    tokens: int = 0
    seconds: float = 0.0  # generation only (after the prompt is processed)
    steps: int = 0  # forward passes that produced tokens (the prompt's pass included)
    drafts: int = 0  # steps that verified a tree
    draft_tokens: int = 0  # drafted nodes verified
    accepted_tokens: int = 0  # drafted nodes accepted
    forced_tokens: int = 0  # accepted nodes an output constraint forced (grammar drafts)
    accepted_per_depth: list[int] = field(default_factory=list)  # accepted at depth d+1
    predicted_per_depth: list[float] = field(default_factory=list)  # controller's forecast
    tokens_per_step: list[int] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)  # tokens decoded per step
    time_draft: float = 0.0
    time_verify: float = 0.0
    time_index: float = 0.0
    # seconds outside llama_decode (host overhead: everything from the end of one step to
    # the end of the next but the forward pass, emitting the step's text included)
    host_plain: float = 0.0  # ... in plain steps
    host_tree: float = 0.0  # ... in steps that verified a tree
    host_tree16: float = 0.0  # ... in steps that verified a tree of 9-16 nodes
    trees16: int = 0  # steps that verified a tree of 9-16 nodes (root included)

    def observe_step(self, decoded: int, accepted: int, *, drafted: int = 0,
                     forecast: Sequence[float] = (), forecast_depths: Sequence[int] = (),
                     draft: float = 0.0, verify: float = 0.0, index: float = 0.0,
                     host: float = 0.0, forced: int = 0) -> None:
        """One forward pass: `decoded` tokens went through the model (1: a plain step),
        `drafted` of them were drafted nodes and `accepted` of those were accepted;
        `forecast` are the controller's acceptance probabilities of the drafted nodes (at
        `forecast_depths`); the times are seconds spent in each phase, `host` the part of
        the step spent outside llama_decode; `forced` accepted nodes a grammar forced."""
        self.steps += 1
        self.tokens_per_step.append(accepted + 1)
        self.tree_sizes.append(decoded)
        if drafted:
            self.drafts += 1
            self.draft_tokens += drafted
            self.accepted_tokens += accepted
            self.forced_tokens += forced
            add_per_depth(self.accepted_per_depth, [1] * accepted, range(1, accepted + 1))
            add_per_depth(self.predicted_per_depth, forecast, forecast_depths)
        self.time_draft += draft
        self.time_verify += verify
        self.time_index += index
        if drafted:
            self.host_tree += host
            if 9 <= decoded <= 16:
                self.host_tree16 += host
                self.trees16 += 1
        else:
            self.host_plain += host

    def observe_plain(self, draft: float, verify: float, index: float, host: float,
                      count: int = 1) -> None:
        """`observe_step` of a plain step (one token decoded, nothing drafted verified):
        the decode loop's call on most steps, without keywords; `count` such steps (a run
        decoded in one call) took these times together."""
        self.steps += count
        if count == 1:
            self.tokens_per_step.append(1)
            self.tree_sizes.append(1)
        else:
            self.tokens_per_step.extend([1] * count)
            self.tree_sizes.extend([1] * count)
        self.time_draft += draft
        self.time_verify += verify
        self.time_index += index
        self.host_plain += host

    def merge(self, other: GenerationStats) -> GenerationStats:
        """Add another generation's counts and times into this one (for totals)."""
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name == "mode":
                if a != b:
                    self.mode = "mixed" if self.steps or self.tokens else b
            elif f.name in ("accepted_per_depth", "predicted_per_depth"):
                add_per_depth(a, b, range(1, len(b) + 1))
            elif isinstance(a, list):
                a.extend(b)
            else:
                setattr(self, f.name, a + b)
        return self

    @classmethod
    def total(cls, items: Iterable[GenerationStats], mode: str = "ar") -> GenerationStats:
        out = cls(mode=mode)
        for s in items:
            out.merge(s)
        out.mode = mode
        return out

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per forward pass (1.0 for plain decoding)."""
        return self.tokens / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def host_ms_plain(self) -> float:
        """Milliseconds outside llama_decode per plain step (drafting attempts included)."""
        n = len(self.tree_sizes) - self.drafts
        return self.host_plain * 1000.0 / n if n > 0 else 0.0

    @property
    def host_ms_tree(self) -> float:
        """Milliseconds outside llama_decode per step that verified a tree."""
        return self.host_tree * 1000.0 / self.drafts if self.drafts else 0.0

    @property
    def host_ms_tree16(self) -> float:
        """Milliseconds outside llama_decode per step that verified a tree of 9-16 nodes
        (the size a host-overhead budget per 16-node tree is about)."""
        return self.host_tree16 * 1000.0 / self.trees16 if self.trees16 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(tokens_per_second=self.tokens_per_second,
                 mean_accepted_length=self.mean_accepted_length,
                 acceptance_rate=self.acceptance_rate)
        return d
