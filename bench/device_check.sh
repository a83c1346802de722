#!/usr/bin/env bash
# One check of ringflash on a GPU machine, from the repository root:
#
#   OUT=/some/dir bash bench/device_check.sh
#
# Stages (env STAGES, default all four, in this order):
#   build     pip-installs the Python package with the CUDA kernels (RINGFLASH_CUDA=ON), log in
#             $OUT/build.log; prints the build time and ptxas's registers and spills per kernel
#   test      pytest tests/python/test_cuda.py -x -q, log in $OUT/test_cuda.log
#   sanitize  compute-sanitizer memcheck and racecheck over a few forward+backward calls (causal,
#             window, GQA, packed, accumulate, hdim 64/128/256, fp16/bf16, zigzag and stripe on one
#             NCCL rank), log in $OUT/sanitize.log
#   bench     bench/gpu_bench.py against torch SDPA's flash and cuDNN backends, log in
#             $OUT/bench.log, results in $OUT/gpu_bench.json
# Every stage runs even when an earlier one failed; the summary ($OUT/summary.txt, rewritten
# after each stage) is printed last, and the exit status is non-zero if any stage failed. Where
# one command may only run for a limited time, split the stages over calls (STAGES="build test",
# then STAGES="sanitize bench"): later stages use the package that the build installed. The stage
# framework (records, summary, timeouts) is bench/stages.sh, shared with bench/multi_gpu_check.sh.
#
# Environment:
#   OUT             where logs go (default ./device-check-out)
#   STAGES          e.g. "build test" (default "build test sanitize bench")
#   CUDA_ARCH       CMAKE_CUDA_ARCHITECTURES (default 90)
#   CMAKE_DEFINES   extra CMake definitions, e.g. "RINGFLASH_DISABLE_HDIM256=ON"; the
#                   RINGFLASH_DISABLE_* switches it does not set are passed as OFF
#   JOBS            build parallelism (default: the number of cores)
#   PYTEST_ARGS     default "-x -q"; PYTEST_JOBS pytest-xdist workers when installed (default 8,
#                   0 for none)
#   SANITIZE_TOOLS  default "memcheck racecheck" (initcheck and synccheck work too);
#                   SANITIZE_KERNELS a --kernel-name filter for every tool (e.g. kns=ringflash;
#                   default none, so that a filter matching nothing cannot pass vacuously)
#   BENCH_ARGS      extra flags for bench/gpu_bench.py (e.g. --quick)
#   BUILD_TIMEOUT, TEST_TIMEOUT, SANITIZE_TIMEOUT, BENCH_TIMEOUT   seconds per stage (timeout(1))
set -u -o pipefail

export PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}
OUT=${OUT:-$PWD/device-check-out}
STAGES=${STAGES:-build test sanitize bench}
CUDA_ARCH=${CUDA_ARCH:-90}
CMAKE_DEFINES=${CMAKE_DEFINES:-}
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 16)}
PYTEST_ARGS=${PYTEST_ARGS:--x -q}
PYTEST_JOBS=${PYTEST_JOBS:-8}
SANITIZE_TOOLS=${SANITIZE_TOOLS:-memcheck racecheck}
SANITIZE_KERNELS=${SANITIZE_KERNELS:-}
BENCH_ARGS=${BENCH_ARGS:-}
BUILD_TIMEOUT=${BUILD_TIMEOUT:-1500}
TEST_TIMEOUT=${TEST_TIMEOUT:-900}
SANITIZE_TIMEOUT=${SANITIZE_TIMEOUT:-600}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-600}
SANITIZER_ERROR_EXIT=86  # compute-sanitizer's exit status when it found errors
KILL_AFTER=  # timeout(1) only sends SIGTERM here

# nvcc and compute-sanitizer where the CUDA toolkit keeps them, if they are not in PATH already.
for dir in /usr/local/cuda/bin /usr/local/cuda/compute-sanitizer; do
  [[ -d $dir && ":$PATH:" != *":$dir:"* ]] && PATH=$PATH:$dir
done
export PATH

mkdir -p "$OUT"
# shellcheck source=bench/stages.sh
source "$(dirname "${BASH_SOURCE[0]}")/stages.sh"
stages_init "$OUT/summary.txt" device_check 9 "$OUT/bench.log" "### gpu_bench table"

