"""``ShardingConfig`` validation: every bad value names ``sharding.<field>``."""

from __future__ import annotations

import pytest

from mcore_agentic.sharding.config import ShardingConfig
from mcore_agentic.utils.errors import ConfigError


def test_defaults_and_bytes():
    cfg = ShardingConfig()
    assert cfg.transport == "tensor" and cfg.check_weight_version
    assert ShardingConfig(bucket_size_mb=0.5).bucket_bytes == 512 * 1024


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(bucket_size_mb=0), "sharding.bucket_size_mb"),
        (dict(bucket_size_mb=-1.0), "sharding.bucket_size_mb"),
        (dict(bucket_size_mb="64"), "sharding.bucket_size_mb"),
        (dict(bucket_size_mb=True), "sharding.bucket_size_mb"),
        (dict(check_weight_version=1), "sharding.check_weight_version"),
        (dict(transport="nccl"), "sharding.transport"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ConfigError) as err:
        ShardingConfig(**kwargs)
    assert err.value.field == field
    assert str(err.value).startswith(field)
