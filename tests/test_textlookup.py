"""Text lookup: drafts matched on the context's characters rather than its tokens (no model);
the real-model check is in test_correctness / test_model_integration."""

from __future__ import annotations

import numpy as np
import pytest
from fakes import FakeBackend

from srsd_local.config import SRSDConfig
from srsd_local.engine import Engine
from srsd_local.spec.drafters import DraftInput, make_drafter
from srsd_local.spec.textlookup import (
    ContextText,
    TextLookupDrafter,
    flat_piece,
    longest_repeat,
)


def _brute(text: bytes, lo: int, hi: int) -> tuple[int, int]:
    n = len(text)
    for size in range(min(hi, n - 1), lo - 1, -1):
        pos = text.rfind(text[n - size:], 0, n - 1)
        if pos >= 0:
            return size, pos
    return 0, -1


@pytest.mark.parametrize("seed", range(40))
def test_longest_repeat_equals_a_brute_force_search(seed):
    rng = np.random.default_rng(seed)
    alphabet = b"ab" if seed % 2 else b"abcd "
    text = bytes(rng.choice(list(alphabet), size=int(rng.integers(2, 200))).tolist())
    assert longest_repeat(text, 1, 64) == _brute(text, 1, 64)


def test_longest_repeat_finds_the_most_recent_occurrence_and_none_below_the_minimum():
    text = b"xx shorten( yy shorten) zz short"
    size, pos = longest_repeat(text)
    assert (size, pos) == (len(b" short"), text.index(b" shorten)"))
    assert longest_repeat(b"abcdefg hij") == (0, -1)
    assert longest_repeat(b"abc abc", lo=4) == (0, -1)  # 3 bytes repeat: below the minimum


def _tok(data: bytes) -> list[int]:  # one token per byte
    return list(data)


def test_the_draft_is_the_text_after_the_match_retokenized_with_a_shorter_match_as_a_branch():
    cfg = SRSDConfig(draft_depth=8)
    text = b'def shorten(text):\n{"name": "shorten", "sig": "short'
    props = TextLookupDrafter(cfg).propose(DraftInput(np.zeros(3, np.int32), 0, None, None,
                                                      text=text, tokenize=_tok))
    conts = [bytes(list(p[0])) for p in props]
    # the longest match (`: "short`, in the name value) first, then the def line's copy
    assert conts[0] == b'en", "si'
    assert b"en(text)" in conts
    assert props[0][2] >= props[-1][2]  # agreement follows the match length
    # a cut-off continuation loses its last token (it may be a fragment of a longer one)
    words = lambda b: [len(w) for w in b.split(b" ")]  # noqa: E731
    longer = TextLookupDrafter(SRSDConfig(draft_depth=2)).propose(DraftInput(
        np.zeros(3, np.int32), 0, None, None, text=b"one two three four five six; one two",
        tokenize=words))
    assert len(longer[0][0]) == 2 and list(longer[0][0]) == words(b" three four")[:2]


def test_no_draft_without_text_tokenizer_or_a_long_enough_repeat():
    d = TextLookupDrafter(SRSDConfig())
    ctx = np.zeros(3, np.int32)
    assert d.propose(DraftInput(ctx, 0, None, None, text=b"abcd abcd")) == []
    assert d.propose(DraftInput(ctx, 0, None, None, text=b"abcdefgh", tokenize=_tok)) == []


def test_srsd_merges_text_drafts_into_its_tree_with_their_origin_bit():
    text = b"alpha beta gamma delta; alpha beta"
    tree = make_drafter("srsd", SRSDConfig(index_backend="numpy")).draft(
        DraftInput(np.asarray([1, 2, 3], np.int32), 7, None, None, text=text, tokenize=_tok))
    assert tree.n_draft > 0 and all(o & 16 for o in tree.origin[1:])
    assert bytes(tree.path_tokens(len(tree) - 1))[:6] == b" gamma"


def test_context_text_follows_appends_and_cuts():
    piece = {1: b"ab", 2: b"c", 3: b"\xc3", 4: b"\xa9!"}.__getitem__
    ct = ContextText()
    assert bytes(ct.sync(np.asarray([1, 2, 3], np.int32), piece)) == b"abc\xc3"
    assert bytes(ct.sync(np.asarray([1, 2, 3, 4], np.int32), piece)) == b"abc\xc3\xa9!"
    ct.cut(2)
    assert len(ct) == 2 and bytes(ct.sync(np.asarray([1, 2, 1], np.int32), piece)) == b"abcab"
    ct.cut(0)
    assert bytes(ct.sync(np.asarray([], np.int32), piece)) == b""


