#!/usr/bin/env bash
# PPO with a critic on gsm8k, written the tandem way: the same run as verl.sh beside it.
# verl's quick start keeps verl's defaults for what it leaves out (GAE with lambda 1, no KL,
# weight decay 0.01, a schedule stepped once per RL step), so they are spelled out here.
# Extra key=value arguments are appended; --print-config shows the config without training.
set -euo pipefail

MODEL_PATH=${MODEL_PATH:-$HOME/models/Qwen2.5-0.5B-Instruct}
TRAIN_FILE=${TRAIN_FILE:-$HOME/data/gsm8k/train.parquet}
TEST_FILE=${TEST_FILE:-$HOME/data/gsm8k/test.parquet}
NGPUS_PER_NODE=${NGPUS_PER_NODE:-1}
if python3 -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
    DEVICE=(trainer.device=cuda trainer.n_gpus_per_node="$NGPUS_PER_NODE"
            actor.engine.mixed_precision=bf16 critic.engine.mixed_precision=bf16)
else  # verl's GPUs become CPU workers here, computing in fp32
    DEVICE=(trainer.device=cpu trainer.n_workers="$NGPUS_PER_NODE")
fi

tandem train preset=ppo \
    model_path="$MODEL_PATH" \
    data.train_path="$TRAIN_FILE" \
    data.val_path="$TEST_FILE" \
    data.train_batch_size=256 \
    data.max_prompt_length=512 \
    data.overlong_prompts=error \
    rollout.max_response_length=512 \
    rollout.n=1 \
    rollout.engine.name=vllm \
    rollout.engine.vllm.gpu_memory_utilization=0.4 \
    algorithm.lam=1.0 \
    algorithm.kl.use_kl_in_reward=false \
    algorithm.kl.estimator=k3 \
    actor.ppo_mini_batch_size=64 \
    actor.engine.lr=1e-6 \
    actor.engine.weight_decay=0.01 \
    actor.engine.gradient_checkpointing=true \
    actor.engine.max_tokens_per_micro_batch=4096 \
    actor.engine.warmup_from_zero=true \
    critic.model_path="$MODEL_PATH" \
    critic.placement=colocated \
    critic.engine.lr=1e-5 \
    critic.engine.weight_decay=0.01 \
    critic.engine.gradient_checkpointing=true \
    critic.engine.max_tokens_per_micro_batch=4096 \
    critic.engine.warmup_from_zero=true \
    trainer.lr_schedule_unit=step \
    trainer.loggers=[console,jsonl] \
    trainer.project=verl_examples \
    trainer.experiment=gsm8k \
    trainer.output_dir=checkpoints/verl_examples/gsm8k \
    trainer.keep_last=1000000 \
    trainer.val_before_train=false \
    trainer.save_every=10 \
    trainer.val_every=10 \
    trainer.total_epochs=15 \
    "${DEVICE[@]}" "$@"
