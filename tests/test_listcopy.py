"""List drafts (pure logic): the names of an earlier comma-separated list, continued in the
output's own separators."""

import numpy as np

from srsd_local.config import SRSDConfig
from srsd_local.spec.draft import LIST, DraftInput, acceptance_source
from srsd_local.spec.drafters import make_drafter
from srsd_local.spec.listcopy import ListCopyDrafter, draft_text, find_list_next, find_list_start


def after(text: bytes) -> bytes | None:
    pieces = find_list_next(text)
    return None if pieces is None else draft_text(pieces)

SRC = (b'def rmtree(path, ignore_errors=False, onerror=None, *, dir_fd=None):\n'
       b'    """Recursively delete a directory tree: path, then the rest."""\n\nJSON: '
       b'{"name": "rmtree", "parameters": ["')


def test_the_next_names_of_the_source_list_are_drafted_in_the_outputs_separators():
    # the separator written in full: the next names, defaults and the bare `*` skipped
    assert after(SRC + b'path", "') == b'ignore_errors", "onerror", "dir_fd'
    # the next name begun (by the known next token): its rest, then the others
    assert after(SRC + b'path", "ignore') == b'_errors", "onerror", "dir_fd'
    # the next name complete: the separator and the names after it
    assert after(SRC + b'path", "ignore_errors') == b'", "onerror", "dir_fd'
    # the last name: the list ends there, nothing to draft
    assert after(SRC + b'path", "ignore_errors", "onerror", "dir_fd') is None


def test_a_separator_begun_is_completed_as_the_text_last_completed_one():
    # `",` so far: completed by the most recent separator between two words that begins
    # with it (`", "` between "rmtree" and "parameters")
    assert after(SRC + b'path",') == b' "ignore_errors", "onerror", "dir_fd'


def test_names_in_prose_or_written_as_the_output_writes_them_are_not_lists():
    # `path` in the docstring is followed by prose, not by a list item
    prose = b'"""Delete path and then the rest, quickly."""\nJSON: ["'
    assert after(prose + b'path", "') is None
    # `a, b` in the text written with the output's own separator: a plain lookup drafts it
    assert after(b'f(a, b, c)\nx = [a, ') is None
    # an output separator without a comma: no list (an expression using the names)
    assert after(b"def f(a, b):\n    return a + ") is None
    # no name before the separator, or a separator across a line end
    assert after(b'f(a, b)\n["') is None
    assert after(b'f(a, b)\na\n') is None


def test_annotations_and_nested_defaults_are_skipped():
    src = b"def f(x: int, y: dict[str, int] = {}, *args, z=(1, 2)):\n    pass\n['"
    assert after(src + b"x', '") == b"y', 'args', 'z"


def test_the_drafter_tokenizes_the_draft_and_marks_its_nodes_list():
    cfg = SRSDConfig(draft_depth=6)
    text = SRC + b'path", "'
    inp_tokens = np.frombuffer(text[:-1], dtype=np.uint8).astype(np.int32)
    inp = DraftInput(inp_tokens, text[-1], None, None, text=text,
                     tokenize=lambda b: list(bytes(b)), piece=lambda t: bytes([t]))
    [(toks, weight, agree)] = ListCopyDrafter(cfg).propose(inp)
    assert bytes(list(toks)) == b"ignore"  # draft_depth tokens
    assert 0 < weight < 1 and agree >= 1
    tree = make_drafter("srsd", cfg).draft(inp)
    assert any(o & LIST for o in tree.origin)
    assert acceptance_source(LIST | 16) == "list"
    assert acceptance_source(LIST | 8) == "grammar+list"


