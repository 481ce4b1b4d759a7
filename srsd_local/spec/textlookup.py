"""Text lookup: drafts copied from the context's text, matched by characters, not tokens.

Token-level lookups (prompt lookup, the n-gram pool, hidden-state retrieval's root check) miss a
copy whose tokens differ from the original's while its text does not: a word the prompt writes
as ` shorten` comes out as `short|en` after a quote, a docstring's `\"\"\"Collapse` is quoted as
`"Collapse`, an edited line is re-indented. Here the longest suffix of the context's text (the
known next token included) that occurred earlier is found, and the text that followed it there
is tokenized afresh as the draft. The suffix length is the evidence (`agree`, `weight`), so the
acceptance model learns how far short matches can be trusted.

The same search also runs on the text with every whitespace run collapsed to one space: a
copy that re-wraps its original (a docstring's wrapped lines quoted as one JSON string, a
paragraph re-flowed, an indented block flattened) breaks the exact match at every line end,
while the collapsed text still matches and its continuation is what an unwrapping copy
writes. The longest repeat is found in one compiled pass where the kernels are built (else
by bisection with bytes.rfind).
"""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Callable, Sequence
from functools import lru_cache

import numpy as np

from ..config import SRSDConfig
from .draft import _MAX_AGREE, TEXT, Drafter, DraftInput, Proposal
from .kernels import repeat_kernel

MIN_MATCH = 4  # bytes of context text a match must cover
MIN_FLAT = 8  # ... of the whitespace-collapsed text (tried when it matches further back)
MAX_MATCH = 64  # the longest suffix looked for
MAX_PROPOSALS = 3  # distinct continuations drafted at most
MAX_PER_MATCH = 2  # occurrences of one suffix looked at (the most recent first)
BYTES_PER_TOKEN = 4  # continuation text taken per draft token (about)
HEAD_TOKENS = 4  # source tokens a copy's head may span to reach a word start (else it is
# tokenized whole)
SPELL = 2  # leading tokens compared: the source's spelling is drafted too where they differ
MEMO_SIZE = 4096  # tokenizations of cut source pieces kept (pieces recur)
_SPACES = re.compile(rb"\s+")
_WHITESPACE = b" \t\n\r\x0b\x0c"  # what \s matches in a bytes pattern
_WORD = re.compile(rb"\w\w")  # two word characters: a place inside a word
_WORDS = re.compile(rb"(?<=\S)(?= \S)")  # before a space that begins a word


def flat_piece(piece: bytes, after_space: bool) -> bytes:
    """`piece` with its whitespace runs collapsed to one space, appended to a collapsed text
    that ends in a space (`after_space`) or not."""
    if piece.translate(None, _WHITESPACE) == piece:  # no whitespace, as most pieces: no
        return piece  # regular expression run for them
    out = _SPACES.sub(b" ", piece)
    return out[1:] if after_space and out[:1] == b" " else out


class ContextText:
    """The text (bytes) of a context's tokens, kept in step with it: pieces of new positions
    are appended when asked for, and `cut` follows the context back."""

    def __init__(self) -> None:
        self._text = bytearray()
        self._ends: list[int] = []  # per token position: where its piece ends in the text
        self.flat = bytearray()  # the text with every whitespace run collapsed to one space
        self._flat_ends: list[int] = []
        # per token: (piece, collapsed after a space, collapsed after anything else), for
        # the `piece` function they came from (a step appends a few dozen tokens, right
        # after a forward pass: a regular expression per piece took 10-15 us a token there)
        self._pieces: dict[int, tuple[bytes, bytes, bytes]] = {}
        self._piece_fn: Callable[[int], bytes] | None = None

    def __len__(self) -> int:
        return len(self._ends)

    def cut(self, n: int) -> None:
        """Keep the first n positions."""
        if n < len(self._ends):
            del self._text[(self._ends[n - 1] if n else 0):]
            del self._ends[n:]
            del self.flat[(self._flat_ends[n - 1] if n else 0):]
            del self._flat_ends[n:]

    def sync(self, tokens: np.ndarray, piece: Callable[[int], bytes]) -> bytearray:
        """The text of `tokens` (the context: what it held so far is a prefix of it)."""
        ends, text, flat, flat_ends = self._ends, self._text, self.flat, self._flat_ends
        if len(tokens) <= len(ends):
            return text
        if piece != self._piece_fn:  # (another vocabulary: its pieces)
            self._pieces, self._piece_fn = {}, piece
        pieces = self._pieces
        space = flat[-1:] == b" "
        for t in tokens[len(ends):].tolist():
            got = pieces.get(t)
            if got is None:
                p = piece(t)
                got = pieces[t] = (p, flat_piece(p, True), flat_piece(p, False))
            text += got[0]
            ends.append(len(text))
            f = got[1] if space else got[2]
            if f:
                flat += f
                space = f[-1] == 32  # (b" ")
            flat_ends.append(len(flat))
        return text

    @property
    def ends(self) -> list[int]:
        """Per token position: where its piece ends in the text (as of the last `sync`;
        the list itself, not a copy)."""
        return self._ends

    def flat_with(self, piece: bytes) -> bytes:
        """The collapsed text (as of the last `sync`) followed by `piece`, collapsed."""
        return bytes(self.flat) + flat_piece(piece, self.flat[-1:] == b" ")


