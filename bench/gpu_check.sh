#!/usr/bin/env bash
# The one prepared device check (listed in README under Documentation): installs nothing, checks
# every GPU backend against the CPU float64 reference, times the kernels and a training step, then
# a ~1B MoE (1.08B parameters) at 32K tokens: the Trainer's step with its MFU against a bf16 matmul
# peak measured in the same run, and rl_hooks' compute_logprobs on ~64K tokens of rollouts. Writes
# everything under $OUT. Run it in ONE device call, then give the machine back. The timeouts add up
# to the 8-minute budget; gpu_check.json is rewritten after each section, so a timeout keeps the
# sections done.
set -u
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  python -c "import flash_attn; print('flash_attn', flash_attn.__version__)" 2>&1 || true
} > "$OUT/env.txt" 2>&1
# Estimated (not yet run on a GPU) ~2-3 min on an H200: the ~1B sections ~1-1.5 min of it (two
# model builds initialised on the host, Triton/cuBLAS warm-up, 8 steps of ~0.3-0.6 s, 10 log-prob calls).
timeout 300 python bench/gpu_check.py --out "$OUT/gpu_check.json" 2>&1 | tee "$OUT/gpu_check.log"
rc=${PIPESTATUS[0]}
echo "gpu_check exit code: $rc" | tee -a "$OUT/gpu_check.log"
# The Triton kernels compiled for real: each against its torch path (max difference, fwd+bwd time).
timeout 60 python bench/triton_kernels.py --reps 5 --out "$OUT/triton_kernels.json" 2>&1 | tee "$OUT/triton_kernels.log"
rc_triton=${PIPESTATUS[0]}
echo "triton_kernels exit code: $rc_triton" | tee -a "$OUT/triton_kernels.log"
# The verl engine under verl's own TrainingWorker with the GPU visible (train.device=auto puts the
# engine on cuda; verl's "nvidia" platform is picked over our host platform).
timeout 120 python -m pytest tests/rl_hooks/test_verl_engine.py -q -x -k "float32 and 1" 2>&1 | tee "$OUT/verl_engine.log"
verl_rc=${PIPESTATUS[0]}
echo "verl engine test exit code: $verl_rc" | tee -a "$OUT/verl_engine.log"
[ "$rc" -eq 0 ] && rc=$rc_triton
[ "$rc" -eq 0 ] && rc=$verl_rc
exit "$rc"
