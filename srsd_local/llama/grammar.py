"""Output constraints on llama.cpp's own grammar engine: GBNF grammars, JSON schemas (through
llama-cpp-python's JSON-schema-to-GBNF converter) and "any JSON object".

`Constraint` is a validated, compiled constraint (one per distinct grammar, cached);
`GrammarState` is one request's position in it: which tokens may come next (`mask`), advance
along an emitted token (`accept`), copy for a tree branch (`clone`). llama.cpp's grammar
sampler does the matching; this module only feeds it candidate tokens, a few at a time:
checking all 262k tokens of a vocabulary costs about 0.1 s, one token about 7 us.

`possible` names a small superset of the tokens a state admits (from which characters it
admits next), so the best admitted token is found without checking the model's favourites
one by one when the grammar rules them all out (the first `{` of a JSON object, a `,` after
a value: tens of milliseconds before, about one now).

`forced_text` finds what the grammar admits next when there is no choice (keys of a schema,
punctuation, closing brackets): those characters are drafted, and verified like any draft;
`Forcing` keeps one request's forced text and whitespace style across steps.

`prune` (a drafted tree's check) and `forced_text` make dozens of calls into llama.cpp's
grammar each; where a C compiler is there they are made from one compiled call
(`_grammar.c`), else from Python.
"""

from __future__ import annotations

import ctypes
import io
import json
import os
import re
import tempfile
import threading
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any, NamedTuple

import numpy as np

from .. import store
from .backend import _llama

_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
# characters probed for forced text: every printable ASCII character and the whitespace
PROBE_CHARS = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
_STDERR_LOCK = threading.Lock()


class _Fns(ctypes.Structure):
    """`_grammar.c`'s `struct fns`: llama.cpp's sampler functions it calls."""

    _fields_ = [("apply", ctypes.c_void_p), ("accept", ctypes.c_void_p),
                ("clone", ctypes.c_void_p), ("release", ctypes.c_void_p)]


class _RunCheck(ctypes.Structure):
    """`_grammar.c`'s `struct run_check`: a grammar state's check of a run's tokens."""

    _fields_ = [("f", ctypes.c_void_p), ("st", ctypes.c_void_p), ("stop_forced", ctypes.c_int32),
                ("ids", ctypes.c_void_p), ("chars", ctypes.c_void_p), ("n", ctypes.c_int32),
                ("eog", ctypes.c_void_p), ("n_eog", ctypes.c_int32),
                ("sentinels", ctypes.c_void_p), ("n_sent", ctypes.c_int32)]


class _Kernels(NamedTuple):
    """`_grammar.c`'s functions, and llama.cpp's functions they call (`fns`)."""

    prune: Any
    forced: Any
    fns: _Fns
    take: Any
    run_check: int  # the address of srsd_grammar_run_check (called from _argmax.c's run)


@lru_cache(maxsize=1)
def _compiled() -> _Kernels | None:
    """`_grammar.c`'s functions and llama.cpp's functions for them, or None where it cannot
    be built (then the checks are made from Python)."""
    src = resources.files("srsd_local.llama").joinpath("_grammar.c").read_bytes()
    lib = store.load_compiled("grammar", src, ((("-O2", "-march=native"), True),
                                               (("-O2",), False)))
    if lib is None:
        return None
    L = _llama()
    fns = _Fns(*(ctypes.cast(getattr(L, f"llama_sampler_{name}"), ctypes.c_void_p).value
                 for name in ("apply", "accept", "clone", "free")))
    ptr = ctypes.c_void_p
    prune = lib.srsd_grammar_prune
    prune.argtypes = [ptr, ptr, ctypes.c_int32, ptr, ptr, ptr, ptr]
    prune.restype = ctypes.c_int32
    forced = lib.srsd_grammar_forced
    forced.argtypes = [ptr, ptr, ctypes.c_int32, ptr, ptr, ctypes.c_int32, ptr,
                       ctypes.c_int32, ptr, ctypes.c_int32, ptr, ctypes.c_int32, ptr]
    forced.restype = ctypes.c_int32
    take = lib.srsd_grammar_take
    take.argtypes = [ptr, ptr, ctypes.c_int32]
    take.restype = ctypes.c_int32
    run_check = ctypes.cast(lib.srsd_grammar_run_check, ctypes.c_void_p).value
    return _Kernels(prune, forced, fns, take, run_check)


