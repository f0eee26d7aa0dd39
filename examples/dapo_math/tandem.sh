#!/usr/bin/env bash
# DAPO on MATH, written the tandem way: the same run as verl.sh beside it, from tandem's dapo
# preset (clip-higher, dynamic sampling, token-mean loss, overlong penalty, no KL) plus the
# recipe's sizes. Extra key=value arguments are appended; --print-config shows the config.
set -euo pipefail

MODEL_PATH=${MODEL_PATH:-$HOME/models/Qwen2.5-Math-1.5B}
TRAIN_FILE=${TRAIN_FILE:-$HOME/data/math/train.parquet}
TEST_FILE=${TEST_FILE:-$HOME/data/math/test.parquet}
NGPUS_PER_NODE=${NGPUS_PER_NODE:-8}
if python3 -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
    DEVICE=(trainer.device=cuda trainer.n_gpus_per_node="$NGPUS_PER_NODE" actor.engine.mixed_precision=bf16)
else  # verl's GPUs become CPU workers here, computing in fp32
    DEVICE=(trainer.device=cpu trainer.n_workers="$NGPUS_PER_NODE")
fi

tandem train preset=dapo \
    model_path="$MODEL_PATH" \
    data.train_path="$TRAIN_FILE" \
    data.val_path="$TEST_FILE" \
    data.train_batch_size=128 \
    data.max_prompt_length=1024 \
    data.overlong_prompts=truncate_left \
    rollout.max_response_length=3072 \
    rollout.n=8 \
    rollout.engine.name=vllm \
    rollout.engine.vllm.gpu_memory_utilization=0.8 \
    rollout.val_temperature=1.0 \
    rollout.val_top_p=0.7 \
    rollout.val_top_k=0 \
    algorithm.filter_groups.max_num_gen_batches=10 \
    algorithm.filter_groups.metric=acc \
    algorithm.kl.coef=0.0 \
    algorithm.kl.kl_loss_coef=0.0 \
    reward.overlong.buffer=512 \
    actor.ppo_mini_batch_size=32 \
    actor.engine.lr=1e-6 \
    actor.engine.weight_decay=0.1 \
    actor.engine.warmup_steps=10 \
    actor.engine.warmup_from_zero=true \
    actor.engine.gradient_checkpointing=true \
    actor.engine.max_tokens_per_micro_batch=8192 \
    trainer.loggers=[console,tensorboard,jsonl] \
    trainer.project=DAPO \
    trainer.experiment=DAPO-Qwen2.5-Math-1.5B \
    trainer.output_dir=checkpoints/DAPO/DAPO-Qwen2.5-Math-1.5B \
    trainer.save_every=10 \
    trainer.val_every=10 \
    trainer.total_epochs=10 \
    trainer.lr_schedule_unit=step \
    trainer.keep_last=1000000 \
    "${DEVICE[@]}" "$@"
