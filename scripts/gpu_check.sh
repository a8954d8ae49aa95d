#!/usr/bin/env bash
# The one script for a GPU machine: build the CUDA extension (for the GPU it sees), the GPU
# tests, the benchmarks with each case's per-kernel profile, the tools' probes, the rest.
# Every step's full log lands under $OUT (default ./gpu_check_out) with env.txt and
# summary.txt; the console gets one line per step and the summary last.
#   DFLASH2_COMMIT=$(git rev-parse --short=12 HEAD) OUT=/some/dir bash scripts/gpu_check.sh
# ends within 9 minutes on one H200. DFLASH2_COMMIT names the commit where the copy has
# no .git (env.txt and every benchmark record carry it). Uses the machine's python3 (or
# $PYTHON) and its torch/triton; needs no network: Python packages the machine lacks
# (speculators and what it needs) come as wheels in .whl/ (scripts/wheelhouse.py build;
# carry .whl with the working tree) and are installed into a scratch directory on
# PYTHONPATH by the `wheels` step.
# Exit status: 0 when every required step passed, 1 otherwise.
#
# GPU_CHECK_DRY_RUN=1: the same script on a machine with no GPU (CI runs it: make
# gpu-check-dry-run), so that it cannot rot between GPU runs: the steps that need a GPU
# (build, kernels, arch, the GPU tests, the tools, the compiles) are skipped saying so;
# the benchmarks run on the CPU's kernels at their --quick shapes with 3 repetitions,
# with their profiles and the profile tables; the wheelhouse is built for the GPU
# machine's Python (its size held) and checked in a scratch environment here
# (scripts/wheelhouse.py check); the summary and the archive are made and checked (at
# most 8 files under $OUT, what the device tool brings back).
#
# A GPU machine is lent rarely, for ~15 minutes of device time and one command of at
# most 10 minutes, so one run has to bring back everything, in order of value: a step
# that fails or times out never stops the later ones, and each step has its own cap so
# that one hang cannot eat the others' time. Caps (seconds) and why:
#   build           150  the CUDA build takes ~60 s there with 16 jobs; nothing else is
#                        worth much without it, so it gets the widest margin
#   wheels           30  pip install --no-index of .whl/ (seconds; skipped without .whl)
#   kernels          30  import check: are the CUDA kernels registered, is a GPU visible
#   arch             30  dk.build_info(): the GPU's compute capability against the code
#                        the build holds (fails when the GPU runs none of it)
#   tests_gpu       120  the GPU tests in 4 pytest-xdist workers: 70 s on the first H200
#                        run (cold Triton cache: one JIT compile per kernel specialization)
#   tune             90  benchmarks/tune.py: every member of every kernel's configuration
#                        space timed at the published shapes (each member's first launch
#                        compiles it); the winners to tuning.jsonl and to the cache the
#                        benchmarks read (DFLASH2_CACHE_DIR)
#   bench_conv       50  --no-compile, all five GPU shapes; each case's three times per
#                        call (call, host, device: CUDA-graph replay) and, with every
#   bench_selector   50  benchmark, its per-kernel profile (torch.profiler, 3 calls of
#   bench_serving    60  each implementation) into profile.jsonl: the profile is taken in
#                        the benchmarks' own pass, not a second one (the head's dense
#                        calls take up to ~1 s each there: no room for two passes)
#   bench_head      150  N 4096 / 16384 x V 248,320 x H 5120 bf16, kl_div (tv a metric) and
#                        ce, fwd and fwd+bwd (issue 37's targets): 5 s of timing a case,
#                        then the profile and the peak; a dense row that does not fit is
#                        recorded as skipped (75 s cut the first H200 run short)
#   bench_step       90  a Qwen3-8B verifier's drafter as speculators' DFlash 2 defaults
#                        build it (5 layers, V 151,936, 512 anchors, fp32 weights + bf16
#                        autocast): upstream / ours / ours+head, eager (needs .whl)
#   profile_tables   20  benchmarks/profile_report.py: profile.jsonl as tables, the
#                        whole-call model beside each call (in logs.tgz)
#   tests_gpu_trainers 120  (optional) the GPU tests that run speculators' and NeMo's
#                        code (needs .whl): their commands, compiled steps, NeMo's modules
#   ncu              75  Nsight Compute with --clock-control none: DRAM throughput (% of
#                        peak) and achieved occupancy of our kernels at the published
#                        shapes (benchmarks/traffic.py --gpu --once); on a runtime that
#                        refuses the counters the log keeps the refusal
#   memcheck         60  compute-sanitizer memcheck, then racecheck, over the CUDA C++
#   racecheck        60  kernels' GPU tests (the caching allocator off for memcheck)
#   tests_rest      120  the CPU-side suite in 12 workers: CI runs it on every change, so
#                        here it only adds this machine's torch and Python
# The caps add up to more than fits: they are there against hangs. The hard bound
# is BUDGET_S: no step may run past it (its cap shrinks to what is left), so the run ends
# at BUDGET_S plus the summary, within 9 minutes even when every step runs to its cap;
# then the last steps are cut short or skipped, and the summary still comes back.
# Time the required steps leave unused goes to the optional steps (the tools' probes,
# the rest of the suite, then the FSDP2 step, the traffic model's kernel timings, the
# torch.compile comparisons), each started only when its whole cap still fits: the
# benchmarks write their records only at the end, so a cut-short run is wasted time.
# Optional steps never change the exit status. Their caps:
#   fsdp_step        60  one FSDP2 training step of the patched tiny speculators drafter on
#                        the GPU in a 1-rank gloo process group (no NCCL: FSDP2 skips its
#                        collectives at world size 1), against the unsharded model; ~15 s
#                        of imports, the steps themselves well under 1 s (needs .whl)
#   traffic_model    60  every kernel timed beside the traffic model's prediction
#   conv_compile    100  and selector_compile 90: Inductor's cold compiles
#   fused_compiled  150  speculators' compiled training forward and NeMo's compiled draft,
#                        upstream against the fused head (benchmarks/tools/
#                        compiled_fused_steps.py): four cold Inductor compiles of a 2-layer
#                        H 1024 drafter, then 10 timed steps a side
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT="${OUT:-$PWD/gpu_check_out}"
PY="${PYTHON:-python3}"
BUDGET_S="${GPU_CHECK_BUDGET_S:-525}"
# GPU_CHECK_TESTS_ONLY=1: build and tests only (a second run of a lease, to check fixes).
TESTS_ONLY="${GPU_CHECK_TESTS_ONLY:-0}"
DRY_RUN="${GPU_CHECK_DRY_RUN:-0}"
# Steps that need a GPU (or build for one): skipped, saying so, in a dry run.
GPU_ONLY='^(build|kernels|arch|tests_gpu|tests_gpu_trainers|ncu|memcheck|racecheck|tests_rest|fsdp_step|traffic_model|conv_compile|selector_compile|fused_compiled)$'
# Packages from .whl/ go here, ahead of the image's on PYTHONPATH (wheels step).
SITE="${GPU_CHECK_SITE:-/tmp/dflash2_gpu_check_site}"
KILL_AFTER=10   # a step ignoring SIGINT (a hung kernel) is killed this long after its cap
MIN_STEP_S=15   # a required step with less time than this left is not started
mkdir -p "$OUT"
rm -f "$OUT/bench.jsonl" "$OUT/bench_compile.jsonl" "$OUT/profile.jsonl"   # the benchmarks append; start clean
# The tune step's winners, read by every later step (a fresh directory: no earlier run's).
export DFLASH2_CACHE_DIR="${DFLASH2_CACHE_DIR:-/tmp/dflash2_gpu_check_tuning}"
rm -rf "$DFLASH2_CACHE_DIR"
export PYTHONUNBUFFERED=1
export MAX_JOBS="${MAX_JOBS:-16}"
# A CPU-only build would "pass" and quietly skip every CUDA kernel: make it an error.
export DFLASH2_BUILD_CUDA="${DFLASH2_BUILD_CUDA:-1}"
# Triton 3.6's interpreter breaks on numpy >= 2.4, so nothing here may use it. With a
# GPU visible, tests/conftest.py leaves TRITON_INTERPRET alone and the tests that run
# under the interpreter elsewhere (the "triton" ids of test_conv_numerics and
# test_conv_op) run the compiled kernels on CUDA; no test forces the interpreter
# (test_triton_aot strips it for its child), so nothing is deselected. 0 rather than
# unset: conftest only setdefault()s it, so should CUDA not be visible those tests skip
# instead of interpreting (and the kernels step fails loudly).
export TRITON_INTERPRET=0
SECONDS=0

