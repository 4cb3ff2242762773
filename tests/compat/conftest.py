"""tests/compat runs scripts written for DeepSpeed against shardwise's compatibility package: it must be
installed in this venv (`make install` does it), or every test here fails with the reason."""

from __future__ import annotations

import importlib.metadata

import pytest


@pytest.fixture(scope="session", autouse=True)
def compat_package_installed() -> None:
    try:
        version = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version is None or not version.endswith("+shardwise"):
        pytest.fail(f"tests/compat needs shardwise's `deepspeed` compatibility package in this venv (found "
                    f"{version or 'no deepspeed'}): pip install -e ./compat/deepspeed, or make install.",
                    pytrace=False)
