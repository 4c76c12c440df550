#!/usr/bin/env bash
# The GPU check (issue 7): on a machine with an NVIDIA GPU and its own PyTorch. It installs the
# worker's other packages from wheels carried beside it (scripts/gpu_wheels.sh makes them), runs
# tests/gpu/ (embedded Redis + a real prefork worker: CUDA in the sandbox, timm and HF training
# through run_round, place_model offload with 1 GiB of VRAM left, a real gpu_oom, a stop during
# a GPU kernel loop, memory after reset), then bench.gpu (executor vs bare loop steps/s), and
# prints one table last (with load-to-first-step and the hash schemes' throughput). Bounded at
# 500 s of stages (one call of the device tool).
#   scripts/gpu_check.sh [wheel dir, default .whl]
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=${1:-.whl}
PY=${PYTHON:-python3}
mkdir -p var/gpu
export ROUNDHOUSE_GPU_RESULTS=$PWD/var/gpu/results.jsonl PYTHONUNBUFFERED=1
rm -f "$ROUNDHOUSE_GPU_RESULTS" var/gpu/*.log
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target var/gpu/site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=$PWD/var/gpu/site:$PYTHONPATH
fi
if ! command -v bwrap >/dev/null 2>&1 && ls "$WHEELS"/bubblewrap_*.deb >/dev/null 2>&1; then
  dpkg -x "$WHEELS"/bubblewrap_*.deb var/gpu/bwrap && export PATH=$PWD/var/gpu/bwrap/usr/bin:$PATH
fi
# What the sandbox depends on, written down first: the machine is lent for minutes.
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  echo "kernel $(uname -r), $(nproc) cores"
  for tool in bwrap setpriv prlimit unshare curl nginx openssl; do echo "$tool: $(command -v $tool || echo missing)"; done
  $PY -c "import sys, sysconfig; print('python', sys.executable, 'base', sys.base_prefix, 'purelib', sysconfig.get_paths()['purelib'])"
  echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
  ldconfig -p | grep -E 'libcuda\.so|libnvidia-ml' || echo "libcuda: not in ld.so.cache"
  ls -ld /dev/nvidia* 2>&1
  grep cgroup /proc/mounts; cat /proc/self/cgroup
} 2>&1 | tee var/gpu/diag.log
$PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, torch.cuda.get_device_name(0))" || exit 1
# Each stage has its own bound, so that all of them fit in one 10-minute call of the device tool.
# GPU_CHECK_STAGES picks some (a rerun within what is left of a session's device time).
STAGES=" ${GPU_CHECK_STAGES:-tests bench bench_off first_step hashes overlap} "
tests=0 bench=0
if [[ $STAGES == *" tests "* ]]; then
  timeout 270 $PY -m pytest -q -p no:cacheprovider -rs tests/gpu 2>&1 | tee var/gpu/pytest.log
  tests=${PIPESTATUS[0]}
fi
if [[ $STAGES == *" bench "* ]]; then
  timeout 100 $PY -m bench.gpu --steps ${GPU_CHECK_STEPS:-40} --runs 2 2>&1 | tee -a var/gpu/bench.log
  bench=${PIPESTATUS[0]}
fi
# The same loop with the sandbox off: what of a gap is the sandbox's and what the executor's.
if [[ $STAGES == *" bench_off "* ]]; then
  timeout 60 $PY -m bench.gpu --steps ${GPU_CHECK_STEPS:-40} --runs 1 --sandbox off 2>&1 | tee -a var/gpu/bench.log
fi
# Issue 15: load_model sent -> the tenant's first emit_stats after one step on the GPU, against
# curl + a bare load to the device; and both state hash schemes on this host's cores.
if [[ $STAGES == *" first_step "* ]]; then
  timeout 90 $PY -m bench.first_step --mb 2048 --runs 2 2>&1 | tee -a var/gpu/bench.log
fi
if [[ $STAGES == *" hashes "* ]]; then
  timeout 40 $PY -m bench.hashes --mb 2048 2>&1 | tee -a var/gpu/bench.log
fi
# Issue 28: overlapped rounds against sequential ones, side by side on this machine (the demo's
# cluster: real workers, sandboxed; docs/OVERLAP.md): each run's wall time and final loss.
if [[ $STAGES == *" overlap "* ]]; then
  for mode in "" "--overlap"; do
    started=$(date +%s.%N)
    timeout 60 $PY -m orchestrator.cli demo --rounds 6 --steps 25 $mode --out var/gpu/demo$mode 2>&1 \
      | grep -E "^round|loss fell" | tee -a var/gpu/bench.log
    echo "demo ${mode:-sequential}: $(echo "$(date +%s.%N) - $started" | bc) s" | tee -a var/gpu/bench.log
  done
fi
$PY -m bench.gpu --table | tee var/gpu/table.txt
if [ -n "${OUT:-}" ]; then cp var/gpu/*.log var/gpu/table.txt var/gpu/results.jsonl "$OUT"/ 2>/dev/null; fi
echo "tests exit $tests, bench exit $bench"
[ "$tests" = 0 ] && [ "$bench" = 0 ]