def prepare_kernels() -> bool:
    """Build (on first use on this machine, ~0.3 s of a compiler) and load `_grammar.c` now,
    so that the first request under a grammar does not pay for it in its steps; whether
    there is a build."""
    return _compiled() is not None


class GrammarError(ValueError):
    """A grammar or JSON schema that cannot be used; the message says what is wrong."""


def _stderr_of(fn: Callable[[], Any]) -> tuple[Any, str]:
    """Run fn with file descriptor 2 captured (llama.cpp's grammar parser prints its errors
    there); returns (result, what it printed)."""
    with _STDERR_LOCK, tempfile.TemporaryFile() as tmp:
        saved = os.dup(2)
        try:
            os.dup2(tmp.fileno(), 2)
            result = fn()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        return result, tmp.read().decode("utf-8", "replace")


def schema_error(schema: Any) -> str | None:
    """None for a valid JSON schema, else "at PATH: what is wrong"."""
    from jsonschema import Draft202012Validator, SchemaError  # noqa: PLC0415

    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        return f"at {'/'.join(str(p) for p in exc.path) or '(top level)'}: {exc.message}"
    return None


def schema_to_gbnf(schema: Any) -> str:
    """A JSON schema (dict or JSON text) -> GBNF; a bad schema raises GrammarError."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf  # noqa: PLC0415

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"json_schema is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("json_schema must be a JSON object (a JSON schema), got "
                           f"{type(schema).__name__}")
    problem = schema_error(schema)
    if problem is not None:
        raise GrammarError(f"invalid json_schema {problem}")
    try:
        gbnf = json_schema_to_gbnf(json.dumps(schema))
    except Exception as exc:  # noqa: BLE001 - the converter raises assorted errors
        raise GrammarError(f"json_schema cannot be turned into a grammar: {exc}") from None
    # JSON strings cannot hold raw control characters; the converter's `char` rule admits
    # them (a raw newline would make the output invalid JSON), so exclude them
    return gbnf.replace(_LOOSE_CHAR, _JSON_CHAR)


_LOOSE_CHAR = 'char ::= [^"\\\\] |'
_JSON_CHAR = 'char ::= [^"\\\\\\x00-\\x1F\\x7F] |'


@dataclass(frozen=True)
class ConstraintSpec:
    """What a request asked for: a GBNF grammar, or a JSON schema, or any JSON object."""

    kind: str  # "grammar" | "json_schema" | "json_object"
    gbnf: str
    schema: Any = None  # the JSON schema (for validating outputs), when there is one

    @classmethod
    def make(cls, grammar: str | None = None, json_schema: Any = None,
             json_object: bool = False) -> ConstraintSpec | None:
        """The one constraint given (None if none); two at once is an error."""
        given = [n for n, v in (("grammar", grammar), ("json_schema", json_schema),
                                ("json_object", json_object or None)) if v is not None]
        if len(given) > 1:
            raise GrammarError(f"give one of grammar, json_schema, json_object, not "
                               f"{' and '.join(given)}")
        if grammar is not None:
            if not isinstance(grammar, str) or not grammar.strip():
                raise GrammarError("grammar must be a non-empty GBNF string (llama.cpp's "
                                   "grammar format, with a rule named root)")
            return cls("grammar", grammar)
        if json_schema is not None:
            return cls("json_schema", schema_to_gbnf(json_schema), json_schema)
        if json_object:
            return cls("json_object", schema_to_gbnf({"type": "object"}), {"type": "object"})
        return None

    def validate(self, text: str) -> str | None:
        """None if `text` satisfies the JSON schema (or is any JSON object for json_object),
        else what is wrong. Grammars are not checked here (the decoder enforces them)."""
        return None if self.kind == "grammar" else schema_problem(self.schema, text)


def schema_problem(schema: Any, text: str) -> str | None:
    """None if `text` is JSON that satisfies `schema`, else what is wrong."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"not JSON: {exc}"
    from jsonschema import Draft202012Validator  # noqa: PLC0415

    errors = sorted(Draft202012Validator(schema).iter_errors(value), key=str)
    return errors[0].message if errors else None


