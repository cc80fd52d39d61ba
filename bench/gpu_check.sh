#!/usr/bin/env bash
# The one prepared device check (listed in README under Documentation): installs nothing into the
# image (the carried wheels go to a temporary directory), checks
# every GPU backend against the CPU float64 reference, times the kernels and a training step, then
# a ~1B MoE (1.08B parameters) at 32K tokens: the Trainer's step with its MFU against a bf16 matmul
# peak measured in the same run, and rl_hooks' compute_logprobs on ~64K tokens of rollouts. Then
# the Triton kernels compiled for real, `longctx-moe train` of the tiny config on the GPU, the
# verl engine test where verl is installed, and the peers: torchtitan's and transformers' Qwen3 MoE
# at the ~1B shape on the same packed row. Writes under $OUT: env.txt, sections.log (every
# section's output), gpu_check.json (the peers folded in as "peers"), fp8.json, memory_truth.json
# (the offload check folded in as "offload_gpu"), triton_kernels.json and the profile tables of one
# ~1B step and one compute_logprobs call (8 files: a device call brings back at most 8). Run it in
# ONE device call, carrying bench/wheels (`make gpu-wheels` first: torchtitan's wheel and what it
# imports), then give the machine back. The timeouts add up to 470 s (450 s where verl is not
# installed, as in the stock image), and the wheels' install has 10 s: under 8 minutes in all;
# gpu_check.json is rewritten after each section, so a timeout keeps the sections done.
#
#   OUT=/tmp/gpu bash bench/gpu_check.sh        # PYTHON=... picks the interpreter (python3)
set -u
OUT=${OUT:-bench/results/gpu}
PY=${PYTHON:-python3}  # GPU images often have no plain `python`
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 || true
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  for m in triton flash_attn transformer_engine transformers verl; do
    $PY -c "import $m; print('$m', getattr($m, '__version__', '?'))" 2>&1 | tail -1
  done
  lscpu | grep -E "Model name|^CPU\(s\)"
} > "$OUT/env.txt" 2>&1

section() {  # section NAME SECONDS COMMAND...: its output goes to $OUT/sections.log; returns its code
  local name=$1 limit=$2
  shift 2
  local log="/tmp/gpu_check_$name.log"
  timeout "$limit" "$@" > "$log" 2>&1
  local rc=$?
  { echo "===== $name: exit code $rc"; cat "$log"; } >> "$OUT/sections.log"
  tail -n 25 "$log"
  echo "$name exit code: $rc"
  return $rc
}

# On one H200 (2026-12-04) the whole script took 137 s, this section most of it.
section gpu_check 130 $PY bench/gpu_check.py --out "$OUT/gpu_check.json" --profile-dir "$OUT"
rc=$?
# The rehearsal's memory against this GPU's: the ~1B step's torch.cuda.max_memory_allocated and
# the same config rehearsed on meta (world 1, this GPU's kind), and their ratio (mem_ratio_gpu).
section memory_truth 40 $PY bench/memory_truth_gpu.py --out "$OUT/memory_truth.json"
rc_mem=$?
# Offload on this GPU (bench/offload_gpu.py): torch.cuda.memory_allocated around
# PolicyTrainer.offload() / onload(), the step after the round trip bitwise, optim.offload=cpu
# against the device optimizer; its JSON is folded into memory_truth.json as "offload_gpu".
section offload_gpu 30 $PY bench/offload_gpu.py --out /tmp/gpu_check_offload.json
rc_offload=$?
$PY - "$OUT/memory_truth.json" /tmp/gpu_check_offload.json <<'PYEOF' || true
import json, sys
from pathlib import Path
main, offload = (Path(p) for p in sys.argv[1:])
res = json.loads(main.read_text()) if main.exists() else {}
res["offload_gpu"] = json.loads(offload.read_text()) if offload.exists() else None
main.write_text(json.dumps(res, indent=2))
PYEOF
# The ~1B step again with execution.fp8=torch (FP8 GEMMs; its MFU is still against the bf16 peak),
# per-tensor scaling, then execution.fp8_recipe=block (its JSON is folded into fp8.json as "block_run").
section fp8_trainer_step 40 $PY bench/gpu_check.py --sections check.fp8,time.trainer_step \
  --set execution.fp8=torch --out "$OUT/fp8.json"
