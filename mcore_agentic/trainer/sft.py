"""Loss-masked SFT warm start on demonstration conversations (``trainer.sft_warmup_steps``).

A demonstration is tokenized exactly as a rollout of it would be (token-in, token-out
layout of :mod:`mcore_agentic.rollout.tokenization`): the prompt rendered with the tool
schemas and the generation prompt; each assistant turn as the chat template renders it,
up to and including its end-of-turn token (loss mask 1, what the policy would sample);
tool results and user turns as the template delta after it, next generation prompt
included (loss mask 0). So the SFT loss trains exactly the tokens the RL loss trains.

The synthetic task ships its demonstrations (``data.synthetic``); other datasets have
none, and a warm start on them is refused with a clear error.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from mcore_agentic.data.batch import Batch, build_rollout_layout
from mcore_agentic.rollout.tokenization import ChatTokenizer
from mcore_agentic.utils.errors import ConfigError

logger = logging.getLogger(__name__)

Trajectory = tuple[list[int], list[int], list[int]]
"""(prompt ids, response ids, response loss mask)."""


def tokenize_demo(messages: Sequence[dict[str, Any]], chat: ChatTokenizer, tools: list[dict] | None) -> Trajectory:
    """Prompt ids, response ids and loss mask of one demonstration (see the module docstring)."""
    messages = [dict(m) for m in messages]
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), None)
    if first is None:
        raise ValueError("a demonstration needs at least one assistant message")
    tokens = chat.conversation(messages[:first], tools=tools)  # linear in the number of turns
    prompt = tokens.prompt_ids
    ids: list[int] = []
    mask: list[int] = []
    last_text = ""
    i = first
    while i < len(messages):
        if messages[i].get("role") == "assistant":
            last_text = chat.assistant_turn_text(messages[i], tools=tools)
            turn = chat.encode(last_text)
            ids += turn
            mask += [1] * len(turn)
            i += 1
            continue
        end = i
        while end < len(messages) and messages[end].get("role") != "assistant":
            end += 1
        segment = tokens.env_segment(messages[:end], i, sampled_text=last_text, sampled_eot=True)
        ids += segment.ids
        mask += [0] * len(segment.ids)
        i = end
    return prompt, ids, mask


def collate_trajectories(trajs: Sequence[Trajectory], pad_token_id: int) -> Batch:
    """Left-padded prompts, right-padded responses: the rollout's batch layout (see :mod:`data.batch`)."""
    prompts, responses, masks = zip(*trajs)
    return Batch(
        tensors=build_rollout_layout(
            prompts, responses, pad_token_id=pad_token_id, response_fields={"response_mask": (masks, torch.long)}
        )
    )


def demonstrations(cfg: Any) -> list[list[dict[str, Any]]]:
    """The warm-start conversations of the run's data (the synthetic task's ideal conversations)."""
    if not cfg.data.synthetic.enable:
        raise ConfigError(
            "trainer.sft_warmup_steps",
            "a warm start needs demonstrations; only the synthetic task (data.synthetic.enable=true) ships them: "
            "set trainer.sft_warmup_steps=0",
        )
    from mcore_agentic.data.synthetic import sft_conversations

    return sft_conversations(cfg.data.synthetic)


def run_sft_warmup(
    actor: Any,
    conversations: Sequence[Sequence[dict[str, Any]]],
    chat: ChatTokenizer,
    tools: list[dict] | None,
    *,
    steps: int,
    batch_size: int,
    seed: int,
    pad_token_id: int,
    max_length: int,
    log: Any = None,
) -> list[dict[str, float]]:
    """``steps`` optimizer steps of masked cross entropy, ``batch_size`` conversations each (seeded order).

    Conversations longer than ``max_length`` tokens are skipped (they could never be rolled out).
    ``log(metrics, step)`` is called after each step. Returns every step's metrics.
    """
    trajs = [tokenize_demo(c, chat, tools) for c in conversations]
    trajs = [t for t in trajs if len(t[0]) + len(t[1]) <= max_length]
    if len(trajs) < batch_size:
        raise ConfigError("trainer.sft_warmup_steps", f"only {len(trajs)} demonstrations fit data.max_*_length")
    rng = np.random.default_rng([seed, 7])
    order: list[int] = []
    history = []
    for step in range(steps):
        if len(order) < batch_size:
            order += rng.permutation(len(trajs)).tolist()
        idx, order = order[:batch_size], order[batch_size:]
        metrics = actor.sft_step(collate_trajectories([trajs[i] for i in idx], pad_token_id))
        metrics = {f"sft/{k}": v for k, v in metrics.items()}
        history.append(metrics)
        if log is not None:
            log(metrics, step)
    return history
