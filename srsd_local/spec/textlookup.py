"""Text lookup: drafts copied from the context's text, matched by characters, not tokens.

Token-level lookups (prompt lookup, the n-gram pool, hidden-state retrieval's root check) miss a
copy whose tokens differ from the original's while its text does not: a word the prompt writes
as ` shorten` comes out as `short|en` after a quote, a docstring's `\"\"\"Collapse` is quoted as
`"Collapse`, an edited line is re-indented. Here the longest suffix of the context's text (the
known next token included) that occurred earlier is found, and the text that followed it there
is tokenized afresh as the draft. The suffix length is the evidence (`agree`, `weight`), so the
acceptance model learns how far short matches can be trusted. Pure Python (bytes.rfind).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from ..config import SRSDConfig
from .draft import _MAX_AGREE, Drafter, DraftInput, Proposal

MIN_MATCH = 4  # bytes of context text a match must cover
MAX_MATCH = 64  # the longest suffix looked for
MAX_PROPOSALS = 3  # distinct continuations drafted at most
MAX_PER_MATCH = 2  # occurrences of one suffix looked at (the most recent first)
BYTES_PER_TOKEN = 4  # continuation text taken per draft token (about)


class ContextText:
    """The text (bytes) of a context's tokens, kept in step with it: pieces of new positions
    are appended when asked for, and `cut` follows the context back."""

    def __init__(self) -> None:
        self._text = bytearray()
        self._ends: list[int] = []  # per token position: where its piece ends in the text

    def __len__(self) -> int:
        return len(self._ends)

    def cut(self, n: int) -> None:
        """Keep the first n positions."""
        if n < len(self._ends):
            del self._text[(self._ends[n - 1] if n else 0):]
            del self._ends[n:]

    def sync(self, tokens: np.ndarray, piece: Callable[[int], bytes]) -> bytearray:
        """The text of `tokens` (the context: what it held so far is a prefix of it)."""
        ends, text = self._ends, self._text
        for t in tokens[len(ends):].tolist():
            text += piece(t)
            ends.append(len(text))
        return text


def longest_repeat(text: bytes | bytearray, lo: int = MIN_MATCH, hi: int = MAX_MATCH
                   ) -> tuple[int, int]:
    """(length, start) of the longest suffix of `text` (lo..hi bytes) that also occurs ending
    earlier, at its most recent such occurrence; (0, -1) when none of lo bytes does. (A suffix
    that occurs implies all its suffixes do, so the length is found by bisection.)"""
    n = len(text)
    hi = min(hi, n - 1)
    found, at = 0, -1
    while lo <= hi:
        mid = (lo + hi) // 2
        pos = text.rfind(text[n - mid:], 0, n - 1)
        if pos >= 0:
            found, at, lo = mid, pos, mid + 1
        else:
            hi = mid - 1
    return found, at


class TextLookupDrafter(Drafter):
    """Drafts the text that followed the longest repeated suffix of the context's text (its
    most recent occurrences with distinct continuations), and, as an alternative branch, what
    followed a suffix half as long (a copy from elsewhere: after a value the output already
    wrote once, the text that followed it in the prompt)."""

    name = "text"
    origin = 16

    def __init__(self, config: SRSDConfig) -> None:
        super().__init__(config)
        self._cache = TokenCache()

    def propose(self, inp: DraftInput) -> list[Proposal]:
        text, tokenize = inp.text, inp.tokenize
        n = len(text)
        if tokenize is None or n <= MIN_MATCH:
            return []
        length, pos = longest_repeat(text)
        depth = self.config.draft_depth
        span = BYTES_PER_TOKEN * depth + 8
        out: list[Proposal] = []
        seen: set[bytes] = set()
        for size in (length, length // 2):
            if size < MIN_MATCH:
                break
            suffix = text[n - size:]
            at = pos if size == length else text.rfind(suffix, 0, n - 1)
            weight = min(1.0, size / 32)
            agree = min(_MAX_AGREE, max(1, size // BYTES_PER_TOKEN))
            tries = 0
            while at >= 0 and tries < MAX_PER_MATCH and len(out) < MAX_PROPOSALS:
                tries += 1
                start = at + size
                cont = bytes(text[start: start + span])
                if cont[:8] not in seen:
                    seen.add(cont[:8])
                    toks = self._cache.tokens(start, cont, start + span >= n, depth // 2,
                                              tokenize, inp.piece)
                    if toks:
                        out.append((np.asarray(toks[:depth], dtype=np.int32), weight, agree))
                at = text.rfind(suffix, 0, at + size - 1)
        return out


class TokenCache:
    """Tokenizations of continuation texts, reused while a copy goes on: the next step's
    continuation starts a few tokens into the last one's (where the accepted text ended), so
    the rest of that tokenization still serves (a tokenizer call right after a forward pass
    runs on cold caches: about 0.3 ms on a CPU, more than the rest of the drafting)."""

    def __init__(self, size: int = 8) -> None:
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
        toks = list(tokenize(cont))
        if not whole:
            toks = toks[:-1]
        if piece is not None:  # where each token starts in cont -> its index
            at, off = {}, 0
            for i, t in enumerate(toks):
                at[off] = i
                off += len(piece(t))
            self._items.append((start, cont, toks, at))
        return toks
