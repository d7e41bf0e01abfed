#!/usr/bin/env bash
# The headless browser tests/test_webui.py drives: Debian's chromium and chromium-driver, installed when missing and
# apt-get can run (as root, or through sudo without a password). `make test` calls it. It never fails the build:
# without the browser that test skips and says how to install it (CI sets LLM_ENGINE_REQUIRE_BROWSER=1: it fails).
set -u
say() { echo "install_browser: $*" >&2; }
if command -v chromedriver >/dev/null && { command -v chromium >/dev/null || command -v chromium-browser >/dev/null; }
then
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    say "no chromium/chromedriver and no apt-get here: tests/test_webui.py will skip"
    exit 0
fi
if [ "$(id -u)" = 0 ]; then
    sudo=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    sudo=(sudo -n)
else
    say "no chromium/chromedriver, and apt-get needs root: run 'apt-get install chromium chromium-driver' as root"
    exit 0
fi
say "installing chromium and chromium-driver with apt-get (for tests/test_webui.py)"
export DEBIAN_FRONTEND=noninteractive
if ! { "${sudo[@]}" apt-get update -qq && "${sudo[@]}" apt-get install -y -qq --no-install-recommends chromium \
        chromium-driver >/dev/null; }; then
    say "apt-get failed: tests/test_webui.py will skip"
fi
exit 0
