"""What every demo's settings share: the sizes of its SFT warm-up and its RL run, checked once.

The arithmetic (:class:`~tandem.demos.arithmetic.DemoSettings`), tool
(:class:`~tandem.demos.tool_agent.ToolDemoSettings`) and VLM
(:class:`~tandem.demos.vlm.VLMDemoSettings`) demos each run an SFT warm-up and then an RL run
from it; their settings subclass :class:`DemoRunSettings`, which holds those sizes and refuses a
bad one when the settings are built (naming ``<class>.<field>``), not minutes later when the RL
run's own config sees it. The defaults here are the arithmetic demo's; each demo overrides
those its README numbers were measured with. The DPO and distillation demos reuse the
arithmetic demo's settings whole.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.config.validation import check_choice, check_positive, check_range
from tandem.pipeline.config import MODES

POSITIVE_COUNTS = (
    "sft_steps",
    "sft_batch_size",
    "rl_steps",
    "prompts_per_step",
    "responses_per_prompt",
    "val_prompts",
    "val_every",
)


@dataclass(frozen=True)
class DemoRunSettings:
    """The sizes every demo's warm-up and RL run share.

    ``sft_steps`` / ``sft_batch_size`` / ``sft_lr``: the SFT warm-up's optimizer steps, rows per
    step and learning rate. ``rl_steps``: RL steps of ``prompts_per_step`` prompts with
    ``responses_per_prompt`` responses each, at learning rate ``rl_lr``. ``val_prompts``:
    held-out prompts, validated every ``val_every`` steps. ``seed`` seeds the data, the
    warm-up and the RL run.
    """

    output_dir: str = "outputs/demo"
    sft_steps: int = 600
    sft_batch_size: int = 128
    sft_lr: float = 1e-3
    rl_steps: int = 60
    prompts_per_step: int = 64
    responses_per_prompt: int = 8
    rl_lr: float = 3e-4
    val_prompts: int = 256
    val_every: int = 10
    seed: int = 0

    def __post_init__(self) -> None:
        owner = type(self).__name__
        if not isinstance(self.output_dir, str) or not self.output_dir:
            raise ValueError(f"{owner}.output_dir must name a directory, got {self.output_dir!r}")
        for name in POSITIVE_COUNTS:
            check_count(owner, name, getattr(self, name))
        check_positive(owner, "sft_lr", self.sft_lr)
        check_positive(owner, "rl_lr", self.rl_lr)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"{owner}.seed must be a non-negative integer, got {self.seed!r}")


def check_count(owner: str, name: str, value: object) -> None:
    """Raise ``ValueError`` naming ``owner.name`` unless ``value`` is a positive integer."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}.{name} must be a positive integer, got {value!r}")


def check_share(owner: str, name: str, value: float) -> None:
    """Raise ``ValueError`` naming ``owner.name`` unless ``0 <= value <= 1``."""
    check_range(owner, name, value, 0.0, 1.0)


def check_pipeline(owner: str, mode: str) -> None:
    """Raise ``ValueError`` naming ``owner.pipeline`` unless ``mode`` is a ``pipeline.mode``."""
    check_choice(owner, "pipeline", mode, MODES)


def check_mini_batch(owner: str, mini_batch_prompts: int, prompts_per_step: int) -> None:
    """Raise ``ValueError`` unless ``mini_batch_prompts`` is a positive divisor of
    ``prompts_per_step`` (each step's prompts split into whole optimizer mini-batches)."""
    check_count(owner, "mini_batch_prompts", mini_batch_prompts)
    if prompts_per_step % mini_batch_prompts:
        raise ValueError(
            f"{owner}.mini_batch_prompts={mini_batch_prompts} must divide "
            f"{owner}.prompts_per_step={prompts_per_step}"
        )
