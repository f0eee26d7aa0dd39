"""``n`` > 1 on the agent-program endpoint: the choice the program's next request echoes continues
the row, every other choice is a segment of its own in the same row, all trained.

The references: the token ids and log-probs the endpoint returned for each choice (through the
real ``openai`` client) against the row's sampled tokens, the chat template's rendering of the
prompt against each segment's start, and the trainer's fp32 log-probs against the rollout's."""

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("openai")

from tandem.agents.config import AgentConfig  # noqa: E402
from tandem.agents.rollout import AgentRollout  # noqa: E402
from tandem.models.chat_literal import literal_template_ids  # noqa: E402
from tests.agents.test_program_agent import engine_setup, prompts, row_tokens, sampling  # noqa: E402
from tests.agents.test_program_segments import trainer_log_probs  # noqa: E402

CHOOSING = """
import json


async def run(client, row):
    info = row["extra_info"]
    messages, requests = list(row["messages"]), []
    for turn, (n, keep) in enumerate(info["plan"]):
        reply = await client.chat.completions.create(
            model="any", messages=messages, max_tokens=6, logprobs=True, n=n
        )
        requests.append([
            {"ids": c.model_extra["token_ids"], "log_probs": [t.logprob for t in c.logprobs.content]}
            for c in reply.choices
        ])
        messages.append(reply.choices[keep].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": f"{info['marker']} after turn {turn}"})
    with open(info["log"], "w") as log:
        json.dump(requests, log)
    return 1.0
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    with engine_setup(tmp_path_factory.mktemp("choices"), {"choosing.py": CHOOSING}) as made:
        yield made


def test_the_echoed_choice_continues_the_row_and_the_others_train_as_segments(setup, tmp_path):
    root, tokenizer, engine, model = setup
    rows = [  # (n, the choice the program keeps) per request
        {"marker": "[c]", "plan": [[3, 2], [1, 0]], "log": str(tmp_path / "c.json")},
        {"marker": "[last]", "plan": [[1, 0], [3, 1]], "log": str(tmp_path / "last.json")},
    ]
    batch, width = prompts(rows, tokenizer)
    rollout = AgentRollout(AgentConfig(name="program", program=str(root / "choosing.py")), tokenizer, engine)
    out = rollout.generate(batch, sampling(tokenizer, 300), width, 0)
    mask = out["response_mask"].bool()
    first = [literal_template_ids(tokenizer, m, add_generation_prompt=True) for m in batch["raw_prompt"]]
    for i, row in enumerate(rows):
        requests = json.loads(Path(row["log"]).read_text())
        assert out["finish_reason"][i] != "program_error" and out["agent_program_splits"][i] == 0
        assert [len(r) for r in requests] == [n for n, _ in row["plan"]]
        # the choices of a request differ (seed + j): each is its own sample
        assert len({tuple(c["ids"]) for c in requests[[n for n, _ in row["plan"]].index(3)]}) > 1
        sampled = out["responses"][i][mask[i]].tolist()
        recorded = out["rollout_log_probs"][i][mask[i]]
        positions = out["position_ids"][i][out["attention_mask"][i].bool()]
        assert int((positions == 0).sum()) == 3  # the continued conversation and two one-turn segments
        if i == 0:  # choices 0 and 1 first (each after the prompt), then choice 2 continued
            c0, c1, c2 = (c["ids"] for c in requests[0])
            assert row_tokens(out, i)[: 3 * len(first[i]) + len(c0 + c1 + c2)] == (
                first[i] + c0 + first[i] + c1 + first[i] + c2
            )
            order = [requests[0][0], requests[0][1], requests[0][2], requests[1][0]]
        else:  # the last request: no echo, so choice 0 continues; the others come before it
            order = [requests[1][1], requests[1][2], requests[0][0], requests[1][0]]
        assert sampled == [t for c in order for t in c["ids"]]
        expected = torch.tensor([p for c in order for p in c["log_probs"]])
        assert torch.allclose(recorded, expected, atol=1e-6, rtol=0)
    diff = (trainer_log_probs(model, out) - out["rollout_log_probs"])[mask]
    assert diff.numel() >= 8 and diff.abs().max() <= 1e-5, float(diff.abs().max())
