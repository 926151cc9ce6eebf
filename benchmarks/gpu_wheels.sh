#!/usr/bin/env bash
# Download, here, the wheels benchmarks/gpu_session.sh installs on a GPU machine that cannot reach a package
# index (MILI's dependencies its image lacks), for CPython 3.12 on x86-64 Linux, into an ignored folder:
#
#   bash benchmarks/gpu_wheels.sh [DIR]        # default DIR: .whl/gpu_session (/.whl/ is in .gitignore)
#
# Then on the GPU machine, with DIR carried along:  bash benchmarks/gpu_session.sh --wheels DIR
# Each wheel is --no-deps: the list names every package the image lacks (its dependencies that the image has,
# e.g. anyio, h11, click, annotated-doc, numpy, einops, are not fetched). One version of each: two stop the install.
# Also writes DIR/COMMIT (this checkout's commit, "+dirty" when it has uncommitted changes), which gpu_session.sh
# prints where the copy it runs in has no .git. Override the Python with PY_VERSION=3.11 and so on.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-.whl/gpu_session}"
PY_VERSION="${PY_VERSION:-3.12}"
# the API server (fastapi >= 0.165 needs opentelemetry-api), the engine's IPC and messages, grammars, GGUF,
# and fla-core (the hybrids' Gated DeltaNet on CUDA)
PACKAGES=(
  fastapi==0.165.0 starlette==1.10.0 opentelemetry-api==1.45.2
  pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 typing-extensions==4.16.0
  uvicorn==0.54.0 httptools==0.9.0
  pyzmq==27.3.0 msgspec==0.22.0
  xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
  gguf==0.19.0
  fla-core==0.6.0
)
mkdir -p "$DIR"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
  "${platforms[@]}" -d "$DIR" "${PACKAGES[@]}" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
commit="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
if [ "$commit" != unknown ] && [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
  commit="$commit+dirty"
fi
echo "$commit" > "$DIR/COMMIT"
ls -1 "$DIR"
# what a device call sends: the tracked files (those present), the untracked ones git does not ignore, and DIR
sizes() { { xargs -0 stat -c %s 2>/dev/null || true; } | awk '{s += $1} END {printf "%.1f", s / 1048576}'; }
tracked=$(git ls-files -z | sizes)
untracked=$(git ls-files -z -o --exclude-standard | sizes)
wheels=$(find "$DIR" -type f -print0 | sizes)
total=$(awk "BEGIN {printf \"%.1f\", $tracked + $untracked + $wheels}")
echo "a device call with $DIR carried sends about $total MiB (tracked $tracked, untracked $untracked, wheels $wheels)"
if awk "BEGIN {exit !($total >= 64)}"; then
  echo "WARNING: over the device tool's 64 MiB: for the call, move mili/demo/checkpoint-hybrid/model.safetensors" \
       "(unused by gpu_session.sh and selftest) into .whl/aside/ (ignored, not carried), and back after"
fi
