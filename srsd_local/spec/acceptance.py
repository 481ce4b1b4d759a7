"""P(drafted node accepted | parent accepted), from its retrieval evidence (depth, share of
drafts through it, their strength, context agreement, recent acceptance), calibrated online
from verification outcomes (Beta counts with back-off to coarser keys). Pure numpy."""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field

from .draft import acceptance_source
from .tree import TokenTree

# bucket edges of the evidence features (a bucket: the number of edges <= the value)
RECENT_EDGES = (0.25, 0.5, 0.75, 0.9)
SHARE_EDGES = (0.34, 0.67, 0.999)
STRENGTH_EDGES = (0.4, 0.6, 0.8, 0.9)
AGREE_EDGES = (2, 3, 5)
MAX_KEY_DEPTH = 12  # deeper nodes share the keys of this depth
SEED_TRIALS = 10  # calibration seeds count at most this many outcomes per kind of node
# the keys' shape in the compiled planner's tables (_kernels.c: KEY_DEPTHS, KEY_RECENT,
# KEY_FINE)
KEY_DEPTHS = MAX_KEY_DEPTH + 1
KEY_RECENT = len(RECENT_EDGES) + 1
FINE_SHAPE = (len(SHARE_EDGES) + 1, len(STRENGTH_EDGES) + 1, len(AGREE_EDGES) + 1)
KEY_FINE = FINE_SHAPE[0] * FINE_SHAPE[1] * FINE_SHAPE[2]


@dataclass(slots=True)
class NodeEvidence:
    depth: int
    share: float  # drafts through this node / drafts through the root
    strength: float  # mean weight of the drafts through this node
    n_drafts: int  # drafts through the root
    agree: int = 0  # longest context match (tokens up to the root) among those drafts
    recent: float = 0.5  # how often the last trees of this generation got a token accepted
    origin: str = ""  # the sources it is judged by ("srsd", "ngram", "ngram+text", ...: see
    # draft.acceptance_source)
    # the keys last computed, and for which (source, greedy)
    _keys: tuple | None = field(default=None, repr=False, compare=False)
    _keys_for: tuple | None = field(default=None, repr=False, compare=False)

    def keys(self, source: str, greedy: bool) -> tuple[tuple, tuple]:
        """(coarse, fine) keys; the node's own origin names its source when known. Computed
        once per (source, greedy): planning and learning ask for them several times."""
        if self._keys_for == (source, greedy):
            return self._keys  # type: ignore[return-value]
        coarse = (self.origin or source, greedy, min(self.depth, MAX_KEY_DEPTH),
                  bisect_right(RECENT_EDGES, self.recent))
        fine = coarse + (bisect_right(SHARE_EDGES, self.share),
                         bisect_right(STRENGTH_EDGES, self.strength),
                         bisect_right(AGREE_EDGES, self.agree))
        self._keys, self._keys_for = (coarse, fine), (source, greedy)
        return self._keys


