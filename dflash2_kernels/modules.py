"""``nn.Module``s with the upstream parameter names, so checkpoints load unchanged."""

from __future__ import annotations

import torch
from torch import nn

from .conv import grouped_dynamic_conv

__all__ = ["GroupedDynamicCausalConv"]


class GroupedDynamicCausalConv(nn.Module):
    """speculators' ``GroupedDynamicCausalConv`` on the fused kernels.

    Parameters (the checkpoint keys): ``base_kernel`` [2, K, H] (side 0 convolves the
    sublayer input, side 1 its output) and ``kernel_projection.weight`` [2*K*G, H].
    """

    def __init__(self, hidden_size: int, *, block_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("block_size", block_size),
                            ("kernel_size", kernel_size), ("group_size", group_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}.")
        if hidden_size % group_size:
            raise ValueError(
                f"hidden_size ({hidden_size}) must be divisible by group_size ({group_size})."
            )
        if kernel_size > block_size:
            raise ValueError(f"kernel_size ({kernel_size}) cannot exceed block_size ({block_size}).")
        self.block_size = block_size
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.num_groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.num_groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Make both convolutions the identity: unit tap 0, zero projection."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0].fill_(1.0)
            self.kernel_projection.weight.zero_()

    def prepare(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden_states [..., H] -> (side-0 conv of it [..., H], side-1 delta [..., K, G]).

        The projection runs once; both deltas are strided views of its output, which the
        kernels read in place.
        """
        kernels = self.kernel_projection(hidden_states).view(
            *hidden_states.shape[:-1], 2, self.kernel_size, self.num_groups
        )
        prepared = grouped_dynamic_conv(
            hidden_states,
            kernels[..., 0, :, :],
            self.base_kernel[0],
            block_size=self.block_size,
            group_size=self.group_size,
        )
        return prepared, kernels[..., 1, :, :]

    def finish(self, hidden_states: torch.Tensor, delta_kernel: torch.Tensor) -> torch.Tensor:
        """Side-1 conv of the sublayer output [..., H] with the delta from ``prepare``."""
        return grouped_dynamic_conv(
            hidden_states,
            delta_kernel,
            self.base_kernel[1],
            block_size=self.block_size,
            group_size=self.group_size,
        )

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.base_kernel.shape[-1]}, block_size={self.block_size}, "
            f"kernel_size={self.kernel_size}, group_size={self.group_size}"
        )
