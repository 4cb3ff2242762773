#!/usr/bin/env bash
# Downloads, into the ignored folder .whl/, the wheels the device machine's image lacks (it has no network):
#   .whl/       what `make test-gpu` installs beside the image's torch 2.11 (pydantic and its parts);
#   .whl/peer/  the real DeepSpeed 0.19.8 and its missing needs, which only benchmarks/gpu_train.py puts on
#               its DeepSpeed children's path (the test install never sees them).
# For CPython 3.12 on x86_64 Linux, the image's Python. Idempotent: a wheel already there is not fetched again.
# The device call then names .whl in `carry` (README, "The device suite").
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# The versions this project's CI venv resolves (pydantic's parts must match pydantic exactly).
TEST_WHEELS=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
             typing-extensions==4.16.0)
PEER_WHEELS=(hjson==3.1.0)
DEEPSPEED=deepspeed==0.19.8
mkdir -p .whl/peer

download() {  # <dir> <spec>...
    local dir=$1; shift
    "$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --abi cp312 --abi abi3 --abi none --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d "$dir" "$@"
}

have() {  # <dir> <spec>: a wheel of that name and version is already in dir
    local name=${2%%==*} version=${2##*==}
    compgen -G "$1/$(echo "$name" | tr - _)-${version}-*.whl" >/dev/null
}

for spec in "${TEST_WHEELS[@]}"; do have .whl "$spec" || download .whl "$spec"; done
for spec in "${PEER_WHEELS[@]}"; do have .whl/peer "$spec" || download .whl/peer "$spec"; done
# PyPI has DeepSpeed only as a source archive: build its pure-Python wheel here (no ops compiled: it builds
# them on the device on first use, with the image's nvcc and ninja).
if ! have .whl/peer "$DEEPSPEED"; then
    build=$(mktemp -d)
    trap 'rm -rf "$build"' EXIT
    "$PYTHON" -m venv "$build/venv"
    "$build/venv/bin/pip" install -q --disable-pip-version-check setuptools wheel
    "$build/venv/bin/pip" download -q --disable-pip-version-check --no-deps --no-binary=:all: -d "$build" "$DEEPSPEED"
    # DeepSpeed's setup.py imports torch only to describe the ops it would build; with none built (DS_BUILD_OPS=0)
    # the wheel is the same for any torch, so a CPU torch stands in for the image's.
    "$build/venv/bin/pip" install -q --disable-pip-version-check "${TORCH_SPEC:-torch==2.13.0}" 2>/dev/null \
        || "$build/venv/bin/pip" install -q --disable-pip-version-check --index-url https://download.pytorch.org/whl/cpu torch
    DS_BUILD_OPS=0 "$build/venv/bin/pip" wheel -q --disable-pip-version-check --no-deps --no-build-isolation \
        -w .whl/peer "$build"/deepspeed-*.tar.gz
fi
ls -1 .whl .whl/peer
du -sh .whl | awk '{print "device wheels: " $1 " (the device call carries at most 64 MiB with the tree)"}'
