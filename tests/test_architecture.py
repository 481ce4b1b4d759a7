"""The layer picture of docs/architecture.md, checked on the source: no import cycles, arrows
point down only, and the pure layer never touches llama.cpp."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# package folder -> module prefix (app/ ships as srsd_local.app)
SOURCES = {ROOT / "srsd_local": "srsd_local", ROOT / "app": "srsd_local.app"}

# the layer of each part; a module may import only from its own part or lower layers
LAYERS = {
    "srsd_local.config": 0, "srsd_local.store": 1, "srsd_local.prompts": 1,
    "srsd_local.spec": 2, "srsd_local.llama": 2,
    "srsd_local.engine": 3,
    "srsd_local": 3.5,  # the package root: the public API (Engine, configs), for the apps
    "srsd_local.bench": 4, "srsd_local.app": 4,
    "srsd_local.cli": 5,
}
LLAMA_CPP = ("llama_cpp",)


def _modules() -> dict[str, Path]:
    out = {}
    for folder, prefix in SOURCES.items():
        for f in folder.rglob("*.py"):
            rel = f.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([prefix, *parts])] = f
    return out


def _imports(name: str, path: Path, known: set[str]) -> list[str]:
    """Every import of `name` (module level or inside functions), resolved to module names."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = base[: len(base) - node.level + 1]
                mod = ".".join(pkg + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{mod}.{a.name}"
                out.append(sub if sub in known else mod)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {m: set(_imports(m, p, known)) for m, p in mods.items()}


def _part(mod: str) -> str:
    best = ""
    for p in LAYERS:
        if (mod == p or mod.startswith(p + ".")) and len(p) > len(best):
            best = p
    return best


def test_every_module_is_in_a_layer():
    assert all(_part(m) for m in _modules()), [m for m in _modules() if not _part(m)]


def test_no_import_cycles():
    graph = {m: {d for d in deps if d in _modules()} for m, deps in _graph().items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_arrows_point_down_only():
    bad = []
    for mod, deps in _graph().items():
        src = _part(mod)
        for d in deps:
            if not d.startswith("srsd_local"):
                continue
            dst = _part(d)
            if dst == src:
                continue
            if LAYERS[dst] >= LAYERS[src]:
                bad.append(f"{mod} -> {d}")
    assert not bad, "upward or sideways imports: " + ", ".join(sorted(bad))


def test_pure_layer_never_imports_llama_cpp():
    bad = [f"{m} -> {d}" for m, deps in _graph().items() if _part(m) == "srsd_local.spec"
           for d in deps if d.split(".")[0] in LLAMA_CPP]
    assert not bad, bad


def test_the_checker_sees_a_planted_cycle_and_upward_import(tmp_path, monkeypatch):
    pkg = tmp_path / "srsd_local"
    (pkg / "spec").mkdir(parents=True)
    (pkg / "engine").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "spec" / "__init__.py").write_text("")
    (pkg / "engine" / "__init__.py").write_text("")
    (pkg / "spec" / "a.py").write_text("from ..engine import b\nimport llama_cpp\n")
    (pkg / "engine" / "b.py").write_text("from ..spec import a\n")
    monkeypatch.setitem(globals(), "SOURCES", {pkg: "srsd_local"})
    with pytest.raises(AssertionError, match="import cycle"):
        test_no_import_cycles()
    with pytest.raises(AssertionError, match="srsd_local.spec.a -> srsd_local.engine.b"):
        test_arrows_point_down_only()
    with pytest.raises(AssertionError, match="llama_cpp"):
        test_pure_layer_never_imports_llama_cpp()
