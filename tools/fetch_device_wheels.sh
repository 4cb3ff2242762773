#!/usr/bin/env bash
# Downloads, into the ignored folder .whl/, the wheels the device machine's image lacks (it has no network):
#   .whl/       what `make test-gpu` installs beside the image's torch 2.11 (pydantic and its parts);
#   .whl/peer/  the real DeepSpeed 0.19.8 and its missing needs, which only benchmarks/gpu_train.py puts on
#               its DeepSpeed children's path (the test install never sees them).
# For CPython 3.12 on x86_64 Linux, the image's Python. Idempotent: a wheel already there is not fetched again
# (then it takes well under a second), another version of the same package is removed (two stop an install).
# It also stamps .whl/commit.txt with this checkout's commit, which the device's copy of the tree lacks (no .git
# travels): run it right before each device call. The device call then names .whl in `carry` (docs/contributing.md,
# "The device suite").
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# The versions this project's CI venv (.venv) resolves; pydantic-core must match pydantic exactly. Of shardwise's
# needs (pyproject.toml) and tests/gpu's, the image lacks only these (the device README's KINDS.md package list);
# typing-extensions is there, but maybe older than pydantic's floor (>=4.16.0): pip takes this one only then.
TEST_WHEELS=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
             typing-extensions==4.16.0)
# DeepSpeed 0.19.8 needs einops hjson msgpack ninja numpy packaging psutil py-cpuinfo pydantic torch tqdm: the
# image has all but hjson and pydantic (pydantic comes from .whl/, which make gpu-install puts in the image).
PEER_WHEELS=(hjson==3.1.0)
DEEPSPEED=deepspeed==0.19.8
mkdir -p .whl/peer

norm() { echo "$1" | tr 'A-Z-.' 'a-z__'; }  # a project name as wheel file names spell it

download() {  # <dir> <spec>...
    local dir=$1; shift
    "$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --abi cp312 --abi abi3 --abi none --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d "$dir" "$@"
}

have() {  # <dir> <spec>: a wheel of that name and version is already in dir; other versions of it are removed
    local name=$(norm "${2%%==*}") version=${2##*==} found=1 wheel base
    for wheel in "$1"/*.whl; do
        [ -e "$wheel" ] || continue
        base=${wheel##*/}
        [ "$(norm "${base%%-*}")" = "$name" ] || continue
        base=${base#*-}
        if [ "${base%%-*}" = "$version" ]; then found=0; continue; fi
        echo "fetch_device_wheels: removing $wheel (this script wants $2)"
        rm -f "$wheel"
    done
    return $found
}

# A version bump in .venv that this list missed is said, not silently carried.
if [ -x .venv/bin/python ]; then
    for spec in "${TEST_WHEELS[@]}"; do
        got=$(.venv/bin/python -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass" "${spec%%==*}")
        [ -z "$got" ] || [ "$got" = "${spec##*==}" ] \
            || echo "fetch_device_wheels: note: .venv has ${spec%%==*} $got, this script carries ${spec##*==}" >&2
    done
fi

for spec in "${TEST_WHEELS[@]}"; do have .whl "$spec" || download .whl "$spec"; done
for spec in "${PEER_WHEELS[@]}"; do have .whl/peer "$spec" || download .whl/peer "$spec"; done
# PyPI has DeepSpeed only as a source archive: build its pure-Python wheel here with no ops compiled
# (DS_BUILD_OPS=0; it builds them on the device on first use, with the image's nvcc and ninja). Its setup.py
# imports torch only to describe the ops it would build, and the wheel holds the same files for any torch, so
# .venv's CPU torch stands in for the image's (else a throwaway venv gets one).
if ! have .whl/peer "$DEEPSPEED"; then
    build=$(mktemp -d)
    trap 'rm -rf "$build"' EXIT
    "$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --no-binary=:all: -d "$build" "$DEEPSPEED"
    builder=.venv/bin/python
    if ! "$builder" -c "import torch, setuptools" 2>/dev/null; then
        "$PYTHON" -m venv "$build/venv"
        builder=$build/venv/bin/python
        "$builder" -m pip install -q --disable-pip-version-check setuptools wheel
        "$builder" -m pip install -q --disable-pip-version-check "${TORCH_SPEC:-torch==2.13.0}" 2>/dev/null \
            || "$builder" -m pip install -q --disable-pip-version-check --index-url https://download.pytorch.org/whl/cpu torch
    fi
    DS_BUILD_OPS=0 "$builder" -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation \
        -w .whl/peer "$build"/deepspeed-*.tar.gz
    have .whl/peer "$DEEPSPEED" || { echo "fetch_device_wheels: no $DEEPSPEED wheel came out" >&2; exit 1; }
fi

# Which commit the device's copy of the tree is (tools/gpu_report.py and the benchmark read it there).
{ git rev-parse HEAD 2>/dev/null || echo unknown; } | tr -d '\n' >.whl/commit.txt
[ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] || printf -- '-dirty' >>.whl/commit.txt
printf ' stamped %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" >>.whl/commit.txt

ls -1s --block-size=K .whl/*.whl .whl/peer/*.whl
echo "commit stamp: $(cat .whl/commit.txt)"
wheels=$(du -sk .whl | cut -f1)
tree=$(git ls-files -z --cached --others --exclude-standard 2>/dev/null | xargs -0 du -ck 2>/dev/null | tail -1 | cut -f1)
echo "device wheels: $((wheels / 1024)) MiB; with the working tree that travels: $(((wheels + ${tree:-0}) / 1024)) MiB" \
     "(the limit is 64 MiB)"
