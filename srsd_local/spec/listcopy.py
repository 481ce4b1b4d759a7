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
begins with it (`",` + ` "`). Where the list ends there, the draft goes on with how the
output closed its earlier lists in that separator (`"]}` after the last name).

A list's first name has no name before it to look up. Where the context ends with an opening
(`"parameters": ["`, perhaps with the start of a name) that earlier outputs followed with a
copy of the bracketed list just before them (`["text", "prefix", "predicate"]` after the
example's `indent(text, prefix, predicate=None)`), the draft is the names of the most recent
bracketed list before the current opening, in the examples' separator, then their closing.
Every earlier output so opened that is looked at must have copied its list that way.

Pure Python (bytes.rfind and a short scan, a few microseconds).
"""

from __future__ import annotations

from ..config import SRSDConfig
from .draft import LIST, Drafter, DraftInput, Proposal
from .textlookup import source_tokens

MAX_SEP = 8  # bytes of a separator between two names
MAX_NAMES = 8  # names drafted at most
TRIES = 8  # earlier occurrences of the last name (as a whole word) looked at
CLOSERS = b")]}\n"
OPENERS = b"([{"
WEIGHT = 0.5  # a guess by structure: weaker than a copy found in the text
START_WEIGHT = 8.0  # a list begun as earlier outputs began theirs: the examples' own
# values, which text lookup and retrieval draft there, weigh the sum of their drafts; a
# lighter start is pruned from the tree before the controller sees it


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


def _name_at(text: bytes, i: int, n: int) -> tuple[int, int]:
    """Where the name of a list item beginning at i starts and ends (spaces, quotes and
    `*` before it skipped; an empty span where no name follows)."""
    while i < n and text[i] in b" *'\"":
        i += 1
    w = i
    while w < n and _word(text[w]):
        w += 1
    return i, w


def _names_after(text: bytes, pos: int, limit: int) -> tuple[list[tuple[bytes, int]], bool]:
    """The names of the comma-separated list that goes on at `pos` (right after one of its
    names): each item's first word, items without one (`*`) skipped, up to the list's
    closing bracket or line end. An item is a name alone (quoted or not) or with a default
    or annotation (`=...`, `:...`, brackets balanced); anything else ends the list (prose).
    Each name with where it is; and whether the list was seen to its closing bracket."""
    names: list[tuple[bytes, int]] = []
    n = min(len(text), limit)
    j, more = _item_end(text, pos, n)
    if not _plain(text[pos:j]):
        return names, False
    while more and len(names) < MAX_NAMES:
        i, w = _name_at(text, j + 1, n)  # after the comma
        j, more = _item_end(text, w, n)
        if not _plain(text[w:j]):
            return names, False
        if w > i:
            names.append((text[i:w], i))
    return names, not more and j < n and text[j] in b")]}"


def _recent_list(text: bytes, before: int) -> tuple[list[tuple[bytes, int]], bool] | None:
    """The most recent bracketed list of names that opens before `before` (`(path, mode=1)`,
    `['a', 'b']`; prose in brackets is passed over): its names with where they are, and
    whether it was seen to its closing bracket; None where none is found nearby."""
    at = before
    for _ in range(TRIES):
        at = max(text.rfind(b"(", 0, at), text.rfind(b"[", 0, at))
        if at < 0:
            return None
        i, w = _name_at(text, at + 1, before)
        if w > i:
            names, ended = _names_after(text, w, before)
            if ended or names:
                return [(text[i:w], i), *names], ended
    return None


def _closing(text: bytes, w: int) -> Piece | None:
    """The closing quotes and brackets right after a list's last name (at `w`), with where
    they are; None where no bracket closes there."""
    e = w
    while e < len(text) and e - w < MAX_SEP and text[e] in b"'\")]}":
        e += 1
    close = text[w:e]
    return (close, w) if any(c in b")]}" for c in close) else None


def _output_list(text: bytes, p: int, limit: int) -> tuple[list[bytes], Piece | None,
                                                          Piece | None]:
    """An earlier list as the output wrote it, from its first name at `p`: its names, its
    separator (with where it is; None for a single name) and its closing (None where it
    was not found before `limit`)."""
    names: list[bytes] = []
    sep: Piece | None = None
    while p < limit and len(names) < MAX_NAMES:
        w = p
        while w < limit and _word(text[w]):
            w += 1
        if w == p:
            break
        names.append(text[p:w])
        e = w
        while e < limit and not _word(text[e]) and e - w < MAX_SEP and text[e] != 10:
            e += 1
        if b"," not in text[w:e]:
            return names, sep, _closing(text, w)
        if sep is None:
            sep = (text[w:e].rstrip(b"*"), w)
        elif not text[w:e].startswith(sep[0]):  # (an item may begin with `*`)
            break
        p = e
    return names, sep, None


def _ending(text: bytes) -> tuple[int, int]:
    """Where the text's last run of non-word bytes (at most MAX_SEP) begins, and where the
    word after it (perhaps empty) begins: `text[j:i]` separates, `text[i:]` is begun."""
    i = len(text)
    while i and _word(text[i - 1]):
        i -= 1
    j = i
    while j and not _word(text[j - 1]) and i - j < MAX_SEP:
        j -= 1
    return j, i


def _tail(text: bytes) -> tuple[bytes, bytes, bytes] | None:
    """(the last whole name, the separator after it, the start of the next name) at the end
    of `text`, or None."""
    j, i = _ending(text)
    start, sep = text[i:], text[j:i]
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
    (the rest of a name or separator, then separators and names in turn, then the closing
    where the list ends), or None where the text does not end in a list or its last name is
    in no earlier comma-separated list."""
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
        names, ended = _names_after(text, end, here)
        if names and names[0][0].startswith(start) and names[0][0] != start:
            break
        if start and names and names[0][0] == start and (len(names) > 1 or ended):
            break
    else:
        return None
    first, pos = names[0]
    out = [(first[len(start):], pos + len(start))] if start else \
        [(full[0][len(sep):], full[1] + len(sep)), (first, pos)]
    for n in names[1:]:
        out += [full, n]
    if ended:
        close = _closer(text, full[0], here)
        if close is not None:
            out.append(close)
    return [p for p in out if p[0]] or None


def _closer(text: bytes, sep: bytes, before: int) -> Piece | None:
    """How the output closed its most recent earlier list written with separator `sep`
    (the quotes and brackets after its last name), with where; None where none is found."""
    at = text.rfind(sep, 0, before)
    for _ in range(2 * MAX_NAMES + 4):
        if at < 0:
            return None
        got = _closing(text, _name_at(text, at + len(sep), before)[1])
        if got is not None:
            return got
        at = text.rfind(sep, 0, at)
    return None


def find_list_start(text: bytes) -> list[Piece] | None:
    """Where the text ends with a list's opening (`"parameters": ["`, perhaps with the
    start of a name) that earlier outputs followed with a copy of the bracketed list just
    before them (`["text", "prefix"]` after `indent(text, prefix, predicate=None)`): the
    names of the most recent such list before this opening, in the earlier outputs'
    separator, then their closing. Every earlier output so opened (two are looked at) must
    have copied its list that way; None otherwise."""
    j, i = _ending(text)
    start, opener = text[i:], text[j:i]
    if not j or not opener or b"\n" in opener or b"," in opener or \
            not any(c in b"([" for c in opener):
        return None
    sep: Piece | None = None
    close: Piece | None = None
    confirmed = 0
    at = text.rfind(opener, 0, j)
    for _ in range(TRIES):
        if at < 0 or confirmed == 2:
            break
        p = at + len(opener)
        if p < j and _word(text[p]):
            names, esep, eclose = _output_list(text, p, j)
            src = _recent_list(text, at)
            if src is None or [n for n, _ in src[0][:len(names)]] != names:
                return None  # this opening was not followed by a copy of the list before it
            confirmed += 1
            sep, close = sep or esep, close or eclose
        at = text.rfind(opener, 0, at)
    cur = _recent_list(text, j) if confirmed else None
    if cur is None:
        return None
    if sep is not None:  # spelt as the output spelt it last (its tokens, not the prompt's)
        last = text.rfind(sep[0], 0, j)
        sep = (sep[0], last) if last >= 0 else sep
    names, ended = cur
    first, pos = names[0]
    if not first.startswith(start):
        return None
    out = [(first[len(start):], pos + len(start))]
    for n in names[1:] if sep is not None else []:
        out += [sep, n]
    if close is not None and ended and (sep is not None or len(names) == 1):
        out.append(close)
    return [p for p in out if p[0]] or None


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
        weight, pieces = WEIGHT, find_list_next(inp.text)
        if not pieces:
            weight, pieces = START_WEIGHT, find_list_start(inp.text)
        if not pieces:
            return []
        key = draft_text(pieces)
        if self._last[0] != key:
            self._last = (key, self._tokens(pieces, inp))
        toks = self._last[1][: self.config.draft_depth]
        return [(list(toks), weight, 2)] if toks else []

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
