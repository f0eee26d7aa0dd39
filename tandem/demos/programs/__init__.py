"""Agent programs the demos train: plain ``openai``-client code that tandem loads by file path
(``agent.program=.../guess.py``), never imported as part of tandem."""
