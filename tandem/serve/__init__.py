"""An OpenAI-compatible HTTP server over any rollout engine (``tandem serve MODEL_PATH``).

Needs the ``serve`` extra: ``pip install "tandem-rl[serve]"`` (FastAPI, uvicorn; the ``openai``
client for talking to it).
"""

from tandem.serve.app import create_app
from tandem.serve.config import ServerConfig
from tandem.serve.launch import ServerThread, build_engine, serve

__all__ = ["ServerConfig", "ServerThread", "build_engine", "create_app", "serve"]
