"""Batches of prompt rows with a resumable, seeded order, and the hand-off into a :class:`Batch`.

The order of epoch ``e`` is a permutation drawn from ``numpy.random.default_rng([seed, e])``:
it depends only on the seed, the epoch and the dataset size, so a run resumed
from ``state_dict()`` (epoch + batches already taken) yields exactly the
batches the uninterrupted run would have yielded next. Every rank builds the
same loader and sees the same global batch; splitting over data-parallel ranks
happens later, on the :class:`Batch`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from mcore_agentic.data.config import DataConfig
from mcore_agentic.utils.errors import ConfigError


class ResumableSampler:
    """Index batches over ``num_rows`` rows, epoch after epoch, with a checkpointable position."""

    def __init__(self, num_rows: int, batch_size: int, *, shuffle: bool = True, seed: int = 0, drop_last: bool = True):
        if batch_size <= 0:
            raise ConfigError("data.train_batch_size", f"must be positive, got {batch_size}")
        if num_rows < batch_size and drop_last:
            raise ConfigError(
                "data.train_batch_size",
                f"={batch_size} is larger than the dataset ({num_rows} rows): lower it or add data",
            )
        self.num_rows = num_rows
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0
        """Batches already taken from the current epoch."""

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(self.num_rows, self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_rows)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)

    def __iter__(self) -> Iterator[list[int]]:
        """The remaining batches of the current epoch; when they run out the next epoch begins."""
        order = self.order(self.epoch)
        while self.position < len(self):
            start = self.position * self.batch_size
            batch = order[start : start + self.batch_size].tolist()
            self.position += 1
            yield batch
        self.epoch += 1
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        # After the last batch of an epoch the next batch is the next epoch's first.
        epoch, position = (self.epoch + 1, 0) if self.position >= len(self) else (self.epoch, self.position)
        return {
            "epoch": epoch,
            "position": position,
            "seed": self.seed,
            "num_rows": self.num_rows,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "num_rows", "batch_size", "shuffle"):
            if state[key] != getattr(self, key):
                raise ConfigError(
                    "trainer.resume_mode",
                    f"the checkpoint's data loader had {key}={state[key]}, this run has {getattr(self, key)}: "
                    "resume with the same data and batch size, or set trainer.resume_mode=disable",
                )
        if not 0 <= state["position"] <= len(self):
            raise ValueError(f"sampler position {state['position']} outside 0..{len(self)}")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])


class RLDataLoader:
    """Lists of row dicts from a dataset, in :class:`ResumableSampler` order."""

    def __init__(
        self,
        dataset: Sequence[dict[str, Any]],
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ):
        self.dataset = dataset
        self.sampler = ResumableSampler(len(dataset), batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last)

    def __len__(self) -> int:
        return len(self.sampler)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        for indices in self.sampler:
            yield [self.dataset[i] for i in indices]

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)


def make_train_loader(dataset: Sequence[dict[str, Any]], cfg: DataConfig, seed: int) -> RLDataLoader:
    """The training loader of ``data``: ``train_batch_size`` prompts per step, reshuffled every epoch."""
    return RLDataLoader(dataset, cfg.train_batch_size, shuffle=cfg.shuffle, seed=seed, drop_last=cfg.drop_last)


