"""verl's reward keys, translated together: the scoring function, the reward manager, DAPO's
overlong buffer (at any of the places verl kept it), a reward model, and the worker count."""

from __future__ import annotations

from tandem.rl.config.reward import MODEL_SOURCE
from tandem.verl.context import Context

# DAPO's overlong buffer: verl 0.8+ reads reward.reward_kwargs; older scripts set reward_model.reward_kwargs
# (verl 0.9 still copies it over) or, older still, reward_model.overlong_buffer.
OVERLONG_PLACES = (
    "reward.reward_kwargs.overlong_buffer_cfg",
    "reward_model.reward_kwargs.overlong_buffer_cfg",
    "reward_model.overlong_buffer",
)


def rewards(ctx: Context) -> None:
    """The scoring function, verl's DAPO reward manager's overlong buffer, and the worker count."""
    for prefix in ("custom_reward_function", "reward.custom_reward_function"):
        path = ctx.get(f"{prefix}.path")
        if path is not None:
            ctx.out["reward.custom_path"] = str(path)
            name = ctx.get(f"{prefix}.name")
            ctx.out["reward.custom_name"] = "compute_score" if name is None else str(name)
    manager = ctx.get("reward.reward_manager.name", ctx.get("reward_model.reward_manager"))
    if manager not in (None, "naive", "dapo", "gdpo"):
        raise ValueError(
            f"reward manager {manager!r}: tandem scores like verl's 'naive' (and 'gdpo') manager, and 'dapo' with "
            "an overlong buffer; use custom_reward_function for anything else"
        )
    for prefix in OVERLONG_PLACES:
        given = [k for k in ("enable", "len", "penalty_factor") if ctx.get(f"{prefix}.{k}") is not None]
        if not given:
            continue
        if manager != "dapo":
            raise ValueError(f"{prefix}.* applies to verl's 'dapo' reward manager; set the manager to dapo")
        if not ctx.get(f"{prefix}.enable"):
            if given != ["enable"]:
                ctx.notes.append(f"{prefix}.{', '.join(given)}: the overlong buffer is off ({prefix}.enable)")
            ctx.out["reward.overlong.enable"] = False
            continue
        if ctx.get(f"{prefix}.len") is None:
            raise ValueError(f"{prefix}.enable=True needs {prefix}.len (verl asserts it too)")
        ctx.out["reward.overlong.enable"] = True
        ctx.out["reward.overlong.buffer"] = int(ctx.get(f"{prefix}.len"))
        factor = ctx.get(f"{prefix}.penalty_factor")
        ctx.out["reward.overlong.penalty_factor"] = 1.0 if factor is None else float(factor)
    for key in ("reward.reward_kwargs.max_resp_len", "reward_model.reward_kwargs.max_resp_len"):
        limit = ctx.get(key)
        if limit is not None and int(limit) != int(ctx.get("data.max_response_length")):
            raise ValueError(
                f"{key}={limit} differs from data.max_response_length="
                f"{ctx.get('data.max_response_length')}; tandem measures the overlong buffer from the latter"
            )
    for prefix, path_key in (("reward_model", "model.path"), ("reward.reward_model", "model_path")):
        if not ctx.get(f"{prefix}.enable"):
            continue
        path = ctx.get(f"{prefix}.{path_key}")
        if path is None:
            raise ValueError(f"{prefix}.enable=True needs {prefix}.{path_key} (a reward model directory)")
        # verl's reward manager returns rm_scores in place of the rule's
        ctx.out["reward.sources"] = (MODEL_SOURCE,)
        ctx.out["reward.model.path"] = str(path)
        if ctx.get(f"{prefix}.max_length") is not None:
            ctx.out["reward.model.max_length"] = int(ctx.get(f"{prefix}.max_length"))
    for key in ("reward.num_workers", "reward_model.num_workers"):
        if ctx.get(key) is not None:
            ctx.out["reward.num_workers"] = int(ctx.get(key))
