"""``nn.Module``s with the upstream parameter names, so checkpoints load unchanged."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from . import reference
from .conv import grouped_dynamic_conv
from .selector import pair_scores, score_candidates, transition_scores
from .selector.ops import check_context_ids
from .serving import edge_scores, walk

__all__ = ["CandidateSelector", "GroupedDynamicCausalConv"]


def _check_sizes(**sizes) -> None:
    """Constructor sizes: ints in [1, 2**63) (TypeError / ValueError naming the size)."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}.")
        if value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}.")
        if value >= 2**63:  # torch.empty's sizes are signed 64-bit
            raise ValueError(f"{name} must be < 2**63, got {value}.")


def _autocast_enabled(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know (meta)
        return False


def check_hidden(name: str, hidden, weight: torch.Tensor) -> None:
    """hidden [..., H] that ``nn.Linear(H, ...)`` with ``weight`` can take, checked in our
    words before nn.Linear's own messages (which name no argument) could fire."""
    reference.require_float_tensor(name, hidden)
    width = weight.shape[1]
    if hidden.dim() == 0 or hidden.shape[-1] != width:
        raise ValueError(f"{name} must be [..., hidden_size={width}], got {tuple(hidden.shape)}.")
    if hidden.device != weight.device:
        raise ValueError(f"{name} is on {hidden.device} but the module's parameters are on {weight.device}.")
    # Under autocast nn.Linear casts both operands; without it the dtypes must agree.
    # (Autocast knows CPU, CUDA and a few accelerators; elsewhere there is none.)
    if hidden.dtype != weight.dtype and not _autocast_enabled(hidden.device.type):
        raise TypeError(f"{name} is {hidden.dtype} but the module's parameters are {weight.dtype} "
                        "(cast one of them, or run under torch.autocast).")


def upstream_parameter(module: nn.Module, name: str) -> nn.Parameter:
    """``module.<name>`` (a dotted path), which must be an ``nn.Parameter``: ours will hold
    that very object, so an optimizer and a checkpoint see no change."""
    owner_path, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    value = getattr(owner, leaf, None)
    if not isinstance(value, nn.Parameter):
        raise TypeError(f"the upstream module's {name} must be an nn.Parameter, got {type(value).__name__}.")
    return value


def upstream_linear_weight(module: nn.Module, name: str, shape: tuple[int, int]) -> nn.Parameter:
    """The weight of the upstream ``nn.Linear(bias=False)`` at ``module.<name>``, of ``shape``."""
    linear = getattr(module, name, None)
    if not isinstance(linear, nn.Linear) or linear.bias is not None:
        raise TypeError(f"the upstream module's {name} must be an nn.Linear without bias, got {linear!r}.")
    weight = upstream_parameter(linear, "weight")
    if tuple(weight.shape) != shape:
        raise ValueError(f"the upstream module's {name}.weight must have shape {shape}, got {tuple(weight.shape)}.")
    return weight


def _upstream_sizes(module: nn.Module, *names: str) -> dict:
    """The size attributes ``names`` of an upstream module (ValueError naming a missing one)."""
    missing = [name for name in names if not hasattr(module, name)]
    if missing:
        raise ValueError(f"the upstream module {type(module).__name__} has no {', '.join(missing)} attribute.")
    return {name: getattr(module, name) for name in names}


# --- FSDP2: methods other than forward ----------------------------------------------------


_FSDP: tuple = ()  # (DTensor, FSDPModule, register_fsdp_forward_method) once looked up


def _fsdp_api() -> tuple:
    """(DTensor, FSDPModule, register_fsdp_forward_method), or () where torch.distributed
    is not built; imported on first use, not with the package."""
    global _FSDP
    if not _FSDP and torch.distributed.is_available():
        try:
            from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
        except ImportError:  # torch < 2.6: FSDP2 lived in the composable API
            from torch.distributed._composable.fsdp import FSDPModule, register_fsdp_forward_method
        from torch.distributed.tensor import DTensor

        _FSDP = (DTensor, FSDPModule, register_fsdp_forward_method)
    return _FSDP


def _fsdp_gathered(module: nn.Module, dtensor: type) -> bool:
    """Whether FSDP2 has gathered ``module``'s parameters (it is inside its forward or a
    registered forward method, or they were not resharded since)."""
    groups = getattr(module._get_fsdp_state(), "_fsdp_param_groups", None)
    if groups is None:  # a torch without per-state groups: judge by the parameters themselves
        return not any(isinstance(p, dtensor) for p in module.parameters())
    return all(group.is_unsharded for group in groups)


def fsdp_forward_method(module: nn.Module, name: str) -> Callable | None:
    """None when ``module.<name>`` can run on the module's parameters as they are; else
    the bound method to call instead, which gathers them first.

    FSDP2 (``fully_shard``) gathers a module's parameters around ``forward`` only. A
    selector that was sharded itself and is called through another method
    (``pair_scores``, ``walk``, ``select``, ...) would hand our ops its sharded DTensor
    parameters beside plain tensors. For such a module the method is registered with
    ``torch.distributed.fsdp.register_fsdp_forward_method`` on first call (what FSDP
    asks of its users) and the registered one is returned: it gathers the parameters
    before the method, and reshards them and reduces their gradients after, as around
    forward. Code being compiled is left alone: registering is a side effect no graph
    can hold (Dynamo runs FSDP2's hooks outside its graphs anyway), and the check would
    only add guards.
    """
    if torch.compiler.is_compiling():
        return None
    api = _fsdp_api()
    if not api or not isinstance(module, api[1]) or _fsdp_gathered(module, api[0]):
        return None
    if name in vars(module):  # registered already, yet called with the parameters sharded
        raise RuntimeError(f"{type(module).__name__}.{name} was called with the module's parameters sharded by "
                           f"FSDP2, outside the registered forward method (call module.{name}(...), not the "
                           "class's).")
    api[2](module, name)
    return getattr(module, name)


def _sharded_parameters_error(module: nn.Module, argument: str, error: RuntimeError) -> RuntimeError:
    """What to do when ``module``'s parameters are DTensors and ``argument`` is not (torch's
    own message names neither), as when a module above it was sharded by FSDP2."""
    kind = type(module).__name__
    return RuntimeError(
        f"{kind}: {argument} is a plain tensor but the module's parameters are DTensors ({error}). Where "
        "FSDP2 (fully_shard) sharded a module above this one, it gathers them only inside that module's "
        "forward: call this method from that forward, or register the method that calls it with "
        "torch.distributed.fsdp.register_fsdp_forward_method(<that module>, '<method>') (NeMo's draft: "
        f"'spec_generate'), or fully_shard this {kind} itself: its methods then gather their own parameters."
    )


class GroupedDynamicCausalConv(nn.Module):
    """speculators' ``GroupedDynamicCausalConv`` on the fused kernels.

    Parameters (the checkpoint keys): ``base_kernel`` [2, K, H] (side 0 convolves the
    sublayer input, side 1 its output) and ``kernel_projection.weight`` [2*K*G, H].
    """

    def __init__(self, hidden_size: int, *, block_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        _check_sizes(hidden_size=hidden_size, block_size=block_size, kernel_size=kernel_size, group_size=group_size)
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

    @classmethod
    def from_upstream(cls, module: nn.Module) -> GroupedDynamicCausalConv:
        """Ours around a speculators ``GroupedDynamicCausalConv``'s own parameters.

        ``module`` needs ``base_kernel`` [2, K, H], ``kernel_projection`` (an
        ``nn.Linear(H, 2*K*G, bias=False)``) and the ints ``block_size``,
        ``kernel_size``, ``group_size`` (and ``num_groups`` = H / group_size where it
        has one). The result holds the very same Parameter objects (no copy, any
        dtype and device: the weights are never touched, no random numbers are drawn)
        and the same attributes and training flag; hooks on ``module`` do not carry
        over. Errors (TypeError / ValueError) name the attribute at fault.
        """
        base = upstream_parameter(module, "base_kernel")
        sizes = _upstream_sizes(module, "block_size", "kernel_size", "group_size")
        if base.dim() != 3 or base.shape[0] != 2 or base.shape[1] != sizes["kernel_size"]:
            raise ValueError(f"the upstream module's base_kernel must have shape [2, kernel_size="
                             f"{sizes['kernel_size']}, hidden_size], got {tuple(base.shape)}.")
        hidden_size = base.shape[2]
        # On the meta device the constructor's placeholders cost no memory and draw no
        # random numbers; it also checks the sizes with speculators' messages.
        with torch.device("meta"):
            conv = cls(hidden_size, **sizes)
        if getattr(module, "num_groups", conv.num_groups) != conv.num_groups:
            raise ValueError(f"the upstream module's num_groups must be hidden_size / group_size = "
                             f"{conv.num_groups}, got {module.num_groups}.")
        conv.kernel_projection.weight = upstream_linear_weight(
            module, "kernel_projection", (2 * conv.kernel_size * conv.num_groups, hidden_size)
        )
        conv.base_kernel = base
        return conv.train(module.training)

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
        check_hidden("hidden_states", hidden_states, self.kernel_projection.weight)
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


class CandidateSelector(nn.Module):
    """The DFlash 2 candidate selector (speculators' and NeMo's), on the fused kernels.

    Parameters (the checkpoint keys, as upstream): ``predecessor_codebook`` A [V, r],
    ``successor_codebook`` B [V, r], ``hidden_projection.weight`` W [r, H]. Positional
    arguments follow NeMo (vocab_size, hidden_size, rank, top_k); speculators passes
    the same names by keyword.
    """

    def __init__(
        self, vocab_size: int, hidden_size: int, rank: int, top_k: int, initializer_range: float = 0.02
    ) -> None:
        super().__init__()
        _check_sizes(vocab_size=vocab_size, hidden_size=hidden_size, rank=rank, top_k=top_k)
        if top_k > vocab_size:
            raise ValueError(f"top_k ({top_k}) cannot exceed vocab_size ({vocab_size}).")
        self.top_k = top_k
        self.initializer_range = initializer_range
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.reset_parameters()

    @classmethod
    def from_upstream(cls, module: nn.Module) -> CandidateSelector:
        """Ours around a speculators ``CandidateSelector``'s own parameters.

        ``module`` needs ``predecessor_codebook`` and ``successor_codebook`` [V, r],
        ``hidden_projection`` (an ``nn.Linear(H, r, bias=False)``) and the int
        ``top_k``. The result holds the very same Parameter objects (no copy, no random
        numbers drawn), ``top_k`` and the training flag; ``initializer_range`` (which
        speculators uses once, in its constructor, and does not keep) is the module's
        where it has one, else 0.02, speculators' default. Hooks on ``module`` do not
        carry over. Errors (TypeError / ValueError) name the attribute at fault.
        """
        predecessor = upstream_parameter(module, "predecessor_codebook")
        successor = upstream_parameter(module, "successor_codebook")
        if predecessor.dim() != 2 or successor.shape != predecessor.shape:
            raise ValueError("the upstream module's predecessor_codebook and successor_codebook must both be "
                             f"[vocab_size, rank], got {tuple(predecessor.shape)} and {tuple(successor.shape)}.")
        vocab_size, rank = predecessor.shape
        projection = getattr(module, "hidden_projection", None)
        hidden_size = getattr(projection, "in_features", None)
        weight = upstream_linear_weight(module, "hidden_projection", (rank, hidden_size))
        top_k = _upstream_sizes(module, "top_k")["top_k"]
        with torch.device("meta"):  # placeholders: no memory, no random numbers drawn
            selector = cls(vocab_size, hidden_size, rank, top_k,
                           initializer_range=getattr(module, "initializer_range", 0.02))
        selector.hidden_projection.weight = weight
        selector.predecessor_codebook = predecessor
        selector.successor_codebook = successor
        return selector.train(module.training)

    def reset_parameters(self) -> None:
        """speculators' initialisation: every parameter ~ N(0, initializer_range)."""
        for parameter in (self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight):
            nn.init.normal_(parameter, std=self.initializer_range)

    def _project(self, hidden: torch.Tensor, name: str) -> torch.Tensor:
        """P = W h: [..., H] -> [..., r], with a message that names the argument."""
        check_hidden(name, hidden, self.hidden_projection.weight)
        try:
            return self.hidden_projection(hidden)
        except RuntimeError as error:
            if "mixed torch.Tensor and DTensor" in str(error):
                raise _sharded_parameters_error(self, name, error) from error
            raise

    def context(self, hidden_states: torch.Tensor, predecessor_ids: torch.Tensor) -> torch.Tensor:
        """A[pred] * W h in the codebook dtype: [..., r] (speculators).

        hidden_states [..., H] float; predecessor_ids [...] int in [0, V), checked on
        every device (a device sync: this is not a training hot path).
        """
        if (gathered := fsdp_forward_method(self, "context")) is not None:
            return gathered(hidden_states, predecessor_ids)
        projected = self._project(hidden_states, "hidden_states")
        check_context_ids(predecessor_ids, projected, self.predecessor_codebook)
        return reference.selector_context(self.predecessor_codebook, projected, predecessor_ids)

    def transition_scores(
        self, hidden_states: torch.Tensor, predecessor_ids: torch.Tensor, candidate_ids: torch.Tensor
    ) -> torch.Tensor:
        """T(pred, cand_j) for each candidate: [..., k] in the codebook dtype."""
        if (gathered := fsdp_forward_method(self, "transition_scores")) is not None:
            return gathered(hidden_states, predecessor_ids, candidate_ids)
        return transition_scores(
            self._project(hidden_states, "hidden_states"),
            self.predecessor_codebook,
            self.successor_codebook,
            predecessor_ids,
            candidate_ids,
        )

    def score_candidates(
        self,
        unary_logits: torch.Tensor,
        hidden_states: torch.Tensor,
        predecessor_ids: torch.Tensor,
        candidate_ids: torch.Tensor,
    ) -> torch.Tensor:
        """U[..., cand_j] + T(pred, cand_j): [..., k] in unary_logits' dtype (speculators)."""
        if (gathered := fsdp_forward_method(self, "score_candidates")) is not None:
            return gathered(unary_logits, hidden_states, predecessor_ids, candidate_ids)
        return score_candidates(
            unary_logits,
            self._project(hidden_states, "hidden_states"),
            self.predecessor_codebook,
            self.successor_codebook,
            predecessor_ids,
            candidate_ids,
        )

    def select(
        self,
        unary_logits: torch.Tensor,
        hidden_states: torch.Tensor,
        predecessor_ids: torch.Tensor,
        top_k: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(unary top-k ids [..., k], their scores [..., k]) (speculators). top_k: this
        module's by default; 0 gives empty results, as torch.topk does."""
        if (gathered := fsdp_forward_method(self, "select")) is not None:
            return gathered(unary_logits, hidden_states, predecessor_ids, top_k)
        k = self.top_k if top_k is None else top_k
        vocab = self.predecessor_codebook.shape[0]
        if isinstance(k, bool) or not isinstance(k, int):
            raise TypeError(f"top_k must be an int, got {type(k).__name__}.")
        if k < 0 or k > vocab:
            raise ValueError(f"top_k must be in [0, vocab_size={vocab}], got {k}.")
        if not isinstance(unary_logits, torch.Tensor):
            raise TypeError(f"unary_logits must be a torch.Tensor, got {type(unary_logits).__name__}.")
        if unary_logits.dim() == 0 or unary_logits.shape[-1] != vocab:
            raise ValueError(f"unary_logits must be [..., vocab_size={vocab}], got {tuple(unary_logits.shape)}.")
        candidate_ids = unary_logits.topk(k, dim=-1).indices
        return candidate_ids, self.score_candidates(unary_logits, hidden_states, predecessor_ids, candidate_ids)

    def pair_scores(
        self,
        hidden: torch.Tensor,
        unary: torch.Tensor,
        candidate_ids: torch.Tensor,
        predecessor_ids: torch.Tensor,
    ) -> torch.Tensor:
        """NeMo's ``pair_scores``: unary [..., k] already gathered; dtypes promote."""
        if (gathered := fsdp_forward_method(self, "pair_scores")) is not None:
            return gathered(hidden, unary, candidate_ids, predecessor_ids)
        return pair_scores(
            self._project(hidden, "hidden"),
            unary,
            self.predecessor_codebook,
            self.successor_codebook,
            candidate_ids,
            predecessor_ids,
        )

    def edge_scores(
        self, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(edges [B, D, k, k], candidate_ids [B, D, k]) of one drafted block: see :func:`edge_scores`."""
        if (gathered := fsdp_forward_method(self, "edge_scores")) is not None:
            return gathered(hidden, logits, anchor_ids)
        return edge_scores(self._project(hidden, "hidden"), logits, anchor_ids, self.predecessor_codebook,
                           self.successor_codebook, self.top_k)

    def walk(
        self,
        hidden: torch.Tensor,
        logits: torch.Tensor,
        anchor_ids: torch.Tensor,
        temperature: float,
        *,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """NeMo's ``walk``, fused: hidden [B, D, H], logits [B, D, V], anchor_ids [B].

        Returns (path [B, D], candidate_ids [B, D, k], draft_probs [B, D, k] float32 or
        None when temperature == 0); see :func:`walk`.
        """
        if (gathered := fsdp_forward_method(self, "walk")) is not None:
            return gathered(hidden, logits, anchor_ids, temperature, generator=generator)
        return walk(self._project(hidden, "hidden"), logits, anchor_ids, self.predecessor_codebook,
                    self.successor_codebook, self.top_k, temperature, generator=generator)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        """The training entry point: :meth:`score_candidates`."""
        return self.score_candidates(*args, **kwargs)

    def extra_repr(self) -> str:
        vocab, rank = self.predecessor_codebook.shape
        return f"vocab_size={vocab}, hidden_size={self.hidden_projection.in_features}, rank={rank}, top_k={self.top_k}"
