"""Masked statistics over token tensors: mean, variance, whitening.

``mask`` is 1 on tokens that count (the policy's own sampled tokens) and 0
elsewhere; masked positions never influence a result, whatever they hold
(values there are zeroed with ``torch.where``, so even NaN/inf is ignored).
"""

from __future__ import annotations

import torch

__all__ = ["masked_mean", "masked_sum", "masked_var", "masked_whiten"]


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # where(), not multiplication: 0 * inf would be NaN.
    return torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is 1 (over everything, or along ``dim``)."""
    masked = _masked(values, mask)
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is 1.

    An all-masked slice gives 0 (not NaN): it has nothing to contribute.
    """
    count = mask.to(values.dtype)
    count = count.sum() if dim is None else count.sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` over the masked positions (a scalar).

    ``unbiased`` applies Bessel's correction ``n / (n - 1)``; with fewer than two
    valid tokens the (biased) variance, i.e. 0 for one token, is returned instead
    of dividing by zero.
    """
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    n = mask.to(values.dtype).sum()
    if unbiased and n.item() >= 2:
        var = var * n / (n - 1)
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """``(values - mean) / sqrt(var + eps)`` with masked statistics (unbiased variance).

    With ``shift_mean=False`` the mean is added back (scale only). Masked positions
    of the result are garbage-in/garbage-out: multiply by the mask if they matter.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened
