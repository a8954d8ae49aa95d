"""Upstream signatures on the fused ops.

:mod:`.nemo`: NeMo Automodel 0.7.0's DFlash 2 pieces (``GroupedDynamicCausalConv``,
``CandidateSelector``, ``grouped_dynamic_convolve``, ``dflash2_rejection_sample``).
``grouped_dynamic_convolve`` is also here, where it has always been.

:mod:`.patch`: one call to swap ours into an upstream model (``patch.patch`` /
``patch.unpatch``, also ``dflash2_kernels.patch``) or into the upstream packages
(``patch_speculators``, ``patch_nemo`` and their ``unpatch_*``, also here).
"""

from . import nemo
from .nemo import grouped_dynamic_convolve
from . import patch  # the module: its function patch is dflash2_kernels.patch
from .patch import PatchReport, patch_nemo, patch_speculators, unpatch_nemo, unpatch_speculators

__all__ = ["grouped_dynamic_convolve", "nemo"]
__all__ += ["PatchReport", "patch", "patch_nemo", "patch_speculators", "unpatch_nemo", "unpatch_speculators"]
