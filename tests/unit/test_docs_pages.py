"""The docs site's generated pages match what generates them, and every Python snippet in the docs parses.

docs/benchmarks.md and docs/reference/troubleshooting.md are rendered by tools/docs_pages.py (`make docs` runs it
first); a committed page that differs from the rendering is stale.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import docs_pages  # noqa: E402 - the generator, a script under tools/

FIX = "python tools/docs_pages.py --write (or make docs)"


@pytest.mark.parametrize("page", sorted(docs_pages.PAGES, key=str), ids=lambda p: p.name)
def test_committed_page_is_the_rendering(page: Path) -> None:
    assert page.exists(), f"{page.relative_to(ROOT)} is missing: {FIX}"
    assert page.read_text() == docs_pages.PAGES[page](), f"{page.relative_to(ROOT)} is stale: {FIX}"


def test_benchmarks_page_has_every_result_and_plot() -> None:
    page = docs_pages.render_benchmarks()
    results = ROOT / "benchmarks" / "results"
    for path in sorted(results.rglob("*.json")):
        stem = path.relative_to(results).with_suffix("").as_posix()
        assert f"\n## {stem}\n" in page, stem
        if isinstance(json.loads(path.read_text()), dict) and "shardwise_source" in path.read_text():
            section = page.split(f"\n## {stem}\n", 1)[1].split("\n## ", 1)[0]
            assert "commit: `" in section, f"{stem}: its commit is not named"
    for png in sorted(results.rglob("*.png")):
        assert f"](benchmarks/{png.relative_to(results).as_posix()})" in page, png.name


def test_troubleshooting_page_has_every_error_class_and_its_messages() -> None:
    page = docs_pages.render_troubleshooting()
    classes = set()
    for path in (ROOT / "src" / "shardwise").rglob("*.py"):
        classes |= set(re.findall(r"^class (\w+Error)\b", path.read_text(), re.M))
    assert len(classes) > 20
    for name in classes:
        assert f"\n## {name}\n" in page, name
    # A literal message and an f-string template, from config/ and checkpoint/.
    assert "DeepSpeed setting that shardwise does not implement yet" in page
    assert "export: world size must be at least 1; got {world}." in page


def python_blocks() -> list[tuple[str, int, str]]:
    blocks = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = path.read_text()
        for match in re.finditer(r"^( *)```python[^\n]*\n(.*?)^\1```", text, re.M | re.S):
            code = "\n".join(line[len(match.group(1)):] for line in match.group(2).splitlines())
            blocks.append((path.relative_to(ROOT).as_posix(), text.count("\n", 0, match.start()) + 1, code))
    return blocks


def test_every_python_snippet_in_the_docs_parses() -> None:
    blocks = python_blocks()
    assert len(blocks) >= 5, "no ```python blocks found: has the docs' layout changed?"
    bad = []
    for page, line, code in blocks:
        try:
            ast.parse(code, f"{page}:{line}")
        except SyntaxError as e:
            bad.append(f"{page}:{line + (e.lineno or 0)}: {e.msg}")
    assert not bad, "Python snippets that do not parse:\n" + "\n".join(bad)


def _static_all(module: str, variable: str = "__all__") -> list[str]:
    """A package's `__all__` (`_PUBLIC` for shardwise's lazily loaded top-level names), read without importing."""
    tree = ast.parse((ROOT / "src" / Path(*module.split(".")) / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == variable for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"{module}: no {variable} found")


# What DeepSpeed scripts and users call: shardwise's top-level names, the packages a script imports from, and the
# functions of config/, checkpoints and profiling that the guides send readers to.
SURFACE = {
    "shardwise": _static_all("shardwise", "_PUBLIC"),
    "shardwise.pipe": _static_all("shardwise.pipe"),
    "shardwise.inference": _static_all("shardwise.inference"),
    "shardwise.checkpoint": [*_static_all("shardwise.checkpoint"), "open_checkpoint", "export_deepspeed",
                             "import_deepspeed", "get_fp32_state_dict_from_zero_checkpoint",
                             "convert_zero_checkpoint_to_fp32_state_dict", "load_state_dict_from_zero_checkpoint"],
    # measured_bytes takes a sharding strategy, which only the engine holds.
    "shardwise.zero": [n for n in _static_all("shardwise.zero") if n != "measured_bytes"],
    "shardwise.config": ["parse_config", "config_json_schema", "Config", "ConfigError"],
    "shardwise.profiling": ["get_model_profile", "FlopsProfiler", "CommsLogger", "memory_breakdown"],
    "shardwise.accelerator": ["get_accelerator"],
    "shardwise.sequence_parallel": _static_all("shardwise.sequence_parallel"),
    "shardwise.tensor_parallel": ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "parallelize",
                                  "tp_model_init"],
}


def test_the_api_reference_documents_the_public_surface() -> None:
    documented = set()
    for page in (ROOT / "docs" / "reference" / "api").glob("*.md"):
        documented |= {m.rsplit(".", 1)[-1] for m in re.findall(r"^::: ([\w.]+)", page.read_text(), re.M)}
    missing = [f"{module}.{name}" for module, names in SURFACE.items() for name in names
               if name not in documented]
    assert not missing, f"public names with no `::: module.name` entry under docs/reference/api/: {missing}"


def test_the_site_config_keeps_every_link_check_strict() -> None:
    """`mkdocs build --strict` fails on warnings only: every link check must stay a warning, not an info line."""
    import yaml

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["strict"] is True
    checks = {f"{group}.{name}": level for group, names in config["validation"].items() for name, level in names.items()}
    assert set(checks) >= {"nav.omitted_files", "nav.not_found", "links.not_found", "links.anchors"}, checks
    assert all(level == "warn" for level in checks.values()), checks
