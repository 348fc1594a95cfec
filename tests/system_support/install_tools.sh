#!/usr/bin/env bash
# Install the system tools the tests use beyond Python: strace (tests/test_hostile_writes.py traces
# what a command writes) and setpriv (runs a command without root's right to read any file).
# Needs root and apt-get for what is missing; elsewhere it says so and those tests skip, except
# under CI (NODERAG_REQUIRE_TOOLS=1), where a missing tool fails them.
set -euo pipefail

missing=()
command -v strace >/dev/null 2>&1 || missing+=(strace)
command -v setpriv >/dev/null 2>&1 || missing+=(util-linux)
if [ ${#missing[@]} -eq 0 ]; then
    echo "install_tools: strace and setpriv already installed"
    exit 0
fi
if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install_tools: not root or no apt-get; install ${missing[*]} to run the tests that trace writes" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install_tools: installed ${missing[*]}"
