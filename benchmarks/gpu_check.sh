#!/usr/bin/env bash
# One command on a machine with an NVIDIA GPU (no network needed; uses the system python and the
# torch installed there):
#   1. build numguard in place with its CUDA kernels (TORCH_CUDA_ARCH_LIST defaults to 9.0);
#   2. capture tensor_stats / multi_tensor_stats / record_ in a CUDA graph, replay, compare to eager
#      (and every dtype/layout against the pure-PyTorch reference);
#   3. run `numguard doctor` with one rank per GPU (facts table, exact collective checks, findings);
#   4. run the tests on CUDA (sync-debug mode "error" around the ops), CUDA-focused files first;
#   5. print the kernel bandwidth table last.
# Every phase is timed; a failing phase does not stop the later ones; the exit status is non-zero
# if any phase failed. Designed to finish in well under 8 minutes on an H200.
#
# Environment: PYTHON (default python3), TORCH_CUDA_ARCH_LIST (default 9.0), MAX_JOBS,
# GPU_CHECK_BUDGET_S (default 450: phases are cut short so that the whole run, the bandwidth table
# included, ends within it), OUT (if set, the JSON results are copied there).
# Builds in place: numguard/_C*.so is replaced by the CUDA build.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
PY="${PYTHON:-python3}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export NUMGUARD_REQUIRE_NATIVE=1 NUMGUARD_EXPECT_CUDA_KERNELS=1
unset NUMGUARD  # the checks call the ops directly; no automatic watching
START=$(date +%s)
BUDGET="${GPU_CHECK_BUDGET_S:-450}"
TABLE_RESERVE=90  # seconds kept for the bandwidth table at the end

declare -a SUMMARY=()
FAILED=0
phase() {  # phase NAME TIMEOUT_S COMMAND...   (NO_BUDGET=1: not cut short by the budget)
  local name="$1" limit="$2"; shift 2
  local t0 rc left
  t0=$(date +%s)
  left=$(( BUDGET - (t0 - START) - TABLE_RESERVE ))
  if [ -z "${NO_BUDGET:-}" ] && [ "$left" -lt "$limit" ]; then limit="$left"; fi
  if [ "$limit" -lt 5 ]; then
    echo "+++ gpu_check [$name] NOT RUN: the ${BUDGET}s budget is spent"
    SUMMARY+=("$(printf '%-28s NOT RUN (out of time)' "$name")")
    FAILED=1
    return 1
  fi
  echo
  echo "+++ gpu_check [$name] (limit ${limit}s, $(( t0 - START ))s elapsed): $*"
  timeout --signal=TERM --kill-after=10 "$limit" "$@"
  rc=$?
  local took=$(( $(date +%s) - t0 ))
  if [ "$rc" -eq 0 ]; then
    SUMMARY+=("$(printf '%-28s ok     %4ds' "$name" "$took")")
  else
    [ "$rc" -eq 124 ] && echo "+++ gpu_check [$name] TIMED OUT after ${limit}s"
    SUMMARY+=("$(printf '%-28s FAILED %4ds (exit %d)' "$name" "$took" "$rc")")
    FAILED=1
  fi
  echo "+++ gpu_check [$name] exit $rc after ${took}s"
  return "$rc"
}

# --- 0. the machine ----------------------------------------------------------------------------
export PY
phase "environment" 60 bash -c '
  set -x
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || nvidia-smi -L
  nvcc --version | tail -n 2
  command -v ninja || echo "ninja not found: the build compiles one file at a time"
  "$PY" -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda); assert torch.cuda.is_available(), \"no CUDA device visible\"; print(torch.cuda.get_device_name())"
'

# --- 1. build ----------------------------------------------------------------------------------
rm -f numguard/_C*.so
phase "build (CUDA $TORCH_CUDA_ARCH_LIST)" 300 env NUMGUARD_BUILD_CUDA=1 "$PY" setup.py -q build_ext --inplace
phase "import" 60 "$PY" -c "
import torch, numguard
from numguard import ops
archs = ops.native_module().cuda_architectures() if ops.native_module() else []
print('backend', numguard.backend(), 'archs', archs)
assert numguard.backend() == 'native', ops.fallback_reason()
assert archs, 'built without CUDA kernels'
for op in ('tensor_stats', 'multi_tensor_stats', 'record_'):
    assert torch._C._dispatch_has_kernel_for_dispatch_key('numguard::' + op, 'CUDA'), op
