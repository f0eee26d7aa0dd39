"""``PreferenceLossConfig``: which preference objective(s) to train with, and their settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tandem.algos.preference.base import F_DIVERGENCE_LOSSES, PREFERENCE_LOSSES, REFERENCE_FREE
from tandem.algos.preference.kto import UNPAIRED_LOSSES
from tandem.config.validation import check_choice, check_positive, check_range

F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
SORTING_LOSSES = ("aot", "aot_unpaired")  # sort over the batch: per-pair weights would misalign


@dataclass(frozen=True)
class PreferenceLossConfig:
    """``preference.*`` (``tandem dpo``) / ``actor.preference.*`` (online DPO): the preference loss.

    Attributes:
        name: a registered paired loss (``tandem algos`` lists them) or an unpaired one (``kto``,
            ``apo_zero_unpaired``: ``tandem dpo`` then reads unpaired rows).
        names: several paired losses trained together (MPO's recipe), replacing ``name``; each
            weighted by ``weights`` (empty: 1 each).
        weights: one weight per entry of ``names``.
        beta: inverse temperature β (how far the policy may move from the reference; IPO's τ,
            the odds-ratio weight λ of ORPO).
        label_smoothing: ε, the assumed rate of flipped labels (``sigmoid``: cDPO; ``robust``,
            ``aot``, ``simpo``, ``cpo``, ``bradley_terry``; ``exo_pair``'s ε, > 0); < 0.5.
        gamma: SimPO's (and ``cpo_simpo``/``alphapo``'s) target reward margin γ.
        rpo_alpha: weight of an NLL term on chosen responses (RPO); 0 turns it off.
        f_divergence_type: f-DPO's divergence: ``reverse_kl`` (DPO), ``forward_kl``,
            ``js_divergence`` or ``alpha_divergence``; non-default only for losses of the
            log-ratio margin.
        f_alpha_divergence_coef: α of ``alpha_divergence``.
        ld_alpha: LD-DPO: the weight of response tokens past the pair's shorter response, in
            [0, 1]; None: every token counts fully (plain DPO).
        use_weighting: WPO: weight each pair by its responses' length-normalised, aligned
            probabilities under the policy.
        discopop_tau: DiscoPOP's temperature τ.
        ipo_length_normalized: IPO on per-token mean log-ratios (TRL's, as the IPO authors ran
            it); False: on summed log-ratios, as Eq. 17 of the paper is written.
        cpo_alpha: weight of the NLL term of the ``cpo*`` and ``alphapo`` losses.
        alpha: AlphaPO's reward shaping α (``alphapo``; ``cpo*`` too when non-zero):
            ``r = (1 - p^(-α)) / α`` in place of ``log p``.
        desirable_weight / undesirable_weight: KTO's weights of desirable and undesirable rows.
    """

    key_prefix: ClassVar[str] = "preference"  # its messages' keys start so (tandem.config.build)

    name: str = "sigmoid"
    names: tuple[str, ...] = ()
    weights: tuple[float, ...] = ()
    beta: float = 0.1
    label_smoothing: float = 0.0
    gamma: float = 0.5
    rpo_alpha: float = 0.0
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5
    ld_alpha: float | None = None
    use_weighting: bool = False
    discopop_tau: float = 0.05
    ipo_length_normalized: bool = True
    cpo_alpha: float = 1.0
    alpha: float = 0.0
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    def __post_init__(self) -> None:
        self._check_names()
        check_positive("preference", "beta", self.beta)
        check_range(
            "preference", "label_smoothing", self.label_smoothing, low=0.0, high=0.5, high_inclusive=False
        )
        check_range("preference", "rpo_alpha", self.rpo_alpha, low=0.0)
        check_range("preference", "cpo_alpha", self.cpo_alpha, low=0.0)
        check_positive("preference", "discopop_tau", self.discopop_tau)
        check_positive("preference", "desirable_weight", self.desirable_weight)
        check_positive("preference", "undesirable_weight", self.undesirable_weight)
        check_choice("preference", "f_divergence_type", self.f_divergence_type, F_DIVERGENCES)
        losses = [name for name, _ in self.losses]
        if self.f_divergence_type != "reverse_kl":
            unsupported = [name for name in losses if name not in F_DIVERGENCE_LOSSES]
            if unsupported:
                raise ValueError(
                    f"preference.f_divergence_type={self.f_divergence_type!r} needs a loss of the log-ratio "
                    f"margin ({sorted(F_DIVERGENCE_LOSSES)}); {unsupported} has none"
                )
        if self.ld_alpha is not None:
            check_range("preference", "ld_alpha", self.ld_alpha, low=0.0, high=1.0)
        if "exo_pair" in losses and self.label_smoothing == 0.0:
            raise ValueError(
                "preference.label_smoothing must be > 0 for exo_pair (its ε; the paper uses 1e-3)"
            )
        if "alphapo" in losses and self.alpha == 0.0:
            raise ValueError("preference.alpha must be non-zero for alphapo (alpha=0 is cpo_simpo)")
        if self.use_weighting and any(name in SORTING_LOSSES for name in losses):
            raise ValueError(
                f"preference.use_weighting does not combine with {list(SORTING_LOSSES)}: they sort the batch, "
                "so per-pair weights would not match"
            )
        if self.unpaired and (self.ld_alpha is not None or self.use_weighting or self.rpo_alpha):
            raise ValueError(
                f"preference.name={self.name!r} is unpaired: preference.ld_alpha, use_weighting and rpo_alpha "
                "need pairs"
            )

    def _check_names(self) -> None:
        if not self.names:
            if self.name not in PREFERENCE_LOSSES and self.name not in UNPAIRED_LOSSES:
                raise ValueError(
                    f"preference.name={self.name!r} is not a preference loss; registered: "
                    f"{PREFERENCE_LOSSES.names()} (paired), {UNPAIRED_LOSSES.names()} (unpaired)"
                )
            if self.weights:
                raise ValueError("preference.weights is set without preference.names (one weight per name)")
            return
        if self.name != "sigmoid":
            raise ValueError(
                f"preference.name={self.name!r} and preference.names are both set; list every loss in names"
            )
        for index, name in enumerate(self.names):
            if name not in PREFERENCE_LOSSES:
                raise ValueError(
                    f"preference.names[{index}]={name!r} is not a paired preference loss; registered: "
                    f"{PREFERENCE_LOSSES.names()}"
                )
        if self.weights and len(self.weights) != len(self.names):
            raise ValueError(
                f"preference.weights has {len(self.weights)} values but preference.names has "
                f"{len(self.names)}; give one weight per name"
            )

    @property
    def losses(self) -> tuple[tuple[str, float], ...]:
        """Each loss trained and its weight: ``names`` with ``weights`` (1 each when empty), or
        ``name`` with weight 1."""
        if not self.names:
            return ((self.name, 1.0),)
        weights = self.weights or (1.0,) * len(self.names)
        return tuple(zip(self.names, (float(w) for w in weights), strict=True))

    @property
    def unpaired(self) -> bool:
        """Whether the objective reads unpaired rows (KTO) instead of pairs."""
        return not self.names and self.name in UNPAIRED_LOSSES

    @property
    def needs_reference(self) -> bool:
        """Whether any loss reads reference log-probs (the trainer then scores a reference)."""
        return any(name not in REFERENCE_FREE for name, _ in self.losses)

    @property
    def label(self) -> str:
        """The objective in a few words, for the console: ``sigmoid`` or ``0.8 sigmoid + 0.2 bco_pair``."""
        if not self.names:
            return self.name
        return " + ".join(f"{weight:g} {name}" for name, weight in self.losses)
