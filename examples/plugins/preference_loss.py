"""A tandem plugin: DPO's logistic loss on the log-ratio margin, as a preference loss of its own.

    tandem dpo --plugin examples/plugins/preference_loss.py preference.name=logistic_margin ...

A preference loss maps ``P`` pairs' summed log-probs (policy and reference, chosen and rejected,
each ``[P]``) to a per-pair loss and the implicit rewards the trainer reports. The same name
serves online DPO in ``tandem train`` (``actor.preference.name``).
"""

import torch.nn.functional as F

from tandem.algos.preference import PreferenceInput, PreferenceOutput, register_preference_loss


@register_preference_loss("logistic_margin")
def logistic_margin(x: PreferenceInput, config) -> PreferenceOutput:
    """``-log sigma(beta (u_c - u_r))`` per pair, ``u = log pi - log pi_ref``. Shapes: ``[P] -> [P]``."""
    chosen = config.beta * (x.policy_chosen - x.reference_chosen)  # [P], with gradients
    rejected = config.beta * (x.policy_rejected - x.reference_rejected)
    return PreferenceOutput(
        loss=-F.logsigmoid(chosen - rejected),
        chosen_rewards=chosen.detach(),
        rejected_rewards=rejected.detach(),
    )