"

# --- 2. CUDA graph capture / replay against eager, records against the reference ----------------
# (before the test suite, so that a slow suite cannot squeeze it out of the time budget)
phase "CUDA graph + reference" 120 "$PY" benchmarks/cuda_graph_check.py

# --- 2b. batch-size finder on real CUDA out-of-memory errors ------------------------------------
# A step needing 2 x batch x 64 MiB under a 2% memory fraction: binary search must end on a size
# that ran whose next size up failed with a real torch.OutOfMemoryError, and every try must start
# with the previous tries' activations freed.
phase "batch finder on CUDA" 60 "$PY" - <<'PYEOF'
import torch, numguard
frac, per = 0.02, 64 << 20
torch.cuda.set_per_process_memory_fraction(frac)
cap = int(frac * torch.cuda.get_device_properties(0).total_memory)
try:
    torch.empty(2 * cap, dtype=torch.uint8, device="cuda")
    raise SystemExit("allocating twice the cap did not fail")
except torch.OutOfMemoryError as exc:
    assert numguard.is_out_of_memory(exc), exc
at_start = []
@numguard.find_executable_batch_size(starting_batch_size=4096, search="binary")
def step(batch_size):
    at_start.append(torch.cuda.memory_allocated())
    x = torch.ones(batch_size, per // 4, device="cuda")
    y = x * 2
    return batch_size, y[:, :8].sum().item()
size, total = step()
tried = step.finder.tried
print("cap", cap >> 20, "MiB; found", size, "; tried", tried)
assert total == 16 * size, total
assert 2 * size * per <= cap, "the size found does not fit the cap"
assert (size + 1, "out of memory") in tried, "the next size up was not shown to fail"
assert max(at_start) < (1 << 20), f"a try started with earlier activations alive: {at_start}"
assert step() == (size, total) and step.finder.tried == [(size, "ok")], "found size not remembered"
print("batch finder on CUDA: ok")
PYEOF

# --- 2d. a watched torch.compile'd model's call captured in a CUDA graph -----------------------
# Module frames recorded inside the compiled graph at the device cursor, replays logged one after
# another, a NaN planted between replays reported naming its submodule.
phase "compiled call in CUDA graph" 180 "$PY" benchmarks/cuda_graph_check.py --compiled

# --- 2e. a model spread over devices (NOTE: [one ring per device]) ----------------------------
# cuda:0 -> cuda:1 (with 2+ GPUs) -> a CPU-offloaded part: each stage records on its own device
# (a side ring per device, nothing sent through sanitize's copy), and a NaN planted in the
# second stage is reported naming it.
phase "spread over devices" 60 "$PY" - <<'PYEOF'
import torch, numguard
two = torch.cuda.device_count() > 1
mid = "cuda:1" if two else "cuda:0"
class Spread(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 64).to("cuda:0")
        self.b = torch.nn.Linear(64, 64).to(mid)
        self.c = torch.nn.Linear(64, 64)  # offloaded to the CPU
    def forward(self, x):
        return self.c(self.b(self.a(x).to(mid)).cpu())
model = Spread()
insp = numguard.watch(model, report_to=None)
copied = []
sanitize = insp._ring.sanitize
insp._ring.sanitize = lambda xs: copied.append(len(xs)) or sanitize(xs)
x = torch.ones(4, 64, device="cuda:0")
with torch.no_grad():
    model(x); model(x)
    sides = sorted(str(s.device) for s in insp._ring.sides)
    assert sides == (["cpu", "cuda:1"] if two else ["cpu"]), sides
    assert copied == [], copied
    model.b.bias[0] = float("nan")
    try:
        model(x)
        raise SystemExit("no trip")
    except numguard.NonFiniteError as exc:
        assert exc.module == "b", exc.module
        print(exc.report)
insp.close()
print("spread over devices: ok (sides", sides, ")")
PYEOF

# --- 2c. numguard doctor on this machine's GPU(s) -----------------------------------------------
# One rank per visible GPU under torchrun (NCCL for the checks, gloo for facts); prints the rank
# table, the exact-result checks, bandwidth (2+ GPUs) and the findings; JSON in benchmarks/results.
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
[ "${NGPU:-0}" -ge 1 ] || NGPU=1
DOCTOR_ARGS=(--timeout 60 --json benchmarks/results/doctor.json)
[ "$NGPU" -ge 2 ] && DOCTOR_ARGS+=(--pairs)
mkdir -p benchmarks/results
phase "doctor ($NGPU GPU rank(s))" 150 "$PY" -m torch.distributed.run --standalone \
  --nproc_per_node "$NGPU" -m numguard doctor "${DOCTOR_ARGS[@]}"

# --- 3. tests ----------------------------------------------------------------------------------
if ! "$PY" -c "import pytest" 2>/dev/null; then
  echo "+++ gpu_check: pytest is not installed for $PY; the test phases will fail (the CUDA graph and"
  echo "+++ reference check below covers the kernels without pytest)"
fi
PYTEST=("$PY" -m pytest -x -q -p no:cacheprovider -o addopts="" -rfEs)
CUDA_TESTS=(tests/test_kernels.py tests/test_cuda_build.py)
phase "tests: kernels on CUDA" 240 "${PYTEST[@]}" "${CUDA_TESTS[@]}"
OTHER_TESTS=()
for f in tests/test_*.py; do
  case " ${CUDA_TESTS[*]} " in *" $f "*) ;; *) OTHER_TESTS+=("$f") ;; esac
