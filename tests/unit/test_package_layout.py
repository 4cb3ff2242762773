"""The shape of `src/shardwise`, checked from the source text: imports flow one way (no circle between
packages, nor between files, whether the import is at the top, in a function or by name; contracts in a leaf),
callers never probe a strategy for attributes, and the Layout page (docs/layout.md) names exactly what `ls` shows."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "shardwise"
TOP = sorted(p.name.removesuffix(".py") for p in PACKAGE.iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.name != "__init__.py"))


def _module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


_IMPORT_BY_NAME = {"import_module", "__import__"}  # importlib.import_module(name), __import__(name)


def _file_edges(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module → the modules of `package` it imports. Every import counts, wherever it is written: at the top,
    inside a function (a lazy import only delays the circle to the first call), under TYPE_CHECKING, or by name
    (`importlib.import_module("pkg.mod")`, `find_spec("pkg.mod")`, which imports `pkg`). `from p import x` counts
    as importing p.x when that is a module, else p. A file that imports by a computed name is charged with every
    module its strings name (absolutely, or relative to its package with or without the dot), since the checker
    cannot tell which of them it picks. The packages a module sits in are not counted: running their __init__
    first is how Python imports, and a module that needs a name from its package's __init__ imports it, which
    counts."""
    root = package.name
    modules = {_module_name(path, package): path for path in package.rglob("*.py")}

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    def ours(name: str) -> bool:
        return name == root or name.startswith(root + ".")

    def absolute(here: str, level: int, module: str | None) -> str:
        base = ".".join(here.split(".")[: len(here.split(".")) - level + 1]) if level else ""
        return ".".join(p for p in (base, module or "") if p)

    edges = {}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found, strings, computed = set(), set(), False
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                target = absolute(here, node.level, node.module)
                if ours(target):
                    found |= {f"{target}.{a.name}" if f"{target}.{a.name}" in modules else known(target)
                              for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {known(a.name) for a in node.names if ours(a.name)}
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.add(node.value)
            elif isinstance(node, ast.Call) and node.args:
                called = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
                if called in _IMPORT_BY_NAME or called == "find_spec":
                    arg = node.args[0]
                    if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
                        computed |= called in _IMPORT_BY_NAME
                        continue
                    module = arg.value.lstrip(".")
                    target = absolute(here, len(arg.value) - len(module), module)
                    if called == "find_spec":  # imports the parent, already imported when it encloses this file
                        target = target.rpartition(".")[0]
                        target = "" if f"{here}.".startswith(f"{target}.") else target
                    if ours(target):
                        found.add(known(target))
        if computed:
            found |= {m for s in strings for m in (s, here + s, f"{here}.{s}") if m in modules}
        edges[name] = found - {None, name}
    return edges


def _edges(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Top-level part of `package` (a subpackage or a file beside __init__) → the parts its files import."""
    def top(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 else None  # the package's own __init__ is above every part

    edges: dict[str, set[str]] = {}
    for module, targets in _file_edges(package).items():
        if (source := top(module)) is not None:
            edges.setdefault(source, set()).update(t for m in targets if (t := top(m)) not in (None, source))
    return edges


def _cycle_through(start: str, edges: dict[str, set[str]]) -> list[str] | None:
    stack = [(start, [start])]
    seen = set()
    while stack:
        node, path = stack.pop()
        for nxt in sorted(edges.get(node, ())):
            if nxt == start:
                return path + [start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, path + [nxt]))
    return None


def _circles(edges: dict[str, set[str]]) -> list[str]:
    return sorted({" → ".join(c) for name in sorted(edges) if (c := _cycle_through(name, edges))})


def test_no_import_circle_between_packages():
    assert not (circles := _circles(_edges())), f"import circles in src/shardwise: {circles}"


def test_no_import_circle_between_files():
    assert not (circles := _circles(_file_edges())), f"import circles between files of src/shardwise: {circles}"


def test_the_walk_finds_a_circle_when_there_is_one():
    assert _cycle_through("a", {"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle_through("a", {"a": {"b"}, "b": set()}) is None
    assert "runtime" in _edges()["initialize"]  # the walk sees real imports


def test_the_file_walk_sees_real_imports():
    edges = _file_edges()
    assert "shardwise.runtime.engine" in edges["shardwise.initialize"]
    assert "shardwise.protocols.engine" in edges["shardwise.runtime.watchers"]  # a TYPE_CHECKING import counts
    assert "shardwise.inference.serve.options" in edges["shardwise.inference.serve.worker"]
    assert "shardwise.launcher.cli" in edges["shardwise.launcher.check_comm"]  # a function-level import counts
    assert "shardwise.autotune.cli" in edges["shardwise.cli"]  # a subcommand, imported by name when it runs
    assert "shardwise.runtime.engine" in edges["shardwise"]  # the public names, imported by computed name
    assert "shardwise.offload" in edges["shardwise.launcher.report"]  # find_spec("shardwise.offload.nvme")


# The second file's way back to the first: each is a circle the checker must report.
WAYS_BACK = {
    "at the top": "from .a import f\n",
    "inside a function": "def g():\n    from fake.a import f\n    return f\n",
    "under TYPE_CHECKING": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n",
    "by name": "import importlib\n\ndef g():\n    return importlib.import_module('fake.a')\n",
    "by a relative name": "import importlib\n\ndef g():\n    return importlib.import_module('.a', __package__)\n",
    "by a computed name": ("import importlib\nTOOLS = {'f': 'fake.a'}\n\n"
                           "def g(tool):\n    return importlib.import_module(TOOLS[tool])\n"),
}


def _fake_package(root: Path, files: dict[str, str]) -> Path:
    for name, text in {"__init__.py": "", **files}.items():
        (root / "fake" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "fake" / name).write_text(text)
    return root / "fake"


@pytest.mark.parametrize("way_back", WAYS_BACK.values(), ids=WAYS_BACK.keys())
def test_the_checker_reports_a_two_file_circle(tmp_path: Path, way_back: str):
    fake = _fake_package(tmp_path, {"a.py": "from .b import g\n\ndef f():\n    return g\n", "b.py": way_back})
    assert _circles(_file_edges(fake)) == ["fake.a → fake.b → fake.a", "fake.b → fake.a → fake.b"]
    one_way = _fake_package(tmp_path / "one_way", {"a.py": "from .b import g\n", "b.py": "def g():\n    pass\n"})
    assert _file_edges(one_way)["fake.a"] == {"fake.b"} and _circles(_file_edges(one_way)) == []


def test_the_checker_reports_a_circle_between_packages_that_no_two_files_make(tmp_path: Path):
    fake = _fake_package(tmp_path, {"x/__init__.py": "", "x/a.py": "from ..y.b import g\n", "x/c.py": "",
                                    "y/__init__.py": "", "y/b.py": "from ..x import c\n\ng = c\n"})
    assert _circles(_file_edges(fake)) == []
    assert _circles(_edges(fake)) == ["x → y → x", "y → x → y"]


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
