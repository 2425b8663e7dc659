"""Standalone mode: serve a model directory's sessions to develop an agent program before training.

``python -m mcore_agentic.endpoint serve --model DIR`` loads an HF-format model (a ``launch/export_hf.py``
export, say) and its tokenizer into an engine and serves the session endpoint. It prints an admin token once;
``POST /sessions`` with it (``Authorization: Bearer <admin token>``) opens a session and returns its id, its
own API key and its base URLs. The session's routes are the training endpoint's (``endpoint/server.py``),
``GET /sessions/{id}/samples`` included: the exact ids, text pieces, loss mask, log-probs and fork reasons the
trainer would train on. Here the client's sampling settings (temperature, top_p) are honoured.

The engine (``--engine``, default ``auto``): vLLM where it is installed for this device and takes the model (on CPU,
vLLM's CPU build: its attention needs a head size it has kernels for), with its prefix cache, so a harness that
re-sends a long system prompt and tool list every turn prefills only what each turn adds; else transformers
(``hf``), which reuses the KV caches of a few finished requests. The line that prints the URL names the engine
and, for ``auto``, why; the prefix cache's hit rate is logged every ``--stats-every`` seconds while it changes.
"""

from __future__ import annotations

import argparse
import logging
import secrets
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from mcore_agentic.endpoint.samples import SessionSettings
from mcore_agentic.endpoint.server import EndpointServer, Limits, SessionRegistry, build_app, request_token
from mcore_agentic.endpoint.session import Session
from mcore_agentic.endpoint.turn import ApiError
from mcore_agentic.rollout.engines.base import engine_event_loop, engine_shutdown
from mcore_agentic.rollout.engines.registry import ENGINE_NAMES
from mcore_agentic.rollout.tokenization import ChatTokenizer
from mcore_agentic.rollout.tool_parser import get_tool_parser

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Model:
    model_path: str
    dtype: str
    routing_shape: tuple[int, int] | None = None


