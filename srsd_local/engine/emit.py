"""From accepted tokens to text: UTF-8 assembly, stop strings, end-of-generation and
max_tokens, applied token by token exactly as plain decoding applies them."""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from dataclasses import dataclass


def check_stop(stop: str | Sequence[str] | None) -> list[str]:
    """Normalise the `stop` argument; a bad one raises ValueError saying what is accepted."""
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if not all(isinstance(s, str) for s in stop):
        raise ValueError(f"invalid stop={stop!r}: accepted is a string or a list of strings")
    return list(stop)


class TextStream:
    """Incremental detokenizer: never splits a UTF-8 character across chunks."""

    def __init__(self, piece: Callable[[int], bytes]) -> None:
        self._piece = piece
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    @property
    def piece(self) -> Callable[[int], bytes]:
        return self._piece

    def push(self, token: int) -> str:
        return self._dec.decode(self._piece(token))

    def decode(self, data: bytes) -> str:
        """The text of several tokens' bytes at once."""
        return self._dec.decode(data)

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


class StopScanner:
    """Holds back text that may be the start of a stop string; finds the cut point."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.text = ""
        self.sent = 0

    def push(self, delta: str) -> tuple[str, bool]:
        """Add text; return (text safe to send now, whether a stop string was hit)."""
        start = max(0, self.sent - max((len(s) for s in self.stops), default=0))
        self.text += delta
        if self.stops:
            hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
            if hits:
                cut = min(hits)
                out, self.sent = self.text[self.sent: cut], cut
                self.text = self.text[:cut]
                return out, True
        safe = len(self.text)
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:k]):
                    safe = min(safe, len(self.text) - k)
                    break
        safe = max(safe, self.sent)
        out, self.sent = self.text[self.sent: safe], safe
        return out, False

    def flush(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


@dataclass
class Emitted:
    text: str  # text safe to send (a possible stop string is held back)
    token_ids: list[int]
    drafted: list[bool]  # per token: did it come from an accepted draft?
    finish_reason: str | None  # "stop" | "length" when the generation ends here


class Emitter:
    """One generation's output side: feed it each step's accepted tokens."""

    def __init__(self, piece: Callable[[int], bytes], is_eog: Callable[[int], bool],
                 max_tokens: int, stops: Sequence[str]) -> None:
        self.text = TextStream(piece)
        self.scan = StopScanner(stops)
        self.is_eog = is_eog
        self.max_tokens = max_tokens
        self.count = 0

    def push(self, tokens: Sequence[int], drafted: Sequence[bool], out_of_room: bool = False
             ) -> Emitted:
        """Emit tokens in order until EOS, a stop string or max_tokens; `out_of_room`: the
        context cannot take another token, so the generation ends after these."""
        if not self.scan.stops:  # no stop string: the text can be decoded in one go
            return self._push_plain(tokens, drafted, out_of_room)
        ids, flags, chunks, finish, hit = [], [], [], None, False
        for tok, was_draft in zip(tokens, drafted):
            if self.is_eog(tok):
                finish = "stop"
                break
            ids.append(tok)
            flags.append(was_draft)
            self.count += 1
            safe, hit = self.scan.push(self.text.push(tok))
            chunks.append(safe)
            if hit:
                finish = "stop"
                break
            if self.count >= self.max_tokens:
                finish = "length"
                break
        if finish is None and out_of_room:
            finish = "length"
        if finish is not None and not hit:  # release the decoder's tail and held-back text
            safe, hit = self.scan.push(self.text.flush())
            chunks.append(safe if hit else safe + self.scan.flush())
            finish = "stop" if hit else finish
        return Emitted("".join(chunks), ids, flags, finish)

    def _push_plain(self, tokens: Sequence[int], drafted: Sequence[bool], out_of_room: bool
                    ) -> Emitted:
        """`push` without stop strings: the tokens up to EOS or max_tokens, their text
        decoded in one call (what decoding them one by one gives, joined)."""
        n = len(tokens)
        for i, tok in enumerate(tokens):
            if self.is_eog(tok):
                n, finish = i, "stop"
                break
        else:
            finish = None
        if self.count + n >= self.max_tokens and n:
            n, finish = self.max_tokens - self.count, "length"
        ids = list(tokens[:n])
        self.count += n
        piece = self.text.piece
        text = self.text.decode(b"".join([piece(t) for t in ids]))
        if finish is None and out_of_room:
            finish = "length"
        if finish is not None:
            text += self.text.flush()
        return Emitted(text, ids, list(drafted[:n]), finish)
