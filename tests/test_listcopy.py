"""List drafts (pure logic): the names of an earlier comma-separated list, continued in the
output's own separators."""

import numpy as np

from srsd_local.config import SRSDConfig
from srsd_local.spec.draft import LIST, DraftInput, acceptance_source
from srsd_local.spec.drafters import make_drafter
from srsd_local.spec.listcopy import ListCopyDrafter, draft_text, find_list_next


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
    assert bytes(toks.tolist()) == b"ignore"  # draft_depth tokens
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
    assert toks.tolist() == [301, ord("b"), ord("b"), 300, 301, ord("c"), ord("c")]