class Constraint:
    """A compiled grammar for one model's vocabulary; `start()` gives a fresh state."""

    def __init__(self, backend: Any, spec: ConstraintSpec) -> None:
        if getattr(backend, "vocab", None) is None:  # e.g. a test double with no llama.cpp model
            raise GrammarError(f"{spec.kind} constraints need a llama.cpp model; this engine's "
                               f"backend ({type(backend).__name__}) has no token vocabulary")
        L = _llama()
        self.spec = spec
        self._vocab_size = backend.n_vocab
        ptr, err = _stderr_of(lambda: L.llama_sampler_init_grammar(
            backend.vocab, spec.gbnf.encode(), b"root"))
        if not ptr:
            detail = " ".join(line.strip() for line in err.splitlines()
                              if "error" in line.lower()) or "llama.cpp could not parse it"
            raise GrammarError(f"invalid {spec.kind}: {detail}")
        self.candidates = threading.local()  # per thread: a _Candidates (see mask)
        self._root = GrammarState(ptr, self)
        self.probe_ids, self.probe_chars = _probe_tokens(backend)
        # a quick first check: two of these admitted means free text, nothing forced
        self.sentinels = np.asarray([self.probe_ids[self.probe_chars.index(c)]
                                     for c in "ae01" if c in self.probe_chars], dtype=np.int32)
        self.eog = np.asarray([t for t in (backend.eos_token,) if t >= 0], dtype=np.int32)
        self.lead, self.eog_ids = _lead_bytes(backend)
        # one non-ASCII character's token: under an ASCII-only grammar it tells whether any
        # non-ASCII character may come next
        wide = backend.tokenize("\u00e9", add_bos=False, special=False)
        self.wide_probe = (wide[0] if _ascii_only(spec.gbnf) and len(wide) == 1 and
                           backend.piece(wide[0]) == "\u00e9".encode() else -1)
        self.probe_bytes = np.asarray([ord(c) for c in self.probe_chars], dtype=np.uint8)
        # the whitespace probes: most of a vocabulary starts with a space, so for tokens
        # that start with one of these the second byte is checked too
        self.spaces = [(i, ord(c)) for i, c in enumerate(self.probe_chars) if c.isspace()]
        self.groups = _byte_groups(backend, self.lead, [byte for _, byte in self.spaces])
        # for the compiled forced_text: the probes' arrays (kept) and their addresses
        self._forced_arrays = (np.ascontiguousarray(self.probe_ids, np.int32),
                               np.ascontiguousarray(self.probe_bytes, np.uint8),
                               np.ascontiguousarray(self.eog, np.int32),
                               np.ascontiguousarray(self.sentinels, np.int32))
        self.forced_args = tuple(a.ctypes.data if len(a) else None
                                 for a in self._forced_arrays)

    def start(self) -> GrammarState:
        return self._root.clone()


def _probe_tokens(backend: Any) -> tuple[np.ndarray, list[str]]:
    """The single-character tokens of PROBE_CHARS that the vocabulary has."""
    ids, chars = [], []
    for c in PROBE_CHARS:
        toks = backend.tokenize(c, add_bos=False, special=False)
        if len(toks) == 1 and backend.piece(toks[0]) == c.encode():
            ids.append(toks[0])
            chars.append(c)
    return np.asarray(ids, dtype=np.int32), chars


def _lead_bytes(backend: Any) -> tuple[np.ndarray, np.ndarray]:
    """(lead, eog): the first two bytes of every token's text as llama.cpp's grammar sees it
    (control tokens as their text; 0 where there is none), as an (n_vocab, 2) uint8 array,
    and the end-of-generation token ids (a grammar admits them where it may end, whatever
    their text). Computed once per model file (about 0.4 s for a 262k vocabulary: one
    llama.cpp call per token), then read from the cache directory."""
    cached = getattr(backend, "_grammar_lead_bytes", None)
    if cached is not None:
        return cached
    try:
        name: str | None = f"{store.file_key(backend.model_path)}.npz"
    except (AttributeError, OSError, TypeError):  # no model file to key the cache by
        name = None
    cached = _read_lead_bytes(name, backend.n_vocab) if name else None
    if cached is None:
        cached = _scan_lead_bytes(backend)
        if name:
            buf = io.BytesIO()
            np.savez(buf, lead=cached[0], eog=cached[1])
            try:
                store.write_bytes(store.path("grammar", name), buf.getvalue())
            except OSError:  # a read-only cache: computed again next time
                pass
    backend._grammar_lead_bytes = cached
    return cached


