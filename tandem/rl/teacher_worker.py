"""``TeacherWorker``: the teacher of on-policy distillation, one rank per actor worker.

Each rank holds a frozen :class:`~tandem.engine.TorchTrainEngine` on ``teacher.model_path`` and
returns the teacher's log-probs of the student's sampled response tokens for its shard
(``teacher_log_probs [B, R]``), over the token ids the two models share (:func:`shared_vocabulary`:
a teacher's head padded past the student's scores without its padding rows). It lives in the
actor's processes (``teacher.placement=colocated``, a role of the colocated group) or in a group
of its own (``separate``); either way the numbers are the same. The controller
(:mod:`tandem.rl.trainer`) calls it after the old log-probs.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from tandem.controller import Worker, mesh_dispatch, register
from tandem.device import bind_device
from tandem.engine import TorchTrainEngine
from tandem.engine.forward_fields import FORWARD_FIELDS
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


def vocabulary_rows(path: str) -> int:
    """The rows of the output head of the HF model in ``path``: its config's ``vocab_size`` (a
    vision-language model's text config's)."""
    return int(AutoConfig.from_pretrained(path).get_text_config().vocab_size)


def shared_vocabulary(config: TrainConfig) -> int:
    """The token ids the teacher scores over: the first ``min(V_student, V_teacher)`` rows of its head.

    The two tokenizers are one (:func:`check_same_tokenizer`) and fit both heads, so the rows past
    the shorter head are padding no tokenizer emits: the teacher's softmax is renormalised over
    the shared ids, and its top-k tokens are ids the student has. Raises ``ValueError`` naming
    ``teacher.top_k`` when it asks for more tokens than there are."""
    student, teacher = vocabulary_rows(config.model_path), vocabulary_rows(config.teacher.model_path)
    shared, top_k = min(student, teacher), config.teacher.top_k
    if top_k > shared:
        raise ValueError(
            f"teacher.top_k={top_k} is more than the {shared} token ids the teacher scores (the "
            f"vocabulary model_path={config.model_path} has {student} ids, "
            f"teacher.model_path={config.teacher.model_path} {teacher}): set teacher.top_k <= {shared}"
        )
    return shared


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
        self.engine.module.restrict_vocabulary(shared_vocabulary(config))  # a head padded past the student's
        mesh = self.engine.mesh  # the ranks of a sequence-parallel group share rows; one reports
        self.set_mesh_rank(TEACHER_MESH, mesh.dp_rank, mesh.dp_size, is_collect=mesh.sp_rank == 0)
        self.residency = Residency(self.engine, self.device, config.teacher.offload, optimizer=False)
        self.residency.offload()  # waits on the CPU between its passes (when asked, on a GPU)
        return sum(p.numel() for p in self.engine.causal_lm.parameters())

    @register(dispatch=mesh_dispatch(TEACHER_MESH), reads=FORWARD_FIELDS, outputs="ref")
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