done
if [ "${#OTHER_TESTS[@]}" -gt 0 ]; then
  phase "tests: rest of the suite" 120 "${PYTEST[@]}" "${OTHER_TESTS[@]}"
fi

# --- 4. bandwidth ------------------------------------------------------------------------------
if [ -f benchmarks/bench_kernels.py ]; then
  if "$PY" benchmarks/bench_kernels.py --help 2>/dev/null | grep -q -- "--cuda-only"; then
    phase "bench_kernels --cuda-only" 90 "$PY" benchmarks/bench_kernels.py --cuda-only --rounds 3
  else
    echo "+++ gpu_check: benchmarks/bench_kernels.py has no --cuda-only flag; its CPU sweep is not run here"
  fi
fi

# --- cross-rank numerics: the replica fingerprint on CUDA ---------------------------------------
# Exact equality with the CPU kernel on every dtype and layout, no host sync (the test file), then
# its throughput against a device-to-device copy of the same bytes.
phase "cross-rank fingerprint (CUDA)" 90 "${PYTEST[@]}" tests/test_cross_rank_fingerprint.py -k cuda
phase "cross-rank fingerprint speed" 60 "$PY" -c '
import torch, time
from numguard import ops
xs = [torch.randn(n, device="cuda") for n in [50257 * 384, 384 * 1152] + [384 * 384] * 40 + [384] * 60]
nbytes = sum(x.numel() * x.element_size() for x in xs)
flat = torch.cat([x.reshape(-1) for x in xs]); dst = torch.empty_like(flat)
def timed(fn, n=20):
    fn(); torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize(); return (time.perf_counter() - t0) / n
fp = timed(lambda: ops.multi_tensor_fingerprint(xs)); cp = timed(lambda: dst.copy_(flat))
print(f"fingerprint of {len(xs)} tensors, {nbytes / 1e6:.1f} MB: {fp * 1e6:.1f} us = {nbytes / fp / 1e9:.0f} GB/s; "
      f"copy of the same bytes {cp * 1e6:.1f} us; fingerprint/copy {fp / cp:.2f}")
'

echo
echo "+++ gpu_check summary (before the bandwidth table)"
for line in "${SUMMARY[@]}"; do echo "    $line"; done
NO_BUDGET=1 phase "bandwidth table" "$TABLE_RESERVE" "$PY" benchmarks/bench_cuda_bandwidth.py

if [ -n "${OUT:-}" ] && [ -d benchmarks/results ]; then
  cp benchmarks/results/*.json "$OUT"/ 2>/dev/null || true
fi
echo
if [ "$FAILED" -ne 0 ]; then
  echo "gpu_check: some phases FAILED or did not run (total $(( $(date +%s) - START ))s):"
  printf '    %s\n' "${SUMMARY[@]}" | grep -E "FAILED|NOT RUN"
  exit 1
fi
echo "gpu_check: all phases passed (total $(( $(date +%s) - START ))s)"