environment_banner
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || echo "nvidia-smi failed"
command -v nvcc >/dev/null && nvcc --version | grep -i release
$PYTHON -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__,
      '| CUDA', torch.version.cuda, '| devices', torch.cuda.device_count())" 2>&1
echo "stages: $STAGES | OUT=$OUT | CUDA_ARCH=$CUDA_ARCH"

# ---- build -------------------------------------------------------------------------------------
if wants build; then
  banner "build (pip install, RINGFLASH_CUDA=ON, CMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH)"
  # The package's own defines come from pyproject.toml ([tool.scikit-build.cmake.define]); these
  # add CUDA, the architecture, ptxas's resource report (-Xptxas=-v) and the host compiler.
  settings=(
    --config-settings=cmake.define.RINGFLASH_CUDA=ON
    "--config-settings=cmake.define.CMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH"
    --config-settings=cmake.define.CMAKE_CUDA_FLAGS=-Xptxas=-v
    --config-settings=cmake.define.CMAKE_CUDA_HOST_COMPILER=/usr/bin/g++
  )
  # The build switches are always passed (OFF unless CMAKE_DEFINES sets them), so that a build
  # folder kept from an earlier configure cannot carry a RINGFLASH_DISABLE_* over.
  defines=$CMAKE_DEFINES
  for switch in RINGFLASH_DISABLE_HDIM64 RINGFLASH_DISABLE_HDIM128 RINGFLASH_DISABLE_HDIM256 RINGFLASH_DISABLE_BACKWARD; do
    [[ " $defines " == *" $switch="* ]] || defines+=" $switch=OFF"
  done
  for define in $defines; do
    settings+=("--config-settings=cmake.define.$define")
  done
  start=$SECONDS
  # The whole log goes to build.log; the terminal gets build steps, warnings and errors.
  CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++ CMAKE_BUILD_PARALLEL_LEVEL=$JOBS \
    run_logged "$OUT/build.log" "$BUILD_TIMEOUT" $PYTHON -m pip install --no-build-isolation --no-deps -v \
    "${settings[@]}" . \
    | grep --line-buffered -E "^ *\[[0-9]+/[0-9]+\]|[Ee]rror|[Ww]arning|ringflash backends|Successfully"
  rc=${PIPESTATUS[0]}
  build_s=$((SECONDS - start))

  banner "ptxas: registers and spills per kernel"
  # ptxas -v prints, per kernel: "Compiling entry function 'NAME' for 'sm_XX'", then a stack/spill
  # line, then "Used N registers". One line per kernel, names demangled where c++filt exists.
  demangle() { if command -v c++filt >/dev/null; then c++filt; else cat; fi; }
  grep -E "ptxas (info|warning)" -A1 "$OUT/build.log" \
    | awk -F"'" '
        /Compiling entry function/ { name = $2; arch = $4 }
        /spill stores/ {
          match($0, /[0-9]+ bytes spill stores, [0-9]+ bytes spill loads/); spill = substr($0, RSTART, RLENGTH) }
        /Used [0-9]+ registers/ {
          match($0, /Used [0-9]+ registers/); regs = substr($0, RSTART + 5, RLENGTH - 15)
          if (name != "") printf "%4s regs  %-42s %s  %s\n", regs, spill, arch, name
          name = ""; spill = "" }' \
    | demangle | cut -c1-220 | sort -u | sort -k1,1nr >"$OUT/.ptxas"
  head -n 80 "$OUT/.ptxas"
  kernels=$(wc -l <"$OUT/.ptxas")
  max_regs=$(awk '{ if ($1 > m) m = $1 } END { print m + 0 }' "$OUT/.ptxas")
  spilling=$(grep -cvE "^ *[0-9]+ regs  0 bytes spill stores, 0 bytes spill loads" "$OUT/.ptxas")
  rm -f "$OUT/.ptxas"
  echo "$kernels kernels, at most $max_regs registers, $spilling with spills"
  ptxas_detail="$kernels kernels compiled, max $max_regs registers, $spilling spilling"
  [[ $kernels -eq 0 ]] && ptxas_detail="no kernel compiled in this run (build up to date?)"

  # ptxas's "(C75xx)" notes: wgmma serialized, or a wait injected into a wgmma pipeline, because
  # registers of an accumulator in flight are touched. The kernel still runs, at a fraction of its
  # speed, so the build fails on them.
  wgmma_notes=$(grep -E "\(C75[0-9][0-9]\)" "$OUT/build.log" | sort -u)
  if [[ $rc -eq 0 && -n $wgmma_notes ]]; then
    echo "$wgmma_notes"
    record build FAILED "${build_s} s; ptxas serialized wgmma or injected waits ($(wc -l <<<"$wgmma_notes") notes above)"
  elif [[ $rc -eq 0 ]]; then
    # From $OUT, so that the installed package is imported, not a source tree.
    info=$(cd "$OUT" && $PYTHON -c "
import ringflash
cuda = [line for line in ringflash.build_info().splitlines() if line.startswith('cuda')]
print('ok' if ringflash.has_cuda() else 'has_cuda() is False: ' + ' '.join(cuda))" 2>&1 | tail -n 1)
    if [[ $info == ok ]]; then
      record build ok "${build_s} s; $ptxas_detail"
    else
      record build FAILED "${build_s} s; installed, but $info"
    fi
  else
    record build FAILED "$(status_text $rc) after ${build_s} s (see build.log)"
  fi
fi

# ---- test --------------------------------------------------------------------------------------
if wants test; then
  # The sm_90a wrappers (wgmma, TMA) against a host reference, on an sm_90 GPU.
  if [[ $($PYTHON -c "import torch; print(torch.cuda.get_device_capability())" 2>/dev/null) == "(9, 0)" ]]; then
    banner "test: tests/cuda/sm90_primitives_test.cu"
    if nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -Isrc tests/cuda/sm90_primitives_test.cu \
        -o /tmp/ringflash_sm90_primitives && /tmp/ringflash_sm90_primitives; then
      record sm90-primitives ok ""
    else
      record sm90-primitives FAILED "see the test stage's output"
    fi
  fi
  banner "test: pytest tests/python/test_cuda.py $PYTEST_ARGS"
  parallel=()
  threads=()
  if [[ $PYTEST_JOBS -gt 0 ]] && $PYTHON -c "import xdist" 2>/dev/null; then
    parallel=(-n "$PYTEST_JOBS")
    # The float64 reference runs on the CPU: share the cores among the workers.
    threads=(env OMP_NUM_THREADS=$(( ($(nproc) + PYTEST_JOBS - 1) / PYTEST_JOBS )))
  fi
  # -rs lists skip reasons: a run where the whole file skips (no CUDA) must not look like a pass.
  # shellcheck disable=SC2086
  pytest_stage test "$OUT/test_cuda.log" "$TEST_TIMEOUT" skips-ok \
    "${threads[@]}" $PYTHON -m pytest tests/python/test_cuda.py $PYTEST_ARGS -rs -p no:cacheprovider "${parallel[@]}"
fi

# ---- sanitize ----------------------------------------------------------------------------------
if wants sanitize; then
  banner "sanitize: compute-sanitizer ($SANITIZE_TOOLS)"
  : >"$OUT/sanitize.log"
  script=$(mktemp /tmp/ringflash_sanitize.XXXXXX.py)
  trap 'rm -f "$script"' EXIT
  cat >"$script" <<'PY'
"""A few small ringflash forward+backward calls on the GPU for compute-sanitizer: causal, window,
softcap + ALiBi, GQA/MQA, packed with an empty document, accumulate mode with offsets, deterministic,
head dims 64/128/256, fp16 and bf16, and strategies on one NCCL rank. Inputs are made on the CPU so
that few torch kernels run."""
import re
import sys

import torch

import ringflash
from ringflash import _C

calls = 0


def qkv(b, sq, sk, hq, hkv, d, dtype, seed, packed=False):
    g = torch.Generator().manual_seed(seed)
    lead = () if packed else (b,)
    shapes = [(*lead, sq, hq, d), (*lead, sk, hkv, d), (*lead, sk, hkv, d)]
    return [torch.randn(s, generator=g).to(dtype).cuda().requires_grad_() for s in shapes]


def fwd_bwd(name, fn, tensors, dtype):
    global calls
    out = fn(*tensors)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(dtype).cuda())
    torch.cuda.synchronize()
    results = [out] + [t.grad for t in tensors]
    assert all(torch.isfinite(r).all() for r in results), f"{name}: non-finite results"
    calls += 1
    print(f"ok {name}", flush=True)


