"""On-policy distillation: a teacher scores the tokens the student sampled.

The student samples responses ``y ~ pi_s``; the teacher gives ``log pi_t(y_t | y_<t)`` of every
sampled token (and, for the divergences over distributions, its log-probs of its top-k tokens
at each position). Two kinds of objective, chosen by name (``algorithm.distill.objective``):

* a dense advantage (:data:`DISTILL_ADVANTAGES`). The per-token reverse KL
  ``KL(pi_s || pi_t)`` at position ``t`` is estimated without bias by
  ``log pi_s(y_t) - log pi_t(y_t)`` (``y_t`` drawn from ``pi_s``), so

      A_t = log pi_t(y_t) - log pi_s(y_t)

  used as a per-token advantage (no discounting, no baseline) makes the policy-gradient update
  descend the student's reverse KL to the teacher on its own trajectories: dense supervision
  on every token instead of one reward per response. It is combined with the RL estimator's
  advantage: ``A = reward_coef * A_rl + coef * A_distill`` (``reward_coef=0``: distillation
  alone).
* a loss term (:data:`DISTILL_LOSSES`): GKD's generalized Jensen-Shannon divergence between
  the two distributions at each position of the student's samples, over the teacher's top-k
  tokens and the rest of the vocabulary as one outcome, added to the actor's loss with weight
  ``coef``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.algos.reductions import Terms, reduce_whole
from tandem.config.validation import check_range
from tandem.registry import Registry

DistillAdvantage = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
DistillLoss = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
DISTILL_ADVANTAGES: Registry[DistillAdvantage] = Registry("distillation advantage")
DISTILL_LOSSES: Registry[DistillLoss] = Registry("distillation loss")
OFF = "none"


@DISTILL_ADVANTAGES.register("reverse_kl")
def reverse_kl_advantages(
    student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """The per-token reverse-KL advantage ``log pi_t(y_t) - log pi_s(y_t)`` (module docstring).

    Args:
        student_log_probs: ``[B, R]`` the student's log-probs of its sampled tokens (the policy
            that sampled them: old log-probs, or the rollout's).
        teacher_log_probs: ``[B, R]`` the teacher's log-probs of the same tokens.
        mask: ``[B, R]`` response tokens (1) and padding or tool output (0).

    Returns:
        ``[B, R]`` float32 advantages, 0 where ``mask`` is 0.
    """
    return (teacher_log_probs.float() - student_log_probs.float()) * mask.float()


def with_rest(log_probs: torch.Tensor) -> torch.Tensor:
    """``[..., k]`` log-probs of ``k`` tokens -> ``[..., k + 1]``: the same, then the log of the mass
    of every other token, ``log(1 - sum exp)`` (computed as ``log(-expm1(logsumexp))``, exact when
    the ``k`` tokens hold nearly all the mass; floored at 1e-30)."""
    held = torch.logsumexp(log_probs, dim=-1, keepdim=True).clamp(max=0.0)
    rest = torch.log(torch.clamp(-torch.expm1(held), min=1e-30))
    return torch.cat([log_probs, rest], dim=-1)


@DISTILL_LOSSES.register("jsd")
def top_k_jsd(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, beta: float) -> torch.Tensor:
    """GKD's generalized Jensen-Shannon divergence per position, over the teacher's top-k tokens and the rest.

    Each distribution becomes ``k + 1`` outcomes: the ``k`` tokens the teacher ranks highest at
    the position, and "any other token" with the remaining mass (:func:`with_rest`). The
    divergence of these coarse distributions never exceeds the full one and equals it when the
    other tokens hold no mass; its gradient also moves the student's mass into the teacher's
    tokens, which renormalising over the ``k`` tokens alone would not. With
    ``M = beta * p_t + (1 - beta) * p_s``:
    ``JSD_beta = beta * KL(p_t || M) + (1 - beta) * KL(p_s || M)``; at the ends, as in TRL's GKD,
    ``beta = 0`` is the forward ``KL(p_t || p_s)`` and ``beta = 1`` the reverse ``KL(p_s || p_t)``.

    Args:
        student_log_probs: ``[..., k]`` the student's log-probs (over the whole vocabulary) of the
            teacher's top-k tokens (differentiable).
        teacher_log_probs: ``[..., k]`` the teacher's log-probs of the same tokens.
        beta: the interpolation, in ``[0, 1]``.

    Returns:
        ``[...]`` float32 divergences.
    """
    student = torch.log_softmax(with_rest(student_log_probs.float()), dim=-1)  # sums to 1 up to rounding
    teacher = torch.log_softmax(with_rest(teacher_log_probs.float()), dim=-1)
    if beta == 0.0:
        return (teacher.exp() * (teacher - student)).sum(-1)
    if beta == 1.0:
        return (student.exp() * (student - teacher)).sum(-1)
    weight = torch.tensor(beta, dtype=torch.float32, device=student.device)
    mixture = torch.logsumexp(
        torch.stack([student + torch.log1p(-weight), teacher + torch.log(weight)]), dim=0
    )
    to_teacher = (teacher.exp() * (teacher - mixture)).sum(-1)
    to_student = (student.exp() * (student - mixture)).sum(-1)
    return beta * to_teacher + (1.0 - beta) * to_student


@dataclass(frozen=True)
class DistillConfig:
    """On-policy distillation (``algorithm.distill.*``); needs a teacher (``teacher.model_path``).

    Attributes:
        objective: ``none`` (off), a dense advantage (``reverse_kl``) or a loss term (``jsd``,
            which needs the teacher's top-k log-probs: ``teacher.top_k``).
        coef: the weight of the distillation advantage or loss term.
        reward_coef: the weight of the RL estimator's advantage (0: distillation alone; the
            rewards are still scored and logged).
        beta: ``jsd``'s interpolation: 0 the forward KL ``KL(p_t || p_s)``, 1 the reverse
            ``KL(p_s || p_t)``, between them the generalized JSD (GKD's ``beta``).
        lmbda: GKD's student-generated fraction: each step samples from the student with this
            probability, and otherwise trains on the training rows' own responses
            (:mod:`tandem.rl.dataset_responses`). Below 1 it needs a loss-term objective
            (``jsd``: on dataset tokens the reverse-KL advantage has no meaning) and
            ``reward_coef=0``. Teacher-generated responses are not built.
        response_key: where a training row holds its response for the off-policy steps:
            ``extra_info[response_key]`` (a GSM8K row in verl's schema has ``answer``).
    """

    objective: str = OFF
    coef: float = 1.0
    reward_coef: float = 1.0
    beta: float = 0.5
    lmbda: float = 1.0
    response_key: str = "response"

    def __post_init__(self) -> None:
        owner = "algorithm.distill"
        known = [OFF, *DISTILL_ADVANTAGES.names(), *DISTILL_LOSSES.names()]
        if self.objective not in known:
            raise ValueError(f"{owner}.objective={self.objective!r} is not registered; choose one of {known}")
        check_range(owner, "coef", self.coef, low=0.0)
        check_range(owner, "reward_coef", self.reward_coef, low=0.0)
        check_range(owner, "beta", self.beta, 0.0, 1.0)
        check_range(owner, "lmbda", self.lmbda, 0.0, 1.0)
        if self.lmbda < 1.0 and not self.adds_loss:
            raise ValueError(
                f"{owner}.lmbda={self.lmbda} trains some steps on the dataset's responses, which needs a loss "
                f"objective over the teacher's distribution ({owner}.objective=jsd; beta=0 is the forward KL), "
                f"not {self.objective!r}: the reverse-KL advantage only holds for tokens the student sampled"
            )
        if self.lmbda < 1.0 and self.reward_coef:
            raise ValueError(
                f"{owner}.lmbda={self.lmbda} with {owner}.reward_coef={self.reward_coef}: a policy-gradient "
                f"advantage needs responses the student sampled; set {owner}.reward_coef=0"
            )
        if not self.response_key:
            raise ValueError(f"{owner}.response_key must name an extra_info field")
        if self.enabled and self.coef == 0 and self.reward_coef == 0:
            raise ValueError(
                f"{owner}.coef and {owner}.reward_coef are both 0: the update would have no signal"
            )

    @property
    def enabled(self) -> bool:
        return self.objective != OFF

    @property
    def shapes_advantages(self) -> bool:
        """The objective is a dense advantage (added to the estimator's)."""
        return self.objective in DISTILL_ADVANTAGES.names()

    @property
    def adds_loss(self) -> bool:
        """The objective is a loss term over the teacher's top-k distribution."""
        return self.objective in DISTILL_LOSSES.names()


def distilled_advantages(
    advantages: torch.Tensor,
    student_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    mask: torch.Tensor,
    config: DistillConfig,
) -> torch.Tensor:
    """The advantages a distilling run trains on, ``[B, R]`` (0 outside ``mask``):
    ``reward_coef * advantages + coef * objective(...)`` for a dense-advantage objective, and
    ``reward_coef * advantages`` for a loss-term one (its term joins the loss instead)."""
    combined = config.reward_coef * advantages
    if config.shapes_advantages:
        dense = DISTILL_ADVANTAGES.get(config.objective)(student_log_probs, teacher_log_probs, mask)
        combined = combined + config.coef * dense
    return combined * mask.to(advantages.dtype)


def distill_metrics(
    student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """``distill/reverse_kl`` (the per-token estimate ``log pi_s - log pi_t``, averaged over
    response tokens), ``distill/teacher_log_prob`` and ``distill/student_log_prob`` of the
    sampled tokens. All ``[B, R]`` inputs; scalar outputs."""
    return distill_metrics_of(reduce_whole(distill_terms(student_log_probs, teacher_log_probs, mask)))


def distill_terms(
    student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, mask: torch.Tensor
) -> Terms:
    """The sums :func:`distill_metrics` is made of (:mod:`tandem.algos.reductions`; ``[B, R]`` inputs)."""
    weights = mask.float()
    student, teacher = student_log_probs.float(), teacher_log_probs.float()
    return {
        "tokens": ("sum", weights),
        "reverse_kl": ("sum", (student - teacher) * weights),
        "teacher": ("sum", teacher * weights),
        "student": ("sum", student * weights),
    }


def distill_metrics_of(reduced: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``distill/*`` from the reduced terms of :func:`distill_terms`."""
    tokens = reduced["tokens"].clamp(min=1)
    return {
        "distill/reverse_kl": reduced["reverse_kl"] / tokens,
        "distill/teacher_log_prob": reduced["teacher"] / tokens,
        "distill/student_log_prob": reduced["student"] / tokens,
    }
