"""Batch rollout: expand prompts ``n`` times, run every request concurrently, collate into a ``Batch``.

Input rows look like the parquet dataset's rows::

    {"prompt": [{"role": ..., "content": ...}, ...], "data_source": str,
     "reward_model": {"ground_truth": str},
     "extra_info": {"tools_kwargs": {...}, "interaction_kwargs": {...}}}

Output (see :mod:`mcore_agentic.data.batch` for the key conventions): ``prompts``
[B, P] left-padded, ``responses``/``response_mask``/``rollout_log_probs`` [B, R]
right-padded, ``input_ids``/``attention_mask``/``position_ids`` [B, P+R], with
``B = len(rows) * n``, ``P <= rollout.prompt_length``, ``R <= rollout.response_length``;
per-sample meta ``messages`` (the final conversation), ``uid`` (shared by a prompt's ``n`` samples),
``data_source``, ``ground_truth`` (``reward_model.ground_truth``), ``tool_rewards`` (float: every
tool's step rewards plus its ``calc_reward``), ``interaction_scores`` (list of turn scores), ``source_reward``
(an agent program's reward, or None), per assistant turn ``turn_ends`` (the response index of its last sampled
token, -1: none), ``turn_tool_rewards``, ``turn_interaction_scores`` and ``turn_source_rewards`` (what algorithm.turn_rewards places there),
``episode_id``, ``episode_sample``, ``episode_samples`` and ``turn_offset`` (the episode a row is a sample of — an
agent episode that forked trains several — and the episode's turn index of its first turn), ``extra_info`` (the dataset row's), ``num_turns`` (assistant + interaction turns), ``finish_reason`` (stop | length | tool_calls |
aborted), ``request_metrics`` (dict: counters, timings, state, error, error_type, error_traceback,
per-tool rewards), ``tool_log`` (per call: turn, name, arguments, result, error, seconds, error_type,
traceback; see :attr:`RolloutRequest.tool_log`; :func:`~mcore_agentic.rollout.failures.summarize_failures`
reads both). An engine that records routed experts adds ``routed_experts`` [B, P+R, moe_layers, top_k] (int16, -1 on padding and tokens it never fed).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mcore_agentic.data.batch import Batch, build_rollout_layout, build_token_field
from mcore_agentic.rollout.agent_loop import AgentContext, run_request
from mcore_agentic.rollout.config import RolloutConfig
from mcore_agentic.rollout.engines.base import RolloutEngine, SamplingParams, engine_event_loop
from mcore_agentic.rollout.loop_monitor import LoopStallMonitor
from mcore_agentic.rollout.request import FinishReason, RequestState, RolloutRequest, Trajectory
from mcore_agentic.rollout.tokenization import ChatTokenizer
from mcore_agentic.rollout.tokenization_diff import mismatch_summary
from mcore_agentic.rollout.tool_parser import get_tool_parser
from mcore_agentic.utils.errors import ConfigError

logger = logging.getLogger(__name__)


def build_requests(rows: Sequence[Mapping[str, Any]], cfg: RolloutConfig) -> list[RolloutRequest]:
    """``cfg.n`` requests per row, sharing a fresh ``uid`` per row (GRPO groups)."""
    requests = []
    for i, row in enumerate(rows):
        messages = row.get("prompt")
        if messages is None or isinstance(messages, str | bytes) or not all(
            isinstance(m, Mapping) and "role" in m for m in messages
        ):
            raise ConfigError(f"prompts[{i}].prompt", "must be a list of chat messages {role, content}")
        extra = dict(row.get("extra_info") or {})
        reward_model = row.get("reward_model") or {}
        uid = uuid.uuid4().hex
        for j in range(cfg.n):
            index = i * cfg.n + j
            requests.append(
                RolloutRequest(
                    request_id=f"{uid}-{j}",
                    uid=uid,
                    messages=[dict(m) for m in copy.deepcopy(list(messages))],
                    data_source=str(row.get("data_source", "")),
                    ground_truth=reward_model.get("ground_truth") if isinstance(reward_model, Mapping) else None,
                    tools_kwargs=dict(extra.get("tools_kwargs") or {}),
                    interaction_kwargs=dict(extra.get("interaction_kwargs") or {}),
                    extra_info=extra,
                    seed=None if cfg.seed is None else cfg.seed + index,
                )
            )
    return requests


async def generate_sequences(
    rows: Sequence[Mapping[str, Any]],
    engine: RolloutEngine,
    tools: Mapping[str, Any] | None,
    interactions: Mapping[str, Any] | None,
    cfg: RolloutConfig,
    tokenizer: Any,
    executor: Any = None,
) -> Batch:
    """Roll out every row ``cfg.n`` times, all requests concurrently; return the collated batch.

    ``tokenizer``: a HF tokenizer with a chat template, or a :class:`ChatTokenizer`.
    ``executor``: the tools' executor (``make_executor(cfg.multi_turn.tool_executor, max_workers=cfg.multi_turn.tool_executor_workers)``); bound to
    every tool that accepts one. Rendering, tokenizing and the sanity check run on
    ``rollout.multi_turn.tokenizer_threads`` threads (0: on the event loop).
    """
    requests = build_requests(rows, cfg)
    ctx = rollout_context(engine, tools, interactions, cfg, tokenizer, executor)
    try:
        async with LoopStallMonitor() as monitor:
            await asyncio.gather(*(run_request(r, ctx) for r in requests))
    finally:
        close_context(ctx)
    batch = finish_batch(requests, cfg, ctx.chat)
    batch.info["rollout/event_loop_max_stall_s"] = monitor.max_stall_s
    return batch


def rollout_context(
    engine: RolloutEngine,
    tools: Mapping[str, Any] | None,
    interactions: Mapping[str, Any] | None,
    cfg: RolloutConfig,
    tokenizer: Any,
    executor: Any = None,
    **extra: Any,
) -> AgentContext:
    """What one rollout's requests share: the engine, tokenizer, parser, tools (bound to ``executor``) and
    a CPU pool of ``rollout.multi_turn.tokenizer_threads`` threads (:func:`close_context` shuts it down).
    ``extra``: further :class:`AgentContext` fields (the weight version, a turn budget)."""
    chat = tokenizer if isinstance(tokenizer, ChatTokenizer) else ChatTokenizer(tokenizer)
    tools = dict(tools or {})
    if executor is not None:
        for tool in tools.values():
            if hasattr(tool, "bind_executor"):
                tool.bind_executor(executor)
    threads = cfg.multi_turn.tokenizer_threads
    pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="rollout-cpu") if threads else None
    return AgentContext(
        engine=engine, chat=chat, cfg=cfg, parser=get_tool_parser(cfg.multi_turn.format), tools=tools,
        interactions=dict(interactions or {}), cpu_pool=pool, **extra,
    )


def close_context(ctx: AgentContext) -> None:
    if ctx.cpu_pool is not None:
        ctx.cpu_pool.shutdown(wait=False, cancel_futures=True)


def finish_batch(requests: Sequence[RolloutRequest], cfg: RolloutConfig, chat: ChatTokenizer) -> Batch:
    """Ended requests -> their batch. Sanity-check mismatches travel in each row's ``request_metrics``
    (``sanity_check_diffs``, the first few); the trainer says them once per step (:func:`mismatch_line`)."""
    return collate(requests, cfg, pad_token_id=_pad_id(chat.tokenizer))


def mismatch_line(meta: Mapping[str, Sequence[Any]]) -> str | None:
    """One line for the sanity-check mismatches of a step's rows (the collated ``meta`` of one or more batches):
    how many trajectories differ from a full render, and the first one's first diffs (token ids where the texts are
    equal); None when none differs."""
    rms = [m or {} for m in meta.get("request_metrics", [])]
    mismatched = [m for m in rms if m.get("sanity_check_mismatch")]
    if not mismatched:
        return None
    first = mismatched[0]
    return mismatch_summary(str(first.get("request_id")), first.get("sanity_check_diffs") or [], len(mismatched), len(rms))


def _pad_id(tokenizer: Any) -> int:
    pad = tokenizer.pad_token_id
    return int(pad if pad is not None else tokenizer.eos_token_id)


def trajectory_tensors(trajs: Sequence[Trajectory], *, pad_token_id: int) -> dict[str, torch.Tensor]:
    """The rollout layout of trajectories: ids, ``response_mask``, ``rollout_log_probs`` and, when the engine
    recorded them, ``routed_experts``."""
    tensors = build_rollout_layout(
        [t.prompt_ids for t in trajs],
        [t.response_ids for t in trajs],
        pad_token_id=pad_token_id,
        response_fields={
            "response_mask": ([t.response_mask for t in trajs], torch.long),
            "rollout_log_probs": ([t.response_log_probs for t in trajs], torch.float32),
        },
    )
    if any(t.routed_experts is not None for t in trajs):
        tensors["routed_experts"] = build_token_field(
            [t.routed_experts for t in trajs], [t.prompt_len for t in trajs],
            prompt_width=tensors["prompts"].shape[1], response_width=tensors["responses"].shape[1],
        )
    return tensors


async def sample_rows(engine: RolloutEngine, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> Batch:
    """One single-turn completion of each prompt (seed: its index), all concurrently, as rollout rows
    (:func:`trajectory_tensors`, pad id 0; with ``routed_experts`` when the engine records routing): the engine's
    samples without the agent loop, for benches and tests."""
    outs = await asyncio.gather(*[engine.generate(list(p), SamplingParams(max_new_tokens=max_new_tokens, seed=i))
                                  for i, p in enumerate(prompts)])
    trajs = []
    for prompt, out in zip(prompts, outs):
        t = Trajectory()
        t.set_prompt(list(prompt))
        t.append(out.token_ids, sampled=True, log_probs=out.log_probs)
        if out.routed_experts is not None:
            t.record_routing(out.routed_experts)
        trajs.append(t)
    return Batch(tensors=trajectory_tensors(trajs, pad_token_id=0))


def collate(requests: Sequence[RolloutRequest], cfg: RolloutConfig, *, pad_token_id: int) -> Batch:
    """Finished requests -> padded tensors and meta lists (layout in the module docstring)."""
    if not requests:
        raise ValueError("no requests to collate")
    for r in requests:
        if not r.done:
            raise ValueError(f"request {r.request_id} is still {r.state.value}")
        if r.trajectory.prompt_len > cfg.prompt_length or r.trajectory.response_len > cfg.response_length:
            raise ValueError(f"request {r.request_id} exceeds the length limits; the loop should have cut it")
    trajs = [r.trajectory for r in requests]
    tensors = trajectory_tensors(trajs, pad_token_id=pad_token_id)
    # The oldest weight version that sampled a row's tokens (partial rollouts resume across versions; -1: none).
    oldest = [min((v for v in set(t.response_versions) if v >= 0), default=-1) for t in trajs]
    meta = {
        "messages": [r.messages for r in requests],
        "uid": [r.uid for r in requests],
        "data_source": [r.data_source for r in requests],
        "ground_truth": [r.ground_truth for r in requests],
        "tool_rewards": [r.total_tool_reward for r in requests],
        "interaction_scores": [list(r.interaction_scores) for r in requests],
        "turn_ends": [list(r.turn_ends) for r in requests],
        "turn_tool_rewards": [list(r.turn_tool_rewards) for r in requests],
        "turn_interaction_scores": [list(r.turn_interaction_scores) for r in requests],
        "turn_source_rewards": [list(r.turn_source_rewards) for r in requests],
        "source_reward": [r.source_reward for r in requests],
        "episode_id": [r.episode_id or r.request_id for r in requests],
        "episode_sample": [r.episode_sample for r in requests],
        "episode_samples": [r.episode_samples for r in requests],
        "turn_offset": [r.turn_offset for r in requests],
        "extra_info": [r.extra_info for r in requests],
        "num_turns": [r.metrics.assistant_turns + r.metrics.user_turns for r in requests],
        "finish_reason": [r.finish_reason.value if r.finish_reason else "aborted" for r in requests],
        "request_metrics": [_request_metrics(r) for r in requests],
        "tool_log": [list(r.tool_log) for r in requests],
        "oldest_version": oldest,
    }
    failed = sum(r.state is RequestState.FAILED for r in requests)
    aborted = sum(r.state is RequestState.COMPLETED and r.finish_reason is FinishReason.ABORTED for r in requests)
    return Batch(
        tensors=tensors,
        meta=meta,
        info={
            "rollout/failed_requests": failed,
            "rollout/aborted_requests": aborted,
            "rollout/sanity_check_mismatches": sum(r.metrics.sanity_check_mismatch for r in requests),
            "rollout/template_drift_turns": sum(r.metrics.template_drift for r in requests),
            "rollout/tokenization_full_context_turns": sum(r.metrics.tokenization_full_context for r in requests),
            "rollout/mean_assistant_turns": sum(r.metrics.assistant_turns for r in requests) / len(requests),
            "rollout/tool_calls": sum(r.metrics.tool_calls for r in requests),
            "rollout/tool_errors": sum(r.metrics.tool_errors for r in requests),
        },
    )


def _request_metrics(r: RolloutRequest) -> dict[str, Any]:
    out: dict[str, Any] = r.metrics.as_dict()
    out.update(
        request_id=r.request_id,
        state=r.state.value,
        error=r.error,
        error_type=r.error_type,
        error_traceback=r.error_traceback,
        sanity_check_diffs=list(r.sanity_check_diffs[:3]),
        tool_rewards_by_tool=dict(r.tool_rewards),
        interaction_final_score=r.interaction_final_score,
    )
    return out


def generate_sequences_sync(
    rows: Sequence[Mapping[str, Any]],
    engine: RolloutEngine,
    tools: Mapping[str, Any] | None,
    interactions: Mapping[str, Any] | None,
    cfg: RolloutConfig,
    tokenizer: Any,
    executor: Any = None,
) -> Batch:
    """:func:`generate_sequences` from synchronous code.

    An engine bound to one event loop (``engine.event_loop``: SGLang, whose request handler
    lives on the loop of its first request) gets every rollout run on that loop: a fresh loop
    per rollout would leave the second rollout waiting forever. Other engines run on a fresh
    loop; inside an already running loop (Ray actors, notebooks), where ``asyncio.run`` is not
    allowed, on a fresh loop in a helper thread.
    """
    return run_sync(generate_sequences(rows, engine, tools, interactions, cfg, tokenizer, executor), engine)


def run_sync(coro: Any, engine: Any = None) -> Any:
    """Run a rollout coroutine from synchronous code, on ``engine.event_loop`` when the engine has one
    (see :func:`generate_sequences_sync`)."""
    loop = engine_event_loop(engine)
    if loop is not None:
        return loop.run_until_complete(coro)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()
