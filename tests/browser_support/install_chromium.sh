#!/usr/bin/env bash
# Install what the page tests (tests/test_explain.py) need: Debian's Chromium, driven by Playwright
# (its Python package is in the test extra; Playwright's own browser download is never used).
# Needs root and apt-get; elsewhere it says so and the page tests skip, except under CI
# (NODERAG_REQUIRE_BROWSER=1), where a missing browser fails them.
set -euo pipefail

if command -v chromium >/dev/null 2>&1; then
    echo "install_chromium: $(command -v chromium) already installed"
    exit 0
fi
if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install_chromium: not root or no apt-get; install Debian's chromium to run the page tests" >&2
    exit 0
fi
echo "install_chromium: installing Debian's chromium (about a minute)..."
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends chromium >/dev/null
echo "install_chromium: $(chromium --version)"
