#!/usr/bin/env bash
# One check of ringflash's sequence parallelism on a machine with several GPUs, from the repository
# root:
#
#   OUT=/some/dir bash bench/multi_gpu_check.sh
#
# Stages (env STAGES, default all five, in this order):
#   build    bench/device_check.sh's build stage (STAGES=build, the same environment: CUDA_ARCH,
#            CMAKE_DEFINES, JOBS, BUILD_TIMEOUT), with the NCCL transport required
#            (RINGFLASH_NCCL=ON unless CMAKE_DEFINES sets RINGFLASH_NCCL); log in $OUT/build.log;
#            then checks that the installed package has NCCL
#   test     pytest tests/python/test_gpu_parallel.py -x -q (2 GPUs: every strategy against the
#            single-GPU kernels, CUDA graph capture, a silent peer), log in $OUT/test_gpu_parallel.log
#   bench    torchrun --nproc_per_node=$NGPU bench/cp_bench.py: ringflash's strategies on NGPU GPUs
#            against ringflash on one, log in $OUT/cp_bench.log, results in $OUT/cp_bench.json
#   peer     torchrun --nproc_per_node=$NGPU $PEER_DIR/torch_cp_bench.py: torch's own context
#            parallelism (flash and cuDNN), log in $OUT/torch_cp.log, results in $OUT/torch_cp_w$NGPU.json
#   compare  bench/cp_compare.py: the two side by side, log in $OUT/cp_compare.log, table in
#            $OUT/cp_compare.json
# Every stage runs even when an earlier one failed; the summary ($OUT/multi_gpu_summary.txt,
# rewritten after each stage; device_check.sh's build writes its own summary.txt) is printed last,
# and the exit status is non-zero if any stage failed. Where one command may only run for a limited
# time, split the stages over calls (STAGES="build", STAGES="test bench", STAGES="peer compare"):
# later stages use the package that the build installed, and compare reads the JSON files in $OUT.
# NVLink multicast (NVLS) stays off: NCCL_NVLS_ENABLE=0 is exported for every stage. The stage
# framework (records, summary, timeouts) is bench/stages.sh, shared with bench/device_check.sh.
#
# Environment:
#   OUT              where logs go (default ./multi-gpu-check-out)
#   STAGES           e.g. "test bench" (default "build test bench peer compare")
#   NGPU             ranks for bench and peer (default: every visible GPU); test uses 2
#   PEER_DIR         where torch_cp_bench.py is (default shared/peers under the repository root if
#                    it exists, else ../shared/peers)
#   PYTEST_ARGS      default "-x -q"
#   CP_BENCH_ARGS    extra flags for bench/cp_bench.py (e.g. "--strategies zigzag,ring,ulysses,hybrid:2,hybrid:4")
#   TEST_TIMEOUT, BENCH_TIMEOUT, PEER_TIMEOUT, COMPARE_TIMEOUT   seconds per stage (timeout(1));
#                    the build's is device_check.sh's BUILD_TIMEOUT
set -u -o pipefail

export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0
PYTHON=${PYTHON:-python3}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-$PWD/multi-gpu-check-out}
STAGES=${STAGES:-build test bench peer compare}
PYTEST_ARGS=${PYTEST_ARGS:--x -q}
CP_BENCH_ARGS=${CP_BENCH_ARGS:-}
TEST_TIMEOUT=${TEST_TIMEOUT:-600}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-900}
PEER_TIMEOUT=${PEER_TIMEOUT:-900}
COMPARE_TIMEOUT=${COMPARE_TIMEOUT:-120}
KILL_AFTER=30  # seconds between timeout(1)'s SIGTERM and its SIGKILL
if [[ -z ${PEER_DIR:-} ]]; then
  if [[ -d $ROOT/shared/peers ]]; then PEER_DIR=$ROOT/shared/peers; else PEER_DIR=$ROOT/../shared/peers; fi
fi
PEER_DIR=$(cd "$PEER_DIR" 2>/dev/null && pwd || echo "$PEER_DIR")  # absolute: the peer runs from $OUT

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: the stages run from other directories
cd "$ROOT" || exit 1
# shellcheck source=bench/stages.sh
source "$ROOT/bench/stages.sh"
stages_init "$OUT/multi_gpu_summary.txt" multi_gpu_check 8 \
  "$OUT/cp_bench.log" "### cp_bench table" "$OUT/cp_compare.log" "### cp_compare table"

environment_banner
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader 2>&1 || echo "nvidia-smi failed"
nvidia-smi topo -m 2>&1 | head -n 20
$PYTHON -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__,
      '| CUDA', torch.version.cuda, '| NCCL', torch.cuda.nccl.version() if torch.cuda.is_available() else '-',
      '| devices', torch.cuda.device_count())" 2>&1
NGPU=${NGPU:-$($PYTHON -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)}
echo "stages: $STAGES | OUT=$OUT | NGPU=$NGPU | PEER_DIR=$PEER_DIR | NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE"
# torchrun, from the same Python as the rest; --standalone picks a free port on this host.
TORCHRUN=($PYTHON -m torch.distributed.run --standalone "--nproc_per_node=$NGPU")

