"""A split episode (the program rewrote its history) trains every segment, in one row.

The references: the chat template's rendering of each request's messages and the tokens and
log-probs the endpoint returned to the program (through the real ``openai`` client) against the
row; the trainer's log-probs of the row, read through the fields the actor's ``compute_log_prob``
declares (``FORWARD_FIELDS``), against the rollout's on every sampled token of every segment."""

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("openai")

from tandem.agents.config import AgentConfig  # noqa: E402
from tandem.agents.program.recorder import EpisodeRecord  # noqa: E402
from tandem.agents.rollout import AgentRollout  # noqa: E402
from tandem.engine import EngineConfig, TorchTrainEngine  # noqa: E402
from tandem.engine.forward_fields import FORWARD_FIELDS  # noqa: E402
from tandem.models.chat_literal import literal_template_ids  # noqa: E402
from tandem.protocol import Batch  # noqa: E402
from tandem.protocol.generation import Completion  # noqa: E402
from tests.agents.test_program_agent import engine_setup, prompts, row_tokens, sampling  # noqa: E402

SPLITTING = """
import json


async def run(client, row):
    info = row["extra_info"]
    messages, requests = list(row["messages"]), []
    for turn in range(info["turns"]):
        reply = await client.chat.completions.create(
            model="any", messages=messages, max_tokens=6, logprobs=True
        )
        choice = reply.choices[0]
        requests.append({
            "messages": list(messages), "ids": choice.model_extra["token_ids"],
            "log_probs": [t.logprob for t in choice.logprobs.content],
        })
        messages.append(choice.message.model_dump(exclude_none=True))
        if turn in info["rewrite"]:  # a summary instead of the reply: the next request is a new segment
            messages[-1] = {"role": "assistant", "content": f"(summary {turn})"}
        messages.append({"role": "user", "content": f"{info['marker']} after turn {turn}"})
    with open(info["log"].format(seed=row["seed"]), "w") as log:
        json.dump(requests, log)
    return 0.5
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    with engine_setup(tmp_path_factory.mktemp("segments"), {"splitting.py": SPLITTING}) as made:
        yield made


def run_rows(setup, rows: list[dict], max_tokens: int) -> Batch:
    root, tokenizer, _, _ = setup
    rollout = AgentRollout(
        AgentConfig(name="program", program=str(root / "splitting.py")), tokenizer, setup[2]
    )
    batch, width = prompts(rows, tokenizer)
    return rollout.generate(batch, sampling(tokenizer, max_tokens), width, 0)


def trainer_log_probs(model: str, out: Batch) -> torch.Tensor:
    """``[B, R]``: the trainer's log-probs of the response columns, from the fields the actor's
    ``compute_log_prob`` reads (packed, prompts shared where rows share them: the default)."""
    trainer = TorchTrainEngine(EngineConfig(model_path=model, max_tokens_per_micro_batch=8192))
    trainer.initialize()
    fields = Batch({k: out[k] for k in FORWARD_FIELDS if k in out.tensors.keys()})
    return trainer.forward_backward(fields, None, True).outputs.log_probs[:, out["prompts"].shape[1] :]


def test_every_segment_of_a_split_episode_trains_in_one_row(setup, tmp_path):
    root, tokenizer, _, model = setup
    rows = [
        {"marker": "[two]", "turns": 2, "rewrite": [0], "log": str(tmp_path / "two.json")},
        {"marker": "[three]", "turns": 3, "rewrite": [0, 1], "log": str(tmp_path / "three.json")},
        {"marker": "[mixed]", "turns": 3, "rewrite": [1], "log": str(tmp_path / "mixed.json")},
    ]
    out = run_rows(setup, rows, 400)
    assert list(out["agent_program_splits"]) == [1, 2, 1]
    mask = out["response_mask"].bool()
    for i, row in enumerate(rows):
        requests = json.loads(Path(row["log"]).read_text())
        assert out["finish_reason"][i] != "program_error" and out["agent_reward"][i] == 0.5
        sampled = [t for r in requests for t in r["ids"]]
        # response_mask covers exactly the sampled tokens of every segment, with their log-probs
        assert out["responses"][i][mask[i]].tolist() == sampled
        recorded = torch.tensor([p for r in requests for p in r["log_probs"]])
        assert torch.allclose(out["rollout_log_probs"][i][mask[i]], recorded, atol=1e-6, rtol=0)
        if len(row["rewrite"]) == row["turns"] - 1:  # every request a segment: the template's rendering
            rendered = [
                t for r in requests
                for t in literal_template_ids(tokenizer, r["messages"], add_generation_prompt=True) + r["ids"]
            ]  # fmt: skip
            assert row_tokens(out, i) == rendered
        # positions restart at 0 where each later segment starts, once per split
        valid = out["attention_mask"][i].bool()
        positions = out["position_ids"][i][valid]
        assert int((positions == 0).sum()) == 1 + out["agent_program_splits"][i]
    diff = (trainer_log_probs(model, out) - out["rollout_log_probs"])[mask]
    assert diff.numel() >= 6 * 8 and diff.abs().max() <= 1e-5, float(diff.abs().max())


def test_a_segment_counts_against_the_budget_the_earlier_segments_left():
    record = EpisodeRecord(None, 0, 3, 20)  # a 3-token row prompt, 20 response columns
    first = record.plan([{"role": "user", "content": "a"}], "", lambda: [1, 2, 3])
    assert first.room == 20
    record.commit(first, Completion("r0", first.context_ids, [5] * 5, [0.0] * 5, [0] * 5, "stop"), {})
    rewritten = [{"role": "user", "content": "b"}]
    second = record.plan(rewritten, "", lambda: [1, 2, 3, 4])
    assert second.appended is None and second.room == 20 - 5 - 4  # its whole prompt counts
    record.commit(second, Completion("r1", second.context_ids, [6] * 2, [0.0] * 2, [0] * 2, "stop"), {})
    row = record.row((1, 2, 3))
    assert row.prompt_ids == (1, 2, 3) and row.segment_starts == [5]
    assert row.token_ids == [5] * 5 + [1, 2, 3, 4] + [6] * 2
    assert row.loss_mask == [1] * 5 + [0] * 4 + [1] * 2 and row.splits == 1


def test_a_segment_that_does_not_fit_ends_the_episode_as_the_budget_does(setup, tmp_path):
    row = {"marker": "[long]", "turns": 3, "rewrite": [0, 1], "log": str(tmp_path / "long.json")}
    out = run_rows(setup, [row], 40)  # two segments' prompts and replies leave no room for a third
    assert list(out["finish_reason"]) == ["program_error"] and list(out["agent_reward"]) == [0.0]
    assert "rollout.max_response_length" in out["agent_program_log"][0]["error"]
