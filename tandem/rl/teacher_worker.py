"""``TeacherWorker``: the teacher of on-policy distillation, one rank per actor worker.

Each rank holds a frozen :class:`~tandem.engine.TorchTrainEngine` on ``teacher.model_path`` and
returns the teacher's log-probs of the student's sampled response tokens for its shard
(``teacher_log_probs [B, R]``), over the token ids the two models share (:func:`shared_vocabulary`:
a teacher's head padded past the student's scores without its padding rows). With
``teacher.engine.sp_size`` / ``tp_size`` the ranks of a sequence- or tensor-parallel group score
the same rows and the first of them reports them (:mod:`tandem.engine.on_rank`). It lives in the
actor's processes (``teacher.placement=colocated``, a role of the colocated group) or in a group
of its own (``separate``); either way the numbers are the same. The controller
(:mod:`tandem.rl.trainer`) calls it after the old log-probs.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig, PreTrainedTokenizerBase

from tandem.controller import Worker, mesh_dispatch, register
from tandem.engine.forward_fields import FORWARD_FIELDS
from tandem.engine.on_rank import bind_rank, parameter_count, parked, start_engine
from tandem.models.loading import check_vocab_compatible, load_tokenizer
from tandem.protocol import Batch
from tandem.protocol.sequences import response_part
from tandem.rl.config import TrainConfig
from tandem.rl.derived import teacher_engine_config

TEACHER_MESH = "teacher"  # the engine's data-parallel ranks: sequence/tensor-parallel peers get the same rows


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


def check_restrictable(config: TrainConfig, shared: int) -> None:
    """Refuse a teacher split over tensor-parallel ranks whose head is padded past the ``shared``
    token ids: a vocabulary split over the ranks cannot be cut to its first rows. Names the keys."""
    tp, teacher_rows = config.teacher.engine.tp_size, vocabulary_rows(config.teacher.model_path)
    if tp > 1 and teacher_rows > shared:
        raise ValueError(
            f"teacher.engine.tp_size={tp} with teacher.model_path={config.teacher.model_path}, whose head is padded "
            f"to {teacher_rows} rows past the {shared} token ids it shares with model_path={config.model_path}: "
            "a head split over tensor-parallel ranks cannot be cut to its first rows; set teacher.engine.tp_size=1"
        )


class TeacherWorker(Worker):
    """One rank of the teacher group (see the module docstring)."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = config

    @register(dispatch="ONE_TO_ALL")
    def init_model(self) -> int:
        """Bind this rank's device and load the frozen teacher; returns its parameter count."""
        config = self.config
        self.device = device = bind_rank(self, config.trainer.device)
        self.engine = start_engine(
            self, teacher_engine_config(config, str(device), config.teacher.engine.strategy),
            mesh=TEACHER_MESH, frozen=True,
        )  # fmt: skip
        check_vocab_compatible(self.engine.causal_lm, load_tokenizer(Path(config.model_path)))
        shared = shared_vocabulary(config)
        check_restrictable(config, shared)
        self.engine.module.restrict_vocabulary(shared)  # a head padded past the student's
        self.residency = parked(self.engine, config.teacher.offload)
        return parameter_count(self.engine)

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
