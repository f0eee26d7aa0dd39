"""A function program's prints are kept per episode (``agent_program_log``), like a command's
output: concurrent episodes that print between their requests each keep exactly their own lines,
capped at ``agent.program_output_bytes``, and writes outside any episode reach the real stream."""

import asyncio
import sys

import pytest

pytest.importorskip("openai")

from tandem.agents.program.captured_output import captured_output  # noqa: E402
from tests.agents.test_program_agent import engine_setup, prompts, rollout_of, sampling  # noqa: E402

PRINTER = """
import sys


async def run(client, row):
    info = row["extra_info"]
    for turn in range(2):
        print(f"{info['marker']} turn {turn}")
        await client.chat.completions.create(model="any", messages=row["messages"], max_tokens=3)
    print(f"{info['marker']} warned", file=sys.stderr)
    print("x" * info.get("flood", 0), end="")
    return 1.0
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    with engine_setup(tmp_path_factory.mktemp("prints"), {"printer.py": PRINTER}) as made:
        yield made


def test_concurrent_episodes_keep_their_own_prints(setup, capfd):
    _, tokenizer, _, _ = setup
    rows = [{"marker": f"<e{i}>"} for i in range(8)]
    batch, width = prompts(rows, tokenizer)
    agents = rollout_of(setup, "printer.py")
    out = agents.generate(batch, sampling(tokenizer, 80), width, 0)  # two segments: both prompts count
    agents.close()
    for i, row in enumerate(rows):
        marker = row["marker"]
        assert out["agent_program_log"][i] == {
            "error": "",
            "stdout": f"{marker} turn 0\n{marker} turn 1\n",
            "stderr": f"{marker} warned\n",
        }
    assert "turn 0" not in capfd.readouterr().out  # none of it reached the run's own output
    assert not hasattr(sys.stdout, "_original")  # the stand-ins are gone once no episode runs


def test_prints_past_the_cap_are_counted_not_kept_and_are_no_fault(setup):
    _, tokenizer, _, _ = setup
    batch, width = prompts([{"marker": "<a>", "flood": 100}], tokenizer)
    agents = rollout_of(setup, "printer.py", program_output_bytes=20)
    out = agents.generate(batch, sampling(tokenizer, 80), width, 0)  # two segments: both prompts count
    agents.close()
    log = out["agent_program_log"][0]
    assert log["error"] == "" and list(out["finish_reason"]) != ["program_error"]
    kept = "<a> turn 0\n<a> turn 1\n"[:20]
    assert log["stdout"] == kept + "\n[... 102 more bytes not kept]"  # 22 + 100 written


def test_writes_outside_an_episode_pass_through_while_another_captures(capsys):
    async def episode(started: asyncio.Event, release: asyncio.Event) -> dict[str, str]:
        with captured_output(64) as printed:
            print("inside")
            started.set()
            await release.wait()
            print("inside again")
        return printed.texts()

    async def main() -> dict[str, str]:
        started, release = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(episode(started, release))
        await started.wait()
        print("outside")  # this task never entered the block: the real stdout
        release.set()
        return await task

    texts = asyncio.run(main())
    assert texts == {"stdout": "inside\ninside again\n", "stderr": ""}
    assert capsys.readouterr().out == "outside\n"