def supported(tensors, **options):
    """True if the case can run; False (reported) for a head dim 256 that the build leaves out;
    exits for any other refusal."""
    ok, _, reason, _ = ringflash.attention_support(*tensors, **options)
    if ok:
        return True
    if tensors[0].shape[-1] == 256 and re.search(r"head[ _]?dim|hdim", reason, re.IGNORECASE):
        print(f"not run, head dim 256 left out of this build: {reason}", flush=True)
        return False
    sys.exit(f"the CUDA kernels refuse a case they must run: {reason}")


cases = [
    ("causal gqa4 d128 bf16", (2, 200, 200, 8, 2, 128, torch.bfloat16), dict(causal=True)),
    ("window sq<sk d64 fp16", (1, 130, 333, 4, 4, 64, torch.float16), dict(window_size=(64, 16))),
    ("mqa full sq>sk d64 bf16", (2, 257, 129, 8, 1, 64, torch.bfloat16), dict()),
    ("causal softcap alibi d128 fp16", (1, 150, 150, 4, 2, 128, torch.float16), dict(causal=True, softcap=20.0)),
    ("causal deterministic d128 bf16", (1, 300, 300, 4, 1, 128, torch.bfloat16), dict(causal=True, deterministic=True)),
    ("causal d256 bf16", (1, 100, 140, 2, 2, 256, torch.bfloat16), dict(causal=True)),
]
for seed, (name, (b, sq, sk, hq, hkv, d, dtype), options) in enumerate(cases):
    tensors = qkv(b, sq, sk, hq, hkv, d, dtype, seed)
    if "alibi" in name:
        options = dict(options, alibi_slopes=torch.linspace(0.5, 0.01, hq).cuda())
    if supported(tensors, **options):
        fwd_bwd(name, lambda q, k, v: ringflash.flash_attn_func(q, k, v, **options), tensors, dtype)

