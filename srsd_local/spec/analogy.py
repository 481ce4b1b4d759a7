"""Analogy drafts: the copy an earlier example made, made again from the current item.

Few-shot prompts and repeated records have outputs that copy their input item by item: a
function's name and signature after `"name": "`, a docstring's first line after
`"summary": "`. At such a point a lookup by the context's own suffix finds the earlier
example and drafts *its* value, which is wrong for the item at hand. Here the example's value
is traced to where it was copied from (the longest prefix of it that occurred before it), the
bytes just before that source (`Function:\\ndef `, `):\\n    \"\"\"`) are the anchor, and the
anchor's most recent occurrence after the examples marks the same place in the current item:
the draft is the text from there up to the byte that ended the example's copy in its source
(`(`, a line end), followed by what the example wrote after its copy (`", "signature": "`),
and, where the example went on to copy again, by the next analogy. Only analogies another
example confirms (it maps to the same place) are drafted, in the tokens of their source.

Pure Python (bytes.rfind, about 10-25 us a search on a 2k-byte prompt).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TypeGuard

from ..config import SRSDConfig
from .draft import ANALOGY, Drafter, DraftInput, Proposal
from .textlookup import longest_found, longest_repeat, source_tokens, token_starts

MIN_SUFFIX = 8  # bytes of the current suffix that must repeat (the example's "key")
CONFIRM = 16  # bytes of it looked for in the other examples (they may differ before)
MIN_COPY = 4  # bytes of the example's value traced to an earlier source
MIN_ANCHOR = 4  # bytes before that source that must recur in the current item
MAX_ANCHOR = 48
SPAN = 96  # bytes of a value looked at
PARAGRAPH = 480  # bytes of a paragraph copied at most (where the example copied one whole)
PARAGRAPH_END = re.compile(rb"\n[ \t]*(?:\n|\"\"\"|\'\'\')")  # a blank line, a docstring's end
LINE_BREAK = re.compile(rb"[ \t]*\n[ \t]*")
LITERAL = 24  # bytes of what the example wrote after its copy (at most)
NEXT_COPY = 6  # bytes from the example's own item that mark where its next copy begins
BYTES_PER_TOKEN = 4  # draft text chained per draft token (about)


@dataclass(frozen=True)
class Analogy:
    copy: bytes  # the current item's counterpart of the example's copied value
    at: int  # where that counterpart starts in the text
    literal: bytes  # what the example wrote after its copy
    source: int  # bytes of the example's value found in its source
    anchor: int  # bytes before that source found again in the current item
    confirmed: bool = False  # another example maps to the same place
    more: bool = False  # the example went on to copy more right after `literal`
    verbatim: bool = True  # `copy` is the text at `at` as is (not a re-wrapped paragraph)

    @property
    def text(self) -> bytes:
        return self.copy + self.literal


def _counterpart(text: bytes, q: int, after: int) -> tuple[int, bytes, int, int, int] | None:
    """For an example whose continuation starts at q: (where the current item's counterpart
    of its copied value starts, the byte that ended the copy in the example's source (two
    line ends where the copy ended a paragraph), bytes of the value found in that source,
    bytes of the anchor, where the anchor starts in the example), or None. The counterpart is
    looked for after byte `after`."""
    value = text[q: q + SPAN]
    m, s = longest_found(lambda k: text.rfind(value[:k], 0, q), MIN_COPY, len(value))
    if not m:
        return None
    a, at = longest_found(lambda k: text.rfind(text[s - k: s], after, len(text)), MIN_ANCHOR,
                     min(MAX_ANCHOR, s))
    if not a or at + a >= len(text):
        return None
    stop = b"\n\n" if PARAGRAPH_END.match(text, s + m) else text[s + m: s + m + 1]
    return at + a, stop, m, a, s - a


def _literal(text: bytes, value: bytes, m: int, item: int, q: int) -> tuple[bytes, bool]:
    """What the example wrote after its copy (value[m:]), up to where its next copy from
    its own item (text[item:q]) begins; (that text, whether a next copy begins there)."""
    lit = value[m: m + LITERAL]
    for j in range(1, len(lit)):
        if text.find(value[m + j: m + j + NEXT_COPY], item, q) >= 0:
            return lit[:j], True
    return lit, False


def find_analogy(text: bytes) -> Analogy | None:
    """The analogy draft at the end of `text`, or None where the suffix repeats nothing, the
    example's continuation copies nothing earlier, or the copy's anchor has no counterpart
    after the examples. `confirmed`: another example maps to the same place."""
    n = len(text)
    size, pos = longest_repeat(text, MIN_SUFFIX)
    if not size:
        return None
    q = pos + size  # the example's continuation starts here
    # the other examples: earlier occurrences of the suffix's last bytes (they may differ
    # further back), the most recent first
    tail = text[n - min(size, CONFIRM):]
    ends: list[int] = []
    at = text.rfind(tail, 0, n - 1)
    while at >= 0 and len(ends) < 3:
        ends.append(at + len(tail))
        at = text.rfind(tail, 0, at + len(tail) - 1)
    after = max([q, *ends])  # the current item begins after every example
    found = _counterpart(text, q, after)
    if found is None:
        return None
    start, stop, m, a, item = found
    verbatim = True
    if stop == b"\n\n":  # the example copied a paragraph: so does the current item, each
        # line break written as a space (a JSON string has no raw line ends)
        cur = text[start: start + PARAGRAPH]
        para = PARAGRAPH_END.search(cur)
        end = -1 if para is None else para.start()
        copy = cur[:SPAN] if end < 0 else LINE_BREAK.sub(b" ", cur[:end])
        verbatim = end < 0 or len(copy) == end
    else:
        cur = text[start: start + SPAN]
        end = cur.find(stop)
        copy = cur if end < 0 else cur[:end]
    value = text[q: q + SPAN]
    if not copy or copy == value[:len(copy)]:
        return None  # nothing to copy, or the example's own value (a plain lookup has it)
    confirmed = False
    for other in [e for e in ends if e != q][:2]:
        seen = _counterpart(text, other, after)
        if seen is not None and seen[0] == start:
            confirmed = True
            break
    # what the example wrote after its copy follows only where the copy's end was found
    literal, more = _literal(text, value, m, item, q) if end >= 0 else (b"", False)
    return Analogy(copy, start, literal, m, a, confirmed, more, verbatim)


class AnalogyDrafter(Drafter):
    """Drafts by analogy with the most recent examples (see the module docstring): where
    the context ends, where its known next token began a value, or after what an output
    grammar forces next; a copy whose example went on to copy more is followed by the next
    analogy, up to the draft depth."""

    name = "analogy"
    origin = ANALOGY

    def __init__(self, config: SRSDConfig) -> None:
        super().__init__(config)
        self._last: tuple[tuple, list[int]] = ((), [])
        # the last chain drafted: (the text it followed, its bytes, its first analogy, whether
        # its end may cut a token)
        self._chain: tuple[bytes, bytes, Analogy, bool] | None = None
        # the rest of that chain last tokenized: its bytes, its tokens and where they start
        # (see _rest_tokens)
        self._rest: tuple[bytes, list[int], dict[int, int]] = (b"", [], {})

    def propose(self, inp: DraftInput) -> list[Proposal]:
        text = inp.text
        if inp.tokenize is None or inp.piece is None or len(text) <= MIN_SUFFIX:
            return []
        resumed = self._resume(inp)
        if resumed is not None:
            return resumed
        base, head, found = text, b"", find_analogy(text)
        if not _usable(found):  # the known next token may have begun the value
            head = inp.piece(inp.root)
            base = text[: len(text) - len(head)]
            found = find_analogy(base) if head else None
            if not _usable(found) or not found.copy.startswith(head):
                found = None
        prefix: list[int] = []
        if found is None and len(inp.forced):  # the value may begin after forced text
            base, head = text + b"".join(inp.piece(t) for t in inp.forced), b""
            found = find_analogy(base)
            if not _usable(found):
                return []
            prefix = list(inp.forced)
        if found is None:
            return []
        draft, cut = self._chained(base, b"", found)
        self._chain = (base, draft, found, cut)
        key = (base[-8:], head, draft)
        if self._last[0] != key:  # found again after a rejection: reuse
            self._last = (key, _tokens(draft, head, found, cut, inp))
        return self._proposal(prefix + self._last[1], len(prefix), found)

    def _chained(self, base: bytes, draft: bytes, link: Analogy | None) -> tuple[bytes, bool]:
        """`draft` (the text after `base` drafted so far) extended by `link` and the analogies
        that follow it, while they are usable, up to about draft_depth tokens; (the draft,
        whether its end may cut a token: it does not where the example went on to copy
        next)."""
        limit = BYTES_PER_TOKEN * self.config.draft_depth
        while _usable(link):  # else the draft ends with a literal the example went on from
            draft += link.text
            if not link.more:
                return draft, True
            if len(draft) >= limit:
                return draft, False
            link = find_analogy(base + draft)
        return draft, True

    def _proposal(self, toks: list[int], fixed: int, found: Analogy) -> list[Proposal]:
        """`toks` drafted (the first `fixed` of them known already), weighed by `found`."""
        toks = toks[: self.config.draft_depth]
        if len(toks) <= fixed:
            return []
        # two examples agree on the place: strong evidence (weight), and the shorter of the
        # anchor and the traced copy says how specific the place is (agreement)
        return [(list(toks), min(1.0, (found.anchor + found.source) / 32),
                 max(1, min(8, min(found.anchor, found.source) // 4)))]

    def _resume(self, inp: DraftInput) -> list[Proposal] | None:
        """The rest of the last chain drafted, where the text since then (the root's and
        what a grammar forces included) followed it: a tree holds only draft_depth tokens
        of a chain, and in the middle of a copied value the context's suffix repeats that
        value's source rather than the example's key, so no analogy is found there afresh.
        None where the text went elsewhere."""
        if self._chain is None:
            return None
        base, draft, found, cut = self._chain
        text = inp.text
        if len(text) <= len(base) or not text.startswith(base):
            return None
        done = text[len(base):]
        forced = b"".join(inp.piece(t) for t in inp.forced) if len(inp.forced) else b""
        if forced and draft.startswith(done + forced):
            done, prefix = done + forced, list(inp.forced)
        else:
            prefix = []
        if len(done) >= len(draft) or not draft.startswith(done):
            return None
        if not cut and len(draft) - len(done) < BYTES_PER_TOKEN * self.config.draft_depth:
            # the chain stopped at its length limit where the example went on: go on
            draft, cut = self._chained(base, draft, find_analogy(base + draft))
            self._chain = (base, draft, found, cut)
        # the tokens of the rest begin where `done` ends (the root's or a forced token's end)
        toks = self._rest_tokens(draft[len(done):], inp)
        return self._proposal(prefix + (toks[:-1] if cut else toks), len(prefix), found)

    def _rest_tokens(self, rest: bytes, inp: DraftInput) -> list[int]:
        """The tokens of `rest`, the chain's text still ahead: where the output took whole
        tokens of the rest tokenized last time, the tail of those tokens (one chain is
        resumed step after step, and tokenizing what is left of it again took most of a
        resumed draft's time); else tokenized afresh."""
        last, toks, starts = self._rest
        skip = len(last) - len(rest)  # (the bytes the output took since)
        k = starts.get(skip) if skip >= 0 and last.endswith(rest) else None
        if k is not None:
            return toks[k:]
        assert inp.tokenize is not None and inp.piece is not None
        got = list(inp.tokenize(rest))
        self._rest = (rest, got, token_starts(got, inp.piece))
        return got


def _usable(found: Analogy | None) -> TypeGuard[Analogy]:
    """Only analogies two examples agree on are drafted (one example alone was too often a
    coincidence)."""
    return found is not None and found.confirmed


def _tokens(draft: bytes, head: bytes, found: Analogy, cut: bool, inp: DraftInput
            ) -> list[int]:
    """The tokens of `draft` after its first bytes `head` (the root's), the first copy as its
    source spells it (a model copies a name as its source has it: ` n|smallest` is copied as
    `n|smallest`, while the tokenizer writes `ns|mall|est`; both as one draft each made the
    trees twice as big for one right branch). Where the root begins the value, the value is
    tokenized whole and must begin with the root. With `cut`, the last token is dropped (it
    may be a fragment)."""
    assert inp.tokenize is not None
    rest = draft[len(found.copy):]
    spelt = source_tokens(inp, found.at, found.at + len(found.copy)) if found.verbatim \
        else None
    toks = list(inp.tokenize(draft)) if spelt is None else \
        spelt + (list(inp.tokenize(rest)) if rest else [])
    if head:
        if not toks or toks[0] != inp.root:
            toks = list(inp.tokenize(draft))  # the tokenizer's spelling may begin with it
        toks = toks[1:] if toks and toks[0] == inp.root else \
            list(inp.tokenize(draft[len(head):]))
    return toks[:-1] if cut else toks
