"""The Python SPM tokenizer (llama/spm.py) on a small vocabulary: merge order, ties, byte
fallback, user-defined tokens, the space prefix. (On the real model it is checked against
llama.cpp's tokenizer in test_model_integration.py.)"""

from __future__ import annotations

from srsd_local.llama.spm import CONTROL, LSTRIP, USER_DEFINED, SpmTokenizer

BYTE = 1 << 5
NORMAL = 1 << 2


def vocab(space_prefix: bool = False, drop_byte: int | None = None, attr_x: int = USER_DEFINED
          ) -> SpmTokenizer | None:
    texts, scores, attrs = [b"<pad>"], [0.0], [CONTROL]
    for b in range(256):
        if b != drop_byte:
            texts.append(f"<0x{b:02X}>".encode())
            scores.append(0.0)
            attrs.append(BYTE)
    words = [("a", 0.0), ("b", 0.0), ("c", 0.0), ("ab", -1.0), ("bc", -0.5), ("abc", -2.0),
             ("\u2581", 0.0), ("\u2581a", -0.1), ("aa", -1.0)]
    for w, s in words:
        texts.append(w.encode())
        scores.append(s)
        attrs.append(NORMAL)
    for w, a in (("<x>", attr_x), ("<xy>", USER_DEFINED), ("<ctl>", CONTROL | USER_DEFINED)):
        texts.append(w.encode())
        scores.append(0.0)
        attrs.append(a)
    return SpmTokenizer.from_vocab(texts, scores, attrs, space_prefix)


def ids(tok: SpmTokenizer, *words: str) -> list[int]:
    return [tok.t.ids[w.encode()] for w in words]


def byte(b: int) -> int:
    return 1 + b  # after <pad>


def test_pairs_merge_highest_score_first_and_ties_go_left():
    tok = vocab()
    assert tok("abc") == ids(tok, "abc")  # bc (-0.5) before ab (-1), then a+bc
    assert tok("ab") == ids(tok, "ab")
    assert tok("ba") == ids(tok, "b", "a")  # no such pair
    assert tok("aaa") == ids(tok, "aa", "a")  # equal scores: the leftmost pair first
    assert tok("") == []


def test_spaces_become_the_space_symbol_and_unknown_text_falls_back_to_bytes():
    tok = vocab()
    assert tok(" a") == ids(tok, "\u2581a")
    assert tok("a b") == ids(tok, "a", "\u2581", "b")
    assert tok("é") == [byte(0xC3), byte(0xA9)]  # not in the vocabulary: its UTF-8 bytes
    assert tok("ad") == ids(tok, "a") + [byte(ord("d"))]


def test_user_defined_tokens_split_the_text_longest_first_but_control_tokens_are_text():
    tok = vocab()
    assert tok("a<x>b<xy>") == ids(tok, "a", "<x>", "b", "<xy>")
    assert tok("<xy><x><x>") == ids(tok, "<xy>", "<x>", "<x>")
    assert tok("<ctl>") == [byte(ord("<")), *ids(tok, "c"), byte(ord("t")), byte(ord("l")),
                            byte(ord(">"))]


def test_a_space_goes_first_at_the_start_and_after_a_token_where_the_vocabulary_asks():
    tok = vocab(space_prefix=True)
    assert tok("a") == ids(tok, "\u2581a")
    assert tok("<x>a") == ids(tok, "<x>", "\u2581a")
    assert vocab()("<x>a") == ids(tok, "<x>", "a")


def test_vocabularies_it_cannot_tokenize_exactly_are_declined():
    assert vocab(drop_byte=0x41) is None  # no byte token for "A"
    assert vocab(attr_x=USER_DEFINED | LSTRIP) is None  # strips the spaces beside it