# ---- build -------------------------------------------------------------------------------------
if wants build; then
  banner "build: bench/device_check.sh STAGES=build, NCCL required"
  defines=${CMAKE_DEFINES:-}
  [[ " $defines " == *" RINGFLASH_NCCL="* ]] || defines+=" RINGFLASH_NCCL=ON"
  start=$SECONDS
  STAGES=build OUT="$OUT" CMAKE_DEFINES="$defines" bash "$ROOT/bench/device_check.sh"
  rc=$?
  build_s=$((SECONDS - start))
  # From $OUT, so that the installed package is imported, not a source tree.
  nccl=$(cd "$OUT" && $PYTHON -c "
import ringflash
print('ok' if ringflash.has_nccl() else 'has_nccl() is False: ' + ' '.join(
    line for line in ringflash.build_info().splitlines() if line.startswith('nccl')))" 2>&1 | tail -n 1)
  if [[ $rc -eq 0 && $nccl == ok ]]; then
    record build ok "${build_s} s; CUDA and NCCL (details in build.log and summary.txt)"
  elif [[ $rc -eq 0 ]]; then
    record build FAILED "${build_s} s; built, but $nccl"
  else
    record build FAILED "device_check.sh build: $(status_text $rc) after ${build_s} s (see build.log, summary.txt)"
  fi
fi

# ---- test --------------------------------------------------------------------------------------
if wants test; then
  banner "test: pytest tests/python/test_gpu_parallel.py $PYTEST_ARGS"
  # -rs lists skip reasons: a run where the whole file skips (fewer than 2 GPUs, no NCCL) must not
  # look like a pass.
  # shellcheck disable=SC2086
  pytest_stage test "$OUT/test_gpu_parallel.log" "$TEST_TIMEOUT" skips-fail \
    $PYTHON -m pytest tests/python/test_gpu_parallel.py $PYTEST_ARGS -rs -p no:cacheprovider
fi

# ---- bench: ringflash --------------------------------------------------------------------------
if wants bench; then
  banner "bench: torchrun --nproc_per_node=$NGPU bench/cp_bench.py $CP_BENCH_ARGS"
  start=$SECONDS
  if [[ $NGPU -lt 1 ]]; then
    record bench FAILED "no GPU (NGPU=$NGPU)"
  else
    rm -f "$OUT/cp_bench.json"
    # shellcheck disable=SC2086
    run_logged "$OUT/cp_bench.log" "$BENCH_TIMEOUT" "${TORCHRUN[@]}" bench/cp_bench.py --out "$OUT" $CP_BENCH_ARGS
    rc=$?
    if [[ $rc -eq 0 ]]; then
      record bench ok "$((SECONDS - start)) s; results in cp_bench.json"
    else
      why=$(status_text $rc)
      [[ $rc -eq 1 && -f $OUT/cp_bench.json ]] && why="a row where ringflash failed or disagrees with one GPU"
      record bench FAILED "$why, after $((SECONDS - start)) s (see cp_bench.log)"
    fi
  fi
fi

# ---- peer: torch context parallelism -----------------------------------------------------------
if wants peer; then
  peer_script=$PEER_DIR/torch_cp_bench.py
  banner "peer: torchrun --nproc_per_node=$NGPU $peer_script"
  start=$SECONDS
  peer_json=$OUT/torch_cp_w$NGPU.json
  if [[ ! -f $peer_script ]]; then
    record peer FAILED "no $peer_script (set PEER_DIR)"
  elif [[ $NGPU -lt 1 ]]; then
    record peer FAILED "no GPU (NGPU=$NGPU)"
  else
    rm -f "$peer_json"
    # The peer writes torch_cp_w<P>.json into $OUT; it runs from $OUT so that nothing else lands
    # in the repository.
    peer_log=$OUT/torch_cp.log
    (cd "$OUT" && OUT="$OUT" run_logged "$peer_log" "$PEER_TIMEOUT" "${TORCHRUN[@]}" "$peer_script")
    rc=$?
    if [[ $rc -eq 0 && -f $peer_json ]]; then
      errors=$($PYTHON -c "import json, sys; print(sum('error' in r for r in json.load(open(sys.argv[1]))))" \
                 "$peer_json" 2>/dev/null || echo '?')
      record peer ok "$((SECONDS - start)) s; results in $(basename "$peer_json") ($errors runs with an error)"
    elif [[ $rc -eq 0 ]]; then
      record peer FAILED "finished, but wrote no $(basename "$peer_json") (see torch_cp.log)"
    else
      record peer FAILED "$(status_text $rc) after $((SECONDS - start)) s (see torch_cp.log)"
    fi
  fi
fi

# ---- compare -----------------------------------------------------------------------------------
if wants compare; then
  banner "compare: bench/cp_compare.py --dir $OUT"
  run_logged "$OUT/cp_compare.log" "$COMPARE_TIMEOUT" $PYTHON bench/cp_compare.py --dir "$OUT"
  rc=$?
  if [[ $rc -eq 0 ]] && grep -q "no torch CP results" "$OUT/cp_compare.log"; then
    record compare FAILED "ringflash only: no torch CP results to compare with (see cp_compare.log)"
  elif [[ $rc -eq 0 ]]; then
    record compare ok "table in cp_compare.json"
  else
    record compare FAILED "$(status_text $rc) (see cp_compare.log)"
  fi
fi

finish_stages build test bench peer compare
