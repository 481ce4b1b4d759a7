"""SentencePiece-style ("llama" type) tokenization of short texts in Python: the tokens
llama.cpp's tokenizer gives, without its fixed cost per call.

Drafting tokenizes many short pieces of text (a word, a line's end, what a grammar forces
next). llama.cpp's `llama_tokenize` first scans every special token of the vocabulary for
an occurrence in the text, control tokens included even where it skips them: Gemma 3 has
6,400, and right after a forward pass has flushed the caches that scan alone takes about
0.1-0.2 ms on a CPU, for a text of a few bytes. This is the same algorithm on the same
tables, where the scan is over the few tokens that can match at all:

1. the text is split at the user-defined tokens it contains (control tokens are text here),
   longest first, each one at all its occurrences from left to right;
2. in each remaining piece a space becomes U+2581 (with a space put first, at the start
   and after a token, where the vocabulary asks for one), the piece is split into UTF-8
   characters, and neighbouring symbols are merged while their concatenation is a token,
   highest score first (ties: the leftmost pair);
3. each symbol is its token, else its bytes' byte tokens (`<0xAB>`).

Pure Python on tables the backend reads from llama.cpp once (`SpmTokenizer.from_vocab`).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

SPACE = "\u2581".encode()  # what a space is in an SPM vocabulary's token texts
UNKNOWN, CONTROL, USER_DEFINED = 1 << 0, 1 << 3, 1 << 4  # llama_token_attr bits
LSTRIP, RSTRIP = 1 << 7, 1 << 8  # (not supported: from_vocab declines such a vocabulary)
_UTF8_LEN = (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4)  # by a lead byte's high nibble


@dataclass(frozen=True)
class SpmTables:
    """What the algorithm needs of a vocabulary."""

    ids: dict[bytes, int]  # token text -> id (for a text several tokens have: the last id)
    scores: Sequence[float]  # per id
    user_defined: Sequence[bytes]  # texts of the user-defined tokens, longest first
    byte_ids: Sequence[int]  # per byte value: its token
    space_prefix: bool = False  # a space put before the text (where a vocabulary asks)


class SpmTokenizer:
    def __init__(self, tables: SpmTables) -> None:
        self.t = tables
        self._user = {text: tables.ids[text] for text in tables.user_defined}
        # the user-defined tokens by their first two bytes (longest first): a text can
        # only contain those whose first two bytes it contains
        self._by_head: dict[bytes, list[bytes]] = {}
        for text in tables.user_defined:
            self._by_head.setdefault(text[:2], []).append(text)
        self._rank = {text: i for i, text in enumerate(tables.user_defined)}

    def __call__(self, text: str | bytes) -> list[int]:
        """The tokens of `text` (no BOS; special-token text tokenized as text)."""
        data = text.encode("utf-8") if isinstance(text, str) else text
        out: list[int] = []
        if not data:
            return out
        after_token = True  # (the text's start counts as one)
        for piece, token in self._partition(data):
            if token is not None:
                out.append(token)
            else:
                if self.t.space_prefix and after_token:
                    piece = b" " + piece
                self._pieces(piece.replace(b" ", SPACE), out)
            after_token = token is not None
        return out

    def _partition(self, data: bytes) -> list[tuple[bytes, int | None]]:
        """The text as pieces of text and user-defined tokens, in order."""
        found = [t for head, texts in self._by_head.items() if head in data for t in texts
                 if t in data]
        if not found:
            return [(data, None)]
        found.sort(key=self._rank.__getitem__)
        parts: list[tuple[bytes, int | None]] = [(data, None)]
        for special in found:  # longest first
            token = self._user[special]
            nxt: list[tuple[bytes, int | None]] = []
            for piece, tok in parts:
                if tok is not None or special not in piece:
                    nxt.append((piece, tok))
                    continue
                chunks = piece.split(special)
                for i, chunk in enumerate(chunks):
                    if i:
                        nxt.append((special, token))
                    if chunk:
                        nxt.append((chunk, None))
            parts = nxt
        return parts

    def _pieces(self, text: bytes, out: list[int]) -> None:
        """Step 2 and 3 of the module's algorithm on one piece of text."""
        ids, scores = self.t.ids, self.t.scores
        starts, ends = [], []  # per symbol: its bytes text[start:end]
        i, n = 0, len(text)
        while i < n:
            starts.append(i)
            i = min(n, i + _UTF8_LEN[text[i] >> 4])
            ends.append(i)
        m = len(starts)
        nxt = list(range(1, m)) + [-1]
        prev = list(range(-1, m - 1))
        alive = [True] * m
        heap: list[tuple[float, int, int, int]] = []  # (-score, left, right, size)

        def pair(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            tok = ids.get(text[starts[left]: ends[right]])
            if tok is not None:
                heap.append((-scores[tok], left, right, ends[right] - starts[left]))

        for k in range(1, m):
            pair(k - 1, k)
        heapq.heapify(heap)
        push, pop = heapq.heappush, heapq.heappop
        while heap:
            _, left, right, size = pop(heap)
            if not (alive[left] and alive[right]) or ends[right] - starts[left] != size or \
                    nxt[left] != right:
                continue
            ends[left] = ends[right]  # the right symbol merged into the left one
            alive[right] = False
            after = nxt[right]
            nxt[left] = after
            if after >= 0:
                prev[after] = left
            for a, b in ((prev[left], left), (left, after)):
                if a >= 0 and b >= 0:
                    tok = ids.get(text[starts[a]: ends[b]])
                    if tok is not None:
                        push(heap, (-scores[tok], a, b, ends[b] - starts[a]))
        k = 0
        byte_ids = self.t.byte_ids
        while k >= 0:
            sym = text[starts[k]: ends[k]]
            tok = ids.get(sym)
            if tok is not None:
                out.append(tok)
            else:
                out.extend(byte_ids[b] for b in sym)
            k = nxt[k]

    @classmethod
    def from_vocab(cls, texts: Sequence[bytes], scores: Sequence[float],
                   attrs: Sequence[int], space_prefix: bool = False) -> SpmTokenizer | None:
        """From a vocabulary's token texts, scores and attributes (llama_token_attr), or
        None where it lacks a byte token for some byte or has user-defined tokens that
        strip the spaces beside them."""
        ids: dict[bytes, int] = {}
        for i, text in enumerate(texts):
            ids[text] = i
        byte_ids = []
        for b in range(256):
            tok = ids.get(f"<0x{b:02X}>".encode(), ids.get(bytes([b])))
            if tok is None:
                return None
            byte_ids.append(tok)
        user = [t for t, a in zip(texts, attrs)
                if a & USER_DEFINED and not a & (CONTROL | UNKNOWN) and t]
        if any(a & USER_DEFINED and a & (LSTRIP | RSTRIP) for a in attrs):
            return None
        user = sorted(dict.fromkeys(user), key=len, reverse=True)
        return cls(SpmTables(ids, list(scores), user, byte_ids, space_prefix))
