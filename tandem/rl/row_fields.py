"""Names of the per-row scalars a step's controller holds in place of per-token fields, when the
tokens stay in the data plane (docs/data-plane.md, "The advantages on the ranks")."""

SEQUENCE_SCORE = "sequence_score"  # [B] float32: a stored draw's score per row (token_level_scores' sum)
SEQUENCE_REWARD = "sequence_reward"  # [B]: token_level_rewards' row sum (the score less any KL penalty)
RESPONSE_TOKENS = "response_tokens"  # [B]: each row's valid response tokens after the rollout correction
ROW_ADVANTAGE = "row_advantage"  # [B]: an outcome estimator's advantage of each row, before its spread
PARTIAL_PREFIX = "partial/"  # [B] per-row partials of a batch-wide statistic (tandem.algos.reductions)
OTB_GROUP = (
    "otb_group"  # [B] int64: a row's compact group id for the optimal token baseline's sums (-1: a pad row)
)
OTB_BASELINE = "otb_baseline"  # [B, R]: the baseline of each row's group (a reference to the group's row)
OTB_ZERO_FROM = "otb_zero_from"  # [B] int64: the column from which a row's baseline is 0
