#!/usr/bin/env bash
# Install llama-cpp-python[server] into the active environment from a cached wheel.
#
# llama-cpp-python ships no binary wheel on PyPI: it compiles llama.cpp from source
# (about 4.5 minutes on an idle 2-core machine). Build it once into $CACHE and reuse it; the
# server extra's own dependencies (fastapi, uvicorn, sse-starlette, ...) are wheels.
# tests/engines/test_openai_engine.py starts `python -m llama_cpp.server` on the default GGUF.
#
#   CACHE=~/.cache/convo-ci/wheels .ci/llama_cpp_wheel.sh
set -euo pipefail

VERSION=0.3.36
CACHE=${CACHE:-$HOME/.cache/convo-ci/wheels}
PY=${PYTHON:-python}
mkdir -p "$CACHE"

if ! ls "$CACHE"/llama_cpp_python-"$VERSION"-*.whl >/dev/null 2>&1; then
  echo "+ building llama-cpp-python==$VERSION into $CACHE (once; several minutes)"
  # A CPU build with the portable defaults; the wheel is tied to this Python and platform.
  CMAKE_ARGS=${CMAKE_ARGS:-"-DGGML_NATIVE=OFF"} \
    "$PY" -m pip wheel --no-deps "llama-cpp-python==$VERSION" -w "$CACHE"
fi
wheel=$(ls "$CACHE"/llama_cpp_python-"$VERSION"-*.whl | head -n 1)
"$PY" -m pip install "$wheel" "llama-cpp-python[server]==$VERSION"
"$PY" -c "import llama_cpp, llama_cpp.server; print('llama-cpp-python', llama_cpp.__version__)"