def test_separators_are_drafted_as_the_output_spelt_them():
    # the output wrote `", "` as two tokens (`",` and ` "`); the tokenizer has one token for
    # it: the draft spells it as the output did
    pieces = {300: b'",', 301: b' "', 302: b'", "'}

    def piece(t: int) -> bytes:
        return pieces.get(t, bytes([t]) if t < 256 else b"")

    def tokenize(b: bytes) -> list[int]:
        out, i = [], 0
        while i < len(b):
            if b.startswith(b'", "', i):
                out.append(302)
                i += 4
            else:
                out.append(b[i])
                i += 1
        return out

    ctx = list(b'f(a, bb, cc)\n["x') + [300, 301] + list(b"y") + [300, 301] + list(b"a")
    text, ends = b"", []
    for t in ctx:
        text += piece(t)
        ends.append(len(text))
    inp = DraftInput(np.asarray(ctx, dtype=np.int32), 300, None, None, text=text + b'",',
                     tokenize=tokenize, piece=piece, ends=ends)
    [(toks, _, _)] = ListCopyDrafter(SRSDConfig(draft_depth=16)).propose(inp)
    assert list(toks) == [301, ord("b"), ord("b"), 300, 301, ord("c"), ord("c")]


EXAMPLES = (b'def indent(text, prefix, predicate=None):\n    """Add a prefix."""\n\n'
            b'JSON: {"name": "indent", "signature": "indent(text, prefix, predicate=None)", '
            b'"parameters": ["text", "prefix", "predicate"]}\n\n'
            b'def is_zipfile(filename):\n    """Check (quickly) a zip file."""\n\n'
            b'JSON: {"name": "is_zipfile", "signature": "is_zipfile(filename)", '
            b'"parameters": ["filename"]}\n\n'
            b'def rmtree(path, ignore_errors=False, *, dir_fd=None):\n    """Delete."""\n\n'
            b'JSON: {"name": "rmtree", "signature": "rmtree(path, ignore_errors=False, *, '
            b'dir_fd=None)", "parameters": ["')


def start(text: bytes) -> bytes | None:
    pieces = find_list_start(text)
    return None if pieces is None else draft_text(pieces)


def test_a_list_opened_as_earlier_outputs_opened_theirs_copies_the_list_before_it():
    # both examples followed `"parameters": ["` with the names of the list just before it
    # (the signature): so does the current item, in their separator, closed as they closed
    assert start(EXAMPLES) == b'path", "ignore_errors", "dir_fd"]}'
    # the first name begun, or complete
    assert start(EXAMPLES + b'pa') == b'th", "ignore_errors", "dir_fd"]}'
    assert start(EXAMPLES + b'path') == b'", "ignore_errors", "dir_fd"]}'
    # a first name the list does not begin with: nothing
    assert start(EXAMPLES + b'x') is None
    # the prose in brackets of the docstring ("(quickly) a zip file") is passed over


def test_no_list_start_where_an_example_did_not_copy_the_list_before_it():
    other = EXAMPLES.replace(b'"parameters": ["filename"]', b'"parameters": ["fname"]')
    assert start(other) is None
    # no earlier output opened a list this way
    assert start(b'def f(a, b):\n    pass\n\nJSON: {"parameters": ["') is None
    # an opening without a bracket is no list
    assert start(EXAMPLES + b'path", "') is None


def test_a_list_drafted_to_its_end_is_closed_as_the_output_closed_its_earlier_lists():
    # mid-list: the next names, then the closing the examples wrote after their last name
    assert after(EXAMPLES + b'path", "') == b'ignore_errors", "dir_fd"]}'
    # after the last name: only the closing
    assert after(EXAMPLES + b'path", "ignore_errors", "dir_fd') == b'"]}'


def test_a_list_start_survives_a_tree_full_of_the_examples_values():
    # text lookup drafts what followed `"parameters": ["` in the examples (heavier than a
    # structural guess); the list's start must still be in a small tree
    text = EXAMPLES
    tokens = np.frombuffer(text[:-1], dtype=np.uint8).astype(np.int32)
    ends = list(range(1, len(text)))
    inp = DraftInput(tokens, text[-1], None, None, text=text,
                     tokenize=lambda b: list(bytes(b)), piece=lambda t: bytes([t]), ends=ends)
    cfg = SRSDConfig(draft_depth=16, max_nodes=8)
    tree = make_drafter("srsd", cfg).draft(inp, max_nodes=8)
    branch, node = b"", 0
    while node is not None:  # the heaviest path from the root
        kids = tree.children(node)
        node = max(kids, key=lambda c: tree.weights[c]) if kids else None
        branch += b"" if node is None else bytes([tree.tokens[node]])
    assert branch.startswith(b'path"')
    assert any(o & LIST for o in tree.origin)
