"""One training step (forward, backward, Megatron DDP + distributed optimizer + grad clipping) at TP=2 and at
PP=2 gives the same updated weights as TP=1 (DP=2), within 1e-5 relative, compared as full HF-named tensors.

One spawn of 2 gloo ranks runs the three layouts in turn on the same tiny Qwen2 checkpoint (tied
embeddings: at PP=2 the embedding gradient crosses stages) and the same global batch of 4 sequences:
DP=2 takes 2 micro-batches of 1 per rank, DP=1 takes 4. Megatron divides each micro-batch loss by the
number of micro-batches and DDP averages over DP ranks, so all layouts minimise the same mean loss.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mcore_agentic.parallel.config import ParallelConfig
from tests.helpers.distributed import run_distributed
from tests.unit.megatron_patches._tiny_gpt import pack, unpack
from tests.unit.models._hf_fixtures import VOCAB, make_tiny_hf

LAYOUTS = {
    "tp1": ParallelConfig(),
    "tp2": ParallelConfig(tensor_model_parallel_size=2),
    "pp2": ParallelConfig(pipeline_model_parallel_size=2),
}
SEQ, GLOBAL_BATCH = 16, 4
RTOL = 1e-5


def _global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _one_step(par: ParallelConfig, path: str) -> dict[str, Any]:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mcore_agentic.models.hf_io import load_hf_config
    from mcore_agentic.models.registry import get_bridge
    from mcore_agentic.parallel.layout import destroy_parallel, initialize_parallel

    initialize_parallel(par, seed=1234)
    hf_config = load_hf_config(path)
    bridge = get_bridge(hf_config)
    tcfg = bridge.transformer_config(hf_config, par)
    tcfg.finalize_model_grads_func = finalize_model_grads  # DP grad reduction + tied-embedding sync across stages
    chunks = bridge.build_model(hf_config, tcfg)
    bridge.load_hf_weights(chunks, path)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    model = [DistributedDataParallel(tcfg, ddp_config, c, disable_bucketing=i > 0) for i, c in enumerate(chunks)]
    # Adam's first step is ~lr*sign(grad); a large eps makes it proportional to the gradient so rounding noise in
    # tiny gradients cannot flip whole updates between layouts (same optimizer code path).
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=1e-2, adam_eps=1.0, weight_decay=0.0, clip_grad=1.0,
            use_distributed_optimizer=True, params_dtype=torch.float32,
        ),
        model,
    )

    dp_size, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    tokens, labels = _global_batch()
    rows = GLOBAL_BATCH // dp_size
    mine = range(dp_rank * rows, (dp_rank + 1) * rows)
    micro_batches = iter([(tokens[i : i + 1], labels[i : i + 1]) for i in mine])
    positions = torch.arange(SEQ).unsqueeze(0)

    def forward_step(data_iterator, chunk):
        tok, lab = next(data_iterator)
        output = chunk(tok, positions, None, labels=lab)

        def loss_func(per_token_loss):
            loss = per_token_loss.float().mean()
            return loss, {"loss": loss.detach()}

        return output, loss_func

    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=micro_batches, model=model, num_microbatches=rows,
        seq_length=SEQ, micro_batch_size=1, forward_only=False,
    )
    ok, grad_norm, _ = optimizer.step()
    weights = dict(bridge.export_hf_weights(chunks))
    destroy_parallel()
    return {"ok": ok, "grad_norm": grad_norm, "weights": weights, "losses": [float(x["loss"]) for x in losses]}


def _body(rank: int, world_size: int, path: str) -> bytes:
    import megatron_patches
    from mcore_agentic.models.hf_io import load_hf_state_dict

    megatron_patches.apply()
    out = {name: _one_step(par, path) for name, par in LAYOUTS.items()}
    out["initial"] = load_hf_state_dict(path)
    return pack(out)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict[str, Any]]:
    path = make_tiny_hf("Qwen2ForCausalLM", tmp_path_factory.mktemp("tiny") / "qwen2_tied", tied=True)
    return [unpack(r) for r in run_distributed(_body, 2, args=(str(path),))]


def test_step_taken_with_same_grad_norm(results):
    ref = results[0]["tp1"]["grad_norm"]
    assert ref > 1.0  # clipping (clip_grad=1.0) is active, so the norm's reduction is exercised too
    for res in results:
        for name in LAYOUTS:
            assert res[name]["ok"]
            assert res[name]["grad_norm"] == pytest.approx(ref, rel=RTOL), name


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_updated_weights_match_tp1(results, layout):
    initial, ref = results[0]["initial"], results[0]["tp1"]["weights"]
    for res in results:
        got = res[layout]["weights"]
        assert got.keys() == ref.keys()
        for key, want in ref.items():
            assert not torch.equal(want, initial[key]), f"{key} did not change in the TP=1 step"
            torch.testing.assert_close(got[key], want, rtol=RTOL, atol=RTOL * want.abs().max().item(),
                                       msg=lambda m, k=key: f"{layout} {k}: {m}")