def test_the_collapsed_text_follows_appends_and_cuts_across_piece_boundaries():
    piece = {1: b"a ", 2: b"\n   ", 3: b"b\t\tc", 4: b" ", 5: b"d"}.__getitem__
    ct = ContextText()
    ct.sync(np.asarray([1, 2, 3, 4, 4, 5], np.int32), piece)
    assert bytes(ct.flat) == b"a b c d"  # runs across pieces are one space
    assert ct.flat_with(b"  e\n") == b"a b c d e "
    ct.cut(4)
    assert bytes(ct.flat) == b"a b c " and ct.flat_with(b" x") == b"a b c x"
    ct.sync(np.asarray([1, 2, 3, 4, 5], np.int32), piece)
    assert bytes(ct.flat) == b"a b c d"
    assert flat_piece(b"\n\n  x  y", True) == b"x y" and flat_piece(b"\n", False) == b" "


def test_the_collapsed_text_is_the_whole_text_collapsed_after_any_appends_and_cuts():
    import random
    import re

    rng = random.Random(7)
    alphabet = [b"", b" ", b"\n", b"\t ", b"x", b"y z", b"  w\n", b"\n\nv", b"u "]
    vocab = {t: rng.choice(alphabet) for t in range(40)}
    other = {t: vocab[(t + 1) % 40] for t in vocab}  # a second vocabulary, same ids
    ct = ContextText()
    toks: list[int] = []
    for step in range(300):
        piece = (vocab if step < 150 else other).__getitem__
        if step == 150:
            ct.cut(0)  # (a slot's text is cut before another model's tokens are kept)
            toks = []
        if rng.random() < 0.2:
            del toks[rng.randrange(len(toks) + 1):]
            ct.cut(len(toks))
        toks += [rng.randrange(40) for _ in range(rng.randrange(1, 6))]
        text = bytes(ct.sync(np.asarray(toks, np.int32), piece))
        assert text == b"".join(piece(t) for t in toks)
        assert bytes(ct.flat) == re.sub(rb"\s+", b" ", text)
        assert ct.ends[-1] == len(text)


def test_a_rewrapped_copy_is_drafted_from_the_collapsed_text():
    # a docstring wrapped over lines, quoted as one line: the exact text stops matching at
    # each line end, the collapsed text goes on
    prompt = b"    Collapse and truncate the given\n    text to fit in the given width.\n"
    out = b'"summary": "Collapse and truncate the given'
    text = prompt + out
    ct = ContextText()
    ct.sync(np.asarray(list(text), np.int32), lambda t: bytes([t]))
    d = TextLookupDrafter(SRSDConfig(draft_depth=8))
    inp = DraftInput(np.zeros(3, np.int32), 0, None, None, text=text, flat=bytes(ct.flat),
                     tokenize=_tok)
    # at the line end both continuations are drafted: the exact one and the unwrapped one
    conts = [bytes(list(p[0])) for p in d.propose(inp)]
    assert conts[0].startswith(b"\n    te") and b" text to" in conts
    # once the copy has crossed the line end only the collapsed text still matches that far
    text2 = text + b" text to"
    ct.sync(np.asarray(list(text2), np.int32), lambda t: bytes([t]))
    props = d.propose(DraftInput(np.zeros(3, np.int32), 0, None, None, text=text2,
                                 flat=bytes(ct.flat), tokenize=_tok))
    assert bytes(list(props[0][0])) == b" fit in "
    assert props[0][2] == 8  # the long collapsed match is its evidence
    # without the collapsed text only the exact continuation is drafted
    plain = d.propose(DraftInput(np.zeros(3, np.int32), 0, None, None, text=text,
                                 tokenize=_tok))
    assert [bytes(list(p[0]))[:5] for p in plain] == [b"\n    "]


