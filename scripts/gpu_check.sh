#!/usr/bin/env bash
# The GPU check (docs/gpu.md): every step of titanctl on this machine's GPU, timed, in one command that
# ends within 9 minutes, writing gpu_check.json and gpu_check.log into $OUT (or --out DIR).
#
#   scripts/gpu_check.sh [--device cuda|cpu] [--out DIR] [--only STEP,...] [--budget STEP=SECONDS] ...
#
# --device cpu runs the same steps with debug shapes on the CPU (under 3 minutes on 2 cores). The
# Python is $PYTHON, else this checkout's .venv, else python3 (a GPU image's own, with its torch).
# Options: scripts/gpu_check.py --help.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONUNBUFFERED=1
exec "$PYTHON" scripts/gpu_check.py "$@"
