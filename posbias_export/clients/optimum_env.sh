#!/usr/bin/env bash
# The side environment Optimum needs (it pins transformers < 4.58, which the project's own
# environment is past): made once at $OPTIMUM_VENV (default .optimum-venv, git-ignored), then
# optimum_client.py (beside this file) runs in it. Used by `python -m posbias_export bench-clients`.
set -euo pipefail
venv="${OPTIMUM_VENV:-.optimum-venv}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "torch==2.13.0" "transformers>=4.50,<4.58" "optimum-onnx>=0.1,<0.2" "onnxruntime>=1.22" numpy
fi
exec "$venv/bin/python" "$(dirname "$0")/optimum_client.py" "$@"
