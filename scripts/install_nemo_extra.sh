#!/usr/bin/env bash
# A separate virtualenv with ds_capture and NeMo AutoModel 0.7.0's model code (the `nemo` extra), CPU only.
#
#   bash scripts/install_nemo_extra.sh [VENV]     # default VENV: /work/nemo_venv
#
# torch goes in first as the CPU 2.13.0 build (any other spec pulls a multi-GB CUDA build); then the project with
# its `nemo` extra; then nemo_automodel without its dependencies, because it pins transformers==5.18.0 against this
# project's 5.24 (pip cannot resolve both) and pulls a GPU stack the model classes do not need on CPU.
set -euo pipefail
VENV="${1:-/work/nemo_venv}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
python3 -m venv "$VENV"
"$VENV/bin/pip" install torch==2.13.0
"$VENV/bin/pip" install "$ROOT[nemo,test]"
"$VENV/bin/pip" install --no-deps nemo_automodel==0.7.0
