"""A tandem plugin: an agent loop that lets the model revise its first answer once.

    tandem train --plugin examples/plugins/agent_loop.py agent.name=revise_once ...

A loop is ``async (ctx, sample) -> Trajectory``: ``model_turn`` samples one model turn into the
trajectory (its tokens trained on), ``append_turns`` adds other turns as chat-template tokens
(masked out of the loss); the episode's whole response shares ``rollout.max_response_length``.
"""

from tandem.agents.loops import AGENT_LOOPS, AgentContext, AgentSample, append_turns, model_turn
from tandem.agents.trajectory import Trajectory

REVISE = "Check your answer. Reply with the final answer only."


@AGENT_LOOPS.register("revise_once")
async def revise_once(ctx: AgentContext, sample: AgentSample) -> Trajectory:
    """A model turn, a user turn asking to check it, and the model's final turn."""
    trajectory = Trajectory(ctx.prompt_ids(sample.messages, sample.images), messages=list(sample.messages))
    first = await model_turn(ctx, sample, trajectory)
    if first is None or trajectory.finish_reason != "stop":  # out of budget, or cut off
        return trajectory
    if append_turns(ctx, trajectory, [{"role": "user", "content": REVISE}]):
        await model_turn(ctx, sample, trajectory)
    return trajectory
