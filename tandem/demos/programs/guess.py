"""A number-guessing game as an agent program: the model guesses, the program answers "higher" or
"lower" with the numbers still possible, for at most ``max_turns`` guesses; reward 1 if found.

Written against the plain ``openai`` client, as any agent would be: tandem calls ``run`` once per
episode with an ``openai.AsyncOpenAI`` client on the run's endpoint (``agent.program=guess.py``).
Run as a command instead (``python guess.py``: the row as JSON on stdin, ``OPENAI_BASE_URL`` and
``OPENAI_API_KEY`` set), it prints the game to stderr and the result on stdout's last line.
"""

import asyncio
import json
import sys

import openai


def answer(text: str, secret: int, low: int, high: int) -> tuple[str, int, int]:
    """The program's reply to the guess ``text`` while the secret lies in ``low..high``, and the
    range after it (``"found"`` when the guess is the secret)."""
    guess = int(text) if text.isdigit() else None
    if guess == secret:
        return "found", secret, secret
    if guess is None or not low <= guess <= high:
        return f"Guess from {low} to {high}.", low, high
    if guess < secret:
        return f"Higher: {guess + 1}-{high}.", guess + 1, high
    return f"Lower: {low}-{guess - 1}.", low, guess - 1


async def run(client, row, log=None):
    """Play one game: ``row["extra_info"]`` holds ``high`` (the secret lies in 1..high),
    ``secret`` and ``max_turns``; returns the reward and the guesses it took."""
    game = row["extra_info"]
    low, high, secret = 1, game["high"], game["secret"]
    messages = list(row["messages"])
    for turn in range(1, game["max_turns"] + 1):
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
        content = reply.choices[0].message.content or ""
        feedback, low, high = answer(content.strip(), secret, low, high)
        if log is not None:
            print(f"guess {turn}: {content!r} -> {feedback}", file=log)
        if feedback == "found":
            return {"reward": 1.0, "metrics": {"guesses": turn}}
        messages.append({"role": "assistant", "content": content})  # as sent: the row stays token-exact
        messages.append({"role": "user", "content": feedback})
    return {"reward": 0.0, "metrics": {"guesses": game["max_turns"]}}


if __name__ == "__main__":
    result = asyncio.run(run(openai.AsyncOpenAI(max_retries=0), json.load(sys.stdin), log=sys.stderr))
    print(json.dumps(result))
