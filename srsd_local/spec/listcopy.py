"""List drafts: the names of a comma-separated list copied in order, in the output's own
separators.

Extraction outputs list names their input wrote as a list with other punctuation: a JSON
`"parameters": ["path", "ignore_errors", "onerror"` from a signature
`(path, ignore_errors=False, onerror=None, *, dir_fd=None)`. A lookup of the context's suffix
finds nothing there (the separators differ) and an analogy has no anchor (each item follows
the one before). Here, where the context ends with a name, a separator and perhaps the start
of the next name, the name is looked for as a member of an earlier comma-separated list; the
draft is the list's next names (defaults `=...` and bare `*` skipped) joined by the output's
separator, up to the list's end. The separator is the one just written when the next name has
begun; otherwise the text written so far is completed by the most recent separator that
begins with it (`",` + ` "`).

Pure Python (bytes.rfind and a short scan, a few microseconds).
"""

from __future__ import annotations

import numpy as np

from ..config import SRSDConfig
from .draft import LIST, Drafter, DraftInput, Proposal
from .textlookup import source_tokens

MAX_SEP = 8  # bytes of a separator between two names
MAX_NAMES = 8  # names drafted at most
TRIES = 8  # earlier occurrences of the last name (as a whole word) looked at
CLOSERS = b")]}\n"
OPENERS = b"([{"
WEIGHT = 0.5  # a guess by structure: weaker than a copy found in the text


def _word(b: int) -> bool:
    return b == 95 or 48 <= b <= 57 or 65 <= b <= 90 or 97 <= b <= 122  # _ 0-9 A-Z a-z


def _item_end(text: bytes, i: int, n: int) -> tuple[int, bool]:
    """Where the list item at i ends (brackets balanced), and whether the list goes on
    there (a comma) rather than ends (a closer, a line end, or `n`)."""
    depth = 0
    while i < n:
        c = text[i]
        if c in OPENERS:
            depth += 1
        elif c in CLOSERS:
            if depth == 0 or c == 10:
                return i, False
            depth -= 1
        elif c == 44 and depth == 0:  # ,
            return i, True
        i += 1
    return n, False


def _plain(rest: bytes) -> bool:
    """What follows a name in a list item: nothing (but quotes), a default or an annotation;
    not prose."""
    rest = rest.strip(b" '\"")
    return not rest or rest[0] in b"=:"


def _names_after(text: bytes, pos: int, limit: int) -> list[tuple[bytes, int]]:
    """The names of the comma-separated list that goes on at `pos` (right after one of its
    names): each item's first word, items without one (`*`) skipped, up to the list's
    closing bracket or line end. An item is a name alone (quoted or not) or with a default
    or annotation (`=...`, `:...`, brackets balanced); anything else ends the list (prose).
    Each name with where it is."""
    names: list[tuple[bytes, int]] = []
    n = min(len(text), limit)
    j, more = _item_end(text, pos, n)
    if not _plain(text[pos:j]):
        return names
    while more and len(names) < MAX_NAMES:
        i = j + 1  # after the comma
        while i < n and text[i] in b" *'\"":
            i += 1
        w = i
        while w < n and _word(text[w]):
            w += 1
        j, more = _item_end(text, w, n)
        if not _plain(text[w:j]):
            break
        if w > i:
            names.append((text[i:w], i))
    return names


def _tail(text: bytes) -> tuple[bytes, bytes, bytes] | None:
    """(the last whole name, the separator after it, the start of the next name) at the end
    of `text`, or None."""
    i = len(text)
    while i and _word(text[i - 1]):
        i -= 1
    start = text[i:]
    j = i
    while j and not _word(text[j - 1]) and i - j < MAX_SEP:
        j -= 1
    sep = text[j:i]
    if not sep or b"\n" in sep or not j or not _word(text[j - 1]):
        return None
    k = j
    while k and _word(text[k - 1]):
        k -= 1
    return text[k:j], sep, start


def _completed(text: bytes, sep: bytes, before: int) -> tuple[bytes, int]:
    """`sep` as the most recent separator between two words before `before` that begins with
    it completes it (itself where none is longer), with where that separator is."""
    at = text.rfind(sep, 0, before)
    while at > 0:
        if _word(text[at - 1]):
            end = at + len(sep)
            while end < before and end - at < MAX_SEP and not _word(text[end]):
                end += 1
            if end < before and _word(text[end]) and b"\n" not in text[at:end]:
                return text[at:end], at
        at = text.rfind(sep, 0, at)
    return sep, len(text) - len(sep)


Piece = tuple[bytes, int]  # a draft's bytes, and where the text has them (their spelling)


def find_list_next(text: bytes) -> list[Piece] | None:
    """What continues the list at the end of `text` (see the module docstring), as pieces
    (the rest of a name or separator, then separators and names in turn), or None where the
    text does not end in a list or its last name is in no earlier comma-separated list."""
    tail = _tail(text)
    if tail is None:
        return None
    name, sep, start = tail
    here = len(text) - len(start) - len(sep) - len(name)
    full = (sep, here + len(name)) if start else _completed(text, sep, here)
    if b"," not in full[0]:
        return None  # not a list the output writes (`a + b` after `f(a, b)`)
    at, tries, looked = here, 0, 0
    while tries < TRIES and looked < 8 * TRIES:
        at = text.rfind(name, 0, at)
        if at < 0:
            return None
        looked += 1
        end = at + len(name)
        if (at and _word(text[at - 1])) or _word(text[end]):
            continue  # not a whole name
        tries += 1
        if text[end:end + len(sep)] == sep:
            continue  # written as the output writes it: a lookup of the suffix drafts that
        names = _names_after(text, end, here)
        if names and names[0][0].startswith(start) and names[0][0] != start:
            break
        if len(names) > 1 and start and names[0][0] == start:
            break
    else:
        return None
    first, pos = names[0]
    out = [(first[len(start):], pos + len(start))] if start else \
        [(full[0][len(sep):], full[1] + len(sep)), (first, pos)]
    for n in names[1:]:
        out += [full, n]
    return [p for p in out if p[0]]


def draft_text(pieces: list[Piece]) -> bytes:
    return b"".join(p for p, _ in pieces)


class ListCopyDrafter(Drafter):
    """Drafts the rest of a list copied name by name (see the module docstring)."""

    name = "list"
    origin = LIST

    def __init__(self, config: SRSDConfig) -> None:
        super().__init__(config)
        self._last: tuple[bytes, list[int]] = (b"", [])
        self._memo: dict[bytes, list[int]] = {}

    def propose(self, inp: DraftInput) -> list[Proposal]:
        if inp.tokenize is None or not inp.text:
            return []
        pieces = find_list_next(inp.text)
        if not pieces:
            return []
        key = draft_text(pieces)
        if self._last[0] != key:
            self._last = (key, self._tokens(pieces, inp))
        toks = self._last[1][: self.config.draft_depth]
        return [(np.asarray(toks, dtype=np.int32), WEIGHT, 2)] if toks else []

    def _tokens(self, pieces: list[Piece], inp: DraftInput) -> list[int]:
        """Each piece in the tokens of the text where it is (the output's own separator as
        the output spelt it: `",| "` where the tokenizer would write `", "` as one token),
        tokenized afresh where the context's tokens are not known there."""
        assert inp.tokenize is not None
        out: list[int] = []
        for piece, pos in pieces:
            got = source_tokens(inp, pos, pos + len(piece), self._memo)
            out += list(inp.tokenize(piece)) if got is None else got
            if len(out) >= self.config.draft_depth:
                break
        return out
