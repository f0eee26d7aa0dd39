"""Episodes/s of an agent program through its OpenAI endpoint vs the same episodes as a tandem
``interaction`` loop: the endpoint's overhead as a ratio (target <= 1.3x).

Both sides run through :class:`~tandem.agents.rollout.AgentRollout` on one native rollout engine
and one tiny model, with the same prompts, seeds and sampling: ``--turns`` model turns per episode,
each answered by the same fixed user reply, ``--episodes`` episodes at once. The program side is a
function program (``async def run(client, row)`` with the real ``openai.AsyncOpenAI`` client over
HTTP); the loop side is the built-in ``interaction`` loop with a reply function. The sides are
timed alternately for ``--rounds`` rounds (after one warm-up round each) and the medians compared.
Since both sample with the same seeds (one per turn, the same stride) from the same contexts, the
two sides' rows must hold the same tokens: the run checks that (and stops if not), so the
work per episode is equal.

A randomly initialised model almost never samples EOS, so every turn would run to the budget:
the model's EOS logit is raised by a constant (one hidden dimension held large in the token
embeddings, read only by EOS's output row) aiming at turns of ``--turn-tokens`` tokens (a rough
aim: 16 gives about 30; the run prints the sampled tokens per episode).

With ``--profile`` one more program round runs under ``cProfile`` on every thread (the episodes'
event loop, the endpoint's server thread, the engine), and the top functions by own time print.

    python bench/agent_program_overhead.py [--episodes 32] [--turns 3] [--rounds 3] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import math
import pstats
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe_machine  # noqa: E402

from tandem.agents.config import AgentConfig  # noqa: E402
from tandem.agents.rollout import AgentRollout  # noqa: E402
from tandem.models import TinyModelConfig, load_model, load_tokenizer, save_tiny_model  # noqa: E402
from tandem.protocol import Batch  # noqa: E402
from tandem.rollout import NativeEngineConfig, NativeRolloutEngine, SamplingParams  # noqa: E402

REPLY = "Not yet. Try once more."
PROGRAM = f"""
async def run(client, row):
    messages = list(row["messages"])
    for turn in range(row["extra_info"]["turns"]):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        choice = reply.choices[0]
        messages.append({{"role": "assistant", "content": choice.message.content}})
        if choice.finish_reason != "stop":
            break
        messages.append({{"role": "user", "content": {REPLY!r}}})
    return 1.0
"""
INTERACTION = f"""
def respond(messages, extra_info):
    done = sum(m["role"] == "assistant" for m in messages) >= extra_info["turns"]
    return {{"content": None if done else {REPLY!r}, "done": done, "reward": 1.0 if done else None}}
"""
MODEL = TinyModelConfig(
    family="qwen2", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
    intermediate_size=384, max_position_embeddings=1024,
)  # fmt: skip


def build_model(root: Path, turn_tokens: int) -> str:
    """The tiny model, its EOS made likely enough that a turn lasts ``turn_tokens`` tokens on average."""
    path = save_tiny_model(root / "model", MODEL)
    model, tokenizer = load_model(str(path)), load_tokenizer(str(path))
    eos, vocab = tokenizer.eos_token_id, model.config.vocab_size
    with torch.no_grad():
        model.get_input_embeddings().weight[:, 0] = 1.0  # held large through the residual stream
        head = model.get_output_embeddings().weight
        head[:, 0] = 0.0
        # after the final RMSNorm that dimension is about sqrt(hidden) (the others are ~0.02), so
        # EOS's logit is about sqrt(hidden) * w: P(EOS) ~ 1 / turn_tokens per token
        head[eos, 0] = math.log((vocab - 1) / (turn_tokens - 1)) / math.sqrt(MODEL.hidden_size)
    model.save_pretrained(str(path))
    return str(path)


def prompt_batch(episodes: int, turns: int, round_seed: int) -> Batch:
    messages = [[{"role": "user", "content": f"Episode {i}: say something."}] for i in range(episodes)]
    return Batch(
        non_tensors={
            "raw_prompt": messages,
            "seed": [round_seed * 10_000 + i for i in range(episodes)],
            "extra_info": [{"turns": turns} for _ in range(episodes)],
        }
    )


def timed(rollout: AgentRollout, batch: Batch, sampling: SamplingParams, width: int) -> tuple[float, Batch]:
    start = time.perf_counter()
    out = rollout.generate(batch, sampling, width, 0)
    return time.perf_counter() - start, out


def profile_every_thread(work) -> str:
    """The top functions by own time of ``work()`` on this thread and on every thread it starts
    (the endpoint's server, the rendering pool), as ``pstats`` prints them."""
    profiles = [cProfile.Profile()]

    def start_in_new_thread(*_):
        profiles.append(profile := cProfile.Profile())
        profile.enable()  # replaces this hook with the profiler's own, for this thread

    threading.setprofile(start_in_new_thread)
    profiles[0].enable()
    try:
        work()
    finally:
        profiles[0].disable()
        threading.setprofile(None)
    text = io.StringIO()
    stats = pstats.Stats(profiles[0], stream=text)
    for profile in profiles[1:]:
        profile.disable()
        stats.add(profile)
    stats.sort_stats("tottime").print_stats(25)
    return text.getvalue()


def client_seconds(repeats: int = 10) -> dict[str, float]:
    """Seconds to build one ``openai.AsyncOpenAI`` client: as the runner builds one per episode (an
    httpx client over the runner's one TLS context), and with openai's default httpx client, which
    loads the CA bundle into a new TLS context each time (what the runner did before)."""
    import ssl

    import openai

    tls = ssl.create_default_context()
    makers = {
        "runner": lambda: openai.AsyncOpenAI(
            base_url="http://127.0.0.1:9/v1", api_key="k", http_client=openai.DefaultAsyncHttpxClient(verify=tls)
        ),
        "default": lambda: openai.AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="k"),
    }
    seconds = {}
    for name, make in makers.items():
        start = time.perf_counter()
        for _ in range(repeats):
            make()
        seconds[name] = (time.perf_counter() - start) / repeats
    return seconds


