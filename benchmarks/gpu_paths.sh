#!/usr/bin/env bash
# Three training steps through each path that places a model or a batch on the training device (benchmarks/
# gpu_checks.sh runs it as its step "paths" with --device cuda): a critic, LoRA with drift probes, the tree sampler
# scored by the learner, a distillation teacher, agency transfer's baseline. Each line: the run's accuracy table row.
set -u
PY=${PY:-python3}
WARM=$($PY -m polyrl warmstart --task addition | tail -1)
status=0
for args in "--method ppo" "--lora-rank 8 --drift-prompts 4" "--sampler tree --tree-predictor likelihood" \
  "--teacher $WARM" "--agency $WARM"; do
  echo "-- $args $*"
  # shellcheck disable=SC2086  # the arguments are words
  if out=$($PY -m polyrl train $args "$@" --steps 3 --eval-prompts 8 --overwrite --run-dir /tmp/polyrl_paths_run \
    --no-tensorboard 2>&1); then
    echo "$out" | grep -E "^│ +[0-9.]+ │" | tail -1
  else
    echo "$out" | tail -5
    status=1
  fi
done
exit $status
