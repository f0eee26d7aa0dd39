"""``actor.offload.*`` in the colocated loop: each phase finds the state it reads on the device,
generation runs with the actor (and the reference) offloaded, and the run's numbers are those
of a run that offloads nothing.

On the CPU an offload moves nothing, so these runs force the moves (CPU to CPU) to follow the
loop's bookkeeping; the GPU tier (tests/gpu) runs the real moves on CUDA.
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


class ForcedResidency(Residency):
    """A residency that moves on the CPU as it would on a GPU; each one made is remembered
    (the worker makes the actor's first, then the reference's)."""

    made: list[Residency] = []

    def __init__(self, engine, device, params, optimizer):
        super().__init__(engine, device, params, optimizer)
        self.offloads_params, self.offloads_optimizer = params, optimizer
        ForcedResidency.made.append(self)


def _numbers(history: list[dict]) -> list[dict]:
    return [
        {k: v for k, v in h.items() if not k.startswith(("timing_s/", "perf/throughput"))} for h in history
    ]


def test_each_phase_finds_what_it_reads_and_the_numbers_do_not_change(rl_files, tmp_path, monkeypatch):
    seen: list[tuple[str, str, str]] = []  # (what ran, actor state, reference state)
    forward_backward = TorchTrainEngine.forward_backward
    generate_batch = NativeRolloutEngine.generate_batch

    def states() -> tuple[str, str]:
        actor, reference = ForcedResidency.made
        return actor.state, reference.state

    def recording_forward_backward(self, batch, loss_fn, forward_only=False, **kwargs):
        role = "actor" if self is ForcedResidency.made[0].engine else "reference"
        seen.append((f"{role} {'forward' if forward_only else 'update'}", *states()))
        return forward_backward(self, batch, loss_fn, forward_only=forward_only, **kwargs)

    def recording_generate_batch(self, requests, *args, **kwargs):
        if len(ForcedResidency.made) == 2:
            seen.append(("generate", *states()))
        return generate_batch(self, requests, *args, **kwargs)

    plain = RLTrainer(small_config(rl_files, tmp_path / "plain", *WITH_REFERENCE)).fit().history
    monkeypatch.setattr(ForcedResidency, "made", [])
    monkeypatch.setattr("tandem.rl.worker.Residency", ForcedResidency)
    monkeypatch.setattr(TorchTrainEngine, "forward_backward", recording_forward_backward)
    monkeypatch.setattr(NativeRolloutEngine, "generate_batch", recording_generate_batch)
    offloaded = RLTrainer(small_config(rl_files, tmp_path / "offloaded", *WITH_REFERENCE, *OFFLOAD_ALL)).fit()

    assert _numbers(offloaded.history) == _numbers(plain)
    phases = {what for what, _, _ in seen}
    assert phases == {"generate", "actor forward", "actor update", "reference forward"}
    for what, actor, reference in seen:
        expected = {
            "generate": ("offloaded", "parameters offloaded"),
            "actor forward": ("optimizer offloaded", "parameters offloaded"),
            "actor update": ("resident", "parameters offloaded"),
            "reference forward": ("optimizer offloaded", "resident"),
        }[what]
        assert (actor, reference) == expected, what


def test_offloading_the_actor_is_refused_where_the_rollout_runs_on_replicas(rl_files, tmp_path):
    for key in ("actor.offload.params", "actor.offload.optimizer"):
        with pytest.raises(ValueError, match=key.replace(".", r"\.") + ".*must be off"):
            small_config(rl_files, tmp_path, "pipeline.mode=one_step_off", f"{key}=true")
    config = small_config(rl_files, tmp_path, "pipeline.mode=one_step_off", "actor.offload.reference=true")
    assert config.actor.offload.reference
