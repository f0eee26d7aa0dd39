"""A split episode on a rollout replica (``pipeline.mode=one_step_off|fully_async``): the group's
stored tensors carry where each segment starts, and the assembled row trains every segment.

The references: the tokens and log-probs the endpoint returned to the program against the row's
sampled tokens, and the trainer's fp32 log-probs against the rollout's on every segment."""

import json

import pytest

pytest.importorskip("openai")

from tandem.agents.config import AgentConfig  # noqa: E402
from tandem.agents.rollout import AgentRollout  # noqa: E402
from tandem.models import load_tokenizer  # noqa: E402
from tandem.pipeline.groups import EpisodePrompt, GroupRequest, GroupTracker  # noqa: E402
from tandem.pipeline.runner import assemble_batch  # noqa: E402
from tandem.pipeline.sample_store import InlineWriter  # noqa: E402
from tandem.rl.data import RLDataset  # noqa: E402
from tandem.rollout import NativeEngineConfig, NativeRolloutEngine, SamplingParams  # noqa: E402
from tests.agents.test_program_async import collect_all  # noqa: E402
from tests.agents.test_program_segments import SPLITTING, trainer_log_probs  # noqa: E402

N = 2  # episodes per prompt group


def test_a_replicas_split_episodes_train_every_segment(rl_files, tmp_path):
    (tmp_path / "splitting.py").write_text(SPLITTING)
    tokenizer = load_tokenizer(rl_files["model"])
    dataset = RLDataset.load(rl_files["train"], tokenizer, 64)
    engine = NativeRolloutEngine.from_pretrained(
        rl_files["model"], NativeEngineConfig(max_num_seqs=8, max_model_len=512)
    )
    agents = AgentRollout(
        AgentConfig(name="program", program=str(tmp_path / "splitting.py")), tokenizer, engine
    )
    tracker = GroupTracker(replica=0, writer=InlineWriter(), agents=agents)
    params = SamplingParams(temperature=1.0, max_tokens=300, stop_token_ids=(tokenizer.eos_token_id,))
    info = {"marker": "<s>", "turns": 3, "rewrite": [0, 1], "log": str(tmp_path / "{seed}.json")}
    prompt = EpisodePrompt(({"role": "user", "content": "<s> start"},), info)
    groups = [GroupRequest("g0", 0, (), tuple(range(N)), params, prompt)]
    try:
        tracker.start(engine, groups)
        metas = collect_all(tracker, 1)
    finally:
        agents.close()
        engine.close()
    batch = assemble_batch(metas, dataset, N, tokenizer.pad_token_id)
    mask = batch["response_mask"].bool()
    assert list(batch["agent_program_splits"]) == [2] * N
    for i in range(N):
        requests = json.loads((tmp_path / f"{i}.json").read_text())  # seeds 0 .. N-1
        assert batch["responses"][i][mask[i]].tolist() == [t for r in requests for t in r["ids"]]
        positions = batch["position_ids"][i][batch["attention_mask"][i].bool()]
        assert int((positions == 0).sum()) == 3  # the row's start and two segment starts
    diff = (trainer_log_probs(rl_files["model"], batch) - batch["rollout_log_probs"])[mask]
    assert diff.numel() >= 3 * N and diff.abs().max() <= 1e-5, float(diff.abs().max())


@pytest.mark.slow
def test_grpo_trains_split_episodes_in_fully_async_with_the_rollouts_log_probs(rl_files, tmp_path):
    """Two fully asynchronous GRPO steps of a program that summarises its history: every segment
    trains, and the trainer's log-probs (the actor's ``compute_log_prob``) equal the rollout's."""
    from tandem.rl.trainer import RLTrainer
    from tests.rl.conftest import small_config

    program = SPLITTING.replace('info = row["extra_info"]', 'info = {"turns": 2, "rewrite": [0], "marker": "!",'
                                ' "log": "/dev/null"}')  # fmt: skip
    (tmp_path / "agent.py").write_text(program)
    config = small_config(
        rl_files, tmp_path / "run", "agent.name=program", f"agent.program={tmp_path / 'agent.py'}",
        "reward.sources=[interaction]", "rollout.max_response_length=120", "trainer.val_before_train=false",
        "trainer.val_every=0", "pipeline.mode=fully_async", "pipeline.trainer_threads=1",
        "pipeline.rollout_threads=1",
    )  # fmt: skip
    history = [e for e in RLTrainer(config).fit().history if "agent/turns/mean" in e]
    assert len(history) == 2
    for entry in history:
        assert entry["agent/program/errors"] == 0 and entry["agent/program/splits"] > 0
        if entry["pipeline/staleness/max"] == 0:
            assert entry["rollout_corr/max_abs_log_prob_diff"] <= 1e-5