{
  date -u
  if command -v nvidia-smi >/dev/null; then
    timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  else
    echo "nvidia-smi: not found"
  fi
  command -v nvcc >/dev/null && nvcc --version | tail -n 1
  timeout 60 "$PY" -c "import sys, torch, triton, numpy; print('python', sys.version.split()[0], '| torch', torch.__version__, '| triton', triton.__version__, '| numpy', numpy.__version__, '|', torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')" \
    || echo "python probe failed"
  echo "commit ${DFLASH2_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}"
  # A static libstdc++ in the build crashed the suite here once (tests/test_extension_linkage.py).
  echo "LDFLAGS=${LDFLAGS:-} | $(g++ --version 2>/dev/null | head -n 1)"
} 2>&1 | tee "$OUT/env.txt"

STEP_NAMES=() STEP_STATUS=() STEP_RC=() STEP_SECS=() STEP_CAPS=()
required_failed=()

# The failed tests named in a pytest log (its short summary), at most 10.
failures() {
  grep -E '^(FAILED|ERROR) ' "$1" | head -n 10 | cut -c 1-200
}

# run_step KIND NAME CAP CMD...: CMD under `timeout`, its output in $OUT/NAME.log,
# its outcome recorded for the summary. SIGINT first, so that pytest still prints its
# summary line and the test it was in.
run_step() {
  local kind=$1 name=$2 cap=$3; shift 3
  local log="$OUT/$name.log" left=$(( BUDGET_S - SECONDS - KILL_AFTER )) limit=$cap status rc start secs cmd failed
  (( left < limit )) && limit=$left
  if [[ $TESTS_ONLY == 1 && ! $name =~ ^(build|wheels|kernels|arch|tests_.*)$ ]]; then
    printf '[%3ds] %-16s skipped: GPU_CHECK_TESTS_ONLY\n' "$SECONDS" "$name"
    STEP_NAMES+=("$name") STEP_STATUS+=("skipped") STEP_RC+=("-") STEP_SECS+=(0) STEP_CAPS+=("$cap")
    return 0
  fi
  if [[ $DRY_RUN == 1 && $name =~ $GPU_ONLY ]]; then
    printf '[%3ds] %-16s skipped: dry run (needs a GPU)\n' "$SECONDS" "$name"
    STEP_NAMES+=("$name") STEP_STATUS+=("skipped") STEP_RC+=("-") STEP_SECS+=(0) STEP_CAPS+=("$cap")
    return 0
  fi
  if { [[ $kind == optional ]] && (( left < cap )); } || (( limit < MIN_STEP_S )); then
    printf '[%3ds] %-16s skipped: %d s left of the budget, cap %d s\n' "$SECONDS" "$name" "$(( left > 0 ? left : 0 ))" "$cap"
    rm -f "$log"   # an earlier run's log in a reused $OUT would pass for this one's
    STEP_NAMES+=("$name") STEP_STATUS+=("skipped") STEP_RC+=("-") STEP_SECS+=(0) STEP_CAPS+=("$cap")
    [[ $kind == required ]] && required_failed+=("$name")
    return 0
  fi
  cmd="$*"
  cmd=${cmd//$'\n'/ }
  printf '[%3ds] %-16s started (timeout %d s): %.150s\n' "$SECONDS" "$name" "$limit" "$cmd"
  echo "\$ $*" >"$log"
  start=$SECONDS
  timeout -s INT -k "$KILL_AFTER" "$limit" "$@" >>"$log" 2>&1
  rc=$?
  secs=$(( SECONDS - start ))
  if (( rc == 0 )); then
    status=passed
  elif (( rc == 124 || (rc == 137 && secs >= limit) )); then
    status="TIMED OUT"
  else
    status=FAILED
  fi
  printf '[%3ds] %-16s %s (rc %s, %d s)\n' "$SECONDS" "$name" "$status" "$rc" "$secs"
  if (( rc != 0 )); then
    # pytest lists its failures above the skips of -ra, out of reach of a plain tail
    failed=$(failures "$log")
    if [[ -n $failed ]]; then
      printf '%s\n' "$failed"
      tail -n 1 "$log"
    else
      tail -n 15 "$log"
    fi | sed 's/^/    | /'
    [[ $kind == required ]] && required_failed+=("$name")
  fi
  STEP_NAMES+=("$name") STEP_STATUS+=("$status") STEP_RC+=("$rc") STEP_SECS+=("$secs") STEP_CAPS+=("$limit")
  return 0
}
step() { run_step required "$@"; }
optional_step() { run_step optional "$@"; }

# --no-index / no version check: there is no network, and pip would otherwise spend
# the build's budget on retries.
step build 150 "$PY" -m pip install --no-build-isolation --no-deps --no-index --disable-pip-version-check -e .
echo "build: rc ${STEP_RC[-1]}, ${STEP_SECS[-1]} s" >>"$OUT/env.txt"

# speculators and what it needs, from wheels carried with the tree (no network there).
# The dry run builds that wheelhouse for the GPU machine's Python instead (its size held)
# and checks the same resolution installed into a scratch environment here.
if [[ $DRY_RUN == 1 ]]; then
  step wheels 240 bash -c "'$PY' scripts/wheelhouse.py build --out '$SITE.whl' && '$PY' scripts/wheelhouse.py check --wheels '$SITE.whl'"
elif compgen -G ".whl/*.whl" >/dev/null; then
  rm -rf "$SITE"
  step wheels 30 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
    --upgrade --target "$SITE" .whl/*.whl
  # the packages ahead of the image's; their commands (speculators, automodel) on the PATH
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"
  grep -h -E '^(speculators|nemo)' .whl/MANIFEST.txt 2>/dev/null | head -n 2 | sed 's/^/wheels: /' >>"$OUT/env.txt"
fi
step kernels 30 "$PY" -c "
import torch
from dflash2_kernels._extension import EXTENSION_ERROR, has_kernel
ops = ['selector_scores', 'selector_scores_backward', 'candidate_topk', 'select_path', 'rejection_sample']
missing = [op for op in ops if not has_kernel(op, 'cuda')]
print('CUDA device visible:', torch.cuda.is_available(), '| extension import error:', EXTENSION_ERROR)
print('CUDA kernels registered:', 'all' if not missing else 'missing ' + ', '.join(missing))
raise SystemExit(1 if missing or not torch.cuda.is_available() else 0)
"
grep -E '^CUDA (device visible|kernels registered)' "$OUT/kernels.log" >>"$OUT/env.txt" 2>/dev/null

# The GPU's architecture against the build's (issue 30): what the build holds, what this
# GPU runs of it, each op's backend here. A GPU it holds no code for fails the step.
step arch 30 "$PY" -c "
import dflash2_kernels as dk
info = dk.build_info()
print(info)
raise SystemExit(0 if info.with_cuda and info.gpus and all(gpu.code for gpu in info.gpus) else 1)
"
grep -E '^(CUDA code|GPU): ' "$OUT/arch.log" >>"$OUT/env.txt" 2>/dev/null

# -v names each test as it starts, so a timed-out log shows where it hung; --durations
# sizes the next run's caps.
PYTEST=("$PY" -m pytest -v -p no:cacheprovider --durations=15)
# With pytest-xdist (the GPU image has it), the tests run in worker processes: a test that
# crashes its process (a segfault, a device-side assert) is reported by name as failed and
# its worker replaced, instead of ending the step with no summary; and the 16 cores shorten
# the CPU-bound rest.
GPU_WORKERS=() REST_WORKERS=()
if "$PY" -c "import xdist" 2>/dev/null; then
  GPU_WORKERS=(-n 4) REST_WORKERS=(-n 12)
fi
# Our kernels' GPU tests first; those that run speculators' or NeMo's code on the GPU
# (with .whl: their commands, compiled steps, 144 NeMo module cases) come after the
# benchmarks, as tests_gpu_trainers.
TRAINER_TESTS=(tests/test_compat_nemo.py tests/test_trainers_e2e.py tests/test_patched_training.py
               tests/test_fused_head_trainers.py)
step tests_gpu 120 "${PYTEST[@]}" "${GPU_WORKERS[@]}" -m gpu "${TRAINER_TESTS[@]/#/--ignore=}"

# Three times per call in every row (call, host, device) and each case's per-kernel
# profile into profile.jsonl (benchmarks/common.py); the dry run's are the CPU's kernels
# at the --quick shapes.
BENCH=(--no-compile --out "$OUT/bench.jsonl" --profile "$OUT/profile.jsonl")
STEP_ARGS=(--head --trainers speculators --drafter qwen3-8b --no-anchor-search)
if [[ $DRY_RUN == 1 ]]; then
  BENCH+=(--quick --max-reps 3)
  STEP_ARGS=(--quick)  # the CPU's training step (the drafter's shape is tens of GB in fp32)
fi
# Every kernel's configuration space timed at the published shapes (default and winner per
# kernel into tuning.jsonl); the benchmarks then launch the winners from that cache.
TUNE_ARGS=(--out "$OUT/tuning.jsonl" --cache "$DFLASH2_CACHE_DIR")
[[ $DRY_RUN == 1 ]] && TUNE_ARGS+=(--interpret)
step tune 90 "$PY" benchmarks/tune.py "${TUNE_ARGS[@]}"
step bench_conv 50 "$PY" benchmarks/bench_conv.py "${BENCH[@]}"
step bench_selector 50 "$PY" benchmarks/bench_selector.py "${BENCH[@]}"
step bench_serving 60 "$PY" benchmarks/bench_serving.py "${BENCH[@]}"
step bench_head 150 "$PY" benchmarks/bench_head.py "${BENCH[@]}"
step bench_step 90 "$PY" benchmarks/bench_step.py "${STEP_ARGS[@]}" "${BENCH[@]}"
step profile_tables 20 "$PY" benchmarks/profile_report.py --records "$OUT/profile.jsonl"
optional_step tests_gpu_trainers 120 "${PYTEST[@]}" "${GPU_WORKERS[@]}" -m gpu "${TRAINER_TESTS[@]}"

# The tools, where the machine's runtime allows them (KINDS.md: Firecracker yes, gVisor
# no): a missing tool is a skip, a refusal stays in the log (the summary shows its tail).
NCU_METRICS=dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_achieved_occupancy.avg.pct_of_peak_sustained_active,gpu__time_duration.sum
# tool_step NAME CAP TOOL CMD...: CMD as an optional step where TOOL is on the PATH.
tool_step() {
  local name=$1 cap=$2 tool=$3; shift 3
  if ! command -v "$tool" >/dev/null; then
    printf '[%3ds] %-16s skipped: %s not found\n' "$SECONDS" "$name" "$tool"
    STEP_NAMES+=("$name") STEP_STATUS+=("skipped: no $tool") STEP_RC+=("-") STEP_SECS+=(0) STEP_CAPS+=("$cap")
    return 0
  fi
  optional_step "$name" "$cap" "$@"
}
# --once: one call of each case at its published shape; -c caps the profiled launches.
tool_step ncu 75 ncu ncu --clock-control none --target-processes all -k 'regex:_kernel$' -c 120 \
  --metrics "$NCU_METRICS" --csv "$PY" benchmarks/traffic.py --gpu --once
SANITIZED_TESTS=(tests/test_selector_gpu.py tests/test_serving_gpu.py)
tool_step memcheck 60 compute-sanitizer env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \
  --target-processes all --error-exitcode 3 "$PY" -m pytest -q -x -p no:cacheprovider "${SANITIZED_TESTS[@]}"
tool_step racecheck 60 compute-sanitizer compute-sanitizer --tool racecheck --target-processes all --error-exitcode 3 \
  "$PY" -m pytest -q -x -p no:cacheprovider tests/test_serving_gpu.py

optional_step tests_rest 120 "${PYTEST[@]}" "${REST_WORKERS[@]}" -m "not gpu"

# FSDP2 on the GPU without NCCL: a 1-rank gloo process group, FSDP2's per-layer + root
# sharding as speculators applies it (apply_fully_sharded), the patched tiny drafter of
# tests/upstream_models.py. fp32: the sharded step's loss and gradients equal the
# unsharded model's (same kernels, no collective); then speculators' --fsdp-shard setting
# (bf16 parameters, fp32 reduction, bf16 autocast) and an AdamW step: finite, our ops ran.
# Eager (speculators would compile its forward with Inductor here: minutes, not this cap).
optional_step fsdp_step 60 "$PY" -c "
import dataclasses, math, sys
import torch, torch.distributed as dist
import dflash2_kernels as dk
from speculators.train.distributed import apply_fully_sharded
from tests import upstream_models as um
if not torch.cuda.is_available():
    sys.exit('no CUDA device')
dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)
cuda = torch.device('cuda')
fields = [getattr(um.speculators_batch(0), f.name) for f in dataclasses.fields(um.SpeculatorsBatch)]
batch = um.SpeculatorsBatch(*[v.to(cuda) if torch.is_tensor(v) else v for v in fields])
def local(t):
    return t.to_local() if hasattr(t, 'to_local') else t
def model(sharded, param_dtype=torch.float32):
    m = um.speculators_draft(0)
    assert len(dk.patch(m).replaced) == 2 * um.LAYERS + 1
    m.to(cuda)
    return apply_fully_sharded(m, param_dtype=param_dtype) if sharded else m
def step(m, autocast=False):
    with um.count_dflash2_ops() as counter, torch.autocast('cuda', torch.bfloat16, enabled=autocast):
        loss, _ = um.speculators_loss(m, batch, seed=0)
        loss.backward()
    grads = {n: local(p.grad) for n, p in m.named_parameters() if p.requires_grad}
    return loss.detach(), grads, dict(counter.counts)
with torch.compiler.set_stance('force_eager'):
    loss, grads, counts = step(model(True))
    want_loss, want, _ = step(model(False))
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    for n, g in grads.items():
        assert want[n].abs().max() > 0, n + ' got no gradient'
        torch.testing.assert_close(g, want[n], rtol=1e-5, atol=1e-5 * want[n].abs().max().item())
    print('fp32 FSDP2 step == unsharded: loss', loss.item(), '|', len(grads), 'gradients | ops', counts)
    mixed = model(True, torch.bfloat16)
    optimizer = torch.optim.AdamW(mixed.named_parameters(), lr=1e-3)
    loss, grads, counts = step(mixed, autocast=True)
    optimizer.step()
    assert math.isfinite(loss.item()) and all(g.isfinite().all() for g in grads.values())
    assert all(local(p).isfinite().all() for p in mixed.parameters())
    assert counts.get('grouped_dynamic_conv') == 4 * um.LAYERS and counts.get('selector_scores_backward') == 1, counts
    print('bf16 FSDP2 step + AdamW: loss', loss.item(), '| ops', counts)
dist.destroy_process_group()
"

# The traffic model's first check (benchmarks/traffic.py, issue 33): every CUDA and Triton
# kernel timed by torch.profiler at the published shapes (inputs drawn on the device, 5
# profiled calls each) beside the H200 time the model predicts from the bytes counted on
# the CPU (docs/results/traffic.jsonl); the table is in traffic_model.log, the records in
# traffic_gpu.jsonl. Cap 60 s: 12 cases, each a few calls of at most ~20 ms.
rm -f "$OUT/traffic_gpu.jsonl"
optional_step traffic_model 60 "$PY" benchmarks/traffic.py --gpu --out "$OUT/traffic_gpu.jsonl"

# Inductor's cold compiles dominate these (4 graphs for conv --quick, 3 for selector).
optional_step conv_compile 100 "$PY" benchmarks/bench_conv.py --quick --out "$OUT/bench_compile.jsonl"
optional_step selector_compile 90 "$PY" benchmarks/bench_selector.py --quick --out "$OUT/bench_compile.jsonl"

# The fused head under the trainers' own torch.compile (issue 30): speculators' forward as
# conditional_torch_compile compiles it, NeMo's draft as its compile: block does; each
# side run and timed, upstream against ours+head.
optional_step fused_compiled 150 "$PY" benchmarks/tools/compiled_fused_steps.py

# pytest_line LOG STATUS: the final "N passed, ..." line of a pytest log; for a run
# cut short, also the test it was in (-v prints its id before running it).
pytest_line() {
  local line running=""
  line=$(grep -E '^=+ .* in [0-9.]+s( \([0-9:]+\))? =+$' "$1" | tail -n 1 | sed -E 's/^=+ //; s/ =+$//')
  [[ $2 == "TIMED OUT" ]] && running=$(grep -E '^tests/[^ ]+::[^ ]+ *$' "$1" | tail -n 1 | sed -E 's/ +$//')
  echo "${line:-no summary line}${running:+ (was in $running)}"
}

# Headline rows of the benchmark records (benchmarks/common.py's Row.record): ours'
# median, percent of the copy bandwidth, and how many times faster than each other
# implementation of the same case; the issue's H200 target beside it.
bench_headlines() {
  timeout 30 "$PY" - "$OUT" <<'PYTHON'
import json, re, sys
from pathlib import Path

out = Path(sys.argv[1])
HEADLINES = [  # (bench, case pattern, target) in bench.jsonl
    ("conv", r"^fwd 16384x4096 bf16$", ">= 85% copy"),
    ("conv", r"^fwd\+bwd 16384x4096 bf16$", ">= 10x reference, >= 2x compiled"),
    ("conv", r" graph$", "<= 10 us"),
    ("selector", r"^fwd\+bwd no dU ", ""),
    ("selector", r"^fwd\+bwd ", ">= 5x reference"),
    ("head", r"^(kl_div|ce labels) fwd(\+bwd)? N(4096|16384) ",
     "device <= the faster dense's, floor / ours >= 0.8, peak <= 1/10 dense"),
]


def cases(path):
    grouped = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return grouped
    for text in lines:
        try:
            row = json.loads(text)
            grouped.setdefault((row["bench"], row["case"]), []).append(row)
        except (ValueError, KeyError):
            pass
    return grouped


def show(rows, target=""):
    ours = next((r for r in rows if r["impl"] == "ours"), rows[0])
    ms = ours["timing"]["median_ms"]
    took = f"{ms * 1e3:7.1f} us" if ms < 0.1 else f"{ms:7.3f} ms"
    line = f"  {ours['bench']:8} {ours['case']:44} {ours['impl']} {took} {ours['pct_copy_bw']:5.1f}% copy"
    device = ours["timing"].get("device_ms")
    if device:  # ratios of device times where both have one
        line += f" (device {device * 1e3:.1f} us)" if device < 0.1 else f" (device {device:.3f} ms)"
    for r in rows:
        if r is not ours:
            other = r["timing"].get("device_ms") if device else None
            line += f" | {(other or r['timing']['median_ms']) / (device if other else ms):5.2f}x {r['impl']}"
    print(line + (f"   [target {target}]" if target else ""))


def target_of(bench, case):
    return next((t for b, p, t in HEADLINES if b == bench and re.search(p, case)), None)


main = cases(out / "bench.jsonl")
for name in dict.fromkeys(b for b, _, _ in HEADLINES):
    own = {case: rows for (bench, case), rows in main.items() if bench == name}
    picked = {case: target_of(name, case) for case in own if target_of(name, case) is not None}
    # Case names not as expected (renamed, or a CPU run): all of that bench's rows, not none.
    for case in picked or own:
        show(own[case], picked.get(case, ""))
compiled = [rows for rows in cases(out / "bench_compile.jsonl").values()
            if any(r["impl"] == "compiled reference" for r in rows)]
if compiled:
    print("  with torch.compile of the reference (--quick shapes):")
for rows in compiled:
    show(rows)
if not main:
    print("  no records in bench.jsonl")
PYTHON
}

# ncu_table LOG: ncu's --csv rows grouped by kernel, or the refusal ncu printed.
ncu_table() {
  timeout 30 "$PY" - "$1" <<'PYTHON'
import csv, sys
rows = [r for r in csv.reader(line for line in open(sys.argv[1], errors="replace") if line.startswith('"'))]
if not rows or "Metric Name" not in rows[0]:
    print("  no ncu rows; its log ends:")
    print("".join("    " + l for l in open(sys.argv[1], errors="replace").readlines()[-4:]), end="")
    raise SystemExit
head, kernels = rows[0], {}
name, metric, value, ident = (head.index(c) for c in ("Kernel Name", "Metric Name", "Metric Value", "ID"))
for r in rows[1:]:
    entry = kernels.setdefault(r[name].split("(")[0][:48], {})
    try:
        entry.setdefault(r[metric], []).append(float(r[value].replace(",", "")))
    except ValueError:
        pass
    entry.setdefault("ids", set()).add(r[ident])
for kernel, m in kernels.items():
    mean = lambda key: sum(v) / len(v) if (v := next((m[k] for k in m if k.startswith(key)), None)) else float("nan")
    print(f"  {kernel:48} {len(m['ids']):4d} {mean('dram__throughput'):6.1f} {mean('sm__warps_achieved'):6.1f}")
PYTHON
}

summary() {
  local i name log
  echo "== gpu_check summary: commit ${DFLASH2_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}, $SECONDS s (budget $BUDGET_S s), logs in $OUT =="
  for i in "${!STEP_NAMES[@]}"; do
    name=${STEP_NAMES[$i]}
    log="$OUT/$name.log"
    printf '%-16s %-9s rc %-4s %4d s / %3d s' "$name" "${STEP_STATUS[$i]}" "${STEP_RC[$i]}" "${STEP_SECS[$i]}" "${STEP_CAPS[$i]}"
    if [[ $name == tests_* && ${STEP_STATUS[$i]} != skipped ]]; then
      printf '  | %s\n' "$(pytest_line "$log" "${STEP_STATUS[$i]}")"
      failures "$log" | sed 's/^/    /'
    else
      echo
    fi
  done
  echo "benchmarks (ours; Nx = times faster than that implementation):"
  bench_headlines || echo "  (could not read the benchmark records)"
  if [[ -f $OUT/bench_serving.log ]] && grep -q '^# targets' "$OUT/bench_serving.log"; then
    sed -n '/^# targets/,$p' "$OUT/bench_serving.log" | sed 's/^# /serving /'
  fi
  if [[ -s $OUT/tuning.jsonl ]]; then
    echo "tuning (per space: shape classes timed, winners other than the default, best gain over the default):"
    timeout 30 "$PY" - "$OUT/tuning.jsonl" <<'PYTHON' || echo "  (could not read the tuning records)"
import json, sys
spaces = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    spaces.setdefault(r["space"], []).append(r)
for name, records in spaces.items():
    moved = sum(r["winner"] != r["default"] for r in records)
    gain = max(r["default_ms"] / r["winner_ms"] for r in records if r["winner_ms"] > 0)
    print(f"  {name:24s} {len(records):3d} timed  {moved:3d} moved  best gain {gain:.2f}x")
PYTHON
  fi
  [[ -f $OUT/ncu.log ]] && { echo "ncu (per kernel: launches, mean DRAM % of peak, mean achieved occupancy %):"; ncu_table "$OUT/ncu.log"; }
  for log in "$OUT/memcheck.log" "$OUT/racecheck.log"; do
    [[ -f $log ]] && grep -h -E '(ERROR|RACECHECK) SUMMARY|Device not supported|error 999|^=+ (passed|failed)|[0-9]+ (passed|failed)' "$log" \
      | tail -n 3 | sed "s/^/$(basename "$log" .log): /"
  done
  if (( ${#required_failed[@]} )); then
    echo "result: FAILED (${required_failed[*]})"
  else
    echo "result: all required steps passed"
  fi
}

echo
summary 2>&1 | tee "$OUT/summary.txt"
# The device tool brings back at most 8 files from $OUT: the step logs travel as one archive.
if compgen -G "$OUT/*.log" >/dev/null; then
  tar -czf "$OUT/logs.tgz" -C "$OUT" $(cd "$OUT" && ls ./*.log) && rm -f "$OUT"/*.log
fi
# A dry run checks what a GPU run would bring back: the files, their count, the profile.
if [[ $DRY_RUN == 1 ]]; then
  kept=$(find "$OUT" -maxdepth 1 -type f | wc -l)
  if (( kept > 8 )) || [[ ! -s $OUT/summary.txt || ! -s $OUT/logs.tgz || ! -s $OUT/profile.jsonl \
                          || ! -s $OUT/tuning.jsonl ]]; then
    echo "dry run: FAILED: $kept files under $OUT (at most 8), summary.txt, logs.tgz, profile.jsonl and" \
         "tuning.jsonl must not be empty"
    ls -la "$OUT"
    exit 1
  fi
  echo "dry run: $kept files under $OUT, $(wc -l <"$OUT/profile.jsonl") profile records," \
       "$(wc -l <"$OUT/tuning.jsonl") tuning records"
fi
(( ${#required_failed[@]} == 0 ))
