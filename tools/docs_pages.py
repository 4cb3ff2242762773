"""Render the docs site's generated pages: docs/benchmarks.md (from benchmarks/results/*.json) and
docs/reference/troubleshooting.md (from the error classes in src/shardwise and the messages they are raised with).

    python tools/docs_pages.py --write     # what `make docs` runs first
    python tools/docs_pages.py --check     # exit 1 when a committed page differs from its rendering

Standard library only, and shardwise is read with `ast`, never imported: the pages render in a second from a bare
checkout. tests/unit/test_docs_pages.py fails when a committed page differs from this rendering. The plots stay in
benchmarks/results; tools/mkdocs_hooks.py adds them to the site under benchmarks/ at build time, so the page links
them there and no copy of a binary lives in docs/.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SOURCES = ROOT / "src" / "shardwise"
BENCHMARKS_PAGE = ROOT / "docs" / "benchmarks.md"
TROUBLESHOOTING_PAGE = ROOT / "docs" / "reference" / "troubleshooting.md"
PLOTS_URL = "benchmarks"
"""Where the hook puts benchmarks/results/**.png in the site, relative to docs/benchmarks.md."""

MAX_ROWS = 16
MAX_COLUMNS = 7
MAX_LIST = 4
# Where a run says what it ran on: the first of each found (breadth first) names the figure's commit and machine.
PROVENANCE = {
    "commit": ("commit", "head"),
    "machine": ("host", "machine", "gpu", "device_name"),
    "device": ("device",),
    "CPU cores": ("cpu_count", "cpu_cores"),
    "torch": ("torch",),
    "date": ("date", "timestamp", "when"),
}
# Sections that describe the run rather than measure it: shown as the run's settings, not as result tables.
SETTINGS = ("setup", "settings", "environment", "time_model", "theory")
NOT_SHOWN = ("load", "load_average", "oracle_losses")
"""Machine load while the run ran and raw loss curves: kept in the JSON, too long to be a table."""


def cell(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        text = str(value).lower() if value is not None else "—"
    elif isinstance(value, float):
        text = f"{value:.4g}"
    elif isinstance(value, list):
        text = ", ".join(cell(v) for v in value[:MAX_LIST]) + (f", … ({len(value)} values)" if len(value) > MAX_LIST else "")
    else:
        text = str(value)
    text = " ".join(text.split())
    if len(text) > 80:
        text = text[:77] + "…"
    return text.replace("|", "\\|").replace("<", "&lt;")


def leaves(value: Any, prefix: str = "", depth: int = 0) -> dict[str, Any]:
    """Scalar leaves (and short lists of scalars) by dotted path, two levels deep at most."""
    if isinstance(value, dict) and depth < 2:
        out: dict[str, Any] = {}
        for key, sub in value.items():
            out.update(leaves(sub, f"{prefix}{key}.", depth + 1))
        return out
    if isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        return {prefix[:-1]: f"[{len(value)} entries]"} if prefix else {}
    if isinstance(value, dict):
        return {prefix[:-1]: f"{{{len(value)} keys}}"}
    return {prefix[:-1]: value}


def table(header: list[str], rows: list[list[Any]], dropped_rows: int = 0, dropped_columns: int = 0) -> list[str]:
    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    more = [f"{n} more {what}" for n, what in ((dropped_rows, "rows"), (dropped_columns, "columns")) if n]
    if more:
        lines += ["", f"*{' and '.join(more)} in the JSON.*"]
    return lines + [""]


def is_scalar(value: Any) -> bool:
    """A value one table cell can hold; a list of numbers shows its first few and its length."""
    return not isinstance(value, (dict, list)) or (isinstance(value, list)
                                                    and not any(isinstance(v, (dict, list)) for v in value))


def rows_table(entries: list[tuple[Any, Any]]) -> list[str]:
    """Entries as rows, the scalar leaves of each as columns (the union, in order of first appearance)."""
    rows = [(k, leaves(v)) for k, v in entries]
    columns: list[str] = []
    for _, row in rows:
        columns += [c for c in row if c not in columns]
    shown = columns[:MAX_COLUMNS]
    return table(["", *shown], [[k, *(row.get(c, "") for c in shown)] for k, row in rows[:MAX_ROWS]],
                 max(0, len(rows) - MAX_ROWS), len(columns) - len(shown))


def section(title: str, value: Any, depth: int = 0) -> list[str]:
    """A result section: its scalars as one table; entries that are records (each with scalars of its own) as
    the rows of another; anything deeper as sections of its own, up to three levels, then flattened."""
    entries = list(value.items()) if isinstance(value, dict) else list(enumerate(value))
    scalars = [(k, v) for k, v in entries if is_scalar(v)]
    nested = [(k, v) for k, v in entries if not is_scalar(v)]
    out = [f"**{title}**", ""]
    if scalars:
        out += table(["", "value"], [list(e) for e in scalars[:MAX_ROWS]], max(0, len(scalars) - MAX_ROWS))
    records = all(isinstance(v, dict) and any(is_scalar(x) for x in v.values()) for _, v in nested)
    if nested and (records and len(nested) > 1 or depth >= 2):
        out += rows_table(nested)
    else:
        for key, sub in nested[:MAX_ROWS]:
            out += section(f"{title} / {key}", sub, depth + 1)
        if len(nested) > MAX_ROWS:
            out += [f"*{len(nested) - MAX_ROWS} more sections of {title} in the JSON.*", ""]
    return out if len(out) > 2 else []


def provenance(data: Any) -> dict[str, Any]:
    found: dict[str, Any] = {}
    queue = [data]
    while queue:
        node = queue.pop(0)
        for key, value in node.items():
            if isinstance(value, dict):
                queue.append(value)
                continue
            for label, names in PROVENANCE.items():
                if key in names and label not in found and isinstance(value, (str, int, float)):
                    found[label] = value
    return found


def plots_of(stems: list[str]) -> dict[str, list[str]]:
    """Each plot under the result it belongs to: the longest JSON stem that is its stem or a prefix of it."""
    owned: dict[str, list[str]] = {stem: [] for stem in stems}
    owned[""] = []
    for png in sorted(RESULTS.rglob("*.png")):
        stem = png.relative_to(RESULTS).with_suffix("").as_posix()
        owner = max((s for s in stems if stem == s or stem.startswith(s + "_")), key=len, default="")
        owned[owner].append(png.relative_to(RESULTS).as_posix())
    return owned


def render_benchmarks() -> str:
    files = sorted(RESULTS.glob("*.json")) + sorted(RESULTS.glob("gpu/*.json")) + sorted(RESULTS.glob("ab/*.json"))
    stems = [f.relative_to(RESULTS).with_suffix("").as_posix() for f in files]
    plots = plots_of(stems)
    out = ["# Benchmarks", "",
           "Generated by `tools/docs_pages.py` from `benchmarks/results/` (each file is what a script in `benchmarks/`",
           "wrote; `benchmarks/README.md` says how to rerun them). Each section names the commit and machine the",
           "figures came from; tables are cut to their first rows and columns, the JSON has the rest.", ""]
    for path, stem in zip(files, stems):
        data = json.loads(path.read_text())
        out += [f"## {stem}", ""]
        if not isinstance(data, dict):
            out += section("results", data)
            continue
        facts = provenance(data)
        out += [f"`benchmarks/results/{stem}.json`" + "".join(f" · {k}: `{cell(v)}`" for k, v in facts.items()), ""]
        what = data.get("benchmark") or data.get("figure") or data.get("what")
        if isinstance(what, str) and what != stem.rsplit("/", 1)[-1]:
            out += [cell(what) if len(what) <= 80 else what.replace("<", "&lt;"), ""]
        scalars = [[k, v] for k, v in data.items() if not isinstance(v, dict) and k not in ("benchmark", "figure", "what")
                   and not (isinstance(v, list) and len(v) > MAX_LIST)]
        if scalars:
            out += table(["", "value"], scalars)
        for key, value in data.items():
            if key in NOT_SHOWN or not isinstance(value, (dict, list)) or not value:
                continue
            if is_scalar(value):
                continue  # a long series (a loss curve): the plots show it
            if key in SETTINGS:
                flat = [[k, v] for k, v in leaves(value).items()]
                out += [f"**{key}**", ""] + table(["", "value"], flat[:MAX_ROWS], max(0, len(flat) - MAX_ROWS))
            else:
                out += section(key, value)
        for png in plots.get(stem, []):
            out += [f"![{png}]({PLOTS_URL}/{png})", ""]
    if plots[""]:
        out += ["## Other figures", ""]
        for png in plots[""]:
            out += [f"![{png}]({PLOTS_URL}/{png})", ""]
    return "\n".join(out).rstrip() + "\n"


def message(node: ast.expr) -> str | None:
    """A raise site's message template: string literals as written, each f-string field as `{expression}`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{" + ast.unparse(v.value) + "}" for v in node.values)
    if isinstance(node, (ast.List, ast.Tuple)) and node.elts:  # ConfigError([problem, ...])
        texts = [message(e) for e in node.elts]
        return None if None in texts else "\n".join(t for t in texts if t is not None)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = message(node.left), message(node.right)
        return None if left is None and right is None else (left or "{…}") + (right or "{…}")
    return None


# The config's pydantic validators raise ValueError; config/parse.py gathers every one into a single ConfigError.
WRAPPED = {"ConfigError": ("ValueError", "shardwise.config")}


def error_classes() -> tuple[dict[str, list[tuple[str, ast.ClassDef]]], dict[str, list[tuple[str, str]]]]:
    classes: dict[str, list[tuple[str, ast.ClassDef]]] = {}
    raised: dict[str, list[tuple[str, str]]] = {}
    for path in sorted(SOURCES.rglob("*.py")):
        module = path.relative_to(SOURCES.parent).with_suffix("").as_posix().replace("/", ".").removesuffix(".__init__")
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Error"):
                classes.setdefault(node.name, []).append((module, node))
            elif isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                func = node.exc.func
                name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
                for wrapper, (inner, package) in WRAPPED.items():
                    if name == inner and (module + ".").startswith(package + "."):
                        name = wrapper
                if name and name.endswith("Error"):
                    text = message(node.exc.args[0]) if node.exc.args else None
                    raised.setdefault(name, []).append((module, text if text is not None else ""))
    return classes, raised


def render_troubleshooting() -> str:
    classes, raised = error_classes()
    out = ["# Troubleshooting", "",
           "Every error shardwise raises, generated by `tools/docs_pages.py` from the error classes in `src/shardwise`",
           "and the messages they are raised with. Under each class: what it means, then what you see — each message",
           "as written in the source, `{…}` standing for the value filled in at run time. Most messages end by saying",
           "what to change. Search this page for a phrase of the message you got.", ""]
    for name in sorted(classes):
        for module, node in classes[name]:
            bases = ", ".join(f"`{ast.unparse(b)}`" for b in node.bases) or "`Exception`"
            out += [f"## {name}", "", f"`{module}.{name}` · a subclass of {bases}", ""]
            doc = ast.get_docstring(node)
            out += [doc if doc else "*(no docstring)*", ""]
        sites = raised.get(name, [])
        texts = list(dict.fromkeys(text for _, text in sites if text))  # each message once, in source order
        modules = sorted({m for m, _ in sites})
        if not sites:
            out += ["Not raised directly: a base class for the errors that name it.", ""]
            continue
        where = ", ".join(f"`{m}`" for m in modules)
        out += [f"**What you see** — raised in {len(sites)} place{'s' * (len(sites) != 1)} ({where}):", ""]
        for text in texts:
            out += ["```text", text.replace("```", "'''"), "```", ""]
        built = len(sites) - sum(1 for _, t in sites if t)
        if built:
            out += [f"*{built} more place{'s' * (built != 1)} build the message in code (see the modules above).*", ""]
    return "\n".join(out).rstrip() + "\n"


PAGES = {BENCHMARKS_PAGE: render_benchmarks, TROUBLESHOOTING_PAGE: render_troubleshooting}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", action="store_true", help="write the pages")
    action.add_argument("--check", action="store_true", help="exit 1 when a committed page is stale")
    args = parser.parse_args(argv)
    stale = []
    for page, render in PAGES.items():
        text = render()
        if page.exists() and page.read_text() == text:
            continue
        if args.write:
            page.write_text(text)
        else:
            stale.append(page.relative_to(ROOT).as_posix())
    if stale:
        print(f"stale: {', '.join(stale)}; python tools/docs_pages.py --write", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
