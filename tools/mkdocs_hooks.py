"""MkDocs hook (mkdocs.yml `hooks:`): the benchmark plots, which live in benchmarks/results, become site files
under benchmarks/, where docs/benchmarks.md (tools/docs_pages.py) links them. Taking them from where the
benchmarks write them keeps one copy of each binary in the repository, and strict mode still checks every link.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def on_files(files: Files, config: MkDocsConfig) -> Files:
    for png in sorted(RESULTS.rglob("*.png")):
        files.append(File.generated(config, f"benchmarks/{png.relative_to(RESULTS).as_posix()}", abs_src_path=str(png)))
    return files
