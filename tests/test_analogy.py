"""Analogy drafts (pure logic): an example's copied value traced to its source, and the same
place in the current item drafted."""

import numpy as np

from srsd_local.config import SRSDConfig
from srsd_local.spec.analogy import AnalogyDrafter, find_analogy
from srsd_local.spec.draft import DraftInput
from srsd_local.spec.drafters import make_drafter

HEAD = b"Describe each function.\n\n"


def item(name: str, args: str, doc: str, done: bool = True) -> bytes:
    src = f'Function:\ndef {name}({args}):\n    """{doc}\n    """\n\nJSON: '.encode()
    if not done:
        return src
    return src + (f'{{"name": "{name}", "signature": "{name}({args})", "summary": "{doc}"}}'
                  "\n\n").encode()


TWO = HEAD + item("indent", "text, prefix", "Adds a prefix to lines.") + \
    item("is_zipfile", "filename", "Quickly see if a file is a ZIP file.")
CURRENT = item("shorten", "text, width", "Collapse and truncate the text.", done=False)


def test_the_name_and_signature_of_the_current_item_are_drafted_by_analogy():
    found = find_analogy(TWO + CURRENT + b'{"name": "')
    assert found is not None and found.confirmed
    assert found.copy == b"shorten"  # up to the byte that ended the example's copy: "("
    assert found.literal.startswith(b'", "signature": "')
    found = find_analogy(TWO + CURRENT + b'{"name": "shorten", "signature": "')
    assert found is not None and found.copy == b"shorten(text, width)"
    found = find_analogy(TWO + CURRENT +
                         b'{"name": "shorten", "signature": "shorten(text, width)", '
                         b'"summary": "')
    assert found is not None and found.copy == b"Collapse and truncate the text."
    assert found.literal.startswith(b'"}')


def test_one_example_is_not_confirmed_and_no_repeat_finds_nothing():
    one = HEAD + item("is_zipfile", "filename", "Quickly see if a file is a ZIP file.")
    found = find_analogy(one + CURRENT + b'{"name": "')
    assert found is not None and found.copy == b"shorten" and not found.confirmed
    assert find_analogy(b"nothing here repeats at all, not a single run of bytes") is None
    # in the middle of a value copied already, the suffix repeats the source: no analogy
    assert find_analogy(TWO + CURRENT + b'{"name": "shorten", "signature": "shorten(te') is None


def byte_input(text: bytes, root: int) -> DraftInput:
    """A context whose tokens are its bytes; `root` (a byte) is the known next token."""
    full = text + bytes([root])
    return DraftInput(np.frombuffer(text, dtype=np.uint8).astype(np.int32), root, None, None,
                      text=full, tokenize=lambda b: list(bytes(b)),
                      piece=lambda t: bytes([t]))


def test_the_drafter_drafts_the_rest_of_a_value_its_known_first_token_began():
    drafter = AnalogyDrafter(SRSDConfig(draft_depth=12))
    ctx = TWO + CURRENT + b'{"name": "'
    [(toks, weight, agree)] = drafter.propose(byte_input(ctx, ord("s")))
    assert bytes(list(toks)) == b'horten", "si'  # draft_depth bytes
    assert 0 < weight <= 1 and agree >= 1
    # the root contradicts the analogy: nothing
    assert drafter.propose(byte_input(ctx, ord("x"))) == []
    # one example only: not drafted (unconfirmed analogies are too often wrong)
    one = HEAD + item("is_zipfile", "filename", "Quickly see if a file is a ZIP file.")
    assert drafter.propose(byte_input(one + CURRENT + b'{"name": "', ord("s"))) == []


def test_the_default_mode_merges_analogy_drafts_into_its_tree():
    cfg = SRSDConfig(draft_depth=8)
    tree = make_drafter("srsd", cfg).draft(byte_input(TWO + CURRENT + b'{"name": "',
                                                      ord("s")))
    paths = set()
    for leaf in range(len(tree)):
        if not tree.children(leaf):
            path, i = [], leaf
            while i:
                path.append(tree.tokens[i])
                i = tree.parents[i]
            paths.add(bytes(reversed(path)))
    assert any(p.startswith(b"horten") for p in paths), paths
    assert any(o & AnalogyDrafter.origin for o in tree.origin)


def test_a_literal_ends_where_the_example_copies_again_and_drafts_chain_through_it():
    found = find_analogy(TWO + CURRENT + b'{"name": "')
    assert found.literal == b'", "signature": "' and found.more
    drafter = AnalogyDrafter(SRSDConfig(draft_depth=100))
    [(toks, _, _)] = drafter.propose(byte_input(TWO + CURRENT + b'{"name": "', ord("s")))
    assert bytes(list(toks)).startswith(
        b'horten", "signature": "shorten(text, width)", "summary": "Collapse and truncate')


def test_a_value_after_text_a_grammar_forces_is_drafted_after_it():
    drafter = AnalogyDrafter(SRSDConfig(draft_depth=60))
    ctx = TWO + CURRENT + b'{"name": "shorten"'
    inp = byte_input(ctx, ord(","))
    assert drafter.propose(inp) == []  # the suffix is no example's key yet
    inp.forced = list(b' "signature": "')
    [(toks, _, _)] = drafter.propose(inp)
    assert bytes(list(toks)).startswith(b' "signature": "shorten(text, width)", "summary')


