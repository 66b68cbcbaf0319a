#!/usr/bin/env bash
# The GPU check, one script, at most 8 minutes: every `gpu`-marked test, then a short bf16-mixed
# throughput comparison on one GPU (two pipeline ranks sharing it against one process,
# benchmarks/gpu_precision_throughput.py), printing its figures. Every part runs even when an
# earlier one fails; the exit status is non-zero if any failed.
#
#   bash benchmarks/gpu_check.sh
#
# Python: $PYTHON if set, else python3 if it imports torch with CUDA and lightning; the package
# itself is taken from this clone (PYTHONPATH), so nothing needs installing. Otherwise (a bare
# machine with network access) a virtual environment is made in .venv and torch, lightning and
# this package are installed into it from PyPI.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
end=$((SECONDS + 470))
status=0

python=${PYTHON:-python3}
ready='import torch, lightning, hydra; assert torch.cuda.is_available(), "no CUDA device"'
if ! "$python" -c "$ready" 2>/dev/null; then
    echo "== $python lacks torch with CUDA or lightning: installing into $repo/.venv"
    [ -x .venv/bin/python ] || python3 -m venv .venv || exit 2
    python=$repo/.venv/bin/python
    "$python" -m pip install --quiet --upgrade pip &&
        "$python" -m pip install --quiet "torch>=2.4,<=2.14.1" &&
        "$python" -m pip install --quiet -e ".[test]" || exit 2
    "$python" -c "$ready" || exit 2
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}

echo "== machine"
nvidia-smi -L 2>/dev/null || true
"$python" -c 'import torch, lightning; print("torch", torch.__version__, "cuda", torch.version.cuda, "lightning", lightning.__version__, "gpus", torch.cuda.device_count())'
git log -1 --format='commit %h %s' 2>/dev/null || true

echo "== gpu-marked tests (pytest -m gpu)"
parallel=()  # four test processes share the GPU where pytest-xdist is there
"$python" -c 'import xdist' 2>/dev/null && parallel=(-n 4)
timeout 300 "$python" -m pytest -q -m gpu -p no:cacheprovider "${parallel[@]}" tests || status=1

left=$((end - SECONDS))
echo "== bf16-mixed throughput, one GPU (${left} s left)"
if [ "$left" -gt 30 ]; then
    timeout "$left" "$python" benchmarks/gpu_precision_throughput.py --steps 24 || status=1
else
    echo "skipped: no time left"
    status=1
fi
echo "== gpu_check: $([ "$status" -eq 0 ] && echo passed || echo FAILED)"
exit "$status"