def longest_repeat(text: bytes | bytearray, lo: int = MIN_MATCH, hi: int = MAX_MATCH
                   ) -> tuple[int, int]:
    """(length, start) of the longest suffix of `text` (lo..hi bytes) that also occurs ending
    earlier, at its most recent such occurrence; (0, -1) when none of lo bytes does. (A suffix
    that occurs implies all its suffixes do, so the length is found by bisection; in one
    compiled pass over the text where there is a build, for bytes.)"""
    n = len(text)
    fn = _repeat()
    if fn is not None and type(text) is bytes and lo >= 1:
        got = fn(text, n, lo, hi)
        return (got >> 32, got & 0xFFFFFFFF) if got else (0, -1)
    return longest_found(lambda k: text.rfind(text[n - k:], 0, n - 1), lo, min(hi, n - 1))


@lru_cache(maxsize=1)
def _repeat():
    return repeat_kernel()


def longest_found(found: Callable[[int], int], lo: int, hi: int) -> tuple[int, int]:
    """(the largest k in lo..hi with found(k) >= 0, found(k)) by bisection, for a `found`
    whose success is monotone (k works implies every smaller k does); (0, -1) when lo
    fails."""
    best, at = 0, -1
    while lo <= hi:
        mid = (lo + hi) // 2
        pos = found(mid)
        if pos >= 0:
            best, at, lo = mid, pos, mid + 1
        else:
            hi = mid - 1
    return best, at


def memo_tokens(part: bytes, tokenize: Callable[[bytes], Sequence[int]],
                memo: dict[bytes, list[int]] | None) -> list[int]:
    """The tokens of `part` tokenized afresh, through `memo` when given (the list itself)."""
    got = None if memo is None else memo.get(part)
    if got is None:
        got = list(tokenize(part))
        if memo is not None:
            if len(memo) > MEMO_SIZE:
                memo.clear()
            memo[part] = got
    return got


def tokenize_words(text: bytes, tokenize: Callable[[bytes], Sequence[int]],
                   memo: dict[bytes, list[int]] | None) -> list[int]:
    """The tokens of `text`, tokenized word by word (cut before each space that begins a
    word after a non-space), each word through `memo`: words recur, and a tokenizer call
    right after a forward pass costs with its length (0.1 ms for 8 bytes, 0.3 for 72 on a
    CPU). The same tokens as one call on the whole: tokenizers do not merge across such a
    cut (the default model's: none of 1200 spans of code and prose of 72 bytes differed)."""
    out: list[int] = []
    for word in _WORDS.split(text):
        if word:
            out.extend(memo_tokens(word, tokenize, memo))
    return out


def context_tokens(inp: DraftInput, part: bytes, tries: int = 2) -> list[int] | None:
    """The context's tokens of `part` where one of its `tries` most recent occurrences in
    the context's text begins and ends at token boundaries, else None. (Drafts only: the
    tokenizer gives the same tokens for such a span, or the context spells it as the model
    wrote it, which is how the model copies it.)"""
    text, ends = inp.text, inp.ends
    size = len(part)
    if not len(ends) or not size:
        return None
    at = text.rfind(part, 0, ends[-1])
    while at >= 0 and tries > 0:
        tries -= 1
        first = bisect_right(ends, at)  # the token that holds byte `at`
        last = bisect_left(ends, at + size)  # ... and the one that holds the last byte
        if (ends[first - 1] if first else 0) == at and ends[last] == at + size:
            return inp.tokens[first: last + 1].tolist()
        at = text.rfind(part, 0, at + size - 1)
    return None


