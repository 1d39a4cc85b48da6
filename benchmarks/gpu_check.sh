#!/usr/bin/env bash
# The GPU checks in one run on a machine with a CUDA device, from the repository root: the tests
# that use the device, the kernel sweep, a profile of one training step with dedup on and off
# (where the host and the device spend it, and where the host waits), and the trainer benchmark
# (dedup on vs off, and fed by the readers vs on preloaded batches). docs/gpu.md says what each
# figure is.
#
#   bash benchmarks/gpu_check.sh [tests] [kernels] [kernels_driver] [profile] [trainer]
#                                                                      (default: all, in order)
#
# It installs nothing from the network. Environment:
#   WHEELS  a folder of wheels installed offline first, over the image's packages, into
#           /tmp/site (default .whl; skipped when absent): numpy<2.5 for numba-cuda (see
#           docs/gpu.md), and the pure-wheel dependencies the image lacks
#   DATA    a clustered dataset for the trainer (default .gpu_data/clustered); built here with
#           benchmarks.trainer.build_dataset (400,000 requests, seed 0) when absent
#   E2E_DATA  the dataset the trainer's --end-to-end part reads (default
#           /tmp/recpipe_gpu_e2e/clustered; built when absent, 1,600,000 requests, seed 0: about
#           36 row groups, so that 12 workers read three each an epoch)
#   OUT     where the logs, the JSON files and summary.txt go (default gpu_out)
# Each step runs under `timeout`; a step that fails or times out is reported and the next runs.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
WHEELS=${WHEELS:-.whl}
DATA=${DATA:-.gpu_data/clustered}
E2E_DATA=${E2E_DATA:-/tmp/recpipe_gpu_e2e/clustered}
mkdir -p "$OUT"
unset NUMBA_ENABLE_CUDASIM
export PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=/tmp/numba_cache PYTHONPATH="$PWD"
if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site "$WHEELS"/*.whl || echo "gpu_check: installing $WHEELS failed"
  export PYTHONPATH="/tmp/site:$PWD"
fi
SUMMARY="$OUT/summary.txt"
{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -2
  python3 -c "
import platform, numba, numpy, pyarrow, torch
from importlib.metadata import PackageNotFoundError, version
def v(name):
    try:
        return version(name)
    except PackageNotFoundError:
        return 'absent'
print('python', platform.python_version(), 'torch', torch.__version__, 'cuda', torch.version.cuda,
      'numba', numba.__version__, 'numba-cuda', v('numba-cuda'), 'cuda-core', v('cuda-core'),
      'numpy', numpy.__version__, 'pyarrow', pyarrow.__version__,
      'device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NONE')"
} 2>&1 | tee "$SUMMARY"

step() {  # step NAME SECONDS COMMAND...: run under timeout, log to $OUT/NAME.log, note the status
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  local note="ok"
  [ $rc -eq 124 ] && note="TIMED OUT after ${limit}s"
  [ $rc -ne 0 ] && [ $rc -ne 124 ] && note="FAILED (exit $rc)"
  echo "== $name: $note in $((SECONDS - start))s (log $OUT/$name.log)" | tee -a "$SUMMARY"
  return $rc
}

run_tests() {
  # every test that puts work on the device: the CUDA kernels against the CPU forms and the
  # NumPy references (both thread layouts, the direct launch), the shared bodies compiled for
  # the device, the hash on CUDA tensors, and the DLRM's dedup parity on CUDA
  step tests 90 python3 -m pytest -q -p no:cacheprovider --maxfail=10 \
    tests/recpipe/test_kernels_cuda.py tests/recpipe/test_bodies.py tests/recpipe/test_splitmix.py \
    tests/trainer/test_models.py::test_dlrm_dedup_parity_on_cuda tests/trainer/test_cuda_optim.py \
    tests/recpipe/test_packed.py
  tail -4 "$OUT/tests.log" | tee -a "$SUMMARY"
}

run_kernels() {
  step kernels 150 python3 -m benchmarks.kernels --repeats 5 \
    --gpu-rows 4096,16384,131072 --out "$OUT/kernels_gpu.json"
  python3 - "$OUT/kernels_gpu.json" <<'EOF' 2>&1 | tee -a "$SUMMARY"
import json, sys
d = json.load(open(sys.argv[1]))
names = ("jagged_index_select", "jagged_index_select_known_size", "jagged_index_select_known_layout",
         "jagged_index_add", "select_kernel_word", "select_kernel_row", "add_kernel_word",
         "add_kernel_row", "add_kernel_run", "torch_copy")
print("rate / a torch copy's (ms) by batch rows; layouts", d["gpu"].get("select_layout"),
      d["gpu"].get("add_layout"))
for p in d.get("gpu_sweep", []):
    cells = [f"{n} {p.get(n + '_vs_torch_copy', 1.0):.2f} ({p[n + '_ms']:.3f})" for n in names]
    print(f"  {p['rows']:>7}: " + "; ".join(cells))
    cells = [f"{k[:-10]} {v:.3f}" for k, v in p.items() if k.endswith("_device_ms")]
    print("     device ms: " + "; ".join(cells))
print("launch ms: dispatcher", round(d["gpu"]["dispatcher_launch_ms"], 4),
      "direct", round(d["gpu"]["direct_launch_ms"], 4))
EOF
}

run_kernels_driver() {
  # the same kernels launched by the driver route (RECPIPE_CUDA_LAUNCH=driver), at 16,384 rows,
  # to decide whether it becomes the default (recpipe.kernels.cuda.launch)
  step kernels_driver 120 env RECPIPE_CUDA_LAUNCH=driver python3 -m benchmarks.kernels --repeats 5 \
    --gpu-rows 16384 --out "$OUT/kernels_gpu_driver.json"
  python3 - "$OUT/kernels_gpu.json" "$OUT/kernels_gpu_driver.json" <<'EOF' 2>&1 | tee -a "$SUMMARY"
import json, sys
def at(path):
    try:
        d = json.load(open(path))
    except (OSError, ValueError):
        return {}
    return {p["rows"]: p for p in d.get("gpu_sweep", [])}.get(16384, {})
core, driver = at(sys.argv[1]), at(sys.argv[2])
print("16,384 rows, ms per call, cuda.core launch vs driver launch:")
for name in ("jagged_index_select", "jagged_index_select_known_layout", "jagged_index_add",
             "select_kernel_row", "add_kernel_row", "add_kernel_run"):
    print(f"  {name}: {core.get(name + '_ms', float('nan')):.3f} vs "
          f"{driver.get(name + '_ms', float('nan')):.3f}")
EOF
}

ensure_data() {
  if [ ! -f "$DATA/_manifest.json" ]; then
    step dataset 240 python3 -c "
from pathlib import Path
from benchmarks.trainer import build_dataset
build_dataset(Path('$(dirname "$DATA")'), requests=400_000, seed=0)" || return
  fi
}

run_profile() {
  ensure_data || return
  step profile 90 python3 -m benchmarks.gpu_profile --data "$DATA" --batch-size 32768 \
    --steps 3 --out "$OUT/profile_gpu.json"
  grep -E "^dedup|sync x" "$OUT/profile.log" | head -30 | tee -a "$SUMMARY"
}

run_trainer() {
  ensure_data || return
  if [ ! -f "$E2E_DATA/_manifest.json" ]; then
    step e2e_dataset 300 python3 -c "
from pathlib import Path
from benchmarks.trainer import build_dataset
build_dataset(Path('$(dirname "$E2E_DATA")'), requests=1_600_000, seed=0)" || return
  fi
  step trainer 300 python3 -m benchmarks.trainer --device cuda --data "$DATA" \
    --end-to-end-data "$E2E_DATA" --batch-size 32768 --steps 10 --warmup 2 --dense-grads \
    --end-to-end --workers 4,8,12 --rounds 3 --bitwise-steps 2 --out "$OUT/trainer_gpu.json"
  python3 - "$OUT/trainer_gpu.json" <<'EOF' 2>&1 | tee -a "$SUMMARY"
import json, sys
d = json.load(open(sys.argv[1]))
for key in ("device_name", "batch_size", "dedup_speedup", "max_loss_rel_diff_on_vs_off",
            "end_to_end_vs_model_only", "end_to_end_workers", "end_to_end_workers_for_0_9",
            "partial_speedup"):
    print(f"  {key}: {d.get(key)}")
s = (d.get("dedup_speedup_spread") or {}).get("wall", {})
print(f"  dedup_speedup spread (wall): {s.get('min')} .. {s.get('max')}")
for point in d.get("end_to_end") or []:
    s = point.get("vs_model_only_spread", {})
    print(f"  end to end, {point['workers']} workers: {point['vs_model_only']:.3f} "
          f"({s.get('min', 0):.3f} .. {s.get('max', 0):.3f})")
EOF
}

stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(tests kernels kernels_driver profile trainer)
for stage in "${stages[@]}"; do
  case $stage in
    tests) run_tests ;;
    kernels) run_kernels ;;
    kernels_driver) run_kernels_driver ;;
    profile) run_profile ;;
    trainer) run_trainer ;;
    *) echo "gpu_check: unknown stage '$stage' (tests, kernels, kernels_driver, profile, trainer)" | tee -a "$SUMMARY" ;;
  esac
done
echo "gpu_check: done; files in $OUT" | tee -a "$SUMMARY"
