"""``tandem serve``: its options and the command."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from rich.console import Console

from tandem.cli.choices import ChoicesFrom


def run_serve(args: argparse.Namespace, console: Console) -> None:
    """``tandem serve MODEL_PATH``: an OpenAI-compatible server over a rollout engine."""
    try:
        from tandem.serve import ServerConfig, build_engine, serve
    except ImportError as error:
        raise SystemExit(
            f'tandem serve needs the serve extra: pip install "tandem-rl[serve]" ({error})'
        ) from error
    from tandem.models import load_tokenizer
    from tandem.models.gguf import resolve_model_path
    from tandem.models.vision import ImagePrompter
    from tandem.rollout.factory import check_engine_installed

    check_engine_installed(args.engine, "--engine")
    config = ServerConfig(
        host=args.host,
        port=args.port,
        model_name=args.served_model_name or Path(args.model_path).name or "tandem",
        api_key=args.api_key or os.environ.get("TANDEM_API_KEY") or None,
        allow_unauthenticated=args.allow_unauthenticated,
        request_timeout_s=args.request_timeout,
        stream_send_timeout_s=args.stream_send_timeout,
        max_sequences_per_request=args.max_sequences_per_request,
        max_request_image_pixels=args.max_request_image_pixels,
        max_image_requests=args.max_image_requests,
        special_tokens_in_text=args.special_tokens_in_text,
    )
    options = {"dtype": args.dtype, "max_model_len": args.max_model_len}
    if args.engine == "native":
        options.update(max_num_seqs=args.max_num_seqs, kv_cache_memory_fraction=args.kv_cache_memory_fraction)
    elif args.max_num_seqs is not None:
        options["max_num_seqs"] = args.max_num_seqs
    if args.engine == "vllm":
        options["gpu_memory_utilization"] = args.gpu_memory_utilization
    model_path = resolve_model_path(args.model_path)  # a GGUF file: its converted HF directory
    try:
        engine = build_engine(model_path, args.engine, **options)
    except ValueError as error:  # a size that cannot fit the model or the memory: the reason, no traceback
        raise SystemExit(f"tandem serve: {error}") from error
    plan = getattr(engine, "kv_plan", None)  # the native engine's KV cache, sized at start
    if plan is not None:
        console.print(plan.describe())
    tokenizer = load_tokenizer(model_path)
    prompter = ImagePrompter.for_model(model_path)  # None: a text model (image_url parts refused)
    auth = "bearer token required" if config.api_key else "no auth"
    images = ", image_url data: URLs" if prompter is not None else ""
    console.print(
        f"serving {args.model_path} as {config.model_name!r} ({args.engine} engine, {auth}{images}) "
        f"at http://{config.host}:{config.port}/v1"
    )
    serve(engine, tokenizer, config, prompter=prompter)


def add_serve(commands: argparse._SubParsersAction) -> None:
    """``tandem serve``: the OpenAI-compatible server's options."""
    server = commands.add_parser("serve", help="an OpenAI-compatible HTTP server: tandem serve MODEL_PATH")
    server.add_argument(
        "model_path",
        help="an HF model directory (config, weights, tokenizer) or a .gguf file (converted once)",
    )
    server.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--served-model-name", help="the model id clients send (default: the directory name)")
    server.add_argument(
        "--api-key", help="require 'Authorization: Bearer KEY' on /v1 and /admin (or set TANDEM_API_KEY)"
    )
    server.add_argument(
        "--engine",
        choices=ChoicesFrom("tandem.rollout.engines", "SERVING_ENGINES"),
        metavar="ENGINE",
        default="native",
        help="the rollout engine that generates (%(choices)s)",
    )
    _add_serve_engine(server)
    _add_serve_limits(server)


def _add_serve_engine(server: argparse.ArgumentParser) -> None:
    """``tandem serve``'s engine and memory options."""
    server.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    server.add_argument("--max-model-len", type=int, default=2048, help="longest prompt + response")
    server.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="most requests generating at once (native default: 256, or as many as fit the KV-cache budget)",
    )
    server.add_argument(
        "--kv-cache-memory-fraction",
        type=float,
        default=0.5,
        help="native engine: the share of the available memory its KV cache may take",
    )
    server.add_argument("--gpu-memory-utilization", type=float, default=0.4, help="vllm engine only")


def _add_serve_limits(server: argparse.ArgumentParser) -> None:
    """``tandem serve``'s per-request limits, timeouts and what it trusts in a request."""
    server.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds before a request is aborted"
    )
    server.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="allow a non-loopback --host without --api-key (anyone reaching the port can generate)",
    )
    server.add_argument(
        "--stream-send-timeout",
        type=float,
        default=30.0,
        help="seconds a stream may wait for a client that stopped reading before it is aborted",
    )
    server.add_argument(
        "--max-sequences-per-request",
        type=int,
        default=256,
        help="most sequences (n x prompts) one request may start",
    )
    server.add_argument(
        "--special-tokens-in-text",
        choices=["text", "control"],
        default="text",
        help="a special-token string typed in a message: plain text (default) or the control token (vLLM's default)",
    )
    server.add_argument(
        "--max-request-image-pixels",
        type=int,
        default=2 * 4096 * 4096,
        help="most decoded image pixels (width x height, summed) in one chat request; beyond: 400",
    )
    server.add_argument(
        "--max-image-requests",
        type=int,
        default=2,
        help="most requests decoding images at once; beyond: 429",
    )