def test_the_engine_keeps_each_slots_text_equal_to_its_context_through_reuse_and_cuts():
    be = FakeBackend(n_ctx=512)
    eng = Engine(be, SRSDConfig(index_backend="numpy"))
    prompts = ["the cat sat on the mat and the cat sat", "the cat sat on the hat",
               "a dog ran", "the cat sat on the mat and the dog"]
    for p in prompts:
        res = eng.generate(p, max_tokens=24, mode="srsd")
        assert res.stats.tokens > 0
        for slot in eng.slots:
            if len(slot.text):  # drafted from since the last sync: in step with the context
                got = bytes(slot.text.sync(slot.ctx[:slot.n_past], be.piece))
                assert got == b"".join(be.piece(int(t)) for t in slot.ctx[:slot.n_past])


def test_a_copy_in_progress_reuses_the_last_tokenization_from_a_token_boundary():
    from srsd_local.spec.textlookup import TokenCache

    calls = []

    def tokenize(b: bytes) -> list[int]:
        calls.append(b)
        return list(b)  # one token per byte

    cache = TokenCache()
    text = b"0123456789abcdefghij"
    first = cache.tokens(0, text[:12], False, 4, tokenize, lambda t: bytes([t]))
    assert first == list(text[:11]) and len(calls) == 1
    # three tokens accepted: the next continuation starts at byte 3, inside the cached one
    again = cache.tokens(3, text[3:15], False, 4, tokenize, lambda t: bytes([t]))
    assert again == list(text[3:11]) and len(calls) == 1
    # different text at that offset (another context) or too little left: tokenized afresh
    assert cache.tokens(3, b"XYZ" + text[6:15], False, 4, tokenize, lambda t: bytes([t]))[0] == 88
    assert cache.tokens(10, text[10:20], True, 6, tokenize, lambda t: bytes([t])) == \
        list(text[10:20])
    assert len(calls) == 3


def test_a_copy_from_a_token_boundary_outside_a_word_is_drafted_in_the_sources_tokens():
    pieces = {300: b"bar", 301: b", baz"}

    def piece(t: int) -> bytes:
        return pieces.get(t, bytes([t]) if t < 256 else b"")

    def tokenize(b: bytes) -> list[int]:
        raise AssertionError(f"tokenizer called for {b!r}")

    ctx = list(b"call(") + [300, 301] + list(b")\ncall")
    text, ends = b"", []
    for t in ctx:
        text += piece(t)
        ends.append(len(text))
    inp = DraftInput(np.asarray(ctx, dtype=np.int32), ord("("), None, None,
                     text=text + b"(", tokenize=tokenize, piece=piece, ends=ends)
    drafts = [list(p[0]) for p in TextLookupDrafter(SRSDConfig(draft_depth=6)).propose(inp)]
    # `call(` repeats; what followed it began with the source's token `bar`: its tokens, up
    # to the context's end, without a tokenizer call
    assert drafts[0] == [300, 301, ord(")"), ord("\n"), ord("c"), ord("a")]


def test_a_copy_from_inside_a_word_tokenizes_only_the_words_rest_then_the_sources_tokens():
    # the source spells ` shorten(text)` as ` short|en|(|text|)`; the output wrote ` sho`
    # (its own split) and goes on copying: the draft is the word's rest tokenized afresh
    # (`rt|en` here, the tokenizer's split of it), then the source's own tokens from the
    # word start after it; one short tokenizer call, remembered for the next time
    pieces = {300: b" short", 301: b"en", 302: b"text", 310: b"rt", 311: b"sho"}
    vocab = {b"rten": [310, 301]}
    calls = []

    def piece(t: int) -> bytes:
        return pieces.get(t, bytes([t]) if t < 256 else b"")

    def tokenize(b: bytes) -> list[int]:
        calls.append(b)
        return vocab.get(b, list(b))

    ctx = list(b"def") + [300, 301, ord("("), 302, ord(")"), ord(":"), ord("\n")] + \
        list(b"x = ")
    text, ends = b"", []
    for t in ctx:
        text += piece(t)
        ends.append(len(text))
    inp = DraftInput(np.asarray(ctx, dtype=np.int32), 311, None, None,
                     text=text + piece(311), tokenize=tokenize, piece=piece, ends=ends)
    drafter = TextLookupDrafter(SRSDConfig(draft_depth=5))
    drafts = [list(p[0]) for p in drafter.propose(inp)]
    assert drafts[0] == [310, 301, ord("("), 302, ord(")")]
    # (and, as a branch, the source's own split from inside its token: `rt`, then `en`)
    assert [ord("r"), ord("t"), 301, ord("("), 302] in drafts
    assert calls == [b"rten", b"rt"]
    assert [list(p[0]) for p in drafter.propose(inp)] == drafts
    assert calls == [b"rten", b"rt"]  # both remembered


