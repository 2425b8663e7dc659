"""``ModelSpec``: one frozen object with what every worker and engine builds the model from, checked once."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mcore_agentic.models.spec import ModelSpec
from mcore_agentic.parallel.config import ParallelConfig
from mcore_agentic.utils.errors import ConfigError


def test_spec_defaults_and_normalisation():
    spec = ModelSpec(Path("/ckpt"), "bfloat16", routing_shape=[2, 4])
    assert spec.model_path == "/ckpt" and spec.torch_dtype is torch.bfloat16 and spec.routing_shape == (2, 4)
    assert (spec.transformer_impl, spec.make_vocab_size_divisible_by, spec.use_remove_padding) == ("auto", 128, True)
    assert spec.vocab_size is None and spec.temperature == 1.0 and spec.parallel == ParallelConfig()
    with pytest.raises(AttributeError):
        spec.dtype = "float32"  # frozen: every worker sees the same model


@pytest.mark.parametrize("kwargs, field", [({"dtype": "int8"}, "model.dtype"), ({"temperature": 0.0}, "rollout.temperature")])
def test_spec_refuses_bad_values_naming_the_key(kwargs, field):
    with pytest.raises(ConfigError) as info:
        ModelSpec("/ckpt", **kwargs)
    assert info.value.field == field


def test_megatron_model_refuses_a_spec_split_other_than_the_layouts():
    from mcore_agentic.workers.megatron_model import check_layout

    layout = SimpleNamespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
                             virtual_pipeline_model_parallel_size=None, context_parallel_size=1,
                             expert_model_parallel_size=1)
    check_layout(ParallelConfig(tensor_model_parallel_size=2), layout)
    with pytest.raises(ValueError, match="tensor_model_parallel_size=1 but the process groups have 2"):
        check_layout(ParallelConfig(), layout)
    with pytest.raises(ValueError, match="expert_model_parallel_size=2 but the process groups have 1"):
        check_layout(ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2), layout)
