"""Token trees for speculative verification. Pure python/numpy.

Node 0 is the root: the token just chosen, not yet in the KV cache. Every other node is a
drafted token; its weight is the summed weight of the drafts that pass through it, so a
parent always weighs at least as much as each child. The backend lays the tree out as a
batch: one row per node, position = n_past + depth, and one sequence id per root-to-leaf
path (a node carries the ids of every path through it).
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TreeLayout:
    tokens: array  # int32 [n] (array("i"): no numpy call on a step's hot path)
    depths: array  # int32 [n]
    seq_ids: list[list[int]]  # per node, the branch ids through it
    leaf_branch: dict[int, int]  # leaf node -> its branch id

    @property
    def n_branches(self) -> int:
        return len(self.leaf_branch)


class TokenTree:
    def __init__(self, root_token: int) -> None:
        self.tokens: list[int] = [int(root_token)]
        self.parents: list[int] = [-1]
        self.depths: list[int] = [0]
        self.weights: list[float] = [0.0]
        self.counts: list[int] = [0]  # drafts through each node
        self.agree: list[int] = [0]  # longest context match among the drafts through a node
        self.origin: list[int] = [0]  # bitmask of the draft sources through a node
        self._children: list[dict[int, int]] = [{}]

    @classmethod
    def from_lists(cls, tokens: list[int], parents: list[int], depths: list[int],
                   weights: list[float], counts: list[int], agree: list[int],
                   origin: list[int], children: list[dict[int, int]] | None = None
                   ) -> TokenTree:
        """A tree from its per-node lists, numbered as `insert` and `prune` number nodes
        (parents before their children, siblings in the order they were added); `children`
        (per node, token -> child) where the caller has them, else worked out."""
        out = cls.__new__(cls)
        out.tokens, out.parents, out.depths = tokens, parents, depths
        out.weights, out.counts, out.agree, out.origin = weights, counts, agree, origin
        if children is None:
            children = [{} for _ in tokens]
            for i in range(1, len(tokens)):
                children[parents[i]][tokens[i]] = i
        out._children = children
        return out

    @classmethod
    def chain(cls, root_token: int, tokens: list[int], weight: float, agree: int = 0,
              origin: int = 1) -> TokenTree:
        """The tree `TokenTree(root_token)` holds after `insert(tokens, weight, agree,
        origin)`, made list by list (a copy run's chain: every step of a run, right after
        a forward pass, where a node-by-node insert costs more than the rest of the step's
        drafting). `tokens`: Python ints."""
        k = len(tokens)
        return cls.from_lists([int(root_token), *tokens], list(range(-1, k)),
                              list(range(k + 1)), [float(weight)] * (k + 1), [1] * (k + 1),
                              [0] + [max(agree, 0)] * k, [origin] * (k + 1),
                              [{t: i} for i, t in enumerate(tokens, 1)] + [{}])

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def n_draft(self) -> int:
        """Drafted nodes (all but the root)."""
        return len(self.tokens) - 1

    def child(self, node: int, token: int) -> int | None:
        return self._children[node].get(int(token))

    def children(self, node: int) -> list[int]:
        return list(self._children[node].values())

    def follow(self, tokens: Sequence[int]) -> list[int]:
        """The nodes below the root that `tokens` (what came after the root) go through in
        a row, down one path, until one of them is no child."""
        path, kids = [], self._children
        node = 0
        for t in tokens:
            nxt = kids[node].get(int(t))
            if nxt is None:
                break
            node = nxt
            path.append(node)
        return path

    def n_leaves(self) -> int:
        """Nodes without children (the root alone counts as one)."""
        return sum(1 for kids in self._children if not kids)

    def sibling_groups(self) -> list[list[int]]:
        """The children of every node that has more than one."""
        return [list(c.values()) for c in self._children if len(c) > 1]

    def add_node(self, parent: int, token: int, weight: float = 0.0) -> int:
        idx = len(self.tokens)
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.weights.append(weight)
        self.counts.append(0)
        self.agree.append(0)
        self.origin.append(0)
        self._children.append({})
        self._children[parent][int(token)] = idx
        return idx

    def graft(self, parent: int, src: TokenTree, node: int) -> int:
        """Copy node `node` of tree `src` (its token and statistics) under `parent`."""
        new = self.add_node(parent, src.tokens[node], src.weights[node])
        self.counts[new] = src.counts[node]
        self.agree[new] = src.agree[node]
        self.origin[new] = src.origin[node]
        return new

    def insert(self, path: Sequence[int], weight: float, agree: int = 0, origin: int = 1
               ) -> None:
        """Add a draft that follows the root; shared prefixes are stored once. `agree` is
        how many context tokens up to the root matched where the draft was found; `origin`
        is the bit of the source that proposed it. (Locals bound once, a draft's array
        turned into Python ints in one call: this runs for every draft of every step.)"""
        if isinstance(path, np.ndarray):
            path = path.tolist()
        kids, weights, counts, agrees, origins = (self._children, self.weights, self.counts,
                                                  self.agree, self.origin)
        weights[0] += weight
        counts[0] += 1
        origins[0] |= origin
        node = 0
        for tok in path:
            nxt = kids[node].get(tok)
            if nxt is None:
                nxt = self.add_node(node, tok)
            weights[nxt] += weight
            counts[nxt] += 1
            if agrees[nxt] < agree:
                agrees[nxt] = agree
            origins[nxt] |= origin
            node = nxt

    def path_tokens(self, node: int) -> list[int]:
        """Tokens from just below the root down to `node`."""
        out = []
        while node > 0:
            out.append(self.tokens[node])
            node = self.parents[node]
        return out[::-1]

    def prune(self, max_nodes: int, max_depth: int, max_branches: int) -> TokenTree:
        """A new tree of at most `max_nodes` drafted nodes, depth and leaf count bounded.

        Nodes are taken best-first by weight (ties: shallower, then earlier), so the result
        is the connected sub-tree of highest cumulative weight within the budget.
        """
        out = TokenTree(self.tokens[0])
        out.weights[0], out.counts[0] = self.weights[0], self.counts[0]
        leaves = 1
        heap: list[tuple[float, int, int, int]] = []  # (-weight, depth, old index, new parent)

        def push_children(old: int, new: int) -> None:
            for c in self._children[old].values():
                if self.depths[c] <= max_depth:
                    heapq.heappush(heap, (-self.weights[c], self.depths[c], c, new))

        push_children(0, 0)
        while heap and out.n_draft < max_nodes:
            _, _, old, new_parent = heapq.heappop(heap)
            opens_leaf = bool(out._children[new_parent])
            if opens_leaf and leaves >= max_branches:
                continue
            leaves += opens_leaf
            push_children(old, out.graft(new_parent, self, old))
        return out

    def head(self, k: int) -> TokenTree:
        """The first k drafted nodes (nodes 0..k) as a tree of their own, statistics included:
        parents come before their children, so they are connected. (A plan that keeps a
        candidate's first nodes, as a chain's prefix always is, needs no node-by-node copy.)"""
        m = k + 1
        out = TokenTree.__new__(TokenTree)
        out.tokens, out.parents, out.depths = self.tokens[:m], self.parents[:m], self.depths[:m]
        out.weights, out.counts = self.weights[:m], self.counts[:m]
        out.agree, out.origin = self.agree[:m], self.origin[:m]
        out._children = [{t: c for t, c in kids.items() if c < m} if kids else {}
                         for kids in self._children[:m]]
        return out

    def subtree(self, keep: Sequence[bool], index: dict[int, int] | None = None) -> TokenTree:
        """The nodes with keep[i] true (the root always; a node whose parent is dropped is
        dropped too), statistics included; `index` (when given) receives old -> new node
        numbers."""
        out = TokenTree(self.tokens[0])
        out.weights[0], out.counts[0], out.origin[0] = (self.weights[0], self.counts[0],
                                                        self.origin[0])
        new = {0: 0} if index is None else index
        new[0] = 0
        for i in range(1, len(self.tokens)):
            par = new.get(self.parents[i])
            if keep[i] and par is not None:
                new[i] = out.graft(par, self, i)
        return out

    def extend(self, node: int, tokens: Sequence[int], origin: int) -> None:
        """A chain of tokens under `node` (a leaf), carrying its statistics (weight, drafts,
        agreement) and the source bit `origin`: a continuation that follows from the node
        itself, such as what a grammar forces after it."""
        for tok in tokens:
            new = self.add_node(node, int(tok), self.weights[node])
            self.counts[new], self.agree[new] = self.counts[node], self.agree[node]
            self.origin[new] = origin
            node = new

    def layout(self) -> TreeLayout:
        leaf_branch: dict[int, int] = {}
        seq_ids: list[list[int]] = [[] for _ in self.tokens]
        for node in range(len(self.tokens)):
            if not self._children[node]:
                b = len(leaf_branch)
                leaf_branch[node] = b
                up = node
                while up >= 0:
                    seq_ids[up].append(b)
                    up = self.parents[up]
        return TreeLayout(
            tokens=array("i", self.tokens),
            depths=array("i", self.depths),
            seq_ids=seq_ids,
            leaf_branch=leaf_branch,
        )