def rows(out: Batch) -> list[list[int]]:
    return [out["input_ids"][i][out["attention_mask"][i].bool()].tolist() for i in range(len(out))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--turn-tokens", type=int, default=16, help="mean tokens per model turn")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    print(describe_machine())
    root = Path(tempfile.mkdtemp(prefix="tandem-agent-bench-"))
    model = build_model(root, args.turn_tokens)
    (root / "program.py").write_text(PROGRAM)
    (root / "respond.py").write_text(INTERACTION)
    tokenizer = load_tokenizer(model)
    engine = NativeRolloutEngine.from_pretrained(
        model, NativeEngineConfig(max_num_seqs=64, max_model_len=1024)
    )
    budget = args.turns * (8 * args.turn_tokens + 24)  # turns never run out of budget: same on both sides
    sampling = SamplingParams(temperature=1.0, max_tokens=budget, stop_token_ids=(tokenizer.eos_token_id,))
    sides = {
        "program": AgentRollout(AgentConfig(name="program", program=str(root / "program.py")), tokenizer, engine),
        "interaction": AgentRollout(
            AgentConfig(name="interaction", interaction_path=str(root / "respond.py"),
                        interaction_name="respond", max_turns=args.turns),
            tokenizer, engine,
        ),
    }  # fmt: skip
    width = 64
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    tokens = 0
    steps: dict[str, list[int]] = {name: [] for name in sides}
    for round_ in range(args.rounds + 1):  # round 0 warms both sides up, untimed
        batch = prompt_batch(args.episodes, args.turns, round_)
        outs = {}
        for name, rollout in sides.items():
            before = engine.stats.steps
            elapsed, outs[name] = timed(rollout, batch, sampling, width)
            if round_:
                seconds[name].append(elapsed)
                steps[name].append(engine.stats.steps - before)
        if rows(outs["program"]) != rows(outs["interaction"]):
            sys.exit(
                f"round {round_}: the program's rows differ from the interaction loop's: not the same work"
            )
        tokens = int(outs["program"]["response_mask"].sum())
        turns = statistics.fmean(outs["interaction"]["agent_turns"])
    median = {name: statistics.median(values) for name, values in seconds.items()}
    print(
        f"{args.episodes} episodes x {turns:.2f} model turns, {tokens / args.episodes:.1f} sampled tokens "
        f"per episode (identical rows on both sides), {args.rounds} alternating rounds"
    )
    for name, values in seconds.items():
        print(f"  {name:12s} {args.episodes / median[name]:7.1f} episodes/s, "
              f"{statistics.median(steps[name]):.0f} engine steps per round (rounds: "
              + ", ".join(f"{v:.2f} s" for v in values) + ")")  # fmt: skip
    print(f"overhead of the endpoint: {median['program'] / median['interaction']:.2f}x (target <= 1.3x)")
    made = client_seconds()
    print(
        f"one openai.AsyncOpenAI client per episode: {made['runner'] * 1e3:.1f} ms to build as the runner "
        f"does ({made['default'] * 1e3:.0f} ms with openai's default TLS context per client), "
        f"{made['runner'] * args.episodes / median['program']:.1%} of the program side's round"
        " if built one after another"
    )
    if args.profile:  # a fresh program side, so that its server thread starts under the profiler
        fresh = AgentRollout(sides["program"].config, tokenizer, engine)
        sides["profiled"] = fresh
        print(
            profile_every_thread(
                lambda: timed(fresh, prompt_batch(args.episodes, args.turns, 99), sampling, width)
            )
        )
    for rollout in sides.values():
        if rollout.program is not None:
            rollout.program.close()
    engine.close()


if __name__ == "__main__":
    main()