PIECES = {256: b" n", 257: b"smallest", 258: b"ns", 259: b"mall", 260: b"est"}


def toy_tokenize(text: bytes) -> list[int]:
    """Bytes, except that `ns`, `mall` and `est` are one token each (greedy)."""
    out, i = [], 0
    while i < len(text):
        for t in (258, 259, 260):
            if text.startswith(PIECES[t], i):
                out.append(t)
                i += len(PIECES[t])
                break
        else:
            out.append(text[i])
            i += 1
    return out


def test_a_copied_name_is_also_drafted_in_the_tokens_of_its_source():
    # the prompt spells the current function's name ` n|smallest`; the tokenizer would
    # write the name alone as `ns|mall|est`, the model copies its source's tokens
    src = item("nsmallest", "n, iterable", "Find the n smallest.", done=False)
    cut = src.index(b" nsmallest")
    ctx = list(TWO) + list(src[:cut]) + [256, 257] + list(src[cut + 10:]) + list(b'{"name": "')

    def piece(t: int) -> bytes:
        return PIECES.get(t, bytes([t]) if t < 256 else b"")

    text, ends = b"", []
    for t in ctx:
        text += piece(t)
        ends.append(len(text))
    drafter = AnalogyDrafter(SRSDConfig(draft_depth=8))
    inp = DraftInput(np.asarray(ctx, dtype=np.int32), ord("n"), None, None,
                     text=text + b"n", tokenize=toy_tokenize, piece=piece, ends=ends)
    proposals = drafter.propose(inp)  # the root `n` began the value as the source spells it
    assert [list(p[0])[:2] for p in proposals] == [[257, ord('"')]]
    # `{"name"` + the root `:`, and the grammar forces ` "`: the source's spelling
    inp = DraftInput(np.asarray(ctx[:-3], dtype=np.int32), ord(":"), None, None,
                     text=text[:-3] + b":", tokenize=toy_tokenize, piece=piece,
                     ends=ends[:-3], forced=[ord(" "), ord('"')])
    heads = sorted(list(p[0])[:5] for p in drafter.propose(inp))
    assert heads == [[32, 34, ord("n"), 257, 34]]


def test_analogy_nodes_are_judged_under_one_key_whatever_else_proposed_them():
    from srsd_local.spec.draft import ANALOGY, GRAMMAR, RETRIEVAL, acceptance_source
    text, ngram = 16, 2
    assert acceptance_source(ANALOGY | text | ngram) == "analogy"
    assert acceptance_source(ANALOGY | GRAMMAR | text) == "grammar+analogy"
    assert acceptance_source(RETRIEVAL | ANALOGY) == "srsd"  # retrieval's key comes first
    assert acceptance_source(text | ngram) == "ngram+text"


def test_the_example_the_suffix_matches_longest_may_be_the_first_and_is_still_confirmed():
    # `insert", "signature": "` repeats 18 bytes of the first example (`indent`) and fewer of
    # the second: the second must still confirm it, and the counterpart is in the current
    # item, not in the second example
    current = item("insert", "a, x", "Insert item x in list a.", done=False)
    found = find_analogy(TWO + current + b'{"name": "insert", "signature": "')
    assert found is not None and found.confirmed
    assert found.copy == b"insert(a, x)"


def test_text_lookup_also_drafts_a_copy_as_its_source_spells_it():
    from srsd_local.spec.textlookup import TextLookupDrafter

    def piece(t: int) -> bytes:
        return PIECES.get(t, bytes([t]) if t < 256 else b"")

    ctx = list(b"def") + [256, 257] + list(b"(n, iterable):\n    pass\n\nx = def")
    text, ends = b"", []
    for t in ctx:
        text += piece(t)
        ends.append(len(text))
    inp = DraftInput(np.asarray(ctx, dtype=np.int32), 256, None, None,
                     text=text + b" n", tokenize=toy_tokenize, piece=piece, ends=ends)
    drafts = [list(p[0]) for p in TextLookupDrafter(SRSDConfig(draft_depth=6)).propose(inp)]
    # after `def n` the source went on with its token `smallest`; the tokenizer would write
    # `s|mall|est`: both are drafted
    assert [257, ord("("), ord("n")] in [d[:3] for d in drafts]
    assert [ord("s"), 259, 260] in [d[:3] for d in drafts]


def test_a_chain_stops_where_the_next_value_has_no_counterpart():
    # the current function has no docstring: the summary cannot be traced, the chain ends
    # after the signature's literal
    current = b"Function:\ndef shorten(text, width):\n    pass\n\nJSON: "
    drafter = AnalogyDrafter(SRSDConfig(draft_depth=100))
    [(toks, _, _)] = drafter.propose(byte_input(TWO + current + b'{"name": "', ord("s")))
    draft = bytes(list(toks))
    assert draft.startswith(b'horten", "signature": "shorten(text, width)", "summary')
    assert b"Quickly" not in draft and b"Adds" not in draft


