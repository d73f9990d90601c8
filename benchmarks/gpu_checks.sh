#!/usr/bin/env bash
# The checks that need one CUDA GPU, which `make test` never runs (not a test suite of its own: each step's log
# lands in OUTDIR and the script prints each one's exit status, time and last lines).
#
#     benchmarks/gpu_checks.sh OUTDIR [STEP ...]
#
# python3 (or $PY) must hold torch with CUDA and polyrl's requirements (`pip install -e '.[train]'`); the vs_trl
# steps also need trl==1.16.0. Steps, in order (default: all):
#   env           torch, CUDA, the GPU, transformers and peft as this python sees them
#   gpu_tests     pytest -m gpu tests/test_fsdp.py: one process on the GPU (--device cuda) equals the CPU, and
#                 FSDP2 on NCCL with one GPU equals one CPU process
#   demo_gpu      the demo (150 steps) in one process; --device auto puts it on the GPU
#   resume_cpu    that run resumed on the CPU (--device cpu), 10 steps more
#   demo_nccl     the demo as one FSDP2 process on NCCL: torchrun --nproc-per-node 1 -m polyrl train
#   paths         benchmarks/gpu_paths.sh --device cuda: a critic, LoRA with drift probes, the tree sampler, a
#                 teacher, agency transfer, 3 steps each
#   vs_trl_size   benchmarks/vs_trl.py scaling --device cuda: polyrl vs TRL on the GPU at 128 natural tokens on a
#                 768 x 12 tiny Llama (113M parameters)
#   vs_trl_demo   the same at the demo settings
#   tune_tokens   polyrl alone (vs_trl.py switch --device cuda) at that 113M point, micro_batch_tokens 4096 (the CPU's
#                 default: 3 passes there) against 16384 (one pass); OUTDIR/tune_tokens.json
#   tune_share    the same, share_prompts on against off (two passes per layer against one on a GPU)
#   tune_share_demo   share_prompts on against off at the demo settings
set -u
OUT=${1:?usage: benchmarks/gpu_checks.sh OUTDIR [STEP ...]}
shift
STEPS=${*:-env gpu_tests demo_gpu resume_cpu demo_nccl paths vs_trl_size vs_trl_demo tune_tokens tune_share \
tune_share_demo}
PY=${PY:-python3}
ROUNDS=${ROUNDS:-2}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PY
RUN=${TMPDIR:-/tmp}/polyrl_gpu_demo

step() {  # step NAME SECONDS COMMAND...: run it when asked for, under a time limit
  local name=$1 limit=$2 start rc
  shift 2
  [[ " $STEPS " == *" $name "* ]] || return 0
  echo "== $name: $*"
  start=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "   exit $rc in $(($(date +%s) - start)) s"
  tail -n 12 "$OUT/$name.log" | cut -c1-200
}

step env 60 "$PY" -c "import torch, transformers, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.get_device_name(0), 'transformers', transformers.__version__, 'peft', peft.__version__)"
step gpu_tests 150 "$PY" -m pytest -m gpu -q -p no:cacheprovider tests/test_fsdp.py
step demo_gpu 120 "$PY" -m polyrl train --overwrite --run-dir "$RUN"
step resume_cpu 90 "$PY" -m polyrl train --resume --run-dir "$RUN" --steps 160 --device cpu
step demo_nccl 180 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 -m polyrl train --overwrite \
  --run-dir "$RUN"
step paths 150 benchmarks/gpu_paths.sh --device cuda
step vs_trl_size 240 "$PY" benchmarks/vs_trl.py scaling --device cuda --trl-python "$PY" --lengths "" --sizes 768x12 \
  --size-length 128 --rounds "$ROUNDS" --steps 3 --warmup 2
step vs_trl_demo 200 "$PY" benchmarks/vs_trl.py demo --device cuda --trl-python "$PY" --rounds "$ROUNDS" --steps 5
tune() {  # tune NAME SWITCH-ARGS...: a polyrl-only A/B of one setting; its result kept as OUT/NAME.json
  local name=$1
  shift
  step "$name" 240 "$PY" benchmarks/vs_trl.py switch --device cuda --rounds "$ROUNDS" --steps 3 --warmup 2 "$@" &&
    [[ " $STEPS " == *" $name "* ]] && cp benchmarks/results/vs_trl_cuda/switch.json "$OUT/$name.json" 2>/dev/null
}
SIZE=(--switch-size 768x12 --size-length 128 --stop natural)
tune tune_tokens "${SIZE[@]}" --polyrl-set micro_batch_tokens=16384
tune tune_share "${SIZE[@]}" --polyrl-set share_prompts=false
tune tune_share_demo --polyrl-set share_prompts=false
cp benchmarks/results/vs_trl_cuda/*.json "$OUT/" 2>/dev/null
exit 0
