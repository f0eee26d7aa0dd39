"""Agent programs (``agent.name=program``): a user's ``async def run(client, row)`` drives episodes
through the real ``openai`` client and the run's endpoint; every request is recorded as tokens.

The references: the token ids the endpoint returned to the program (what it sampled) against the
training row's model tokens, the trainer's log-probs against the rollout's, the chat template's
rendering of a rewritten history against a split row's prompt, and each episode's own marker
against the text its row decodes to."""

import contextlib
import json
import re
from pathlib import Path

import pytest
import torch

openai = pytest.importorskip("openai")

from tandem.agents.config import AgentConfig  # noqa: E402
from tandem.agents.loops import episode_metrics  # noqa: E402
from tandem.agents.program.recorder import EpisodeRecord  # noqa: E402
from tandem.agents.program.replies import assistant_reply  # noqa: E402
from tandem.agents.rollout import AgentRollout  # noqa: E402
from tandem.agents.tool_calls import parse_hermes  # noqa: E402
from tandem.agents.trajectory import TurnEncoder  # noqa: E402
from tandem.engine import EngineConfig, TorchTrainEngine  # noqa: E402
from tandem.models import load_tokenizer, save_tiny_model  # noqa: E402
from tandem.models.chat_literal import literal_template_ids  # noqa: E402
from tandem.protocol import Batch  # noqa: E402
from tandem.protocol.generation import Completion  # noqa: E402
from tandem.rollout import NativeEngineConfig, NativeRolloutEngine, SamplingParams  # noqa: E402

PROGRAM = """
import asyncio, json

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]


async def run(client, row):
    info = row["extra_info"]
    messages, sampled = list(row["messages"]), []
    for turn in range(info["turns"]):
        extra = {"tools": TOOLS} if info.get("tools") else {}
        reply = await client.chat.completions.create(
            model="any", messages=messages, max_tokens=6, logprobs=True, **extra
        )
        sampled.append(reply.choices[0].model_extra["token_ids"])
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        if info.get("rewrite") and turn == 0:
            messages[-1] = {"role": "assistant", "content": "(a summary)"}
        role = "tool" if info.get("tools") else "user"
        messages.append({"role": role, "content": f"{info['marker']} after turn {turn}"})
    with open(info["log"], "w") as log:
        json.dump({"sampled": sampled, "key": client.api_key}, log)
    return {"reward": float(info["turns"]), "metrics": {"requests": info["turns"]}}
"""

# each fault by row; the log keeps the episode's key, an error's status and message, or the
# tokens sampled (tests/agents/test_program_faults_async.py reads them too)
FAULTS = """
import asyncio, json
import openai


async def run(client, row):
    info = row["extra_info"]
    fault, messages = info["fault"], row["messages"]
    json.dump({"key": client.api_key}, open(info["log"], "w"))
    try:
        if fault == "raise":
            raise RuntimeError("the agent crashed")
        if fault == "hang":
            await asyncio.sleep(60)
        if fault == "malformed":
            await client.chat.completions.create(model="any", messages=[{"role": "robot", "content": "x"}])
        if fault == "max_requests":
            for _ in range(3):
                await client.chat.completions.create(model="any", messages=messages, max_tokens=2)
        if fault == "max_tokens":
            for _ in range(2):
                await client.chat.completions.create(model="any", messages=messages, max_tokens=20)
        if fault == "bad_return":
            return "a lot"
        if fault == "none":
            reply = await client.chat.completions.create(model="any", messages=messages, max_tokens=4)
            json.dump({"key": client.api_key, "sampled": reply.choices[0].model_extra["token_ids"]},
                      open(info["log"], "w"))
    except openai.APIStatusError as error:
        json.dump({"key": client.api_key, "status": error.status_code, "message": error.message},
                  open(info["log"], "w"))
    return 1.0
"""


@contextlib.contextmanager
def engine_setup(root: Path, programs: dict[str, str]):
    """``(root, tokenizer, engine, model_dir)``: a tiny model's native engine under ``root``, with
    the ``programs`` (file name -> source) written beside it; the engine closes on exit."""
    model = str(save_tiny_model(root / "model"))
    engine = NativeRolloutEngine.from_pretrained(
        model, NativeEngineConfig(max_num_seqs=32, max_model_len=512)
    )
    for name, source in programs.items():
        (root / name).write_text(source)
    try:
        yield root, load_tokenizer(model), engine, model
    finally:
        engine.close()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    with engine_setup(
        tmp_path_factory.mktemp("program"), {"program.py": PROGRAM, "faults.py": FAULTS}
    ) as made:
        yield made