def test_pieces_the_context_holds_between_token_boundaries_take_its_tokens():
    from srsd_local.spec.textlookup import context_tokens

    pieces = {300: b" alpha", 301: b" beta", 302: b"al", 303: b"pha"}
    ctx = [300, 301, ord(";"), 302, 303, ord(" "), ord("x"), 301]
    text, ends = b"", []
    for t in ctx:
        text += pieces.get(t, bytes([t]) if t < 256 else b"")
        ends.append(len(text))
    inp = DraftInput(np.asarray(ctx, dtype=np.int32), 0, None, None, text=text, ends=ends,
                     tokenize=list)
    assert context_tokens(inp, b" beta") == [301]  # the most recent occurrence
    assert context_tokens(inp, b" alpha beta") == [300, 301]  # from the first byte on
    assert context_tokens(inp, b"alpha") == [302, 303]  # the one between boundaries
    assert context_tokens(inp, b"lph") is None  # inside tokens only
    assert context_tokens(inp, b" x") == [ord(" "), ord("x")]
    assert context_tokens(inp, b"gamma") is None
    # the drafter asks the tokenizer only for what the context cannot give
    calls = []

    def tokenize(b: bytes) -> list[int]:
        calls.append(b)
        return list(b)

    fctx = [ord(c) for c in "one  two"] + [301]
    ftext, fends = b"", []
    for t in fctx:
        ftext += pieces.get(t, bytes([t]) if t < 256 else b"")
        fends.append(len(ftext))
    drafter = TextLookupDrafter(SRSDConfig(draft_depth=4))
    got = drafter._tokenizer(DraftInput(np.asarray(fctx, dtype=np.int32), 0, None, None,
                                        text=ftext, ends=fends, tokenize=tokenize))
    assert list(got(b" beta")) == [301] and calls == []
    assert list(got(b" gamma")) == list(b" gamma") and calls == [b" gamma"]
    # a piece that does not begin a word is tokenized afresh, though the context holds it
    assert context_tokens(DraftInput(np.asarray(fctx, dtype=np.int32), 0, None, None,
                                     text=ftext, ends=fends), b"two") == list(b"two")
    assert list(got(b"two")) == list(b"two") and calls == [b" gamma", b"two"]


def test_a_piece_is_collapsed_as_the_regular_expression_collapses_it():
    # pieces without whitespace skip the regular expression: the same bytes either way, on
    # random pieces over whitespace, bytes \s does not match and other bytes
    import random
    import re

    from srsd_local.spec.textlookup import flat_piece

    spaces = re.compile(rb"\s+")
    rng = random.Random(1)
    alphabet = b"ab \t\n\r\x0b\x0c\x1c\x1f\x85\xa0x"
    for _ in range(20000):
        piece = bytes(rng.choice(alphabet) for _ in range(rng.randint(0, 6)))
        for after_space in (False, True):
            want = spaces.sub(b" ", piece)
            if after_space and want[:1] == b" ":
                want = want[1:]
            assert flat_piece(piece, after_space) == want


def test_the_compiled_longest_repeat_equals_the_bisection_over_rfind():
    # the compiled pass (bytes texts) against longest_repeat's definition (bisection with
    # bytes.rfind) on random texts over small alphabets, bounds included; a bytearray takes
    # the bisection itself
    import random

    from srsd_local.spec.textlookup import _repeat, longest_found, longest_repeat

    assert _repeat() is not None  # built with the system's C compiler

    def by_rfind(text, lo, hi):
        n = len(text)
        return longest_found(lambda k: text.rfind(text[n - k:], 0, n - 1), lo, min(hi, n - 1))

    rng = random.Random(3)
    for _ in range(20000):
        alphabet = rng.choice([b"ab", b"abc", b"a b\n", b"abcdefgh"])
        text = bytes(rng.choice(alphabet) for _ in range(rng.randint(0, 120)))
        lo, hi = rng.choice([1, 2, 4, 8]), rng.choice([4, 8, 64, 200])
        want = by_rfind(text, lo, hi)
        assert longest_repeat(text, lo, hi) == want
        assert longest_repeat(bytearray(text), lo, hi) == want
    text = b"x" * 500  # the longest is capped at hi, at its most recent occurrence
    assert longest_repeat(text, 4, 64) == (64, 499 - 64)
