"""The agent-program demo (``tandem demo --method agent_program``): GRPO through a plain
``openai``-client number-guessing program (``tandem/demos/programs/guess.py``) raises held-out
success over the warmed-up model's; and the report shows an agent program's log in its samples.

The references: binary search's bound on the number of guesses (what the teacher's halving must
meet on every game), the held-out success before GRPO (what after must beat), and the text a
program wrote (what the rendered report must show, escaped)."""

import html
import json
import math
import sys

import pytest

pytest.importorskip("openai")

from tandem.agents.config import AgentConfig  # noqa: E402
from tandem.agents.rollout import AgentRollout  # noqa: E402
from tandem.demos.agent_program import (  # noqa: E402
    HIGHS,
    PROGRAM,
    SUCCESS_KEY,
    GuessDemoSettings,
    game_row,
    run_guess_demo,
    teacher_game,
)
from tandem.protocol import Batch  # noqa: E402
from tandem.report import write_report  # noqa: E402
from tandem.report.samples import VAL_SAMPLES_FILE, append_val_samples  # noqa: E402
from tests.agents.test_program_agent import engine_setup, row_tokens, sampling  # noqa: E402
from tests.report.test_hostile_runs import write_run  # noqa: E402


def test_the_teachers_halving_finds_every_number_and_counting_only_the_small_ones():
    for high in HIGHS:
        for secret in range(1, high + 1):
            halving = teacher_game(high, secret, 4, bisect=True)
            guesses = [int(m["content"]) for m in halving if m["role"] == "assistant"]
            assert guesses[-1] == secret and len(guesses) <= math.ceil(math.log2(high + 1)) <= 4
            counting = teacher_game(high, secret, 4, bisect=False)
            found = int(counting[-1]["content"]) == secret
            assert found == (secret <= 4), (high, secret, counting)
            assert all(m["role"] == ("assistant" if i % 2 == 0 else "user") for i, m in enumerate(counting))


def test_the_guessing_program_plays_the_same_games_as_a_function_and_as_a_command(tmp_path):
    """``guess.py`` as ``agent.program`` and as ``agent.program_command`` on the same rows and seeds
    (the reference: each other): the same trained tokens and rewards, and the command's stderr
    is the game as the conversation shows it."""
    rows = [game_row(8, 3, 2, 0), game_row(15, 9, 2, 1)]
    batch = Batch(
        non_tensors={
            "raw_prompt": [r["prompt"] for r in rows],
            "seed": [5, 6],
            "extra_info": [r["extra_info"] for r in rows],
        }
    )
    with engine_setup(tmp_path, {}) as (_, tokenizer, engine, _):
        outs = {}
        for name, config in {
            "function": AgentConfig(name="program", program=str(PROGRAM)),
            "command": AgentConfig(name="program", program_command=(sys.executable, str(PROGRAM))),
        }.items():
            agents = AgentRollout(config, tokenizer, engine)
            outs[name] = agents.generate(batch, sampling(tokenizer, 120), 48, 0)
            agents.program.close()
    function, command = outs["function"], outs["command"]
    for i in range(len(rows)):
        assert row_tokens(function, i) == row_tokens(command, i)
        log = command["agent_program_log"][i]
        assert (
            log["error"] == ""
            and json.loads(log["stdout"].splitlines()[-1])["reward"] == command["agent_reward"][i]
        )
        replies = [m["content"] for m in command["agent_messages"][i] if m["role"] == "user"][1:]
        assert [line.split(" -> ")[1] for line in log["stderr"].splitlines()][: len(replies)] == replies
    assert list(function["agent_reward"]) == list(command["agent_reward"])


def test_a_bad_demo_setting_names_its_field():
    with pytest.raises(ValueError, match="GuessDemoSettings.bisect_rate"):
        GuessDemoSettings(bisect_rate=1.5)
    with pytest.raises(ValueError, match="GuessDemoSettings.val_prompts=60 must be at most 46"):
        GuessDemoSettings(val_prompts=60)


def test_the_report_shows_an_agent_programs_log_under_its_sample(tmp_path):
    run = write_run(tmp_path / "run", "program", ("guess",))
    log = {
        "error": "exited with status 3",
        "stdout": "<b>guess 1</b>: 8 -> Higher",
        "stderr": "Traceback: boom",
    }
    append_val_samples(
        run, 1,
        [
            {"prompt": "p1", "response": "8", "score": 0.0, "ground_truth": "9", "program_log": log},
            {"prompt": "p2", "response": "4", "score": 1.0, "ground_truth": "4",
             "program_log": {"error": "", "stdout": "", "stderr": ""}},
            {"prompt": "p3", "response": "2", "score": 1.0, "ground_truth": "2"},  # no program
        ],
    )  # fmt: skip
    page = write_report([run], tmp_path / "report.html").read_text()
    section = page[page.index("<h3>Validation samples</h3>") : page.index("Resolved config")]
    for name, text in log.items():  # each part shown, escaped, once, under the first sample only
        assert section.count(f"agent program {name}:<pre>{html.escape(text)}</pre>") == 1
    assert "<b>guess" not in section and section.count("class='program-log'") == 3


@pytest.mark.slow  # SFT and 2 GRPO steps: minutes on 2 CPU cores (no shrunk run learns in seconds here)
def test_grpo_through_the_guessing_program_raises_held_out_success(tmp_path):
    """The demo's warm-up, then 2 of its GRPO steps (measured: 46.9% -> 90.6% held-out)."""
    result = run_guess_demo(GuessDemoSettings(output_dir=str(tmp_path), rl_steps=2))
    curve = [r[SUCCESS_KEY] for r in result.history if SUCCESS_KEY in r]
    assert curve[0] < 0.6 and curve[-1] >= curve[0] + 0.25, curve
    for r in result.history:
        if r["step"] > 0:
            assert r["agent/program/errors"] == 0 and r["agent/program/splits"] == 0
            assert r["rollout_corr/max_abs_log_prob_diff"] <= 1e-4
    samples = (result.output_dir / VAL_SAMPLES_FILE).read_text().splitlines()
    # the report's samples carry each program's log (a function program's: no fault, no output)
    assert samples and all(
        json.loads(line)["program_log"] == {"error": "", "stdout": "", "stderr": ""} for line in samples
    )
