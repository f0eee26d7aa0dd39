"""``actor.offload.*`` and ``critic.offload.*``: each phase finds the state it reads on the
device, generation runs with the rest offloaded, and the run's numbers are those of a run that
offloads nothing.

On the CPU an offload moves nothing, so these runs force the moves (CPU to CPU) to follow the
loops' bookkeeping; the GPU tier (tests/gpu) runs the real moves on CUDA.
"""

import pytest

from tandem.engine import TorchTrainEngine
from tandem.engine.offload import Residency
from tandem.rl import RLTrainer
from tandem.rollout import NativeRolloutEngine
from tests.rl.conftest import small_config

OFFLOAD_ALL = ("actor.offload.params=true", "actor.offload.optimizer=true", "actor.offload.reference=true")
WITH_REFERENCE = (
    "data.val_path=",
    "algorithm.kl.use_kl_loss=true",
    "actor.recompute_old_log_probs=true",
    "trainer.device=cpu",
)
PPO = ("preset=ppo", "critic.engine.lr=1e-3", "data.val_path=", "trainer.device=cpu")


class ForcedResidency(Residency):
    """A residency that moves on the CPU as it would on a GPU; each one made is remembered."""

    made: list[Residency] = []

    def __init__(self, engine, device, params, optimizer):
        super().__init__(engine, device, params, optimizer)
        self.offloads_params, self.offloads_optimizer = params, optimizer
        ForcedResidency.made.append(self)


def _role(engine) -> str:
    """``actor``, ``reference`` or ``critic``: the worker makes the actor's residency before the reference's."""
    if engine.config.head == "value":
        return "critic"
    causal = [r.engine for r in ForcedResidency.made if r.engine.config.head != "value"]
    return "actor" if engine is causal[0] else "reference"


def _record_phases(monkeypatch) -> list[tuple[str, dict[str, str]]]:
    """Force the moves, and record each engine pass and generation with every model's state then."""
    seen: list[tuple[str, dict[str, str]]] = []
    forward_backward = TorchTrainEngine.forward_backward
    generate_batch = NativeRolloutEngine.generate_batch

    def states() -> dict[str, str]:
        return {_role(r.engine): r.state for r in ForcedResidency.made}

    def recording_forward_backward(self, batch, loss_fn, forward_only=False, **kwargs):
        seen.append((f"{_role(self)} {'forward' if forward_only else 'update'}", states()))
        return forward_backward(self, batch, loss_fn, forward_only=forward_only, **kwargs)

    def recording_generate_batch(self, requests, *args, **kwargs):
        seen.append(("generate", states()))
        return generate_batch(self, requests, *args, **kwargs)

    monkeypatch.setattr(ForcedResidency, "made", [])
    monkeypatch.setattr("tandem.rl.worker.Residency", ForcedResidency)
    monkeypatch.setattr("tandem.engine.on_rank.Residency", ForcedResidency)  # parked(): critic, reference
    monkeypatch.setattr(TorchTrainEngine, "forward_backward", recording_forward_backward)
    monkeypatch.setattr(NativeRolloutEngine, "generate_batch", recording_generate_batch)
    return seen


def _numbers(history: list[dict]) -> list[dict]:
    return [
        {k: v for k, v in h.items() if not k.startswith(("timing_s/", "perf/throughput"))} for h in history
    ]


def test_each_phase_finds_what_it_reads_and_the_numbers_do_not_change(rl_files, tmp_path, monkeypatch):
    plain = RLTrainer(small_config(rl_files, tmp_path / "plain", *WITH_REFERENCE)).fit().history
    seen = _record_phases(monkeypatch)
    offloaded = RLTrainer(small_config(rl_files, tmp_path / "offloaded", *WITH_REFERENCE, *OFFLOAD_ALL)).fit()

    assert _numbers(offloaded.history) == _numbers(plain)
    expected = {
        "generate": {"actor": "offloaded", "reference": "parameters offloaded"},
        "actor forward": {"actor": "optimizer offloaded", "reference": "parameters offloaded"},
        "actor update": {"actor": "resident", "reference": "parameters offloaded"},
        "reference forward": {"actor": "optimizer offloaded", "reference": "resident"},
    }
    assert {what for what, _ in seen} == set(expected)
    for what, states in seen:
        assert states == expected[what], what


def test_the_critic_waits_offloaded_except_while_it_computes(rl_files, tmp_path, monkeypatch):
    plain = RLTrainer(small_config(rl_files, tmp_path / "plain", *PPO)).fit().history
    seen = _record_phases(monkeypatch)
    offloaded = RLTrainer(
        small_config(
            rl_files,
            tmp_path / "offloaded",
            *PPO,
            "critic.offload.params=true",
            "critic.offload.optimizer=true",
        )
    ).fit()

    assert _numbers(offloaded.history) == _numbers(plain)
    expected = {"generate": "offloaded", "actor update": "offloaded", "critic forward": "optimizer offloaded",
                "critic update": "resident"}  # fmt: skip
    assert {what for what, _ in seen} >= set(expected)
    for what, states in seen:
        if what in expected:
            assert states["critic"] == expected[what], what


def test_offloading_the_actor_is_refused_where_the_rollout_runs_on_replicas(rl_files, tmp_path):
    for key in ("actor.offload.params", "actor.offload.optimizer"):
        with pytest.raises(ValueError, match=key.replace(".", r"\.") + ".*must be off"):
            small_config(rl_files, tmp_path, "pipeline.mode=one_step_off", f"{key}=true")
    config = small_config(rl_files, tmp_path, "pipeline.mode=one_step_off", "actor.offload.reference=true")
    assert config.actor.offload.reference
