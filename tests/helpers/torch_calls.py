"""Reading torch calls in the tests' ``TorchFunctionMode`` guards and counters."""

from __future__ import annotations

import torch


def target_device(args: tuple, kwargs: dict) -> torch.device | None:
    """The device a ``Tensor.to``/``.cuda`` call moves to: the first tensor's, device or device name among its
    arguments or its ``device=`` keyword; None when it names none (a dtype-only ``.to``)."""
    for a in (*args, kwargs.get("device")):
        if isinstance(a, torch.Tensor):
            return a.device
        if isinstance(a, (str, torch.device)):
            return torch.device(a)
    return None
