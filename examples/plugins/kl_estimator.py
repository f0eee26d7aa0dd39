"""A tandem plugin: a KL estimator, Schulman's k3 without its clamps.

    tandem train --plugin examples/plugins/kl_estimator.py algorithm.kl.use_kl_loss=true \
        algorithm.kl.estimator=k3_unclamped ...

An estimator maps the policy's and the reference's per-token log-probs to a per-token KL
estimate; the trainer aggregates it (``actor.policy_loss.loss_agg_mode``) like the built-in ones.
"""

import torch

from tandem.algos import KL_ESTIMATORS


@KL_ESTIMATORS.register("k3_unclamped")
def k3_unclamped(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """``exp(l) - 1 - l`` with ``l = log pi_ref - log pi``: unbiased for KL(pi || pi_ref), >= 0.

    Shapes: ``[B, R], [B, R] -> [B, R]``.
    """
    log_ratio = ref_log_probs - log_probs
    return torch.exp(log_ratio) - 1 - log_ratio