# Packed, with an empty document and rows after the last one.
lengths = [17, 0, 150, 1]
cu = torch.tensor([0, 17, 17, 167, 168], dtype=torch.int32).cuda()
tensors = qkv(None, sum(lengths) + 5, sum(lengths) + 5, 4, 2, 64, torch.bfloat16, 10, packed=True)
if supported(tensors, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True):
    fwd_bwd("packed causal d64 bf16", lambda q, k, v: ringflash.flash_attn_varlen_func(
        q, k, v, cu, cu, max(lengths), max(lengths), causal=True), tensors, torch.bfloat16)

# Accumulate mode over two key blocks with explicit offsets, as a ring step.
q, k, v = (t.detach() for t in qkv(1, 90, 160, 4, 2, 128, torch.float16, 11))
if supported([q, k, v], causal=True):
    stream = dict(stream=torch.cuda.current_stream().cuda_stream)
    out = torch.zeros(q.shape, dtype=torch.float32, device="cuda")
    lse = torch.full((1, 4, 90), float("-inf"), device="cuda")
    blocks = [(70, 160), (0, 70)]
    for start, end in blocks:
        _C.attention_forward(q, k[:, start:end], v[:, start:end], out, lse, causal=True, q_offset=70, k_offset=start,
                             accumulate=True, **stream)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(12)).half().cuda()
    dq = torch.zeros(q.shape, dtype=torch.float32, device="cuda")
    dk = torch.zeros(k.shape, dtype=torch.float32, device="cuda")
    dv = torch.zeros(v.shape, dtype=torch.float32, device="cuda")
    for start, end in blocks:
        _C.attention_backward(q, k[:, start:end], v[:, start:end], out, dout, lse, dq, dk[:, start:end],
                              dv[:, start:end], causal=True, q_offset=70, k_offset=start, accumulate=True, **stream)
    torch.cuda.synchronize()
    assert all(torch.isfinite(t).all() for t in (out, dq, dk, dv)), "accumulate: non-finite results"
    calls += 1
    print("ok accumulate offsets d128 fp16", flush=True)

