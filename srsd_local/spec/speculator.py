"""The Speculator: what to verify at each step, and learning from what was accepted.

Lifecycle (one Speculator per engine, one `Request` per generation):

- `begin(mode, greedy)` starts a generation and returns its per-request state;
- `propose(req, inp, room)` drafts a tree rooted at the known next token and lets the
  controller keep the sub-tree that pays for itself; it returns a `Plan` to verify, or None
  for a plain step;
- `observe(req, plan, path, seconds, ctx)` learns from the outcome: acceptance counts,
  per-depth calibration, the step's cost, and the request's back-off state.

Under greedy decoding a drafted node is accepted exactly when its token is the one the model
emits after its parent, so the nodes the controller did not verify (a declined tree, the part
of a candidate tree a plan left out) are learned too, once the tokens emitted after them are
known (at the request's next drafting): a controller that learned only from what it verified
would never correct an estimate too low to be verified.

State shared by all generations (acceptance and cost models, depth calibration) lives on the
Speculator; state of one generation (recent acceptance, back-off) lives on its `Request`, so
several generations can run side by side. Pure numpy: no llama.cpp here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import MODES, SRSDConfig
from .acceptance import AcceptanceModel, DepthCalibration, LazyEvidence, NodeEvidence, evidence
from .copyrun import chain, continues, find_copy
from .cost import CostModel
from .draft import (
    _MAX_AGREE,
    ANALOGY,
    COPY,
    LIST,
    TEXT,
    Drafter,
    DraftInput,
)
from .drafters import NgramModDrafter, make_drafter
from .fastplan import compiled_planner
from .planner import Plan, choose
from .tree import TokenTree

RECENT_RATE = 0.3  # EMA weight of the last verified tree's outcome
RECENT_DRIFT = 0.05  # per plain step, towards neutral, so drafting gets retried
MAX_SKIP = 16  # steps without drafting after plans kept being declined
EXPLORE_GAP = 50  # steps between plans that try a stale cost estimate optimistically ...
MAX_EXPLORE_GAP = 3200  # ... doubled after each such plan, up to this, until a surprise
EXPLORE_AFTER_SURPRISE = 4  # plans that do so after a step far faster than its estimate
INDEXED_MODES = ("retrieval", "srsd", "hybrid")  # modes that query the hidden-state index
TEXT_MODES = ("srsd",)  # modes that draft from the context's text (DraftInput.text)
FOLLOW_MODES = ("srsd",)  # modes that follow copy runs (copyrun.py)
SEARCH = -1  # Request.copy_at: look for the copy the last tree came from
# modes whose drafting, while backed off, waits for the root to follow the context's last
# token somewhere before (measured: such attempts were declined 75 times in 80, and the 5
# verified trees got 3 tokens accepted)
GATED_MODES = ("srsd",)
# Sources run only for requests where they pay (`Speculator.sources_off`): text lookup,
# analogy and list drafts, which the default mode runs beside retrieval and the n-gram pool
# on every drafting attempt. A source is credited when one of its nodes is accepted (also one
# retrieval or the pool proposed too: a second source's agreement shapes the tree and its
# estimates); after SOURCE_IDLE drafting attempts of a request without a credit it runs only
# on every SOURCE_PROBE-th attempt, until it is credited again. (Measured: with retrieval as
# the only source the engine verified its trees in ~1.0 ms against ~1.2-1.3 with all five; a
# first version that credited only nodes no always-running source proposed lost 2-4% of
# tokens/s on text edits and HumanEval.)
SOURCE_GATED_MODES = ("srsd",)
GATED_SOURCES = (TEXT, ANALOGY, LIST)
TEXT_SOURCES = TEXT | ANALOGY | LIST  # the sources that read DraftInput.text: the gated ones
SOURCE_IDLE = 6
SOURCE_PROBE = 8
# a chain from a copy found by matching the last tokens weighs what the request's earlier
# found copies paid (an EMA from FOUND_COPY_START, at FOUND_COPY_RATE, at most
# FOUND_COPY_MAX): the acceptance model keys the chain's nodes by it, apart from a run's own
# chains (1.0). Output that repeats a pattern with variations matches its last tokens in
# the wrong place (chains of 16-32 got 0-2 accepted); an edit's copy, in the right one.
# Below FOUND_COPY_SKIP, a found copy is not planned (the step drafts as usual: retrieval
# re-anchors on such output where the last tokens do not), and each one passed up brings
# the record back towards the start by FOUND_COPY_RETURN, so the request tries them again.
FOUND_COPY_START = 0.7
FOUND_COPY_RATE = 0.5
FOUND_COPY_MAX = 0.89
FOUND_COPY_SKIP = 0.3
FOUND_COPY_RETURN = 0.1


@dataclass
class Request:
    """The speculation state of one generation."""

    mode: str
    greedy: bool
    recent: float = 0.5  # EMA: did the last verified trees get a token accepted?
    declined: int = 0  # plans in a row the controller declined
    skip: int = 0  # steps not to draft
    # greedy only: the last candidate tree, to learn the outcomes of its nodes that were not
    # verified once the tokens after them are known: (context length at its root, the tree,
    # its evidence, the nodes learned already)
    unverified: tuple[int, TokenTree, list, set[int]] | None = None
    # a copy run: the context position whose token the next root should be (SEARCH: not
    # known yet, the last tree was accepted to a leaf), or None (no run)
    copy_at: int | None = None
    attempts: int = 0  # drafting attempts that ran the sources
    # per gated source bit: its drafting attempts since its nodes last paid (see
    # sources_off); the bits of those that ran at the attempt waiting for its outcome
    idle: dict[int, int] = field(default_factory=dict)
    ran: int = 0
    # EMA: the share of the nodes of its chains from a found copy (not a run followed) that
    # were accepted; the weight of its next such chain
    found_copies: float = FOUND_COPY_START

    @property
    def uses_index(self) -> bool:
        return self.mode in INDEXED_MODES

    @property
    def uses_text(self) -> bool:
        return self.mode in TEXT_MODES


def unplanned(tree: TokenTree, recent: float) -> Plan:
    """A tree verified as drafted (no controller): no forecast."""
    ev = evidence(tree, recent)
    return Plan(tree, [], ev, 0.0, [])


class Speculator:
    def __init__(self, config: SRSDConfig, cost: CostModel | None = None,
                 acceptance: AcceptanceModel | None = None) -> None:
        self.config = config
        # without a measured profile, verification is assumed as cheap as a plain step
        self.cost = cost or CostModel([1, 2], [1.0, 1.0])
        self.acceptance = acceptance or AcceptanceModel()
        # per (mode, greedy, copy run or merged draft)
        self.depth_calibration: dict[tuple[str, bool, bool], DepthCalibration] = {}
        self.drafters = self._make_drafters(config)
        self._compiled = compiled_planner()  # None: the Python planner
        self._explored_at = -EXPLORE_GAP  # cost.steps at the last exploratory plan
        self._surprises = 0  # cost.surprises when last looked at
        self._explore_left = 0  # plans that still explore after a surprise
        self._explore_gap = EXPLORE_GAP  # steps from one exploratory plan to the next

    def _make_drafters(self, config: SRSDConfig) -> dict[str, Drafter | None]:
        self.pool = NgramModDrafter(config)  # one n-gram pool serves every mode that uses it
        return {m: make_drafter(m, config, self.pool) for m in MODES}

    def reconfigure(self, config: SRSDConfig) -> None:
        self.config = config
        self.drafters = self._make_drafters(config)

    def forget_outputs(self) -> None:
        """Empty the n-gram pool (what earlier generations wrote), e.g. so that a benchmark
        run cannot draft from another run's output of the same prompt."""
        self.pool.reset()

    def begin(self, mode: str, greedy: bool) -> Request:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}: accepted are {', '.join(MODES)}")
        return Request(mode, greedy)

    def room(self, req: Request, free: int) -> int:
        """Drafted nodes a tree may have when `free` context cells remain after the root."""
        drafter = self.drafters[req.mode]
        return 0 if drafter is None else max(0, min(drafter.config.max_nodes, free))

    def propose(self, req: Request, inp: DraftInput, room: int, offset: int = 0,
                gain: float = 0.0) -> Plan | None:
        """The tree to verify this step (rooted at inp.root), or None for a plain step.
        `offset` tokens of other requests share the forward pass, expected to emit `gain`
        tokens: the tree is chosen for the whole batch's tokens per second."""
        drafter = self.drafters[req.mode]
        if drafter is None or room <= 0:
            return None
        if not len(inp.forced):
            if self.skips(req):
                return None
            if req.declined and req.mode in GATED_MODES and \
                    find_copy(inp.tokens, inp.root, 1) is None:
                self._back_off(req, False)  # what this drafting would have found is
                return None  # left for later: the last candidate tree too (_settle)
        if req.unverified is not None:
            self._settle(req, inp)
        if req.mode in SOURCE_GATED_MODES:
            req.attempts += 1
            req.ran = TEXT_SOURCES & ~inp.skip
        tree = drafter.draft(inp, max_nodes=room)
        if not tree.n_draft:
            self._credit(req, 0)
            if drafter.config.adaptive:  # found nothing: back off as if declined
                self._back_off(req, False)
            return None
        if not drafter.config.adaptive:
            return unplanned(tree, req.recent)
        plan = self._decide(tree, req, room, int(inp.tokens.shape[0]), offset, gain)
        if plan is None:  # declined: the sources that ran paid nothing this time
            self._credit(req, 0)
        return plan

    def prepare(self, req: Request, tokens) -> None:
        """The request's context is `tokens` (its prompt, prefilled): the n-gram pool takes
        it in now, where the request drafts from the pool (its first drafting step would,
        and pay for the whole prompt in its host time)."""
        drafter = self.drafters[req.mode]
        if drafter is self.pool or self.pool in getattr(drafter, "parts", ()):
            self.pool.observe(tokens)

    def sources_off(self, req: Request) -> int:
        """The origin bits of the sources not to run at the request's next drafting attempt
        (see SOURCE_IDLE): those whose nodes did not pay for SOURCE_IDLE attempts in a
        row, but on every SOURCE_PROBE-th attempt, when all run."""
        if req.mode not in SOURCE_GATED_MODES or req.attempts % SOURCE_PROBE == SOURCE_PROBE - 1:
            return 0
        idle = req.idle
        return sum(b for b in GATED_SOURCES if idle.get(b, 0) >= SOURCE_IDLE)

    @staticmethod
    def _credit(req: Request, paid: int) -> None:
        """The outcome of the request's last drafting attempt for the gated sources that ran
        in it: `paid`, the bits of those whose nodes were accepted."""
        ran = req.ran
        if not ran:
            return
        req.ran = 0
        idle = req.idle
        for b in GATED_SOURCES:
            if ran & b:
                idle[b] = 0 if paid & b else idle.get(b, 0) + 1

    def _decide(self, tree: TokenTree, req: Request, room: int, ctx: int, offset: int,
                gain: float, copy_from: int | None = None) -> Plan | None:
        """The controller's plan for a candidate tree (None: declined, a plain step);
        back-off and what is learned later from the nodes not verified. `copy_from`: the
        tree is a copy run's chain whose root copies that context position."""
        plan = self._plan(tree, req, room, ctx, offset, gain, copy_from)
        self._back_off(req, bool(plan.tree.n_draft))
        if req.greedy:  # (a declined plan's source is the root alone)
            req.unverified = (ctx, tree, plan.candidate_evidence, set(plan.source))
        return plan if plan.tree.n_draft else None

    def follow(self, req: Request, tokens, root: int, room: int, offset: int = 0,
               gain: float = 0.0) -> Plan | None:
        """A copy run's next chain, planned (see copyrun.py), or None when the request is
        not in a run that goes on; then the caller drafts as usual (a chain the controller
        declined leaves the request backed off, so the caller makes a plain step)."""
        at = req.copy_at
        if at is None or room <= 0 or req.mode not in FOLLOW_MODES or not self.config.adaptive:
            return None
        req.copy_at = None
        weight = 1.0
        if at == SEARCH:
            weight = found_copy_weight(req)
            if weight < FOUND_COPY_SKIP:
                req.found_copies += FOUND_COPY_RETURN * (FOUND_COPY_START - req.found_copies)
                return None
            at = find_copy(tokens, root)
        if at is None or not continues(tokens, root, at):
            return None
        if req.unverified is not None:
            self._settle(req, DraftInput(tokens, root, None, None))
        tree = TokenTree.chain(root, chain(tokens, root, at, room), weight, _MAX_AGREE, COPY)
        plan = self._decide(tree, req, room, int(tokens.shape[0]), offset, gain, at)
        if plan is not None:
            plan.found_copy = weight < 1.0
        return plan

    def _settle(self, req: Request, inp: DraftInput) -> None:
        """Learn the outcomes of the last candidate tree's nodes that were not verified, as
        far as the tokens emitted since its root (the context, then `inp.root`) tell them:
        a node whose parent the emitted tokens follow was accepted if they go on with its
        token, rejected otherwise; the children of the last node they follow are left out
        where no token after it is known yet."""
        assert req.unverified is not None
        n0, tree, ev, done = req.unverified
        req.unverified = None
        toks = inp.tokens
        if toks.shape[0] <= n0 or int(toks[n0]) != tree.tokens[0]:
            return  # the context is not the one the tree was drafted on
        emitted = toks[n0 + 1:].tolist()
        emitted.append(int(inp.root))
        path = tree.follow(emitted)
        on_path, open_end = {0, *path}, len(path) == len(emitted)
        node = path[-1] if path else 0
        parents = tree.parents
        nodes = [i for i in range(1, len(tree)) if parents[i] in on_path and i not in done
                 and not (open_end and parents[i] == node)]
        self._count(ev, nodes, [i in on_path for i in nodes], req.mode, True)

    @staticmethod
    def _back_off(req: Request, verified: bool) -> None:
        """After drafting that led to no tree (nothing found, or the controller declined
        it) the next drafting waits 1, 2, 4, ... up to MAX_SKIP steps; a verified tree
        resets it."""
        req.declined = 0 if verified else req.declined + 1
        req.skip = min(2 ** req.declined // 2, MAX_SKIP)

    def indexes(self, req: Request) -> bool:
        """Whether a plain step captures and indexes its hidden row: always for a request
        that uses the index, but for a sampled one whose drafting stays backed off after
        this step (its next drafting needs the row of the step before it; rows of the
        steps between are left out of the index: sampled prose rarely gets a tree
        accepted, and each capture splits the forward pass and copies a row)."""
        return req.uses_index and (req.greedy or req.skip == 0)

    def skips(self, req: Request) -> bool:
        """Whether this step goes without drafting: the controller kept declining, so it
        looks again later, not every step (counts the step). A caller that knows nothing
        forces the next tokens asks before preparing a draft's input."""
        if req.skip > 0:
            req.skip -= 1
            return True
        return False

    def _plan(self, tree: TokenTree, req: Request, room: int, ctx: int, offset: int = 0,
              gain: float = 0.0, copy_from: int | None = None) -> Plan:
        n_max = min(room, len(tree) - 1) + 1
        if self.cost.surprises != self._surprises:  # an estimate was far too high: look
            self._surprises = self.cost.surprises  # for more of them in the next plans
            self._explore_left = EXPLORE_AFTER_SURPRISE
            self._explore_gap = EXPLORE_GAP
        explore = ((self._explore_left > 0 or
                    self.cost.steps - self._explored_at >= self._explore_gap)
                   and self.cost.can_explore(n_max))
        if explore:  # an unconfirmed cost estimate must not rule big trees out for good,
            # but where exploring finds the estimates right (no surprise), it costs a tree
            # that does not pay each time: it gets rarer
            if self._explore_left == 0:
                self._explore_gap = min(2 * self._explore_gap, MAX_EXPLORE_GAP)
            self._explored_at = self.cost.steps
            self._explore_left = max(0, self._explore_left - 1)
        # steps may be padded up to the room's size (dummy rows), not only the tree's
        cost, size = self.cost.plan_table(room + 1 + offset, ctx, explore=explore)
        # a copy run's chains are calibrated apart: their depths fare unlike a merged tree's
        dc = self.depth_calibration.setdefault((req.mode, req.greedy, copy_from is not None),
                                               DepthCalibration())
        cost, fast = cost[offset: offset + n_max + 1], self._compiled
        if fast is not None:
            ev = LazyEvidence(tree, req.recent)
            plan = fast.choose(tree, self.acceptance, req.mode, req.greedy, ev, cost,
                               self.config.max_branches, dc.scale(), gain)
        else:
            ev = evidence(tree, req.recent)
            means, explores = self.acceptance.q_all(ev, req.mode, req.greedy)
            plan = choose(tree, [1.0, *explores], cost, self.config.max_branches,
                          [1.0, *means], dc.scale(), ev, gain)
        if plan.tree.n_draft:
            total = len(plan.tree) + offset
            plan.pad = int(size[total]) - total
        plan.candidate_evidence = ev
        plan.copy_from = copy_from
        return plan

    def observe(self, req: Request, plan: Plan | None, path: list[int]) -> None:
        """Learn from one step: `plan` was verified (None: a plain step), `path` are the
        accepted node indices from the root (a run of k plain steps: k entries, the steps
        after the first being those the controller would skip, `skips`). (The step's cost:
        `observe_cost`.)"""
        req.copy_at = None
        if plan is None:
            for _ in path:
                req.recent += RECENT_DRIFT * (0.5 - req.recent)
            if len(path) > 1:
                req.skip = max(0, req.skip - (len(path) - 1))
        else:
            tree = plan.tree
            if len(path) > 1 and not tree.children(path[-1]):  # accepted to a leaf: the
                # output goes on copying (the chain's source, else the source to look for)
                req.copy_at = (SEARCH if plan.copy_from is None else
                               plan.copy_from + len(path))
            if plan.found_copy:
                req.found_copies += FOUND_COPY_RATE * (
                    (len(path) - 1) / max(tree.n_draft, 1) - req.found_copies)
            if plan.probs:
                key = (req.mode, req.greedy, plan.copy_from is not None)
                self.depth_calibration[key].update(plan.raw_probs[1:], tree.depths[1:],
                                                   len(path) - 1)
            self._learn(tree, plan.evidence, path, req)
            req.recent += RECENT_RATE * (float(len(path) > 1) - req.recent)
            if req.ran:  # a drafted tree: which gated sources' nodes paid
                origin, paid = tree.origin, 0
                for i in path[1:]:
                    paid |= origin[i]  # (bits of sources that are not gated: no matter)
                self._credit(req, paid)

    def observe_cost(self, n: int, seconds: float, ctx: int) -> None:
        """A forward pass of n tokens (all requests' together) took `seconds` at context
        length `ctx`."""
        if self.config.adaptive:
            self.cost.observe(n, seconds, ctx)

    def observe_plain_cost(self, seconds: float, ctx: int, count: int = 1) -> None:
        """`observe_cost` of a plain step (one token of one request); `count` such steps
        (a run) took `seconds` each."""
        if self.config.adaptive:
            self.cost.observe_plain(seconds, ctx, count)

    def _learn(self, tree: TokenTree, ev: list[NodeEvidence | None], path: list[int],
               req: Request) -> None:
        """Every verified node whose parent was accepted is one outcome for calibration."""
        on_path = set(path)
        parents = tree.parents
        nodes = [i for i in range(1, len(tree)) if parents[i] in on_path]
        self._count(ev, nodes, [i in on_path for i in nodes], req.mode, req.greedy)

    def _count(self, ev, nodes: list[int], accepted: list[bool], mode: str, greedy: bool
               ) -> None:
        """One outcome per node (indices into `ev`) for the acceptance model: in one
        compiled call where the compiled planner planned the tree."""
        if isinstance(ev, LazyEvidence) and ev.keys is not None:
            self._compiled.learn(self.acceptance, ev, nodes, accepted)
        else:
            learn = self.acceptance.update
            for i, a in zip(nodes, accepted):
                learn(ev[i], mode, greedy, a)


def found_copy_weight(req: Request) -> float:
    """The weight of a chain from a copy found by matching the last tokens (see
    FOUND_COPY_START)."""
    return min(FOUND_COPY_MAX, req.found_copies)
