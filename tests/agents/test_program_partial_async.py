"""An agent program's request paused by a partial rollout (``pipeline.mode=fully_async`` with
``pipeline.partial_rollout``): a weight sync lands while the request generates, as a replica's
``receive_weights(version, "keep")`` applies it, and the request goes on under the new weights.

The references: the tokens, weight versions and log-probs the endpoint returned to the program
(logged by the program itself) against the assembled training row; the trainer's fp32 log-probs
under the weights of each version against the rollout's, for the tokens whose whole context that
version computed: the paused request's tokens sampled before the update (version 0) and the next
request (version 1, its context read again under the new weights). The paused request's tokens
after the update are sampled by the new weights over the cache the old ones wrote (what a
partial rollout is), which neither version's forward reproduces: ``rollout_corr/*`` measures that
in a run; here they carry version 1 and the log-probs the rollout reported."""

import json
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("openai")

from tandem.agents.config import AgentConfig  # noqa: E402
from tandem.agents.rollout import AgentRollout  # noqa: E402
from tandem.models import load_tokenizer  # noqa: E402
from tandem.pipeline.groups import EpisodePrompt, GroupRequest, GroupTracker  # noqa: E402
from tandem.pipeline.runner import assemble_batch  # noqa: E402
from tandem.pipeline.sample_store import InlineWriter  # noqa: E402
from tandem.rl.data import RLDataset  # noqa: E402
from tandem.rollout import NativeEngineConfig, NativeRolloutEngine, SamplingParams  # noqa: E402
from tests.agents.test_program_agent import trainer_log_probs  # noqa: E402
from tests.agents.test_program_async import collect_all  # noqa: E402

FIRST, SECOND = 150, 8  # the two requests' max_tokens: the first is long, so the sync lands inside it

PROGRAM = f"""
import json


async def run(client, row):
    messages, turns = list(row["messages"]), []
    for max_tokens in ({FIRST}, {SECOND}):
        reply = await client.chat.completions.create(
            model="any", messages=messages, max_tokens=max_tokens, logprobs=True
        )
        choice = reply.choices[0]
        turns.append({{
            "ids": choice.model_extra["token_ids"], "versions": choice.model_extra["weight_versions"],
            "log_probs": [entry.logprob for entry in choice.logprobs.content],
        }})
        messages.append(choice.message.model_dump(exclude_none=True))
        messages.append({{"role": "user", "content": "again"}})
    with open(row["extra_info"]["log"], "w") as log:
        json.dump(turns, log)
    return 1.0
"""


def perturbed_model(model: str, root) -> tuple[str, list[tuple[str, torch.Tensor]]]:
    """A copy of ``model`` under ``root`` with every weight moved (the trainer's next version), and
    those weights by HF name."""
    shutil.copytree(model, root)
    weights = load_file(f"{model}/model.safetensors")
    generator = torch.Generator().manual_seed(9)
    moved = {name: t + 0.1 * torch.randn(t.shape, generator=generator) for name, t in weights.items()}
    save_file(moved, f"{root}/model.safetensors")
    return str(root), list(moved.items())


def test_a_program_request_paused_by_a_partial_rollout_records_each_tokens_version(rl_files, tmp_path):
    (tmp_path / "agent.py").write_text(PROGRAM)
    model = rl_files["model"]
    updated, weights = perturbed_model(model, tmp_path / "v1")
    tokenizer = load_tokenizer(model)
    dataset = RLDataset.load(rl_files["train"], tokenizer, 64)
    engine = NativeRolloutEngine.from_pretrained(model, NativeEngineConfig(max_num_seqs=8, max_model_len=512))
    agents = AgentRollout(AgentConfig(name="program", program=str(tmp_path / "agent.py")), tokenizer, engine)
    tracker = GroupTracker(replica=0, writer=InlineWriter(), agents=agents)
    params = SamplingParams(temperature=1.0, max_tokens=200, ignore_eos=True)  # no early end
    info = {"log": str(tmp_path / "turns.json")}
    group = GroupRequest(
        "g0", 0, (), (3,), params, EpisodePrompt(({"role": "user", "content": "start"},), info)
    )
    try:
        tracker.start(engine, [group])
        deadline = time.monotonic() + 60
        while engine.stats.generated_tokens < 10:  # the first request is generating
            assert time.monotonic() < deadline, "the program's first request never generated"
            time.sleep(0.001)
        engine.pause("keep")  # a replica's receive_weights(1, "keep"): partial rollout
        engine.update_weights(weights, version=1)
        engine.resume()
        (meta,) = collect_all(tracker, 1)
    finally:
        agents.close()
        engine.close()
    first, second = json.loads((tmp_path / "turns.json").read_text())
    assert len(first["ids"]) == FIRST and len(second["ids"]) == SECOND
    paused_at = first["versions"].index(1)  # the first token the new weights sampled
    assert 10 <= paused_at < FIRST  # the update landed inside the first request
    assert (
        first["versions"] == [0] * paused_at + [1] * (FIRST - paused_at)
        and second["versions"] == [1] * SECOND
    )
    assert (meta.min_version, meta.max_version) == (0, 1)

    batch = assemble_batch([meta], dataset, 1, tokenizer.pad_token_id)
    mask = batch["response_mask"][0].bool()
    # the trained tokens are the sampled ones, each with the version that sampled it and the
    # log-prob the rollout reported for it
    assert batch["responses"][0][mask].tolist() == first["ids"] + second["ids"]
    assert batch["weight_version"][0][mask].tolist() == first["versions"] + second["versions"]
    reported = torch.tensor(first["log_probs"] + second["log_probs"], dtype=batch["rollout_log_probs"].dtype)
    assert torch.equal(batch["rollout_log_probs"][0][mask], reported)
    # each version's tokens against the trainer under that version's weights
    rollout = batch["rollout_log_probs"][0][mask]
    old, new = (trainer_log_probs(weights, batch)[0][mask] for weights in (model, updated))
    assert (old[:paused_at] - rollout[:paused_at]).abs().max() <= 1e-5
    assert (new[FIRST:] - rollout[FIRST:]).abs().max() <= 1e-5
    assert (old[FIRST:] - rollout[FIRST:]).abs().max() > 1e-2  # the versions matter
