#!/usr/bin/env bash
# The one script for a GPU machine: build the CUDA extension (for the GPU it sees), the GPU
# tests, the rest of the suite, the benchmarks. Every step's full log lands under $OUT (default
# ./gpu_check_out) with env.txt and summary.txt; the console gets one line per step and
# the summary last.
#   DFLASH2_COMMIT=$(git rev-parse --short=12 HEAD) OUT=/some/dir bash scripts/gpu_check.sh
# ends within 9 minutes on one H200. DFLASH2_COMMIT names the commit where the copy has
# no .git (env.txt and every benchmark record carry it). Uses the machine's python3 (or
# $PYTHON) and its torch/triton; needs no network.
# Exit status: 0 when every required step passed, 1 otherwise.
#
# A GPU machine is lent rarely, for ~15 minutes of device time and one command of at
# most 10 minutes, so one run has to bring back everything: a step that fails or times
# out never stops the later ones, and each step has its own cap so that one hang cannot
# eat the others' time. Caps (seconds) and why:
#   build           150  the CUDA build takes ~60 s there with 16 jobs; nothing else is
#                        worth much without it, so it gets the widest margin
#   kernels          30  import check: are the CUDA kernels registered, is a GPU visible
#   arch             30  dk.build_info(): the GPU's compute capability against the code
#                        the build holds (fails when the GPU runs none of it)
#   tests_gpu       120  338 tests in 4 pytest-xdist workers: 70 s on the first H200 run
#                        (cold Triton cache: one JIT compile per kernel specialization)
#   tests_rest      120  ~2,700 tests in 12 workers (most skip there: no speculators or
#                        NeMo); the first H200 run reached 583 of them in 45 s
#   bench_conv       50  --no-compile, all five GPU shapes (the targets sit at
#                        16384x4096, which --quick drops); torch.compile warm-up of the
#                        reference would cost more than the whole step
#   bench_selector   50  --no-compile, both shapes
#   bench_serving    60  --no-compile, B in {1, 8, 32, 128}; many CUDA-graph captures
#   bench_head      150  --no-compile, N 4096 / 16384 x V 248,320 x H 5120 bf16, kl_div (tv a
#                        metric) and ce, fwd and fwd+bwd (issue 37's targets): the dense
#                        head's [N, V] passes take ~0.1-1 s a call there, 8 s of timing a
#                        case, then each side's device time (torch.profiler) and peak; a
#                        dense row that does not fit is recorded as skipped (75 s cut the
#                        first H200 run short after N 4096: it writes records at the end)
# The caps add up to more than fits: they are there against hangs. The hard bound
# is BUDGET_S: no step may run past it (its cap shrinks to what is left), so the run ends
# at BUDGET_S plus the summary, within 9 minutes even when every step runs to its cap;
# then the last benchmarks are cut short or skipped, and the summary still comes back.
# Time the required steps leave unused (expected: a few minutes) goes to the optional
# steps, the FSDP2 step first, then the torch.compile comparisons (conv: the ">= 2x
# torch.compile" target), each started only when its whole cap still fits: the
# benchmarks write their records only at the end, so a cut-short run is wasted time.
# Optional steps never change the exit status. Their caps:
#   fsdp_step        60  one FSDP2 training step of the patched tiny speculators drafter on
#                        the GPU in a 1-rank gloo process group (no NCCL: FSDP2 skips its
#                        collectives at world size 1), against the unsharded model; ~15 s
#                        of imports, the steps themselves well under 1 s
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
KILL_AFTER=10   # a step ignoring SIGINT (a hung kernel) is killed this long after its cap
MIN_STEP_S=15   # a required step with less time than this left is not started
mkdir -p "$OUT"
rm -f "$OUT/bench.jsonl" "$OUT/bench_compile.jsonl"   # the benchmarks append; start clean
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
  if [[ $TESTS_ONLY == 1 && ! $name =~ ^(build|kernels|arch|tests_.*)$ ]]; then
    printf '[%3ds] %-16s skipped: GPU_CHECK_TESTS_ONLY\n' "$SECONDS" "$name"
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
step tests_gpu 120 "${PYTEST[@]}" "${GPU_WORKERS[@]}" -m gpu
step tests_rest 120 "${PYTEST[@]}" "${REST_WORKERS[@]}" -m "not gpu"

step bench_conv 50 "$PY" benchmarks/bench_conv.py --no-compile --out "$OUT/bench.jsonl"
step bench_selector 50 "$PY" benchmarks/bench_selector.py --no-compile --out "$OUT/bench.jsonl"
step bench_serving 60 "$PY" benchmarks/bench_serving.py --no-compile --out "$OUT/bench.jsonl"
step bench_head 150 "$PY" benchmarks/bench_head.py --no-compile --out "$OUT/bench.jsonl"

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
    device = (ours.get("extra") or {}).get("device_ms")
    if device:  # the device's share (bench_head): ratios of device times
        line += f" (device {device:.2f} ms)"
    for r in rows:
        if r is not ours:
            other = (r.get("extra") or {}).get("device_ms") if device else None
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
(( ${#required_failed[@]} == 0 ))