class KeyTables:
    """The acceptance counts by integer key, for the compiled planner and learner
    (_kernels.c: srsd_plan, srsd_learn). A source name gets an id when first seen; coarse
    keys are c = ((id * 2 + greedy) * KEY_DEPTHS + depth) * KEY_RECENT + recent bucket, a
    pair (accepted, tried) of doubles each in `coarse`; a coarse key's fine keys get a row of
    KEY_FINE pairs in `fine` when the first of them is counted (`fine_row`, -1 before).
    `AcceptanceModel.counts` (the dict that is stored and read back) and these tables hold
    the same counts: what the Python counts is set here too, what the compiled learner
    counts here is `pending` (key ids) until the dict is next read. `addresses`: the arrays'
    buffers (they move when an array grows)."""

    def __init__(self, prior_of) -> None:
        self._prior_of = prior_of
        self.ids: dict[str, int] = {}
        self.names: list[str] = []
        self.pending: list[int] = []  # key ids the compiled learner counted (srsd_learn)
        self.prior = array("d")
        self.coarse = array("d")
        self.fine_row = array("i")
        self.fine = array("d")
        self._offsets: dict[tuple, int | None] = {}  # key -> its pair's offset (fine: ~)
        self.src_of_bits = array("i", [0] * 256)
        for bits in range(1, 256):
            self.src_of_bits[bits] = self.src(acceptance_source(bits))
        self._moved()

    def __getstate__(self) -> dict:  # (a copy's arrays have buffers of their own)
        state = self.__dict__.copy()
        del state["addresses"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._moved()

    def _moved(self) -> None:
        self.addresses = tuple(a.buffer_info()[0] for a in (
            self.coarse, self.fine_row, self.fine, self.prior, self.src_of_bits))

    def src(self, name: str) -> int:
        """The id of a source name (its tables made on first sight; its prior read then)."""
        got = self.ids.get(name)
        if got is None:
            got = self.ids[name] = len(self.ids)
            self.names.append(name)
            self.prior.append(self._prior_of(name))
            per_src = 2 * KEY_DEPTHS * KEY_RECENT
            self.coarse.extend([0.0] * (2 * per_src))
            self.fine_row.extend([-1] * per_src)
            self._moved()
        return got

    def _offset(self, key: tuple) -> int | None:
        """Where a key's pair is: >= 0 in `coarse`, ~offset in `fine`; None for a key of
        another shape (a stored one of an older version: the planner never asks for it)."""
        if key in self._offsets:
            return self._offsets[key]
        got = None
        if len(key) in (4, 7) and isinstance(key[0], str) and key[1] in (0, 1) and all(
                isinstance(v, int) and not isinstance(v, bool) for v in key[2:]):
            d, rb, *fine = key[2:]
            if 0 <= d < KEY_DEPTHS and 0 <= rb < KEY_RECENT and all(
                    0 <= v < m for v, m in zip(fine, FINE_SHAPE)):
                c = ((self.src(key[0]) * 2 + int(key[1])) * KEY_DEPTHS + d) * KEY_RECENT + rb
                got = 2 * c
                if fine:
                    row = self.row(c)
                    sb, stb, ab = fine
                    got = ~(2 * (row * KEY_FINE + (sb * FINE_SHAPE[1] + stb) * FINE_SHAPE[2]
                                 + ab))
        self._offsets[key] = got
        return got

    def row(self, c: int) -> int:
        """The fine row of coarse index c (made when it has none)."""
        row = self.fine_row[c]
        if row < 0:
            row = self.fine_row[c] = len(self.fine) // (2 * KEY_FINE)
            self.fine.extend([0.0] * (2 * KEY_FINE))
            self._moved()
        return row

    def flush(self, counts: dict) -> None:
        """The counts of the `pending` keys written to `counts` (as the dict's keys)."""
        done, self.pending = set(self.pending), []
        for kid in done:
            c, f = divmod(kid, KEY_FINE + 1)
            rest, rb = divmod(c, KEY_RECENT)
            rest, d = divmod(rest, KEY_DEPTHS)
            src, greedy = divmod(rest, 2)
            key: tuple = (self.names[src], bool(greedy), d, rb)
            if f:
                sb, rest = divmod(f - 1, FINE_SHAPE[1] * FINE_SHAPE[2])
                key += (sb, *divmod(rest, FINE_SHAPE[2]))
                at = 2 * (self.fine_row[c] * KEY_FINE + f - 1)
                table = self.fine
            else:
                at, table = 2 * c, self.coarse
            counts[key] = [table[at], table[at + 1]]

    def set(self, key: tuple, value: Sequence[float]) -> None:
        at = self._offset(key)
        if at is not None:
            table = self.coarse if at >= 0 else self.fine
            at = at if at >= 0 else ~at
            table[at], table[at + 1] = float(value[0]), float(value[1])

    def clear(self) -> None:
        """Every count zero (the sources keep their ids)."""
        self.coarse = array("d", bytes(8 * len(self.coarse)))
        self.fine_row = array("i", [-1]) * len(self.fine_row)
        self.fine = array("d")
        self._offsets.clear()
        self.pending.clear()
        self._moved()


@dataclass
class AcceptanceModel:
    """P(node accepted | parent accepted), calibrated online.

    `q()` is the posterior mean (what is reported as predicted acceptance); `q_explore()` adds
    an optimism bonus that shrinks with the evidence seen, so kinds of nodes that were never
    verified still get tried and calibrated instead of being ruled out by the prior.
    """

    prior: float = 0.4  # measured: weak srsd hits are accepted ~20%, strong ones ~80-100%
    strength: float = 4.0  # pseudo-counts of the prior at each back-off level
    bonus: float = 0.15
    # key -> [accepted, tried] (read it as `counts`: what the compiled learner counted is
    # written in on reading)
    _counts: dict = field(default_factory=dict, repr=False)

    forced_prior: float = 0.95  # nodes an output grammar forces: only a tokenization or a
    # whitespace guess can miss (the counts correct it)
    analogy_prior: float = 0.8  # analogy drafts two examples agree on: 0.94 of their nodes
    # were accepted in the calibration set's fixed trees
    list_prior: float = 0.9  # lists continued name by name: 11 of 12 nodes in those trees
    # (too few to seed the deeper nodes of a list, which the generic prior would cut)
    copy_prior: float = 0.9  # chains that continue a copy run (copyrun.py): 1081 of 1224
    # nodes accepted in a dev run (4 prompts each of the edit and code workloads), the first
    # node of 79 of 80 chains

    def __post_init__(self) -> None:
        # the counts by integer key for the compiled planner (priors read per source when
        # it is first seen: set the prior fields at construction)
        self.tables = KeyTables(self._prior_of)
        for key, value in self._counts.items():
            self.tables.set(key, value)

    @property
    def counts(self) -> dict:
        """key -> [accepted, tried] for every key counted (coarse keys: (source, greedy,
        depth, recent bucket); fine ones add the share, strength and agreement buckets)."""
        if self.tables.pending:
            self.tables.flush(self._counts)
        return self._counts

    def clear(self) -> None:
        """Forget every count."""
        self._counts.clear()
        self.tables.clear()

    def _post(self, ev: NodeEvidence, source: str, greedy: bool) -> tuple[float, float]:
        return self._post_keys(*ev.keys(source, greedy))

    def _prior_of(self, kind: str) -> float:
        """The prior of a node whose sources are `kind`."""
        return self.forced_prior if "grammar" in kind else \
            self.analogy_prior if "analogy" in kind else \
            self.list_prior if "list" in kind else \
            self.copy_prior if kind == "copy" else self.prior

    def _post_keys(self, coarse: tuple, fine: tuple) -> tuple[float, float]:
        """(posterior mean, outcomes counted under the coarse key) of a node's keys."""
        a, n_coarse = self.counts.get(coarse, (0, 0))
        qc = (a + self.strength * self._prior_of(coarse[0])) / (n_coarse + self.strength)
        a, n = self.counts.get(fine, (0, 0))
        return (a + self.strength * qc) / (n + self.strength), n_coarse

    def q(self, ev: NodeEvidence, source: str, greedy: bool) -> float:
        return self._post(ev, source, greedy)[0]

    def q_explore(self, ev: NodeEvidence, source: str, greedy: bool) -> float:
        """Optimistic by how little this depth (and recent-acceptance level) was tried: the
        bonus follows the coarse key, which fills quickly, so it cannot compound down long
        chains of rarely seen fine keys."""
        return self.q_both(ev, source, greedy)[1]

    def q_both(self, ev: NodeEvidence, source: str, greedy: bool) -> tuple[float, float]:
        """(q, q_explore) from one lookup."""
        return self._both(*self._post(ev, source, greedy))

    def _both(self, mean: float, n_coarse: float) -> tuple[float, float]:
        """(q, q_explore) from a posterior mean and the outcomes under its coarse key."""
        return mean, min(1.0, mean + self.bonus / (1.0 + n_coarse) ** 0.5)

    def q_all(self, evs: Sequence[NodeEvidence | None], source: str, greedy: bool
              ) -> tuple[list[float], list[float]]:
        """(q, q_explore) of every node but the root (`evs[0]`), each distinct key looked
        up once (the nodes of a tree share most of theirs: a chain's deep nodes all do)."""
        # (the arithmetic of _post_keys and _both inlined, the coarse key's part computed
        # once per coarse key: this runs on every plan)
        memo: dict[tuple, tuple[float, float]] = {}
        per_coarse: dict[tuple, tuple[float, float]] = {}
        get, strength, bonus = self.counts.get, self.strength, self.bonus
        means: list[float] = []
        explores: list[float] = []
        for ev in evs[1:]:
            coarse, fine = ev.keys(source, greedy)  # type: ignore[union-attr]
            got = memo.get(fine)
            if got is None:
                c = per_coarse.get(coarse)
                if c is None:
                    a, n = get(coarse, (0, 0))
                    c = per_coarse[coarse] = (
                        (a + strength * self._prior_of(coarse[0])) / (n + strength),
                        bonus / (1.0 + n) ** 0.5)
                a, n = get(fine, (0, 0))
                mean = (a + strength * c[0]) / (n + strength)
                got = memo[fine] = (mean, min(1.0, mean + c[1]))
            means.append(got[0])
            explores.append(got[1])
        return means, explores

    horizon: int = 2000  # older outcomes fade once a key has this many

    def update(self, ev: NodeEvidence, source: str, greedy: bool, accepted: bool) -> None:
        counts = self.counts
        for key in ev.keys(source, greedy):
            c = counts.setdefault(key, [0, 0])
            c[0] += int(accepted)
            c[1] += 1
            if c[1] > self.horizon:
                c[0], c[1] = c[0] / 2, c[1] / 2
            self.tables.set(key, c)

    def to_json(self) -> list:
        return [[list(k), v] for k, v in self.counts.items()]

    def seed(self, data: list, missing_only: bool = False) -> None:
        """Add a model calibration's acceptance counts as seeds: each kind of node counts as
        at most SEED_TRIALS outcomes, so what real steps teach soon outweighs them."""
        self.load_json(data, cap=SEED_TRIALS, missing_only=missing_only)

    def load_json(self, data: list, cap: float | None = None, missing_only: bool = False
                  ) -> None:
        """Add stored counts; with `cap`, each key counts as at most that many outcomes;
        with `missing_only`, only keys not counted yet."""
        counts = self.counts
        for stored, (a, n) in data:
            key = tuple(stored)
            if missing_only and key in counts:
                continue
            if cap is not None and n > cap:
                a, n = a * cap / n, cap
            counts[key] = [a, n]
            self.tables.set(key, (a, n))


def evidence(tree: TokenTree, recent: float = 0.5) -> list[NodeEvidence | None]:
    """Per node (None for the root): the features the acceptance model is keyed by."""
    return [None, *(node_evidence(tree, i, recent) for i in range(1, len(tree)))]


def node_evidence(tree: TokenTree, i: int, recent: float = 0.5) -> NodeEvidence:
    """evidence(tree, recent)[i], alone."""
    counts, c, o = tree.counts, tree.counts[i], tree.origin[i]
    root_count = max(counts[0], 1)
    return NodeEvidence(tree.depths[i], c / root_count, tree.weights[i] / (c if c > 1 else 1),
                        root_count, tree.agree[i], recent, acceptance_source(o) if o else "")


class LazyEvidence(Sequence):
    """evidence(tree, recent), each node's made when first asked for: the compiled planner
    reads the tree itself, and what is learned later asks for a few nodes of it. (The tree
    is not changed after it was planned.) `picked`: the nodes of the tree that are nodes
    0, 1, ... of this sequence (a plan's sub-tree); all of them in order when None."""

    __slots__ = ("_tree", "_recent", "_picked", "_made", "keys")

    def __init__(self, tree: TokenTree, recent: float,
                 picked: Sequence[int] | None = None) -> None:
        self._tree, self._recent, self._picked = tree, recent, picked
        self._made: dict[int, NodeEvidence] = {}
        self.keys = None  # per node of the tree: its key indices (set by the planner)

    def nodes_of(self, js: Sequence[int]) -> list[int]:
        """The tree's nodes that are this sequence's js."""
        p = self._picked
        return list(js) if p is None else [p[j] for j in js]

    def __len__(self) -> int:
        return len(self._tree) if self._picked is None else len(self._picked)

    @property
    def recent(self) -> float:
        return self._recent

    def __getitem__(self, j):  # type: ignore[override]
        if isinstance(j, slice):
            return [self[k] for k in range(*j.indices(len(self)))]
        if j < 0:
            j += len(self)
        if not 0 <= j < len(self):
            raise IndexError(j)
        i = j if self._picked is None else self._picked[j]
        if i == 0:
            return None
        got = self._made.get(i)
        if got is None:
            got = self._made[i] = node_evidence(self._tree, i, self._recent)
        return got

    def picked(self, nodes: Sequence[int]) -> LazyEvidence:
        """The same evidence for a sub-tree made of `nodes` (in its order), sharing what
        was made already."""
        out = LazyEvidence(self._tree, self._recent, nodes)
        out._made, out.keys = self._made, self.keys
        return out


class DepthCalibration:
    """A second, per-depth calibration on top of the node model: the ratio of measured to
    predicted acceptance at each depth over recent trees (exponentially weighted). The node
    features cannot see everything (a long copy in progress makes deep nodes near-certain);
    this corrects what remains, so forecasts match outcomes depth by depth."""

    def __init__(self, depths: int = 17, decay: float = 0.98, lo: float = 0.2,
                 hi: float = 10.0) -> None:
        self.pred = [1.0] * depths
        self.act = [1.0] * depths
        self.decay, self.lo, self.hi = decay, lo, hi

    def scale(self) -> list[float]:
        """Per depth: measured / predicted acceptance, clipped to [lo, hi]. (Plain Python
        lists: a few dozen numbers, every step, on caches a forward pass just flushed.)"""
        lo, hi = self.lo, self.hi
        return [min(max(a / max(p, 1e-9), lo), hi) for a, p in zip(self.act, self.pred)]

    def update(self, raw_probs: Sequence[float], depths: Sequence[int], accepted_depth: int
               ) -> None:
        n = len(self.pred)
        last = n - 1  # the last entry gathers every depth from there on: its forecasts
        pred = [0.0] * n  # and its accepted nodes alike (one per depth a path reached)
        for p, d in zip(raw_probs, depths):
            pred[min(d, last)] += p
        decay = self.decay
        for d in range(n):
            if pred[d] > 0:
                hit = float(max(0, accepted_depth - last + 1)) if d == last else \
                    (1.0 if 1 <= d <= accepted_depth else 0.0)
                self.pred[d] = decay * self.pred[d] + pred[d]
                self.act[d] = decay * self.act[d] + hit
