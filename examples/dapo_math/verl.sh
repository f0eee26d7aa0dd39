#!/usr/bin/env bash
# DAPO on MATH, written the verl way: the keys of verl's DAPO recipe (clip-higher, dynamic
# sampling on accuracy, token-mean loss, overlong buffer, no KL) with one word changed,
# `verl.trainer.main_ppo` -> `tandem.verl.main_ppo`.
# Data: tandem prepare-data math --source <MATH train file> --out $HOME/data/math/train.parquet
#       (and --split test for the test file). Extra key=value arguments are appended; the last
# value of a key wins. --print-config shows the tandem config without training.
set -euo pipefail

MODEL_PATH=${MODEL_PATH:-$HOME/models/Qwen2.5-Math-1.5B}
TRAIN_FILE=${TRAIN_FILE:-$HOME/data/math/train.parquet}
TEST_FILE=${TEST_FILE:-$HOME/data/math/test.parquet}
NGPUS_PER_NODE=${NGPUS_PER_NODE:-8}

max_prompt_length=1024
max_response_length=3072
overlong_buffer_len=512
train_prompt_bsz=128
n_resp_per_prompt=8
train_prompt_mini_bsz=32
actor_ppo_max_token_len=$(((max_prompt_length + max_response_length) * 2))

python3 -m tandem.verl.main_ppo \
    data.train_files="$TRAIN_FILE" \
    data.val_files="$TEST_FILE" \
    data.prompt_key=prompt \
    data.truncation='left' \
    data.max_prompt_length=${max_prompt_length} \
    data.max_response_length=${max_response_length} \
    data.gen_batch_size=$((train_prompt_bsz * 3)) \
    data.train_batch_size=${train_prompt_bsz} \
    actor_rollout_ref.rollout.n=${n_resp_per_prompt} \
    algorithm.adv_estimator=grpo \
    algorithm.use_kl_in_reward=False \
    algorithm.kl_ctrl.kl_coef=0.0 \
    algorithm.filter_groups.enable=True \
    algorithm.filter_groups.metric=acc \
    algorithm.filter_groups.max_num_gen_batches=10 \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.actor.kl_loss_coef=0.0 \
    actor_rollout_ref.actor.clip_ratio_low=0.2 \
    actor_rollout_ref.actor.clip_ratio_high=0.28 \
    actor_rollout_ref.actor.clip_ratio_c=10.0 \
    actor_rollout_ref.actor.loss_agg_mode=token-mean \
    actor_rollout_ref.actor.use_dynamic_bsz=True \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=${actor_ppo_max_token_len} \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.optim.lr_warmup_steps=10 \
    actor_rollout_ref.actor.optim.weight_decay=0.1 \
    actor_rollout_ref.actor.ppo_mini_batch_size=${train_prompt_mini_bsz} \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.actor.grad_clip=1.0 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.80 \
    actor_rollout_ref.rollout.temperature=1.0 \
    actor_rollout_ref.rollout.top_p=1.0 \
    actor_rollout_ref.rollout.top_k=-1 \
    actor_rollout_ref.rollout.val_kwargs.temperature=1.0 \
    actor_rollout_ref.rollout.val_kwargs.top_p=0.7 \
    actor_rollout_ref.rollout.val_kwargs.top_k=-1 \
    actor_rollout_ref.rollout.val_kwargs.do_sample=True \
    actor_rollout_ref.rollout.val_kwargs.n=1 \
    reward.reward_manager.name=dapo \
    +reward.reward_kwargs.overlong_buffer_cfg.enable=True \
    +reward.reward_kwargs.overlong_buffer_cfg.len=${overlong_buffer_len} \
    +reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0 \
    +reward.reward_kwargs.max_resp_len=${max_response_length} \
    trainer.logger=['console','tensorboard'] \
    trainer.project_name=DAPO \
    trainer.experiment_name=DAPO-Qwen2.5-Math-1.5B \
    trainer.n_gpus_per_node="$NGPUS_PER_NODE" \
    trainer.nnodes=1 \
    trainer.val_before_train=True \
    trainer.test_freq=10 \
    trainer.save_freq=10 \
    trainer.total_epochs=10 \
    trainer.resume_mode=auto "$@"