rc_fp8=$?
section fp8_block_trainer_step 40 $PY bench/gpu_check.py --sections time.trainer_step \
  --set execution.fp8=torch --set execution.fp8_recipe=block --out /tmp/gpu_check_fp8_block.json
rc_fp8_block=$?
$PY - "$OUT/fp8.json" /tmp/gpu_check_fp8_block.json <<'PYEOF' || true
import json, sys
from pathlib import Path
main, block = (Path(p) for p in sys.argv[1:])
res = json.loads(main.read_text()) if main.exists() else {}
res["block_run"] = json.loads(block.read_text()) if block.exists() else None
main.write_text(json.dumps(res, indent=2))
PYEOF
# The Triton kernels compiled for real: each against its torch path (max difference, fwd+bwd time).
section triton_kernels 30 $PY bench/triton_kernels.py --reps 5 --out "$OUT/triton_kernels.json"
rc_triton=$?
# The user's first command on a GPU: the default tiny config, train.device=auto picks cuda.
section train_cli 25 $PY -m longctx_moe.cli train --config configs/tiny_cpu.yaml \
  --set data.path=data/stdlib_tiny --set train.steps=40 --set train.run_dir=/tmp/gpu_check_run \
  --set checkpoint.resume=none
rc_cli=$?
# The verl engine under verl's own TrainingWorker with the GPU visible (train.device=auto puts the
# engine on cuda; verl's "nvidia" platform is picked over our host platform). verl and its Ray are
# not in the stock image (and Ray's wheel is over what a device call carries): say so instead.
if $PY -c "import verl" 2>/dev/null; then
  section verl_engine 20 $PY -m pytest tests/rl_hooks/test_verl_engine.py -q -x -k "float32 and 1"
  verl_rc=$?
else
  echo "verl is not installed in this image: the verl engine test was not run"
  verl_rc=0
fi
# The peers on this GPU (bench/peers_gpu.py, one process each, the trainer section's shape and
# packed row; ours is that section's figure): torchtitan 0.3.0's Qwen3 MoE from the wheels carried
# in bench/wheels, installed offline into a temporary directory (where they are absent, or torchtitan
# does not import here, its record says why in one line), and transformers' Qwen3MoeForCausalLM.
TT=/tmp/gpu_check_torchtitan
rm -rf "$TT" /tmp/gpu_check_peer_torchtitan.json /tmp/gpu_check_peer_transformers.json
timeout 10 $PY -m pip install --no-index --no-deps -q --target "$TT" bench/wheels/*.whl > /tmp/gpu_check_wheels.log 2>&1 \
  || echo "bench/wheels not installed (run \`make gpu-wheels\` before the device call): $(tail -n 1 /tmp/gpu_check_wheels.log)"
section peers_torchtitan 65 env PYTHONPATH="$TT:$PYTHONPATH" $PY bench/peers_gpu.py --model torchtitan \
  --out /tmp/gpu_check_peer_torchtitan.json
rc_tt=$?
section peers_transformers 50 $PY bench/peers_gpu.py --model transformers --out /tmp/gpu_check_peer_transformers.json
rc_hf=$?
$PY - "$OUT/gpu_check.json" /tmp/gpu_check_peer_torchtitan.json /tmp/gpu_check_peer_transformers.json <<'PYEOF' || true
import json, sys
from pathlib import Path
main, *peers = (Path(p) for p in sys.argv[1:])
res = json.loads(main.read_text()) if main.exists() else {}
ours = res.get("time.trainer_step")
table = {"ours": {"step": ours, "peak_matmul": res.get("time.peak_matmul")} if ours else None}
for name, path in zip(("torchtitan", "transformers"), peers):
    table[name] = json.loads(path.read_text()) if path.exists() else None
res["peers"] = table
main.write_text(json.dumps(res, indent=2))
PYEOF
for r in $rc_mem $rc_offload $rc_fp8 $rc_fp8_block $rc_triton $rc_cli $verl_rc $rc_tt $rc_hf; do [ "$rc" -eq 0 ] && rc=$r; done
exit "$rc"