def test_a_chain_cut_at_the_draft_depth_goes_on_where_the_model_followed_it():
    drafter = AnalogyDrafter(SRSDConfig(draft_depth=12))
    ctx = TWO + CURRENT + b'{"name": "'
    [(toks, _, _)] = drafter.propose(byte_input(ctx, ord("s")))
    assert bytes(list(toks)) == b'horten", "si'
    # the model accepted that and chose `g`: in the middle of the key, where no analogy is
    # found afresh, the rest of the chain is drafted
    ctx += b's' + bytes(list(toks))
    assert find_analogy(ctx + b"g") is None or not find_analogy(ctx + b"g").confirmed
    [(toks, _, _)] = drafter.propose(byte_input(ctx, ord("g")))
    assert bytes(list(toks)) == b'nature": "sh'
    # two steps on, in the middle of the signature's value: still the chain, drafted on
    # past its first length limit
    ctx += b"g" + bytes(list(toks)) + b"o"
    [(toks, _, _)] = drafter.propose(byte_input(ctx, ord("r")))
    assert bytes(list(toks)) == b'ten(text, wi'
    # the model went elsewhere: nothing from the chain
    assert drafter.propose(byte_input(ctx + b"rten(x", ord(","))) == []


def test_a_paragraph_the_examples_copied_whole_is_copied_whole_across_its_line_breaks():
    # the examples' summaries are their docstrings' first paragraphs (one line each, a
    # blank line after); the current one runs over two lines: copied up to its blank line,
    # its line break written as a space, then what the examples wrote after theirs
    def para(name: str, args: str, doc: str, rest: str, summary: str) -> bytes:
        return (f'Function:\ndef {name}({args}):\n    """{doc}\n\n    {rest}\n    """\n\n'
                f'JSON: {{"name": "{name}", "summary": "{summary}"}}\n\n').encode()

    two = HEAD + para("indent", "text", "Adds a prefix to lines.", "More.",
                      "Adds a prefix to lines.") + \
        para("is_zipfile", "f", "Quickly see if a file is a ZIP file.", "Other.",
             "Quickly see if a file is a ZIP file.")
    current = (b'Function:\ndef which(cmd):\n    """Given a command, return the path which\n'
               b'    conforms to the given mode.\n\n    Rest.\n    """\n\nJSON: ')
    found = find_analogy(two + current + b'{"name": "which", "summary": "')
    assert found is not None and found.confirmed and not found.verbatim
    assert found.copy == b"Given a command, return the path which conforms to the given mode."
    assert found.literal.startswith(b'"}')
    # tokenized as written, not in the source's tokens (which hold the line break)
    drafter = AnalogyDrafter(SRSDConfig(draft_depth=200))
    [(toks, _, _)] = drafter.propose(byte_input(two + current + b'{"name": "which", "summary": ',
                                                ord('"')))
    assert bytes(list(toks)).startswith(b"Given a command, return the path which conforms")


def test_a_resumed_chain_takes_the_tail_of_its_last_tokens_instead_of_tokenizing_again():
    calls: list[bytes] = []

    def counted(text: bytes, root: int) -> DraftInput:
        inp = byte_input(text, root)
        inp.tokenize = lambda b: calls.append(bytes(b)) or list(bytes(b))
        return inp

    drafter = AnalogyDrafter(SRSDConfig(draft_depth=32))
    ctx, root = TWO + CURRENT + b'{"name": "', ord("s")
    [(toks, _, _)] = drafter.propose(counted(ctx, root))
    drafts = []
    for took in (3, 4, 2):  # the model takes that many drafted tokens, then the next one
        ctx, root = ctx + bytes([root, *toks[:took]]), toks[took]
        [(toks, _, _)] = drafter.propose(counted(ctx, root))
        drafts.append(bytes(toks))
        if took == 3:
            tokenized = len(calls)  # (this resumption extended the chain: tokenized)
    assert drafts == [b'en", "signature": "shorten(text,', b'"signature": "shorten(text, widt',
                      b'gnature": "shorten(text, width)"']
    assert len(calls) == tokenized  # the next two steps along the chain: no tokenizer call


def test_the_tail_of_the_last_tokens_serves_only_where_the_output_took_whole_tokens():
    calls: list[bytes] = []
    inp = byte_input(b"xyz", ord("a"))
    inp.tokenize = lambda b: calls.append(bytes(b)) or list(bytes(b))
    inp.piece = lambda t: b"ab" if t == 1000 else bytes([t])
    drafter = AnalogyDrafter(SRSDConfig())
    drafter._rest = (b"abcd", [1000, ord("c"), ord("d")], {0: 0, 2: 1, 3: 2})
    assert drafter._rest_tokens(b"cd", inp) == [ord("c"), ord("d")] and not calls
    drafter._rest = (b"abcd", [1000, ord("c"), ord("d")], {0: 0, 2: 1, 3: 2})
    assert drafter._rest_tokens(b"bcd", inp) == list(b"bcd") and calls == [b"bcd"]
    assert drafter._rest_tokens(b"zz", inp) == list(b"zz") and calls[-1] == b"zz"
