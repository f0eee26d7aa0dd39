"""verl's rollout keys that only make sense together: the engine and its settings, and how
validation samples."""

from __future__ import annotations

from tandem.verl import names
from tandem.verl.context import Context
from tandem.verl.keys import ACTOR, ROLLOUT

ROUTER_REPLAY = (f"{ACTOR}.router_replay.mode", f"{ROLLOUT}.enable_rollout_routing_replay")


def rollout_engine(ctx: Context) -> None:
    name = ctx.get(f"{ROLLOUT}.name")
    if name is None:
        raise ValueError(f"{ROLLOUT}.name is required (vllm, hf, or tandem's native)")
    engine = names.tandem_name(f"{ROLLOUT}.name", name)
    ctx.out["rollout.engine.name"] = engine
    vllm_settings = {
        "gpu_memory_utilization": float,
        "enforce_eager": bool,
        "enable_prefix_caching": bool,
        "dtype": str,
    }
    # The same intent in the other engines' own settings: (their field, the value from verl's).
    own = {
        "native": {"dtype": ("dtype", str), "enforce_eager": ("cuda_graphs", lambda eager: not bool(eager))},
        "hf": {"dtype": ("dtype", str)},
    }
    for key, convert in vllm_settings.items():
        if not ctx.set_by_user(f"{ROLLOUT}.{key}"):
            continue
        value = ctx.get(f"{ROLLOUT}.{key}")
        if engine == "vllm":
            ctx.out[f"rollout.engine.vllm.{key}"] = convert(value)
        elif key in own.get(engine, {}):
            field, translate_value = own[engine][key]
            ctx.out[f"rollout.engine.{engine}.{field}"] = translate_value(value)
        else:
            ctx.notes.append(f"{ROLLOUT}.{key}: a vLLM setting; the {engine} engine does not read it")
    if ctx.set_by_user(f"{ROLLOUT}.max_num_seqs"):
        if engine in ("vllm", "native"):
            ctx.out[f"rollout.engine.{engine}.max_num_seqs"] = int(ctx.get(f"{ROLLOUT}.max_num_seqs"))
        else:
            ctx.notes.append(f"{ROLLOUT}.max_num_seqs: the {engine} engine generates one request at a time")
    mode = ctx.get(f"{ROLLOUT}.logprobs_mode")
    if mode not in ("processed_logprobs", "processed"):
        raise ValueError(
            f"{ROLLOUT}.logprobs_mode={mode}: tandem's trainer compares against processed log-probs "
            "(after temperature), so the rollout must return those"
        )


def validation_sampling(ctx: Context) -> None:
    """verl's agent loop samples validation with ``val_kwargs.temperature/top_p/top_k/n`` as given
    (``do_sample`` is not read); temperature 0 is greedy, one answer per prompt."""
    base = f"{ROLLOUT}.val_kwargs"
    if ctx.set_by_user(f"{base}.do_sample"):
        ctx.notes.append(
            f"{base}.do_sample: verl samples validation by val_kwargs.temperature; so does tandem"
        )
    temperature = float(ctx.get(f"{base}.temperature"))
    ctx.out["rollout.val_temperature"] = temperature
    n = int(ctx.get(f"{base}.n"))
    if temperature == 0.0:
        if n != 1:
            ctx.notes.append(f"{base}.n={n} at temperature 0: greedy gives one answer per prompt (val_n=1)")
        ctx.out["rollout.val_n"] = 1
        return
    ctx.out["rollout.val_n"] = n
    ctx.out["rollout.val_top_p"] = float(ctx.get(f"{base}.top_p"))
    top_k = ctx.get(f"{base}.top_k")
    ctx.out["rollout.val_top_k"] = 0 if top_k is None or int(top_k) < 0 else int(top_k)


def router_replay(ctx: Context) -> None:
    """verl's rollout routing replay: ``router_replay.mode=R3`` with the rollout recording its
    experts (``enable_rollout_routing_replay``) is tandem's ``actor.router_replay=rollout``. R2
    (replaying the old-log-prob pass's routing) has no tandem counterpart."""
    mode_key, record_key = ROUTER_REPLAY
    mode, recorded = ctx.get(mode_key, "disabled"), bool(ctx.get(record_key, False))
    if mode == "R3":
        if not recorded:
            raise ValueError(
                f"{mode_key}=R3 replays the rollout's experts, which the rollout records only with "
                f"{record_key}=True: set it, or {mode_key}=disabled"
            )
        ctx.out["actor.router_replay"] = "rollout"
    elif mode == "R2":
        raise ValueError(
            f"{mode_key}=R2 replays the old-log-prob pass's routing, which tandem does not do; "
            f"R3 (with {record_key}=True) replays the rollout's: actor.router_replay=rollout"
        )
    elif mode != "disabled":
        raise ValueError(f"{mode_key}={mode}: choose disabled, R2 or R3")
    elif recorded:  # recorded, not replayed: tandem still measures how often the trainer disagrees
        name = ctx.get(f"{ROLLOUT}.name")
        if name is not None and names.tandem_name(f"{ROLLOUT}.name", name) == "vllm":
            ctx.out["rollout.engine.vllm.record_routing"] = True
        ctx.notes.append(
            f"{record_key}=True without {mode_key}=R3: the rollout records each token's experts and "
            "the trainer logs moe/routing_disagreement (how often its own routing differs) without "
            "replaying them (tandem's native and hf engines always record; vLLM: "
            "rollout.engine.vllm.record_routing)"
        )