def rollout_of(setup, program: str, **limits) -> AgentRollout:
    root, tokenizer, engine, _ = setup
    return AgentRollout(AgentConfig(name="program", program=str(root / program), **limits), tokenizer, engine)


def prompts(rows: list[dict], tokenizer) -> tuple[Batch, int]:
    """A prompt batch (``raw_prompt``, ``seed``, ``extra_info``) and its prompt width."""
    messages = [[{"role": "user", "content": f"{row['marker']} start"}] for row in rows]
    width = max(len(literal_template_ids(tokenizer, m, add_generation_prompt=True)) for m in messages)
    batch = Batch(
        non_tensors={"raw_prompt": messages, "seed": list(range(7, 7 + len(rows))), "extra_info": rows}
    )
    return batch, width


def sampling(tokenizer, max_tokens=120) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, stop_token_ids=(tokenizer.eos_token_id,))


def row_tokens(out: Batch, i: int) -> list[int]:
    return out["input_ids"][i][out["attention_mask"][i].bool()].tolist()


def trainer_log_probs(model: str, out: Batch) -> torch.Tensor:
    """The trainer's log-prob of each response token ``[B, R]`` (fp32)."""
    trainer = TorchTrainEngine(EngineConfig(model_path=model, max_tokens_per_micro_batch=8192))
    trainer.initialize()
    fields = {k: out[k] for k in ("input_ids", "attention_mask", "position_ids")}
    log_probs = trainer.forward_backward(Batch(fields), None, True).outputs.log_probs
    return log_probs[:, out["prompts"].shape[1] :]


def test_episodes_of_one_two_and_five_turns_train_exactly_the_sampled_tokens(setup, tmp_path):
    root, tokenizer, engine, model = setup
    rows = [
        {"marker": f"[m{i}]", "turns": turns, "tools": i == 2, "log": str(tmp_path / f"{i}.json")}
        for i, turns in enumerate([1, 2, 5])
    ]
    batch, width = prompts(rows, tokenizer)
    out = rollout_of(setup, "program.py").generate(batch, sampling(tokenizer, 240), width, 0)
    mask = out["response_mask"].bool()
    for i, row in enumerate(rows):
        log = json.loads(Path(row["log"]).read_text())
        sampled = [t for turn in log["sampled"] for t in turn]
        # the trained tokens are the sampled ones, exactly, in order; the rest is masked out
        assert out["responses"][i][mask[i]].tolist() == sampled and len(log["sampled"]) == row["turns"]
        assert out["agent_reward"][i] == row["turns"] and out["agent_program_splits"][i] == 0
        assert out["agent_program_metrics"][i] == {"requests": row["turns"]}
        assert out["finish_reason"][i] != "program_error"
        # the row is what the template renders around those tokens: the user or tool turns between
        text = tokenizer.decode(row_tokens(out, i))
        assert text.count(row["marker"]) == row["turns"]  # the prompt's, then one per reply but the last
    assert (out["rollout_log_probs"][~mask] == 0).all()
    diff = (trainer_log_probs(model, out) - out["rollout_log_probs"])[mask]
    assert diff.numel() >= 6 * 8 and diff.abs().max() <= 1e-5, float(diff.abs().max())


def test_a_rewritten_history_starts_a_new_segment_of_the_row_and_counts_a_split(setup, tmp_path):
    root, tokenizer, engine, model = setup
    rows = [{"marker": "[r]", "turns": 2, "rewrite": True, "log": str(tmp_path / "r.json")}]
    batch, width = prompts(rows, tokenizer)
    out = rollout_of(setup, "program.py").generate(batch, sampling(tokenizer), width, 0)
    assert list(out["agent_program_splits"]) == [1]
    log = json.loads(Path(log_path := rows[0]["log"]).read_text())
    # the row holds both segments: the first request's prompt and reply, then the template's
    # rendering of the rewritten history and the second reply, each its own sequence
    rewritten = [
        {"role": "user", "content": "[r] start"},
        {"role": "assistant", "content": "(a summary)"},
        {"role": "user", "content": "[r] after turn 0"},
    ]
    first = literal_template_ids(tokenizer, rewritten[:1], add_generation_prompt=True)
    prompt = literal_template_ids(tokenizer, rewritten, add_generation_prompt=True)
    assert row_tokens(out, 0) == first + log["sampled"][0] + prompt + log["sampled"][1], log_path
    # both requests' sampled tokens are trained, the second segment's prompt is not
    assert (
        out["responses"][0][out["response_mask"][0].bool()].tolist() == log["sampled"][0] + log["sampled"][1]
    )
    positions = out["position_ids"][0][out["attention_mask"][0].bool()].tolist()
    second = len(first) + len(log["sampled"][0])
    assert positions == list(range(second)) + list(range(len(prompt) + len(log["sampled"][1])))
    assert (
        episode_metrics([1], [0], [0], ["stop"], [], out["agent_program_splits"])["agent/program/splits"] == 1
    )