# A strategy's data movement (fills, copies, the fp32 accumulators; the contiguous and the strided
# elementwise kernels) over a one-rank NCCL communicator.
if ringflash.has_nccl():
    # Under memcheck NCCL's set-up runs slowly: 30 s did not always cover it.
    comm = _C.nccl_communicator(_C.nccl_unique_id(), 0, 1, torch.cuda.current_device(), 300.0)
    q, k, v = (t.detach() for t in qkv(1, 77, 77, 4, 2, 64, torch.bfloat16, 13))
    options = dict(causal=True, stream=torch.cuda.current_stream().cuda_stream)
    for strategy in ("zigzag", "stripe"):  # no NCCL kernel at one rank: only ringflash's are checked
        out, lse = torch.empty_like(q), torch.empty(1, 4, 77, device="cuda")
        _C.parallel_forward(q, k, v, out, lse, strategy=strategy, world=comm, **options)
        dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(14)).to(q.dtype).cuda()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _C.parallel_backward(q, k, v, out, dout, lse, dq, dk, dv, strategy=strategy, world=comm, **options)
        torch.cuda.synchronize()
        assert all(torch.isfinite(t).all() for t in (out, dq, dk, dv)), f"{strategy}: non-finite results"
        calls += 1
        print(f"ok {strategy} on one nccl rank d64 bf16", flush=True)
    del comm

print(f"{calls} forward+backward cases ran", flush=True)
sys.exit(0 if calls else 1)
PY
  sanitize_detail=()
  sanitize_failed=0
  for tool in $SANITIZE_TOOLS; do
    filter=()
    [[ -n $SANITIZE_KERNELS ]] && filter=(--kernel-name "$SANITIZE_KERNELS")
    echo "---- compute-sanitizer --tool $tool ${filter[*]}" | tee -a "$OUT/sanitize.log"
    start=$SECONDS
    # No caching allocator: each tensor is its own allocation, so memcheck sees out-of-bounds
    # accesses that would otherwise land inside a larger cached block. API errors are not
    # reported: ringflash checks every CUDA call it makes (a failure throws and ends the script),
    # while NCCL's initialisation probes for kernel images and meets cudaErrorNoKernelImageForDevice
    # by design.
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 run_logged -a "$OUT/sanitize.log" "$SANITIZE_TIMEOUT" compute-sanitizer \
      --tool "$tool" --error-exitcode $SANITIZER_ERROR_EXIT --print-limit 50 --report-api-errors no \
      "${filter[@]}" $PYTHON "$script" \
      | tail -n 25
    rc=$?
    summary_line=$(grep -E "(ERROR|RACECHECK) SUMMARY" "$OUT/sanitize.log" | tail -n 1 | sed 's/^=* *//')
    case $rc in
      0) sanitize_detail+=("$tool: ${summary_line:-ok} ($((SECONDS - start)) s)") ;;
      "$SANITIZER_ERROR_EXIT")
        sanitize_failed=1
        sanitize_detail+=("$tool: ERRORS: ${summary_line:-see sanitize.log}") ;;
      *) sanitize_failed=1; sanitize_detail+=("$tool: $(status_text $rc) (${summary_line:-see sanitize.log})") ;;
    esac
  done
  detail=$(printf '%s; ' "${sanitize_detail[@]}")
  if [[ $sanitize_failed -eq 0 ]]; then
    record sanitize ok "${detail%; }"
  else
    record sanitize FAILED "${detail%; }"
  fi
fi

# ---- bench -------------------------------------------------------------------------------------
if wants bench; then
  banner "bench: bench/gpu_bench.py $BENCH_ARGS"
  start=$SECONDS
  # shellcheck disable=SC2086
  run_logged "$OUT/bench.log" "$BENCH_TIMEOUT" $PYTHON bench/gpu_bench.py --json "$OUT/gpu_bench.json" $BENCH_ARGS
  rc=$?
  if [[ $rc -eq 0 ]]; then
    record bench ok "$((SECONDS - start)) s; results in gpu_bench.json"
  else
    why=$(status_text $rc)
    [[ $rc -eq 1 ]] && why="a shape where ringflash failed or disagrees with torch"
    record bench FAILED "$why, after $((SECONDS - start)) s (see bench.log)"
  fi
fi

finish_stages build test sanitize bench
