"""Which turns of a prompt group act from the same state (``adv_estimator=gigpo``'s step groups), on a rollout leader.

A turn is a maximal run of sampled tokens in a row's loss mask (:func:`mcore_agentic.algorithms.turn_advantages.turn_spans`).
Its state is read from the tokens in front of it: ``observation`` — the environment's tokens since the previous turn
(the tool results or user reply, with the chat template's tokens around them), or the prompt for the first turn:
GiGPO's anchor states — or ``history``, everything before it (prompt and response up to the turn: the policy's
exact input). Turns of one prompt group (``uid``) with equal state tokens get one id, numbered from 0 in order of
appearance; every prompt group of the leader holds all its rows, so no id crosses ranks.
"""

from __future__ import annotations

import hashlib

import torch

from mcore_agentic.data.batch import Batch


def turn_state_tensor(batch: Batch, state: str) -> torch.Tensor:
    """``[B, R]`` long: on every sampled token of a turn, 1 + its state's id within the row's prompt group; 0 elsewhere
    (failed rows sample nothing). ``state``: ``observation`` or ``history`` (module docstring)."""
    if state not in ("observation", "history"):
        raise ValueError(f"state must be observation or history, got {state!r}")
    prompt_width = batch["prompts"].shape[1]
    mask = batch["response_mask"].bool()
    out = torch.zeros(mask.shape, dtype=torch.long)
    ids: dict[object, dict[bytes, int]] = {}
    for i in range(len(batch)):
        prompt = batch["prompts"][i][batch["attention_mask"][i, :prompt_width].bool()]
        response = batch["responses"][i]
        known = ids.setdefault(batch["uid"][i], {})
        previous_end = 0
        for start, end in _runs(mask[i]):
            first = previous_end == 0  # a run ends past its start, so 0 means no turn came before
            before = torch.cat([prompt, response[:start]]) if state == "history" or first else response[previous_end:start]
            key = hashlib.blake2b(before.to(torch.int64).numpy().tobytes(), digest_size=16).digest()
            out[i, start:end] = known.setdefault(key, len(known)) + 1
            previous_end = end
    return out


def _runs(row_mask: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, end)`` (end exclusive) of each maximal run of True."""
    padded = torch.nn.functional.pad(row_mask.to(torch.int8), (1, 1))
    edges = (padded[1:] - padded[:-1]).nonzero().flatten().tolist()
    return list(zip(edges[0::2], edges[1::2]))