def test_sixteen_concurrent_episodes_on_one_engine_never_mix(setup, tmp_path):
    root, tokenizer, engine, model = setup
    rows = [{"marker": f"<e{i:02d}>", "turns": 2, "log": str(tmp_path / f"{i}.json")} for i in range(16)]
    batch, width = prompts(rows, tokenizer)
    agents = rollout_of(setup, "program.py")
    out = agents.generate(batch, sampling(tokenizer, 60), width, 0)
    for i, row in enumerate(rows):
        text = tokenizer.decode(row_tokens(out, i))
        markers = set(re.findall(r"<e\d\d>", text))
        assert markers <= {row["marker"]} and text.count(row["marker"]) == 2, text
        log = json.loads(Path(row["log"]).read_text())
        assert out["responses"][i][out["response_mask"][i].bool()].tolist() == [
            t for s in log["sampled"] for t in s
        ]
    keys = {json.loads(Path(row["log"]).read_text())["key"] for row in rows}
    assert len(keys) == 16  # one identity per episode
    # a call after its episode ended is refused with a message the client shows
    client = openai.OpenAI(base_url=agents.program.base_url, api_key=keys.pop(), max_retries=0)
    with pytest.raises(openai.ConflictError, match="this episode has ended"):
        client.chat.completions.create(model="any", messages=[{"role": "user", "content": "x"}])
    agents.close()


def test_each_fault_is_the_programs_error_and_scores_zero_while_the_others_go_on(setup, tmp_path):
    root, tokenizer, engine, model = setup
    faults = ["none", "raise", "hang", "malformed", "max_requests", "max_tokens", "bad_return"]
    rows = [
        {"marker": f"[f{i}]", "fault": f, "log": str(tmp_path / f"{f}.json")} for i, f in enumerate(faults)
    ]
    batch, width = prompts(rows, tokenizer)
    agents = rollout_of(
        setup, "faults.py", program_timeout_s=3.0, program_max_requests=2, program_max_tokens=4
    )
    out = agents.generate(batch, sampling(tokenizer), width, 0)
    reasons = dict(zip(faults, out["finish_reason"], strict=True))
    rewards = dict(zip(faults, out["agent_reward"], strict=True))
    assert rewards["none"] == 1.0 and reasons["none"] != "program_error"
    for fault in faults[1:]:
        assert reasons[fault] == "program_error" and rewards[fault] == 0.0, fault
    seen = {
        f: json.loads(Path(r["log"]).read_text())
        for f, r in zip(faults, rows, strict=True)
        if Path(r["log"]).exists()
    }
    assert seen["malformed"]["status"] == 400 and "messages.0.role" in seen["malformed"]["message"]
    assert (
        seen["max_requests"]["status"] == 400
        and "agent.program_max_requests" in seen["max_requests"]["message"]
    )
    assert seen["max_tokens"]["status"] == 400 and "agent.program_max_tokens" in seen["max_tokens"]["message"]
    metrics = episode_metrics(
        [1] * len(faults), [0] * len(faults), [0] * len(faults), out["finish_reason"], []
    )
    assert metrics["agent/program/errors"] == len(faults) - 1
    # an ended episode's key is refused with a message the client shows
    client = openai.OpenAI(base_url=agents.program.base_url, api_key="unknown", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="unknown API key"):
        client.chat.completions.create(model="any", messages=[{"role": "user", "content": "x"}])
    agents.close()


