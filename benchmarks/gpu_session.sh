#!/usr/bin/env bash
# One prepared run for a session lent an NVIDIA H100/H200 (issue 58): in under 8 minutes, one table of the copy
# roofline and batch-1 decode roofline, the Triton decode attention's GB/s, batch-1 / batch-64 / nano-vllm's
# workload through LLM.generate, a `mili serve` run under `mili bench serve` with each process's CPU per token,
# and the embeddings row. benchmarks/gpu_session.py says how each row is measured.
#
#   here, once:        bash benchmarks/gpu_wheels.sh            # wheels the GPU image lacks -> .whl/gpu_session
#   on the GPU:        bash benchmarks/gpu_session.sh --wheels .whl/gpu_session [--logs DIR]
#                      (the device tool: carry [".whl/gpu_session"], and --logs "$OUT" to bring back the logs)
#   on any CPU:        bash benchmarks/gpu_session.sh --tiny      # every row, tiny (tests/e2e/test_gpu_session.py)
#
# --wheels DIR (or MILI_WHEELS=DIR): pip-installs DIR/*.whl (--no-index --no-deps) into a folder put first on
# PYTHONPATH (MILI_WHEELS_TARGET, default /tmp/mili-wheels), leaving the image's packages alone. Without it, or
# with wheels missing, the packages MILI needs that cannot be imported are named (the rows that need them fail).
# The commit printed is $MILI_GIT_COMMIT, else git's; and DIR/COMMIT's (written by gpu_wheels.sh) beside it.
# Other arguments go to benchmarks/gpu_session.py (--model PATH, --budget S, --logs DIR).
set -uo pipefail
start=$SECONDS
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null || PY=python
wheels="${MILI_WHEELS:-}"
tiny=0
budget=""
rest=()
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) wheels="$2"; shift 2 ;;
    --wheels=*) wheels="${1#--wheels=}"; shift ;;
    --tiny) tiny=1; rest+=("$1"); shift ;;
    --budget) budget="$2"; shift 2 ;;
    -h|--help) sed -n '2,17p' "$0"; exec "$PY" benchmarks/gpu_session.py --help ;;
    *) rest+=("$1"); shift ;;
  esac
done

if [ -n "$wheels" ]; then
  if ! ls "$wheels"/*.whl >/dev/null 2>&1; then
    echo "ERROR: --wheels $wheels holds no .whl files (run benchmarks/gpu_wheels.sh here and carry the folder)" >&2
  else
    target="${MILI_WHEELS_TARGET:-/tmp/mili-wheels}"
    echo "installing $(ls "$wheels"/*.whl | wc -l) wheels from $wheels into $target ..." >&2
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" \
         "$wheels"/*.whl >&2; then
      export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
    else
      echo "ERROR: pip could not install the wheels in $wheels" >&2
    fi
  fi
  if [ -f "$wheels/COMMIT" ]; then  # (the device tool's copy may carry an older .git: both are printed)
    MILI_WHEELS_COMMIT="$(cat "$wheels/COMMIT")"
    export MILI_WHEELS_COMMIT
  fi
fi

# what MILI imports that the GPU image lacks: the offline engine needs msgspec; the server the rest
"$PY" - <<'EOF' >&2
import importlib.util
need = {"msgspec": "every engine row", "fastapi": "serve", "starlette": "serve", "pydantic": "serve",
        "uvicorn": "serve", "zmq": "serve (pyzmq)", "opentelemetry": "serve (fastapi >= 0.165)",
        "xgrammar": "structured outputs (no row)", "gguf": "GGUF files (no row)",
        "fla": "hybrids on CUDA (fla-core, no row)", "torch": "every row", "transformers": "every row"}
missing = [f"{m} ({why})" for m, why in need.items() if importlib.util.find_spec(m) is None]
if missing:
    print("MISSING packages: " + ", ".join(missing) + " -- carry them as wheels: bash benchmarks/gpu_wheels.sh here, "
          "then --wheels .whl/gpu_session there")
EOF

if [ -z "$budget" ]; then
  if [ "$tiny" = 1 ]; then budget=600; else budget=$((465 - (SECONDS - start))); fi
fi
exec "$PY" benchmarks/gpu_session.py --budget "$budget" "${rest[@]}"
