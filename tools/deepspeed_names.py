"""List every `deepspeed.*` name that Python scripts import or call, and whether the installed `deepspeed`
(shardwise's compatibility package) resolves it.

    python tools/deepspeed_names.py FOLDER...                       # folders on disk
    python tools/deepspeed_names.py --git-dir REPO.git training applications   # folders of a bare git dir (HEAD)
    ... --reference /work/main/.dsvenv/bin/python   # mark names DeepSpeed 0.19.8 itself lacks (fate `absent`)
    ... --write                   # also store names, files and fates in the catalogue and regenerate its page

A name is found in `import deepspeed.x [as y]`, `from deepspeed.x import y [as z]` and in attribute chains
that start at a name bound to deepspeed (`deepspeed.runtime.utils.set_random_seed(...)`, `dist.get_rank()`
after `import deepspeed.comm as dist`). Aliases are per file, not per scope: a name is over-reported rather
than missed. The fate of a name: `works` (it resolves to an implementation), `refused` (importing or
getting it raises shardwise's NotSupportedError, or it is one of `shardwise.unsupported`'s stand-ins,
which raise it when called), `absent` (missing here and in DeepSpeed 0.19.8 too, so the script fails there
alike; found with --reference) or `missing` (ImportError/AttributeError: the gap to close).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]
CATALOGUE = ROOT / "tests" / "data" / "deepspeed_examples_names.json"
PAGE = ROOT / "docs" / "reference" / "deepspeed-names.md"
STAND_IN_MODULE = "shardwise.unsupported"
NO_ARGUMENT_FACTORIES = {"get_accelerator"}  # called while resolving `get_accelerator().device_name`


def sources_from_folders(folders: list[str]) -> Iterator[tuple[str, str]]:
    for folder in folders:
        for path in sorted(Path(folder).rglob("*.py")):
            yield str(path), path.read_text(encoding="utf-8", errors="replace")


def sources_from_git(git_dir: str, rev: str, folders: list[str]) -> Iterator[tuple[str, str]]:
    listing = subprocess.run(["git", "--git-dir", git_dir, "ls-tree", "-r", "--name-only", rev, "--", *folders],
                             check=True, capture_output=True, text=True).stdout.split("\n")
    for path in sorted(p for p in listing if p.endswith(".py")):
        blob = subprocess.run(["git", "--git-dir", git_dir, "show", f"{rev}:{path}"], capture_output=True)
        if blob.returncode:  # a snapshot may lack large files
            print(f"skipped {path}: {blob.stderr.decode(errors='replace').strip()}", file=sys.stderr)
            continue
        yield path, blob.stdout.decode("utf-8", errors="replace")


def _is_deepspeed(module: str | None) -> bool:
    return module is not None and (module == "deepspeed" or module.startswith("deepspeed."))


def names_in(source: str) -> set[str]:
    """The deepspeed names one file's source imports or reaches through an attribute chain."""
    tree = ast.parse(source)
    bound: dict[str, str] = {}  # local name -> the deepspeed name it stands for
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_deepspeed(alias.name):
                    found.add(alias.name)
                    # `import deepspeed.x` binds `deepspeed`; `import deepspeed.x as y` binds y to deepspeed.x
                    bound[alias.asname or "deepspeed"] = alias.name if alias.asname else "deepspeed"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _is_deepspeed(node.module):
            for alias in node.names:
                full = node.module if alias.name == "*" else f"{node.module}.{alias.name}"
                found.add(full)
                if alias.name != "*":
                    bound[alias.asname or alias.name] = full

    def dotted(node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            return bound.get(node.id)
        if isinstance(node, ast.Attribute):
            base = dotted(node.value)
            return base and f"{base}.{node.attr}"
        if isinstance(node, ast.Call) and not node.args and not node.keywords:
            base = dotted(node.func)  # get_accelerator() is how scripts reach the accelerator's methods
            return f"{base}()" if base and base.rsplit(".", 1)[-1] in NO_ARGUMENT_FACTORIES else None
        return None

    parents = {id(child): parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    for node in ast.walk(tree):
        parent = parents.get(id(node))
        # only the longest chain counts; its prefixes are modules or classes on the way
        if isinstance(node, ast.Attribute) and not (isinstance(parent, ast.Attribute) and parent.value is node):
            name = dotted(node)
            if name:
                found.add(name)
    return found


def collect(sources: Iterator[tuple[str, str]]) -> dict[str, list[str]]:
    users: dict[str, set[str]] = defaultdict(set)
    for path, source in sources:
        try:
            names = names_in(source)
        except SyntaxError as err:  # e.g. a Python 2 file left in an example folder
            print(f"skipped {path}: {err.msg} (line {err.lineno})", file=sys.stderr)
            continue
        for name in names:
            users[name].add(path)
    return {name: sorted(users[name]) for name in sorted(users)}


def resolve(name: str) -> Any:
    """Import the longest module prefix of `name`, then getattr the rest, as a script's use of it would."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as err:
            if err.name is None or not ".".join(parts[:cut]).startswith(err.name):
                raise  # a module that exists but fails to import its own dependencies
            continue
        for attr in parts[cut:]:
            if attr != "*":
                obj = getattr(obj, attr.removesuffix("()"))
                obj = obj() if attr.endswith("()") and attr[:-2] in NO_ARGUMENT_FACTORIES else obj
        return obj
    raise ModuleNotFoundError(name)


def is_stand_in(obj: Any) -> bool:
    return getattr(obj, "__module__", None) == STAND_IN_MODULE and callable(obj)


def fate(name: str) -> tuple[str, str]:
    """(`works` | `refused` | `missing`, the reason or error)."""
    from shardwise.unsupported import NotSupportedError
    try:
        obj = resolve(name)
    except NotSupportedError as err:
        return "refused", str(err)
    except (ImportError, AttributeError) as err:
        return "missing", f"{type(err).__name__}: {err}"
    if is_stand_in(obj):
        try:
            obj()
        except NotSupportedError as err:
            return "refused", str(err)
        return "missing", "a stand-in that did not refuse"
    return "works", ""


def absent_in_reference(python: str, names: list[str]) -> dict[str, str]:
    """{name: its error} for the names that do not resolve under `python` (an interpreter with real DeepSpeed)."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from deepspeed_names import resolve\n"
            "out = {}\nfor n in json.loads(sys.stdin.read()):\n try: resolve(n)\n"
            " except (ImportError, AttributeError) as e: out[n] = f'{type(e).__name__}: {e}'\nprint(json.dumps(out))")
    done = subprocess.run([python, "-c", code, str(Path(__file__).parent)], input=json.dumps(names), check=True,
                          capture_output=True, text=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    return json.loads(done.stdout.strip().splitlines()[-1])


def page(catalogue: dict) -> str:
    lines = ["# DeepSpeed names used by DeepSpeedExamples (and DeepSpeed-Chat)", "",
             f"Generated by `tools/deepspeed_names.py --write` from `{catalogue['source']}` "
             f"(folders: {', '.join(catalogue['folders'])}); the catalogue is "
             "`tests/data/deepspeed_examples_names.json` and `tests/compat/test_examples_names.py` checks each fate.",
             "", "`works`: the name resolves to shardwise's implementation. `refused`: importing, building or calling "
             "it raises `NotSupportedError` with the reason and what to use instead. `absent`: DeepSpeed 0.19.8 lacks "
             "it too (the script fails there alike), so it is absent here as well.", "",
             "| name | fate | used by |", "| --- | --- | --- |"]
    for name, entry in catalogue["names"].items():
        fate_text = (entry["fate"] + (f": {entry['why']}" if entry["why"] else "")).replace("|", r"\|")
        lines.append(f"| `{name}` | {fate_text} | {', '.join(entry['files'])} |")
    counts = defaultdict(int)
    for entry in catalogue["names"].values():
        counts[entry["fate"]] += 1
    lines += ["", "Totals: " + ", ".join(f"{count} {what}" for what, count in sorted(counts.items())), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", help="folders to scan (inside --git-dir when given)")
    parser.add_argument("--git-dir", help="a (bare) git directory to read the folders from, with git show")
    parser.add_argument("--rev", default="HEAD")
    parser.add_argument("--source", help="where the files came from, for the catalogue (default: --git-dir@commit)")
    parser.add_argument("--reference", help="a Python with DeepSpeed 0.19.8, to tell `absent` names from `missing`")
    parser.add_argument("--write", action="store_true", help=f"store {CATALOGUE.name} and regenerate {PAGE.name}")
    args = parser.parse_args(argv)
    if args.git_dir:
        sources = sources_from_git(args.git_dir, args.rev, args.folders)
        commit = subprocess.run(["git", "--git-dir", args.git_dir, "rev-parse", args.rev], check=True,
                                capture_output=True, text=True).stdout.strip()
        source = args.source or f"{args.git_dir}@{commit}"
    else:
        sources, source = sources_from_folders(args.folders), args.source or "local folders"
    names = collect(sources)
    catalogue = {"source": source, "folders": args.folders, "names": {}}
    fates = {name: fate(name) for name in names}
    unresolved = [name for name, (what, _) in fates.items() if what == "missing"]
    if args.reference and unresolved:
        for name, error in absent_in_reference(args.reference, unresolved).items():
            fates[name] = ("absent", f"DeepSpeed 0.19.8 lacks it too ({error})")
    for name, files in names.items():
        what, why = fates[name]
        catalogue["names"][name] = {"fate": what, "why": why, "files": files}
        print(f"{what:8} {name}  [{len(files)} file(s): {', '.join(files[:3])}{' ...' if len(files) > 3 else ''}]"
              + (f"\n         {why}" if why else ""))
    missing = [n for n, e in catalogue["names"].items() if e["fate"] == "missing"]
    print(f"{len(names)} names, {len(missing)} missing", file=sys.stderr)
    if args.write:
        CATALOGUE.write_text(json.dumps(catalogue, indent=1) + "\n")
        PAGE.write_text(page(catalogue))
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