def test_a_tool_call_comes_back_as_tool_calls_and_its_echo_continues_the_row(setup):
    """The model's ``<tool_call>`` block becomes OpenAI ``tool_calls``; the program's next request
    (the assistant message as the client echoes it, then the tool's result) continues the row
    with the sampled ids and the template's tokens of the tool turn, not a re-rendering."""
    root, tokenizer, engine, model = setup
    text = 'Let me look. <tool_call>{"name": "lookup", "arguments": {"q": "a b"}}</tool_call>'
    reply, called = assistant_reply(text, parse_hermes)
    assert called and reply["content"] == "Let me look."
    (call,) = reply["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "lookup"
    assert json.loads(call["function"]["arguments"]) == {"q": "a b"}
    assert assistant_reply(text, None) == ({"role": "assistant", "content": text}, False)

    record = EpisodeRecord(TurnEncoder(tokenizer), tokenizer.eos_token_id, row_prompt=20, budget=400)
    first = [{"role": "user", "content": "find a b"}]
    plan = record.plan(
        first, "tools", lambda: literal_template_ids(tokenizer, first, add_generation_prompt=True)
    )
    sampled = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    record.commit(
        plan,
        Completion("r0", plan.context_ids, sampled, [-0.5] * len(sampled), [0] * len(sampled), "stop"),
        reply,
    )
    echoed = {  # what openai's message.model_dump() sends back: arguments as a JSON string, spacing its own
        "role": "assistant", "content": "Let me look.",
        "tool_calls": [{"id": call["id"], "type": "function",
                        "function": {"name": "lookup", "arguments": '{"q":"a b"}'}}],
    }  # fmt: skip
    result = {"role": "tool", "tool_call_id": call["id"], "content": "found"}
    second = record.plan([*first, echoed, result], "tools", lambda: pytest.fail("re-rendered"))
    tool_turn = tokenizer.encode(
        "\n<|im_start|>tool\nfound<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    assert second.appended == tool_turn
    assert second.context_ids == plan.context_ids + tuple(sampled + tool_turn)
    # other tools (or none) render another system prompt: a new segment
    assert record.plan([*first, echoed, result], "other tools", lambda: [1, 2]).appended is None


def docs_program() -> str:
    """The example of docs/agents.md's "Train an agent you already have"."""
    page = (Path(__file__).parents[2] / "docs" / "agents.md").read_text()
    (code,) = re.findall(r"```python\n(# agent\.py.*?)```", page, re.DOTALL)
    return code


def test_the_docs_example_runs_and_its_rewards_are_its_conversations(setup, tmp_path):
    root, tokenizer, engine, model = setup
    (root / "docs_agent.py").write_text(docs_program())
    rows = [{"expression": f"{i}+{i}", "marker": f"{i}+{i}="} for i in range(4)]
    batch, width = prompts(rows, tokenizer)
    batch = batch.assign(
        non_tensors={"raw_prompt": [[{"role": "user", "content": f"{i}+{i}="}] for i in range(4)]}
    )
    out = rollout_of(setup, "docs_agent.py").generate(batch, sampling(tokenizer, 64), width, 0)
    for i, (messages, reward, metrics) in enumerate(
        zip(out["agent_messages"], out["agent_reward"], out["agent_program_metrics"], strict=True)
    ):
        attempts = sum(m["role"] == "assistant" for m in messages)
        assert metrics == {"attempts": attempts} and out["finish_reason"][i] != "program_error"
        solved = messages[-1]["content"].strip() == str(2 * i)
        assert reward == ((1.0 - 0.5 * (attempts - 1)) if solved else 0.0)


@pytest.mark.slow
def test_grpo_trains_the_docs_agent_with_the_rollouts_log_probs(rl_files, tmp_path):
    """Two GRPO steps with ``agent.name=program``: the trainer's log-probs of the sampled tokens
    equal the endpoint's (the reference), and the program's reward is the interaction source's."""
    from tandem.rl.trainer import RLTrainer
    from tests.rl.conftest import small_config

    (tmp_path / "agent.py").write_text(docs_program())
    config = small_config(
        rl_files, tmp_path / "run", "agent.name=program", f"agent.program={tmp_path / 'agent.py'}",
        "reward.sources=[interaction]", "rollout.max_response_length=64", "trainer.val_before_train=false",
    )  # fmt: skip
    history = RLTrainer(config).fit().history
    assert len(history) == 2
    for entry in history:
        assert entry["rollout_corr/max_abs_log_prob_diff"] <= 1e-5
        assert entry["agent/program/errors"] == 0 and entry["agent/turns/mean"] >= 1
        assert entry["agent/program/splits"] == 0  # the docs agent only extends its conversation
        assert entry["agent/turns/mean"] > 1.5  # the random policy rarely answers: most take two attempts


def test_a_wrong_program_setting_is_an_error_naming_its_key(tmp_path):
    (tmp_path / "sync.py").write_text("def run(client, row):\n    return 1.0\n")
    (tmp_path / "one.py").write_text("async def play(client):\n    return 1.0\n")
    cases = {
        "agent.name=program needs agent.program": {"name": "program"},
        "agent.program is set but agent.name='tool_agent'": {
            "name": "tool_agent", "program": str(tmp_path / "one.py:play"), "tools": ("calculator",),
        },
        "'run' must be an async function": {"name": "program", "program": str(tmp_path / "sync.py")},
        "'play' must take two arguments": {"name": "program", "program": str(tmp_path / "one.py:play")},
        "defines no function 'run'": {"name": "program", "program": str(tmp_path / "one.py")},
        "agent.program_timeout_s": {"name": "program", "program": "x.py", "program_timeout_s": 0},
    }  # fmt: skip
    for message, fields in cases.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            AgentConfig(**fields)
