#!/usr/bin/env bash
# Check titanctl against another torch release: `make test-torch TORCH=2.15.0` (or run this directly).
#
#   scripts/test_torch.sh VERSION [--no-smoke] [extra pytest args...]
#
# Builds a scratch venv with torch==VERSION and the rest of constraints.txt (its torch line swapped),
# runs the in-process tests (as `make test-fast` does), then a distributed smoke run under torchrun
# (scripts/torch_smoke.py: one process, FSDP 2, TP 2, losses compared). The venv lives outside the
# repository, under $TITANCTL_TORCH_VENVS (default ~/.cache/titanctl/torch-venvs): a torch
# from PyPI is a CUDA build of several GB. It is reused by later runs of the same version.
set -euo pipefail

if [[ $# -lt 1 || "$1" == -* ]]; then
    echo "usage: $0 VERSION [--no-smoke] [pytest args...]   (e.g. $0 2.15.0)" >&2
    exit 2
fi
TORCH_VERSION="$1"
shift
SMOKE=1
if [[ "${1:-}" == "--no-smoke" ]]; then
    SMOKE=0
    shift
fi

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ROOT="${TITANCTL_TORCH_VENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/titanctl/torch-venvs}"
VENV="$ROOT/torch-$TORCH_VERSION"
PYTHON="${PYTHON:-python3}"
case "$VENV/" in
    "$REPO"/*) echo "refusing to build a multi-GB venv inside the repository: $VENV" >&2; exit 2 ;;
esac

mkdir -p "$ROOT"
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)

# The project's pins with only the torch line changed, so any difference seen is torch's.
CONSTRAINTS="$VENV/constraints.txt"
grep -v '^torch==' "$REPO/constraints.txt" > "$CONSTRAINTS.new"
echo "torch==$TORCH_VERSION" >> "$CONSTRAINTS.new"
mv "$CONSTRAINTS.new" "$CONSTRAINTS"
# pip reads PIP_CONSTRAINT in place of a `constraint` set in a pip config file: a machine-wide cap
# such as torch<=2.14.1 would otherwise refuse the version asked for.
export PIP_CONSTRAINT="$CONSTRAINTS"

STAMP="$VENV/.installed-$(cat "$CONSTRAINTS" "$REPO/pyproject.toml" | sha256sum | cut -c1-16)"
if [[ ! -e "$STAMP" ]]; then
    echo "== installing torch $TORCH_VERSION and titanctl's dependencies into $VENV"
    "${PIP[@]}" "torch==$TORCH_VERSION"
    (cd "$REPO" && "${PIP[@]}" -e ".[test]")
    "$VENV/bin/python" -m pip check
    rm -f "$VENV"/.installed-*
    touch "$STAMP"
fi

cd "$REPO"
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import torch
print(f"== torch {torch.__version__} (CUDA build: {torch.version.cuda or 'no'}), torchao {md.version('torchao')}, "
      f"numpy {md.version('numpy')}, transformers {md.version('transformers')}")
EOF

echo "== in-process tests (TITANCTL_FAST_TESTS=1 pytest -m 'not slow')"
status=0
TITANCTL_FAST_TESTS=1 "$VENV/bin/python" -m pytest tests -q -m "not slow" -p no:cacheprovider "$@" || status=$?

if [[ "$SMOKE" == 1 ]]; then
    echo "== distributed smoke (torchrun: one process, FSDP 2, TP 2)"
    "$VENV/bin/python" scripts/torch_smoke.py || status=$?
fi
exit "$status"
