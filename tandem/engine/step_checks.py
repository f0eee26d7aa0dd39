"""What :meth:`TorchTrainEngine.forward_backward <tandem.engine.torch_engine.TorchTrainEngine.forward_backward>`
refuses before it runs a step, each refusal naming what is wrong (the key, the field, the rows)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.engine.base import LossFn
from tandem.engine.expert_parallel import check_expert_training
from tandem.engine.ulysses import check_same_rows
from tandem.engine.vision_inputs import IMAGES_FIELD, check_images_field
from tandem.protocol import Batch

if TYPE_CHECKING:
    from tandem.engine.torch_engine import TorchTrainEngine


def check_step(engine: TorchTrainEngine, batch: Batch, loss_fn: LossFn | None, forward_only: bool) -> None:
    """Refuse a step ``engine`` cannot run: missing fields, no loss to train, a strategy that
    cannot reduce the mesh's gradients, token ids past the vocabulary, ranks of one
    sequence- or tensor-parallel group handed different rows (a collective on those groups)."""
    engine._require_module()
    engine.routing.check_batch(set(batch.keys()))
    if "input_ids" not in batch or "attention_mask" not in batch:
        raise ValueError(
            f"forward_backward needs input_ids and attention_mask; the batch has {sorted(batch.keys())}"
        )
    if not forward_only and loss_fn is None:
        raise ValueError("forward_backward needs a loss_fn unless forward_only=True")
    check_images_field(batch.get(IMAGES_FIELD), engine.vision_language)
    if not forward_only:
        _check_training_strategy(engine)
    vocab = engine.module.vocab_size()
    largest = int(batch["input_ids"].max()) if batch["input_ids"].numel() else 0
    if largest >= vocab:
        raise ValueError(f"input_ids hold token id {largest}, but the model's vocabulary has {vocab} entries")
    mesh = engine.mesh
    if engine.sequence_parallel is not None:
        engine.sequence_parallel.check_same_rows(batch["input_ids"], engine.device)
    if mesh.tp_size > 1:  # a rank handed other rows would mix them into its peers' sums
        check_same_rows(
            batch["input_ids"], mesh.tp_group, mesh.tp_size, "tensor-parallel",
            "compute each layer of the rows they share together", engine.device,
        )  # fmt: skip


def _check_training_strategy(engine: TorchTrainEngine) -> None:
    """``strategy=single`` does not reduce gradients: it trains no split rows (sequence or expert
    parallelism) and no more than one tensor-parallel group (forward passes are fine)."""
    config, mesh = engine.config, engine.mesh
    if engine.sequence_parallel is not None and config.strategy == "single":
        raise ValueError(
            f"engine.sp_size={config.sp_size} trains with engine.strategy ddp or fsdp2 only (single: "
            "forward passes only): the ranks of a sequence-parallel group hold partial gradients, "
            "summed over the mesh"
        )
    check_expert_training(config, mesh.world_size)
    if config.strategy == "single" and mesh.tp_size > 1 and mesh.dp_size > 1:
        raise ValueError(
            f"engine.tp_size={config.tp_size} with engine.strategy=single trains one tensor-parallel "
            f"group, but the world holds {mesh.dp_size} (forward passes only: their gradients would not "
            "be reduced); use engine.strategy=fsdp2"
        )
