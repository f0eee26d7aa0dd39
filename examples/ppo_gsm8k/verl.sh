#!/usr/bin/env bash
# PPO with a critic on gsm8k, written the verl way: verl's quick start (docs/start/quickstart.rst)
# with one word changed, `verl.trainer.main_ppo` -> `tandem.verl.main_ppo`. verl's default
# estimator is GAE, so a critic trains beside the actor.
# Data: tandem prepare-data gsm8k --source <gsm8k train file> --out $HOME/data/gsm8k/train.parquet
#       (and --split test for the test file). Extra key=value arguments are appended; the last
# value of a key wins. --print-config shows the tandem config without training.
set -euo pipefail

MODEL_PATH=${MODEL_PATH:-$HOME/models/Qwen2.5-0.5B-Instruct}
TRAIN_FILE=${TRAIN_FILE:-$HOME/data/gsm8k/train.parquet}
TEST_FILE=${TEST_FILE:-$HOME/data/gsm8k/test.parquet}
NGPUS_PER_NODE=${NGPUS_PER_NODE:-1}

PYTHONUNBUFFERED=1 python3 -m tandem.verl.main_ppo \
    data.train_files="$TRAIN_FILE" \
    data.val_files="$TEST_FILE" \
    data.train_batch_size=256 \
    data.max_prompt_length=512 \
    data.max_response_length=512 \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.4 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4 \
    critic.optim.lr=1e-5 \
    critic.model.path="$MODEL_PATH" \
    critic.ppo_micro_batch_size_per_gpu=4 \
    algorithm.kl_ctrl.kl_coef=0.001 \
    trainer.logger=console \
    trainer.val_before_train=False \
    trainer.n_gpus_per_node="$NGPUS_PER_NODE" \
    trainer.nnodes=1 \
    trainer.save_freq=10 \
    trainer.test_freq=10 \
    trainer.total_epochs=15 "$@"
