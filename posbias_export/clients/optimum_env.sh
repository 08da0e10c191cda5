#!/usr/bin/env bash
# The side environment Optimum needs (it pins transformers < 4.58, which the project's own
# environment is past): made once at $OPTIMUM_VENV (default .optimum-venv, git-ignored), then
# optimum_client.py (beside this file) runs in it (`bench-clients`); with `embed` as the first
# argument, embed_client.py (sentence-transformers' ONNX backend on an embedder folder) instead;
# with `make`, only the environment.
set -euo pipefail
venv="${OPTIMUM_VENV:-.optimum-venv}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "torch==2.13.0" "transformers>=4.50,<4.58" "optimum-onnx>=0.1,<0.2" "onnxruntime>=1.22" numpy \
    "sentence-transformers>=5,<7"
fi
if [ "${1:-}" = make ]; then  # the environment only (tests make it once)
  exit 0
fi
if [ "${1:-}" = embed ]; then
  shift
  exec "$venv/bin/python" "$(dirname "$0")/embed_client.py" "$@"
fi
exec "$venv/bin/python" "$(dirname "$0")/optimum_client.py" "$@"
