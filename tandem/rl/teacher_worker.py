"""``TeacherWorker``: the teacher of on-policy distillation, one rank per actor worker.

Each rank holds a frozen :class:`~tandem.engine.TorchTrainEngine` on ``teacher.model_path`` and
returns the teacher's log-probs of the student's sampled response tokens for its shard
(``teacher_log_probs [B, R]``). It lives in the actor's processes (``teacher.placement=colocated``,
a role of the colocated group) or in a group of its own (``separate``); either way the numbers
are the same. The controller (:mod:`tandem.rl.trainer`) calls it after the old log-probs.
"""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from tandem.controller import Worker, mesh_dispatch, register
from tandem.device import bind_device
from tandem.engine import TorchTrainEngine
from tandem.engine.offload import Residency
from tandem.engine.parallel import rank_strategy
from tandem.models.loading import check_vocab_compatible, load_tokenizer
from tandem.protocol import Batch
from tandem.protocol.sequences import response_part
from tandem.rl.config import TrainConfig
from tandem.rl.derived import teacher_engine_config

TEACHER_MESH = "teacher"  # the engine's data-parallel ranks: sequence-parallel peers get the same rows


def check_same_tokenizer(
    teacher: PreTrainedTokenizerBase, teacher_path: str, student: PreTrainedTokenizerBase, student_path: str
) -> None:
    """Refuse a teacher whose tokenizer maps text to other ids than the student's: its
    log-probs would be of other tokens. Names both model directories and the first difference."""
    teacher_vocab, student_vocab = teacher.get_vocab(), student.get_vocab()
    differs = ""
    if teacher_vocab != student_vocab:
        only = sorted(set(teacher_vocab.items()) ^ set(student_vocab.items()))[:3]
        differs = f"{len(teacher_vocab)} vs {len(student_vocab)} tokens; first differing (token, id): {only}"
    elif teacher.eos_token_id != student.eos_token_id:
        differs = f"EOS id {teacher.eos_token_id} vs {student.eos_token_id}"
    if differs:
        raise ValueError(
            f"teacher.model_path={teacher_path} has another tokenizer than model_path={student_path} "
            f"({differs}): the teacher must score the student's own token ids"
        )


class TeacherWorker(Worker):
    """One rank of the teacher group (see the module docstring)."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = config

    @register(dispatch="ONE_TO_ALL")
    def init_model(self) -> int:
        """Bind this rank's device and load the frozen teacher; returns its parameter count."""
        config = self.config
        hf_logging.disable_progress_bar()
        self.device = bind_device(config.trainer.device, self.local_rank)
        if self.world_size > 1:
            self.init_process_group(device=self.device)
        strategy = rank_strategy(config.teacher.engine.strategy, self.world_size)
        if strategy == "ddp":  # nothing to reduce: each rank scores its own rows with a whole copy
            strategy = "single"
        self.engine = TorchTrainEngine(teacher_engine_config(config, str(self.device), strategy))
        self.engine.initialize()
        self.engine.causal_lm.requires_grad_(False)
        check_vocab_compatible(self.engine.causal_lm, load_tokenizer(Path(config.model_path)))
        mesh = self.engine.mesh  # the ranks of a sequence-parallel group share rows; one reports
        self.set_mesh_rank(TEACHER_MESH, mesh.dp_rank, mesh.dp_size, is_collect=mesh.sp_rank == 0)
        self.residency = Residency(self.engine, self.device, config.teacher.offload, optimizer=False)
        self.residency.offload()  # waits on the CPU between its passes (when asked, on a GPU)
        return sum(p.numel() for p in self.engine.causal_lm.parameters())

    @register(dispatch=mesh_dispatch(TEACHER_MESH))
    def compute_teacher_log_prob(self, batch: Batch) -> Batch:
        """``teacher_log_probs [B, R]``: the teacher's log-probs of each sampled response token;
        with ``teacher.top_k`` also ``teacher_top_ids`` (int64) and ``teacher_top_log_probs``
        ``[B, R, k]``: its ``k`` most likely tokens at each position, most likely first."""
        top_k = self.config.teacher.top_k
        with self.residency.computing():
            outputs = self.engine.forward_backward(batch, None, forward_only=True, top_k=top_k).outputs
        width = batch["prompts"].shape[1]
        tensors = {"teacher_log_probs": response_part(outputs.log_probs, width)}
        if top_k:
            tensors["teacher_top_ids"] = response_part(outputs.top_ids, width)
            tensors["teacher_top_log_probs"] = response_part(outputs.top_log_probs, width)
        return Batch(tensors)
