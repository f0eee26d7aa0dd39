"""The declared standard fields of a :class:`~tandem.protocol.Batch`: name, dtype kind, shape and meaning.

Shapes use ``B`` for the batch (one row per sample), ``P`` for the padded prompt length,
``R`` for the padded response length and ``S = P + R`` for the whole sequence (``L`` and
``k``: a mixture-of-experts model's MoE layers and experts per token). Prompts are
left-padded and responses right-padded, so ``input_ids = cat(prompts, responses)``.

A batch may carry fields that are not declared here (a user's custom columns); the
declared ones are checked for dtype kind and rank when a batch is built, so a float mask or
a 1-D ``advantages`` is caught at the boundary rather than deep inside a loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

DTypeKind = Literal["int", "float", "bool_or_int", "any"]


@dataclass(frozen=True)
class FieldSpec:
    """One declared field: its name, dtype kind, rank, per-what it is indexed and meaning."""

    name: str
    kind: DTypeKind
    shape: str
    meaning: str

    @property
    def ndim(self) -> int:
        return len(self.shape.strip("[]").split(","))

    def check(self, tensor: torch.Tensor) -> None:
        """Raise ``ValueError`` naming the field when ``tensor`` does not fit this spec."""
        if tensor.ndim != self.ndim:
            raise ValueError(
                f"field {self.name!r} must have shape {self.shape} ({self.ndim}-D), got {tuple(tensor.shape)}"
            )
        is_float = tensor.is_floating_point()
        is_intlike = not is_float and not tensor.is_complex()
        ok = {
            "int": is_intlike and tensor.dtype != torch.bool,
            "float": is_float,
            "bool_or_int": is_intlike,
            "any": True,
        }[self.kind]
        if not ok:
            raise ValueError(f"field {self.name!r} must be of {self.kind} dtype, got {tensor.dtype}")


def _spec(name: str, kind: DTypeKind, shape: str, meaning: str) -> FieldSpec:
    return FieldSpec(name, kind, shape, meaning)


STANDARD_FIELDS: dict[str, FieldSpec] = {
    s.name: s
    for s in [
        _spec("prompts", "int", "[B, P]", "prompt token ids, left-padded with the pad id"),
        _spec("responses", "int", "[B, R]", "response token ids, right-padded with the pad id"),
        _spec("input_ids", "int", "[B, S]", "prompt and response token ids, cat(prompts, responses)"),
        _spec("attention_mask", "bool_or_int", "[B, S]", "1 on real tokens of input_ids, 0 on padding"),
        _spec("position_ids", "int", "[B, S]", "position of each token within its own sequence"),
        _spec(
            "response_mask",
            "bool_or_int",
            "[B, R]",
            "1 on response tokens that count in the loss (0 on padding and on tool/observation tokens)",
        ),
        _spec(
            "rollout_log_probs",
            "float",
            "[B, R]",
            "log pi_rollout(a_t|s_t) as reported by the rollout engine",
        ),
        _spec(
            "old_log_probs",
            "float",
            "[B, R]",
            "log pi_old(a_t|s_t) recomputed by the trainer before the update",
        ),
        _spec("ref_log_probs", "float", "[B, R]", "log pi_ref(a_t|s_t) under the frozen reference policy"),
        _spec(
            "sum_pi_squared",
            "float",
            "[B, R]",
            "sum_v pi_old(v|s_t)^2 of the trainer's (temperature-scaled) distribution at each response position",
        ),
        _spec("values", "float", "[B, R]", "critic value V(s_t) before each response token"),
        _spec(
            "token_level_scores",
            "float",
            "[B, R]",
            "raw reward placed on response tokens (outcome: last token)",
        ),
        _spec(
            "token_level_rewards",
            "float",
            "[B, R]",
            "scores after the KL penalty (equal to scores without one)",
        ),
        _spec("advantages", "float", "[B, R]", "advantage estimate per response token"),
        _spec("returns", "float", "[B, R]", "return target per response token (critic regression target)"),
        _spec(
            "reward_components",
            "float",
            "[B, K]",
            "the K reward components the reward function returned beside its score (algorithm.gdpo_reward_keys)",
        ),
        _spec(
            "reward_baselines",
            "float",
            "[B]",
            "per-sample baseline reward (ReMax: reward of the greedy response)",
        ),
        _spec(
            "group_ids",
            "int",
            "[B]",
            "integer id of the prompt group a sample belongs to (n samples share one)",
        ),
        _spec(
            "weight_version",
            "int",
            "[B, R]",
            "policy weight version under which each response token was sampled",
        ),
        _spec("entropys", "float", "[B, R]", "entropy of the policy at each response position"),
        _spec(
            "routed_experts",
            "int",
            "[B, S, L, k]",
            "the experts the rollout routed each token of input_ids to, per MoE layer (int16; -1: not "
            "routed, e.g. padding and each response's last token)",
        ),
    ]
}

STANDARD_NON_TENSOR_FIELDS: dict[str, str] = {
    "uid": "string id of the prompt group (n responses of one prompt share it)",
    "data_source": "name of the dataset a sample came from; selects the reward function",
    "raw_prompt": "the prompt as chat messages (list of {role, content} dicts)",
    "ground_truth": "the reference answer the reward function checks against",
    "extra_info": "free-form per-sample dict carried from the dataset",
    "images": "a vision-language prompt's images (tandem.protocol.images.ImageInputs; None: text only)",
}

# A generation request that names its prompts' places instead of carrying their tokens (the data
# plane's requests: tandem.rl.data.RLDataset.requests; the rank or replica reads the rows itself).
PROMPT_PLACE = (
    "prompt_place"  # per request row: (file, row), the file's number in its source and the row's in it
)
PROMPT_SOURCE = "prompt_source"  # the request's meta: the key of the prompt source those places refer to
PROMPT_IMAGES = "prompt_images"  # the request's meta: whether its source holds images (rows get an images column)


def check_standard_field(name: str, tensor: torch.Tensor) -> None:
    """Check ``tensor`` against the declared spec of ``name``; fields not declared pass unchecked."""
    spec = STANDARD_FIELDS.get(name)
    if spec is not None:
        spec.check(tensor)