def default_lengths(context: int | None, prompt: int | None, response: int | None) -> tuple[int, int]:
    """``(prompt length, response length)``: as given, else sized from the model's context (``context``, its
    ``max_position_embeddings``; 32768 when unknown): a response of 8192 tokens (at most half the context) and the
    rest for the prompt, so a harness's long first prompt fits whatever the model."""
    context = context or 32768
    response = response if response is not None else min(8192, context // 2)
    prompt = prompt if prompt is not None else max(context - response, 1)
    return prompt, response


def session_admin(registry: SessionRegistry, factory: Any, admin_token: str, max_sessions: int) -> Any:
    """The standalone server's ``POST /sessions`` (admin token only) and ``DELETE /sessions/{id}`` (its own token)."""

    def install(app: Any) -> None:
        def refuse(exc: ApiError) -> JSONResponse:
            headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
            return JSONResponse({"error": {"message": exc.message, "type": exc.type, "param": exc.param,
                                           "code": exc.code}}, status_code=exc.status, headers=headers)

        @app.post("/sessions")
        async def open_session(request: Request) -> Any:
            token = request_token(request.headers)
            if token is None or not secrets.compare_digest(token.encode(), admin_token.encode()):
                return refuse(ApiError(401, "invalid admin token", type="authentication_error"))
            if len(registry) >= max_sessions:
                return refuse(ApiError(429, f"{max_sessions} sessions are open, the limit: delete one",
                                       type="rate_limit_error"))
            session: Session = factory()
            registry.add(session)
            base = f"{request.base_url}sessions/{session.id}"
            return {"session_id": session.id, "api_key": session.token, "base_url": f"{base}/v1",
                    "anthropic_base_url": base}

        @app.delete("/sessions/{session_id}")
        async def close_session(session_id: str, request: Request) -> Any:
            try:
                registry.authorised(session_id, request_token(request.headers))
            except ApiError as exc:
                return refuse(exc)
            session = registry.remove(session_id)
            if session is not None:
                session.close()  # aborts what it still generates
            return {"session_id": session_id, "deleted": True}

    return install


def choose_engine(requested: str, model_path: str, device: str) -> tuple[str, str]:
    """The engine ``--engine requested`` means for this model and device, and why (``auto`` only): vLLM where it is
    installed for the device's kind and takes the model, else transformers."""
    if requested != "auto":
        return requested, ""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "hf", "vLLM is not installed"
    try:
        from vllm.platforms import current_platform
    except Exception as exc:  # noqa: BLE001 -- a broken vLLM install: serve with transformers
        return "hf", f"vLLM does not import ({type(exc).__name__}: {exc})"
    kind = "cpu" if device == "cpu" else device.split(":")[0]
    if (kind == "cpu") != bool(current_platform.is_cpu()):
        return "hf", f"the installed vLLM is not built for {kind}"
    if kind == "cpu":
        import json
        from pathlib import Path

        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        config = json.loads((Path(model_path) / "config.json").read_text())
        config = config.get("text_config", config)
        head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
        if head_dim not in CPUAttentionBackend.get_supported_head_sizes():
            return "hf", f"vLLM's CPU attention has no kernel for this model's head_dim {head_dim}"
    return "vllm", "vLLM's CPU build is installed" if kind == "cpu" else "vLLM is installed"


def _log_prefix_cache(engine: Any, every_s: float, stop: threading.Event) -> None:
    """Log the engine's prefix-cache counts every ``every_s`` seconds when they changed."""
    from mcore_agentic.rollout.engines.base import prefix_cache_stats

    last = prefix_cache_stats(engine)
    while last is not None and not stop.wait(every_s):
        now = prefix_cache_stats(engine)
        if now is not None and now != last:
            step = now - last
            logger.info("prefix cache: %d of %d prompt tokens served from the cache (%.1f%%; %.1f%% since start)",
                        step.cached_tokens, step.prompt_tokens, 100 * step.hit_rate, 100 * now.hit_rate)
            last = now


def serve(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mcore_agentic.endpoint serve", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="an HF-format model directory (config, weights, tokenizer)")
    parser.add_argument("--engine", default="auto", choices=("auto", *ENGINE_NAMES),
                        help="auto: vLLM where installed for the device and able to take the model, else hf")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--host", default="127.0.0.1", help="loopback by default; anything else serves the network")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--tool-format", default="hermes", help="the model's tool-call format (rollout.multi_turn.format)")
    parser.add_argument("--prompt-length", type=int, default=None,
                        help="longest first prompt of a sample; default: the model's context less the response "
                             "length (coding harnesses send 10-40k tokens of system prompt and tools)")
    parser.add_argument("--response-length", type=int, default=None,
                        help="a sample's token budget after its prompt; default: 8192, at most half the context")
    parser.add_argument("--max-sessions", type=int, default=256)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--kv-cache-mb", type=int, default=None,
                        help="vLLM on CPU: MiB of KV cache (default: room for 8 sequences of the longest sample)")
    parser.add_argument("--stats-every", type=float, default=60.0, help="seconds between prefix-cache log lines")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from transformers import AutoConfig, AutoTokenizer

    from mcore_agentic.rollout.config import RolloutConfig
    from mcore_agentic.rollout.engines import build_engine

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model_config = AutoConfig.from_pretrained(args.model)
    args.prompt_length, args.response_length = default_lengths(
        getattr(model_config, "max_position_embeddings", None), args.prompt_length, args.response_length)
    vocab = getattr(model_config, "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        parser.exit(2, f"error: --model: the tokenizer has {len(tokenizer)} tokens but the model's vocabulary "
                       f"{vocab}: its special tokens would index past the embedding; export the model with its own "
                       "tokenizer\n")
    name, why = choose_engine(args.engine, args.model, args.device)
    kv_mb = args.kv_cache_mb
    if name == "vllm" and kv_mb is None and args.device == "cpu":  # not rollout's 64 sequences: a developer's few
        from mcore_agentic.rollout.engines.vllm_args import default_kv_cache_bytes

        kv_mb = -(-default_kv_cache_bytes(args.model, max_model_len=args.prompt_length + args.response_length,
                                          dtype=args.dtype, sequences=8) // 2**20)
    cfg = RolloutConfig(name=name, prompt_length=args.prompt_length, response_length=args.response_length,
                        kv_cache_memory_mb=kv_mb)
    engine = build_engine(cfg, _Model(args.model, args.dtype), device=args.device, seed=args.seed)
    bound = engine_event_loop(engine)  # SGLang: its loop must run for the sessions' calls (engine_call)
    if bound is not None and not bound.is_running():
        threading.Thread(target=bound.run_forever, name="engine-loop", daemon=True).start()
    chat = ChatTokenizer(tokenizer)
    settings = SessionSettings(prompt_length=cfg.prompt_length, response_length=cfg.response_length,
                               max_model_len=cfg.effective_max_model_len, honor_client_sampling=True)
    tool_parser = get_tool_parser(args.tool_format)
    registry = SessionRegistry()
    admin_token = secrets.token_urlsafe(32)

    def new_session() -> Session:
        return Session(uuid.uuid4().hex, engine=engine, chat=chat, parser=tool_parser, settings=settings,
                       seed=args.seed)

    app = build_app(registry, Limits(), admin=session_admin(registry, new_session, admin_token, args.max_sessions))
    server = EndpointServer(app, host=args.host, port=args.port)
    stop_stats = threading.Event()
    threading.Thread(target=_log_prefix_cache, args=(engine, args.stats_every, stop_stats), name="prefix-cache-stats",
                     daemon=True).start()
    print(f"serving {args.model} with {name}{f' ({why})' if why else ''} on {server.url}\nadmin token: {admin_token}\n"
          f"open a session: curl -X POST -H 'Authorization: Bearer {admin_token}' {server.url}/sessions", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        stop_stats.set()
        server.close()
        engine_shutdown(engine)  # its scheduler thread ends before the interpreter does
