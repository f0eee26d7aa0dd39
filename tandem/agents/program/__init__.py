"""Agent programs as rollouts (``agent.name=program``): the user's own agent, written against the
``openai`` client, drives each episode through an OpenAI-compatible endpoint served by the run's
rollout engine, and every request it makes is recorded as tokens.

* :mod:`~tandem.agents.program.config`: the program (``agent.program``), its limits, its result.
* :mod:`~tandem.agents.program.recorder`: an episode's requests as token-exact training rows.
* :mod:`~tandem.agents.program.endpoint`: the HTTP endpoint (``/v1/chat/completions``), one
  API key per episode; :mod:`~tandem.agents.program.streaming`: its streamed replies.
* :mod:`~tandem.agents.program.command`: a command-line program (``agent.program_command``) as
  one subprocess per episode: its environment, stdin, result line, output caps and faults;
  in the OS sandbox (``agent.program_sandbox``) through :mod:`~tandem.agents.program.sandboxed`
  (the launch), :mod:`~tandem.agents.program.sandboxed_child` (the sandbox's side) and
  :mod:`~tandem.agents.program.relay` (the host's end of its one route, to the endpoint).
* :mod:`~tandem.agents.program.runner`: starts the endpoint, runs each episode's program under its
  limits, turns the recording into a trajectory.

The endpoint and the runner need the ``serve`` extra (FastAPI, uvicorn, ``openai``); this
package's ``config`` and ``recorder`` do not.
"""