def source_tokens(inp: DraftInput, lo: int, end: int, memo: dict | None = None
                  ) -> list[int] | None:
    """The tokens of the context's text[lo:end] as the context has them (a piece the span
    cuts is tokenized afresh, through `memo` when given), or None where the context's tokens
    are not known (a model copies a name as its source spells it: ` n|smallest` is copied
    as `n|smallest`, while the tokenizer writes `ns|mall|est`)."""
    ends, tokenize = inp.ends, inp.tokenize
    if not len(ends) or end > ends[-1] or tokenize is None:
        return None
    k = bisect_right(ends, lo)
    out: list[int] = []
    while lo < end:
        e = ends[k]
        if (ends[k - 1] if k else 0) == lo and e <= end:
            out.append(int(inp.tokens[k]))
        else:
            out.extend(memo_tokens(inp.text[lo: min(e, end)], tokenize, memo))
        lo, k = min(e, end), k + 1
    return out


class TextLookupDrafter(Drafter):
    """Drafts the text that followed the longest repeated suffix of the context's text (its
    most recent occurrences with distinct continuations), and, as an alternative branch, what
    followed a suffix half as long (a copy from elsewhere: after a value the output already
    wrote once, the text that followed it in the prompt); and, when the whitespace-collapsed
    text matches further back than the text itself, what followed there, collapsed."""

    name = "text"
    origin = TEXT

    def __init__(self, config: SRSDConfig) -> None:
        super().__init__(config)
        self._memo: dict[bytes, list[int]] = {}  # pieces and words -> their tokens
        self._cache = TokenCache(self._memo)
        self._flat_cache = TokenCache(self._memo)  # positions in the collapsed text

    def propose(self, inp: DraftInput) -> list[Proposal]:
        text = inp.text
        n = len(text)
        if inp.tokenize is None or n <= MIN_MATCH:
            return []
        length, pos = longest_repeat(text)
        out: list[Proposal] = []
        seen: set[bytes] = set()
        flat, fsize, fat = inp.flat, 0, -1
        if len(flat) > MIN_FLAT:
            fsize, fat = longest_repeat(flat, MIN_FLAT)
        if fsize > length:  # the copy re-wraps: its collapsed text matches further back
            # (first, so that its longer match is the evidence of a continuation both share)
            self._add(out, seen, self._flat_cache, flat, fat + fsize, fsize, inp)
        room = MAX_PROPOSALS - (0 < fsize <= length)  # keep one for the collapsed text
        for size in (length, length // 2):
            if size < MIN_MATCH:
                break
            suffix = text[n - size:]
            at = pos if size == length else text.rfind(suffix, 0, n - 1)
            tries = 0
            while at >= 0 and tries < MAX_PER_MATCH and len(out) < room:
                tries += 1
                self._add(out, seen, self._cache, text, at + size, size, inp)
                at = text.rfind(suffix, 0, at + size - 1)
        if 0 < fsize <= length:  # at a line end the exact copy breaks the line, an
            # unwrapping one goes on with a space: both are drafted
            self._add(out, seen, self._flat_cache, flat, fat + fsize, fsize, inp)
        return out

    def _add(self, out: list[Proposal], seen: set[bytes], cache: TokenCache,
             text: bytes, start: int, size: int, inp: DraftInput) -> None:
        """Propose the text from `start` (after a match of `size` bytes), unless a proposal
        already starts the same way."""
        depth = self.config.draft_depth
        span = BYTES_PER_TOKEN * depth + 8
        cont = bytes(text[start: start + span])
        if cont[:8] in seen or inp.tokenize is None:
            return
        seen.add(cont[:8])
        weight, agree = min(1.0, size / 32), min(_MAX_AGREE, max(1, size // BYTES_PER_TOKEN))
        ends = inp.ends
        if cache is self._cache and len(ends) and start < ends[-1] and \
                (start == 0 or ends[bisect_left(ends, start)] == start) and \
                not (start and _WORD.match(text, start - 1, start + 1)):
            # the copy begins where a token of the source began, outside a word: the
            # source's own tokens are the draft (afresh, the tokenizer gives the same ones,
            # words being tokenized one by one, and a tokenizer call right after a forward
            # pass costs more than the rest of the lookup); inside a word (` n|smallest`)
            # the tokenizer may split the word's rest otherwise (`s|mall|est`): both below
            end = ends[bisect_right(ends, min(start + span, ends[-1])) - 1]  # a token's end
            spelt = source_tokens(inp, start, end, self._memo) if end > start else None
            if spelt:
                out.append((list(spelt[:depth]), weight, agree))
                return
        toks = self._head_then_source(inp, start, span) if cache is self._cache else None
        if toks is None:
            toks = cache.tokens(start, cont, start + span >= len(text), depth // 2,
                                self._tokenizer(inp), inp.piece)
        if toks:
            out.append((list(toks[:depth]), weight, agree))
        if cache is self._cache and toks and len(ends):  # the source's own tokens,
            # where they begin otherwise (a copy that begins inside a source token)
            spelt = source_tokens(inp, start, min(start + span, ends[-1]), self._memo)
            if spelt and spelt[:SPELL] != toks[:SPELL]:
                out.append((list(spelt[:-1][:depth]), weight, agree))


    @staticmethod
    def _tokenizer(inp: DraftInput) -> Callable[[bytes], Sequence[int]]:
        """Tokens of a piece of text: for a word (a piece that begins with a space), the
        context's own where it holds the word between two token boundaries (a text search
        instead of a tokenizer call); else afresh. (A piece that begins inside a word is
        tokenized afresh: there the tokenizer's spelling may differ from the source's, and
        both are drafted.)"""
        fresh = inp.tokenize
        assert fresh is not None

        def tokenize(part: bytes) -> Sequence[int]:
            got = context_tokens(inp, part) if part[:1] == b" " else None
            return fresh(part) if got is None else got

        return tokenize

    def _head_then_source(self, inp: DraftInput, start: int, span: int) -> list[int] | None:
        """The tokens of the context's text from `start` (inside a source token, or inside
        a word) for `span` bytes: the text up to the first word start after it where a
        source token begins, tokenized afresh (a few bytes; pieces recur, so through the
        memo), then the source's own tokens from there (words are tokenized one by one).
        A tokenizer call right after a forward pass costs with its length: 0.1 ms for 8
        bytes, 0.3 for 72 on a CPU. None where no such word start is near."""
        ends, text = inp.ends, inp.text
        if not len(ends) or start >= ends[-1]:
            return None
        limit = min(start + span, ends[-1])
        k = bisect_right(ends, start)
        for b in ends[k: k + HEAD_TOKENS]:
            if b >= limit:
                return None
            if not _WORD.match(text, b - 1, b + 1):
                break
        else:
            return None
        got = memo_tokens(bytes(text[start:b]), self._tokenizer(inp), self._memo)
        end = ends[bisect_right(ends, limit) - 1]  # the last source token that fits
        tail = source_tokens(inp, b, end, self._memo) if end > b else None
        return [*got, *tail] if got and tail else None


class TokenCache:
    """Tokenizations of continuation texts, reused while a copy goes on: the next step's
    continuation starts a few tokens into the last one's (where the accepted text ended), so
    the rest of that tokenization still serves (a tokenizer call right after a forward pass
    runs on cold caches: about 0.3 ms on a CPU, more than the rest of the drafting)."""

    def __init__(self, memo: dict[bytes, list[int]] | None = None, size: int = 8) -> None:
        self._memo = memo  # words -> their tokens (tokenize_words)
        self._items: deque[tuple[int, bytes, list[int], dict[int, int]]] = deque(maxlen=size)

    def tokens(self, start: int, cont: bytes, whole: bool, min_left: int,
               tokenize: Callable[[bytes], Sequence[int]],
               piece: Callable[[int], bytes] | None) -> list[int]:
        """The tokens of `cont` (the text from byte `start` of a context; `whole`: it runs
        to the end of that text, else its last token is dropped as a possible fragment)."""
        for s0, c0, toks, at in self._items:
            k = at.get(start - s0)
            if k is not None and len(toks) - k >= min_left and \
                    c0[start - s0:] == cont[: len(c0) - start + s0]:
                return toks[k:]
        toks = tokenize_words(cont, tokenize, self._memo)
        if not whole:
            toks = toks[:-1]
        if piece is not None:
            self._items.append((start, cont, toks, token_starts(toks, piece)))
        return toks


def token_starts(toks: Sequence[int], piece: Callable[[int], bytes]) -> dict[int, int]:
    """Where each of `toks` starts in their text (its byte offset -> its index): a text
    from one of those offsets on is the tail of `toks` from that index."""
    at, off = {}, 0
    for i, t in enumerate(toks):
        at[off] = i
        off += len(piece(t))
    return at
