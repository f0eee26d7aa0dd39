#!/usr/bin/env bash
# GRPO on gsm8k, written the tandem way: the same run as verl.sh beside it, in tandem's keys
# (`tandem train --verl ... --print-config` prints this translation for any verl command).
# Where tandem's defaults already equal the value, the key is left out; verl steps the
# learning-rate schedule once per RL step and keeps every checkpoint, so those are spelled
# out. Extra key=value arguments are appended; --print-config shows the config without training.
set -euo pipefail

MODEL_PATH=${MODEL_PATH:-$HOME/models/Qwen2.5-0.5B-Instruct}
TRAIN_FILE=${TRAIN_FILE:-$HOME/data/gsm8k/train.parquet}
TEST_FILE=${TEST_FILE:-$HOME/data/gsm8k/test.parquet}
NGPUS_PER_NODE=${NGPUS_PER_NODE:-1}
if python3 -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
    DEVICE=(trainer.device=cuda trainer.n_gpus_per_node="$NGPUS_PER_NODE" actor.engine.mixed_precision=bf16)
else  # verl's GPUs become CPU workers here, computing in fp32
    DEVICE=(trainer.device=cpu trainer.n_workers="$NGPUS_PER_NODE")
fi

tandem train preset=grpo \
    model_path="$MODEL_PATH" \
    data.train_path="$TRAIN_FILE" \
    data.val_path="$TEST_FILE" \
    data.train_batch_size=256 \
    data.max_prompt_length=512 \
    data.overlong_prompts=filter \
    rollout.max_response_length=1024 \
    rollout.n=5 \
    rollout.engine.name=vllm \
    rollout.engine.vllm.gpu_memory_utilization=0.6 \
    rollout.top_k=0 \
    actor.engine.lr=1e-6 \
    actor.engine.weight_decay=0.01 \
    actor.engine.gradient_checkpointing=true \
    actor.engine.max_tokens_per_micro_batch=16384 \
    actor.engine.warmup_from_zero=true \
    actor.ppo_mini_batch_size=64 \
    actor.offload.reference=true \
    algorithm.kl.use_kl_loss=true \
    algorithm.kl.kl_loss_coef=0.001 \
    algorithm.kl.estimator=k3 \
    trainer.loggers=[console,tensorboard,jsonl] \
    trainer.project=verl_grpo_example_gsm8k \
    trainer.experiment=qwen2_5_0_5b_grpo \
    trainer.output_dir=checkpoints/verl_grpo_example_gsm8k/qwen2_5_0_5b_grpo \
    trainer.save_every=20 \
    trainer.val_every=5 \
    trainer.total_epochs=15 \
    trainer.lr_schedule_unit=step \
    trainer.keep_last=1000000 \
    "${DEVICE[@]}" "$@"
