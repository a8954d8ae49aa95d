"""NeMo Automodel's ``_grouped_dynamic_convolve`` signature on the fused op."""

from __future__ import annotations

import torch

from .. import reference
from ..conv import grouped_dynamic_conv


def grouped_dynamic_convolve(
    hidden: torch.Tensor,
    dynamic: torch.Tensor,
    base_kernel: torch.Tensor,
    group_size: int,
    block_size: int,
) -> torch.Tensor:
    """hidden [B, S, H], dynamic [B, S, K, G], base_kernel [K, H] -> [B, S, H].

    NeMo restarts block positions with every sequence; with S a multiple of
    block_size that is the flattened-row rule of the fused op, and any other S is
    refused with a ValueError (NeMo itself fails there with a reshape error).
    """
    reference.check_nemo_conv_args(hidden, dynamic, base_kernel, group_size, block_size)
    return grouped_dynamic_conv(
        hidden, dynamic, base_kernel, block_size=block_size, group_size=group_size
    )
