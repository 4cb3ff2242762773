"""The shape of `src/shardwise`, checked from the source text: imports flow one way (no circle between
packages, nor between files, contracts in a leaf), callers never probe a strategy for attributes, and the Layout page (docs/layout.md)
names exactly what `ls` shows."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "shardwise"
TOP = sorted(p.name.removesuffix(".py") for p in PACKAGE.iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.name != "__init__.py"))


def _imported_top_levels(path: Path) -> set[str]:
    """The top-level parts of shardwise a module imports (at any depth of the file, TYPE_CHECKING included)."""
    here = path.relative_to(PACKAGE).parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        parts: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(here[: len(here) - node.level + 1])
            parts = base + (node.module.split(".") if node.module else [])
            if not parts:  # `from . import x` at the top: x is the target
                found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shardwise."):
            parts = node.module.split(".")[1:]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("shardwise."):
                    found.add(alias.name.split(".")[1])
        if parts:
            found.add(parts[0])
    return found & set(TOP)


def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {name: set() for name in TOP}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).parts
        source = parts[0].removesuffix(".py")
        if source in edges:
            edges[source] |= _imported_top_levels(path) - {source}
    return edges


def _cycle_through(start: str, edges: dict[str, set[str]]) -> list[str] | None:
    stack = [(start, [start])]
    seen = set()
    while stack:
        node, path = stack.pop()
        for nxt in sorted(edges[node]):
            if nxt == start:
                return path + [start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, path + [nxt]))
    return None


def test_no_import_circle_between_packages():
    edges = _edges()
    circles = [" → ".join(c) for name in TOP if (c := _cycle_through(name, edges))]
    assert not circles, f"import circles in src/shardwise: {circles}"


def test_the_walk_finds_a_circle_when_there_is_one():
    assert _cycle_through("a", {"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle_through("a", {"a": {"b"}, "b": set()}) is None
    assert "runtime" in _edges()["initialize"]  # the walk sees real imports


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _file_edges() -> dict[str, set[str]]:
    """Module → the shardwise modules it imports (any depth, TYPE_CHECKING included; `from p import x` counts
    as importing p.x when that is a module, else p)."""
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]) if node.level else ""
                target = ".".join(p for p in (base, node.module or "") if p)
                if target.startswith("shardwise"):
                    found |= {f"{target}.{a.name}" if f"{target}.{a.name}" in modules else known(target)
                              for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {known(a.name) for a in node.names if a.name.startswith("shardwise")}
        edges[name] = found - {None, name}
    return edges


def test_no_import_circle_between_files():
    edges = _file_edges()
    circles = {" → ".join(c) for name in sorted(edges) if (c := _cycle_through(name, edges))}
    assert not circles, f"import circles between files of src/shardwise: {sorted(circles)}"


def test_the_file_walk_sees_real_imports():
    edges = _file_edges()
    assert "shardwise.runtime.engine" in edges["shardwise.initialize"]
    assert "shardwise.protocols.engine" in edges["shardwise.runtime.watchers"]  # a TYPE_CHECKING import counts
    assert "shardwise.inference.serve.options" in edges["shardwise.inference.serve.worker"]


def test_protocols_import_no_implementation():
    assert _edges()["protocols"] <= {"config", "distributed", "precision"}


_PROBES = re.compile(r"\b(getattr|hasattr)\(\s*(self\.)?(engine\.)?strategy\b")


def test_nothing_probes_a_strategy_for_attributes():
    probing = [f"{path.relative_to(ROOT)}:{n}" for path in PACKAGE.rglob("*.py")
               for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if _PROBES.search(line)]
    assert not probing, f"capabilities a caller needs are typed members of ShardingStrategy; probed at {probing}"


def _layout_page_names() -> set[str]:
    text = (ROOT / "docs" / "layout.md").read_text(encoding="utf-8")
    block = text.split("## Layout", 1)[1].split("```")[1]
    names = set()
    for line in block.splitlines():
        if not line.startswith("  ") or line.startswith("   "):
            continue  # src/shardwise/ entries are indented by two spaces
        first = re.split(r"\s{2,}", line.strip())[0]
        names.update(n.strip().rstrip("/").removesuffix(".py") for n in first.split(","))
    return names


def test_the_layout_page_matches_the_tree():
    listed, present = _layout_page_names(), set(TOP)
    assert present - listed == set(), f"docs/layout.md lacks {sorted(present - listed)}"
    assert listed - present == set(), f"docs/layout.md names what is not in src/shardwise: {sorted(listed - present)}"