def _read_lead_bytes(name: str, n_vocab: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The stored (lead, eog) of a model file, or None when missing, unreadable or not of
    this vocabulary's shape."""
    try:
        with np.load(store.path("grammar", name), allow_pickle=False) as f:
            lead, eog = f["lead"], f["eog"]
    except Exception:  # noqa: BLE001 - missing, truncated, not an .npz: read as missing
        return None
    if lead.shape != (n_vocab, 2) or lead.dtype != np.uint8 or eog.dtype != np.int32 or \
            eog.ndim != 1 or (len(eog) and not 0 <= int(eog.min()) <= int(eog.max()) < n_vocab):
        return None
    return lead, eog


def _scan_lead_bytes(backend: Any) -> tuple[np.ndarray, np.ndarray]:
    """`_lead_bytes` read from llama.cpp's vocabulary, token by token."""
    L = _llama()
    n = backend.n_vocab
    lead = np.zeros((n, 2), dtype=np.uint8)
    eog = []
    buf = ctypes.create_string_buffer(_PIECE_MAX)
    to_piece, is_eog, vocab = L.llama_token_to_piece, L.llama_vocab_is_eog, backend.vocab
    for t in range(n):
        k = to_piece(vocab, t, buf, _PIECE_MAX, 0, True)
        if k > 0:
            head = buf.raw[:2]
            lead[t, 0] = head[0]
            if k > 1:
                lead[t, 1] = head[1]
        elif k < 0:  # longer than the buffer: its lead bytes unknown, kept as possible
            lead[t] = _UNKNOWN
        if is_eog(vocab, t):
            eog.append(t)
    return lead, np.asarray(eog, dtype=np.int32)


_PIECE_MAX = 256
_UNKNOWN = 0xFF  # a lead byte that never starts UTF-8 text: always kept as possible
_WIDE_ESCAPE = re.compile(r"\\x[89a-fA-F]|\\u|\\U")


def _ascii_only(gbnf: str) -> bool:
    """Whether a grammar names no character above ASCII (none in its text, none escaped):
    then a position admits either no non-ASCII character or all of them but for ASCII
    exclusions (a negated class, any-character), and one non-ASCII probe tells which."""
    return gbnf.isascii() and _WIDE_ESCAPE.search(gbnf) is None


class _ByteGroups:
    """A vocabulary's tokens grouped by the first byte of their text (`lead`), and those that
    start with one of the `spaces` bytes by their second byte: the tokens of byte b are
    order[starts[b]:starts[b + 1]] (sizes[b] of them), of space byte s and second byte b
    space_order[s][space_starts[s][b]:...]. Made once per model (possible() gathers a
    superset from the groups of the bytes a grammar admits instead of scanning every token)."""

    def __init__(self, lead: np.ndarray, spaces: Sequence[int]) -> None:
        bins = np.arange(257)
        self.order = np.argsort(lead[:, 0], kind="stable").astype(np.int32)
        self.starts = np.searchsorted(lead[self.order, 0], bins)
        self.sizes = np.diff(self.starts)
        self.space_order: dict[int, np.ndarray] = {}
        self.space_starts: dict[int, np.ndarray] = {}
        self.space_sizes: dict[int, np.ndarray] = {}
        for byte in spaces:
            rows = self.order[self.starts[byte]:self.starts[byte + 1]]
            order = rows[np.argsort(lead[rows, 1], kind="stable")]
            starts = np.searchsorted(lead[order, 1], bins)
            self.space_order[byte], self.space_starts[byte] = order, starts
            self.space_sizes[byte] = np.diff(starts)


def _byte_groups(backend: Any, lead: np.ndarray, spaces: Sequence[int]) -> _ByteGroups:
    """The model's _ByteGroups, made at its first grammar and kept with the backend."""
    key = tuple(spaces)
    cached = getattr(backend, "_grammar_byte_groups", None)
    if cached is None or cached[0] != key:
        cached = backend._grammar_byte_groups = (key, _ByteGroups(lead, spaces))
    return cached[1]


class _Candidates:
    """Token ids to mask, in a numpy buffer that a llama_token_data_array points at: made
    once per grammar and thread, not per state and call (a drafted tree's check clones a
    state per branch and masks each once). A mask's answer is copied out before the next."""

    def __init__(self) -> None:
        self.buf = np.zeros(0, dtype=_TOKEN_DATA)
        self.arr: Any = None
        self.ref: Any = None

    def take(self, n: int) -> np.ndarray:
        """The first n entries, the array struct sized to them."""
        if self.arr is None or len(self.buf) < n:
            L = _llama()
            self.buf = np.zeros(max(n, 2 * len(self.buf), 64), dtype=_TOKEN_DATA)
            self.arr = L.llama_token_data_array(
                data=self.buf.ctypes.data_as(ctypes.POINTER(L.llama_token_data)), size=0,
                selected=-1, sorted=False)
            self.ref = ctypes.byref(self.arr)
        arr = self.arr
        arr.size, arr.selected, arr.sorted = n, -1, False
        return self.buf[:n]


class GrammarState:
    """One position in a grammar (a llama.cpp grammar sampler of its own)."""

    def __init__(self, ptr: Any, owner: Constraint) -> None:
        self._ptr = ptr
        self.owner = owner
        self._run_checks: dict[bool, _RunCheck] = {}  # (see run_check)

    def __del__(self) -> None:
        ptr, self._ptr = getattr(self, "_ptr", None), None
        if ptr:
            try:
                _llama().llama_sampler_free(ptr)
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass

    def clone(self) -> GrammarState:
        return GrammarState(_llama().llama_sampler_clone(self._ptr), self.owner)

    def mask(self, ids: np.ndarray) -> np.ndarray:
        """Which of the token ids the grammar admits next (bool array)."""
        local = self.owner.candidates
        cand = getattr(local, "c", None)
        if cand is None:
            cand = local.c = _Candidates()
        buf = cand.take(len(ids))
        buf["id"] = ids
        buf["logit"] = 0.0
        _llama().llama_sampler_apply(self._ptr, cand.ref)
        return np.isfinite(buf["logit"])

    def _admitted_bytes(self) -> np.ndarray:
        """bool[256]: the bytes a next token's text may start with, as far as the probes
        tell: single ASCII characters, and one non-ASCII character under an ASCII-only
        grammar (other bytes stay possible; 0, no text, never: llama.cpp rejects those)."""
        owner = self.owner
        ok = np.ones(256, dtype=bool)
        ids = owner.probe_ids
        if owner.wide_probe >= 0:
            ids = np.append(ids, np.int32(owner.wide_probe))
        got = self.mask(ids)
        ok[owner.probe_bytes] = got[: len(owner.probe_bytes)]
        if owner.wide_probe >= 0:
            ok[0x80:_UNKNOWN] = got[-1]
        ok[0] = False
        return ok

    def possible(self) -> np.ndarray | None:
        """Token ids that include every token the grammar admits next (a superset), when
        that rules out at least half of the vocabulary; else None. A token is admitted only
        if its first character is (the grammar matches character by character), and one
        that starts with a space only if the character after it is admitted after the
        space; end-of-generation tokens always stay in (admitted where the grammar may
        end), and so does what the probes cannot tell."""
        owner = self.owner
        if not len(owner.probe_ids):
            return None
        groups = owner.groups
        first = self._admitted_bytes()
        spaces = [(i, byte) for i, byte in owner.spaces if first[byte]]
        first[[byte for _, byte in owner.spaces]] = False  # (those: by their second byte)
        firsts = np.flatnonzero(first)
        seconds = []
        for i, byte in spaces:
            after = self.clone()
            after.accept(int(owner.probe_ids[i]))
            second = after._admitted_bytes()
            second[0] = True  # the space alone
            seconds.append((byte, np.flatnonzero(second)))
        # counted before gathered: where the superset is not narrow, nothing is gathered
        count = int(groups.sizes[firsts].sum()) + sum(
            int(groups.space_sizes[byte][b].sum()) for byte, b in seconds)
        if 2 * count > owner.lead.shape[0]:
            return None
        parts = [groups.order[groups.starts[b]:groups.starts[b + 1]] for b in firsts]
        for byte, bs in seconds:
            order, starts = groups.space_order[byte], groups.space_starts[byte]
            parts.extend(order[starts[b]:starts[b + 1]] for b in bs)
        parts.append(owner.eog_ids)
        ids = np.unique(np.concatenate(parts)).astype(np.int32)
        return ids if 2 * len(ids) <= owner.lead.shape[0] else None

    def allows(self, token: int) -> bool:
        return bool(self.mask(np.asarray([token], dtype=np.int32))[0])

    def accept(self, token: int) -> None:
        """Advance along `token`, which must be admitted (`allows`): llama.cpp aborts on a
        token its grammar rejects."""
        _llama().llama_sampler_accept(self._ptr, int(token))

    def take_if_admitted(self, token: int) -> bool:
        """Whether the grammar admits `token` next; where it does, the state advances along
        it (`allows` then `accept`, in one compiled call where there is a build: a greedy
        step's check of its argmax, right after a forward pass, took ~0.09 ms on a CPU as
        numpy and ctypes calls)."""
        fast = _compiled()
        if fast is not None:
            return bool(fast.take(ctypes.addressof(fast.fns), self._ptr, int(token)))
        if not self.allows(token):
            return False
        self.accept(token)
        return True

    def run_check(self, stop_forced: bool) -> tuple[int, int] | None:
        """For a run of plain steps in one compiled call (Backend.step_run's `check`): the
        address of a C function that checks each token the run takes against this state and
        advances it along the token where admitted, and the address of its data (kept with
        this state). With `stop_forced`, the run stops after a token where the grammar forces
        what comes next (which a drafting request drafts). None without a build."""
        fast = _compiled()
        if fast is None:
            return None
        data = self._run_checks.get(stop_forced)
        if data is None:
            ids, chars, eog, sentinels = self.owner.forced_args
            data = self._run_checks[stop_forced] = _RunCheck(
                ctypes.addressof(fast.fns), ctypes.cast(self._ptr, ctypes.c_void_p).value,
                int(stop_forced), ids, chars, len(self.owner.probe_chars), eog,
                len(self.owner.eog), sentinels, len(self.owner.sentinels))
        return fast.run_check, ctypes.addressof(data)

    def forced_text(self, max_chars: int, style: SpaceStyle | Callable[[str], bool],
                    prev: str = "") -> str:
        """The characters the grammar admits next when it admits one non-space character
        (optional whitespace is drafted the way `style` says the output so far writes it
        after the previous character: a SpaceStyle, or a function of that character); stops
        at a real choice or after max_chars."""
        owner = self.owner
        ids, chars = owner.probe_ids, owner.probe_chars
        if isinstance(style, SpaceStyle):
            fast = _compiled()
            if fast is not None and max_chars > 0:
                return self._forced_compiled(fast, max_chars, style, prev)
            space_after = style.space_after
        else:
            space_after = style
        if not len(ids) or self.mask(owner.sentinels).sum() >= 2:
            return ""  # free text (a string, a number): nothing is forced
        n = len(ids)
        ids_eog = np.concatenate([ids, owner.eog])  # one check per character for both
        st = self.clone()
        out: list[str] = []
        for _ in range(max_chars):
            ok = st.mask(ids_eog)
            allowed = [chars[i] for i in np.flatnonzero(ok[:n])]
            solid = [c for c in allowed if not c.isspace()]
            if len(solid) > 1 or (not solid and not allowed):
                break
            if ok[n:].any():
                break  # the output may end here
            if solid and len(allowed) == 1:
                c = solid[0]
            elif solid:  # one character, with optional whitespace before it
                c = " " if " " in allowed and space_after(prev) else solid[0]
            elif len(allowed) == 1:
                c = allowed[0]
            else:
                break
            st.accept(int(ids[chars.index(c)]))
            out.append(c)
            prev = c
        return "".join(out)

    def _forced_compiled(self, fast: _Kernels, max_chars: int, style: SpaceStyle, prev: str
                         ) -> str:
        """`forced_text` in one compiled call (`_grammar.c`), whitespace as `style` writes it."""
        forced, fns = fast.forced, fast.fns
        owner = self.owner
        ids, chars, eog, sentinels = owner.forced_args
        out = ctypes.create_string_buffer(max_chars)
        got = forced(ctypes.addressof(fns), self._ptr, max_chars, ids, chars,
                     len(owner.probe_chars), eog, len(owner.eog), sentinels,
                     len(owner.sentinels), style.table_address, int(style.space_after(prev)),
                     out)
        if got < 0:
            raise MemoryError("the grammar's forced text check ran out of memory")
        return out.raw[:got].decode("ascii")

    def prune(self, tokens: Sequence[int], parents: Sequence[int]
              ) -> tuple[list[bool], dict[int, GrammarState]]:
        """For a token tree given as (tokens, parents; node 0 the root, already accepted in
        this state; parents before children): which nodes the grammar admits along their
        path (a node under a rejected one is rejected), and the state after each admitted
        leaf. (A drafted node's state, not needed once its children are checked, becomes its
        last admitted child's: a chain clones one state, not one per node; this state itself
        is never advanced.)"""
        fast = _compiled()
        if fast is not None:
            return self._prune_compiled(fast, tokens, parents)
        n = len(tokens)
        keep = [False] * n
        keep[0] = True
        states: dict[int, GrammarState] = {0: self}
        children: dict[int, list[int]] = {}
        for i in range(1, n):
            children.setdefault(parents[i], []).append(i)
        for node in range(n):
            if not keep[node] or node not in children:
                continue
            st = states.pop(node)
            kids = children[node]
            ok = st.mask(np.asarray([tokens[k] for k in kids], dtype=np.int32))
            admitted = [k for k, good in zip(kids, ok) if good]
            last = admitted[-1] if admitted and node != 0 else -1
            for k in admitted:
                keep[k] = True
                child = st if k == last else st.clone()
                child.accept(tokens[k])
                states[k] = child
        leaves = {k: s for k, s in states.items() if k not in children and k != 0}
        return keep, leaves

    def _prune_compiled(self, fast: _Kernels, tokens: Sequence[int], parents: Sequence[int]
                        ) -> tuple[list[bool], dict[int, GrammarState]]:
        """`prune` in one compiled call (`_grammar.c`)."""
        prune, fns = fast.prune, fast.fns
        n = len(tokens)
        tok, par = array("i", tokens), array("i", parents)
        keep = array("B", bytes(n))
        states = (ctypes.c_void_p * n)()
        if prune(ctypes.addressof(fns), self._ptr, n, tok.buffer_info()[0],
                 par.buffer_info()[0], keep.buffer_info()[0], states) != 0:
            raise MemoryError("the grammar check of a drafted tree ran out of memory")
        owner, kind = self.owner, _llama().llama_sampler_p_ctypes
        leaves = {k: GrammarState(ctypes.cast(ptr, kind), owner)
                  for k, ptr in enumerate(states) if ptr}
        return keep.tolist(), leaves



class SpaceStyle:
    """How the output so far writes optional whitespace: after which punctuation it puts a
    space (learned from the emitted text; before any evidence: after ':' and ',')."""

    def __init__(self) -> None:
        self.after: dict[str, bool] = {}
        self.last = ""  # the last character emitted
        # space_after per byte value, for the compiled forced_text (ASCII characters)
        self.table = (ctypes.c_uint8 * 256)()
        self.table[ord(":")] = self.table[ord(",")] = 1
        self.table_address = ctypes.addressof(self.table)

    def feed(self, text: str) -> None:
        t = self.last + text
        for a, b in zip(t, t[1:]):
            if not (a.isspace() or a.isalnum()):
                self.after[a] = b == " "
                if ord(a) < 128:
                    self.table[ord(a)] = b == " "
        if t:
            self.last = t[-1]

    def space_after(self, c: str) -> bool:
        return self.after.get(c, c in ":,")


class Forcing:
    """One request's grammar-forced drafts: what the grammar forces after the output so far
    (kept across steps while the output follows it) and how that output writes optional
    whitespace."""

    def __init__(self, state: GrammarState, max_chars: int) -> None:
        self.state, self.max_chars = state, max_chars
        self.style = SpaceStyle()
        self.left = ""  # forced text not emitted yet

    def emitted(self, text: str) -> None:
        """The output went on by `text` (the grammar state follows it through the sampler)."""
        self.style.feed(text)
        self.left = self.left[len(text):] if self.left.startswith(text) else ""

    def next_text(self) -> str:
        """What the grammar forces next: the text left from the last step, found anew when
        little of it is left."""
        if len(self.left) < self.max_chars // 4:
            self.left = self.state.forced_text(self.max_chars, self.style, self.style.last)
        return self.left

    def after(self, state: GrammarState, prev: str) -> str:
        """What the grammar forces at `state`, a drafted branch ending in character `prev`."""
        return state.forced_text(self.max_chars // 4, self.style, prev)
