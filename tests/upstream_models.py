"""Tiny random DFlash 2 draft models built from the real upstream classes, and their inputs.

For the patch tests and for examples: every builder takes a seed, downloads nothing
and runs on the CPU in well under a second. The upstream packages are imported only
inside the builders, so importing this module never needs them.

speculators (``speculators.models.dflash2``): :func:`speculators_draft` and
:func:`speculators_batch` (the inputs of ``DFlash2DraftModel.forward``).
NeMo Automodel (``draft_qwen3_dflash2``): :func:`nemo_draft`, :func:`nemo_trainer`,
:func:`nemo_batch` (the inputs of ``DFlash2TrainerModule.forward``) and
:func:`qwen3_target` (a tiny ``Qwen3ForCausalLM`` verifier for ``spec_generate``).

:func:`count_dflash2_ops` counts the ``torch.ops.dflash2`` calls made under it, so a
test can check that our kernels ran rather than assume it.
"""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

# One tiny Qwen3 shape for every model here: H = 64 (4 conv groups of 16), 2 layers,
# V = 128. The draft block L = 4 with K = 2 taps, selector rank 32 and top-k 16: on
# random tokens 1 in 8 true tokens is among the candidates, so NeMo's selector loss
# (which skips the others) has positions to train on.
HIDDEN = 64
LAYERS = 2
VOCAB = 128
BLOCK = 4
TAPS = 2
GROUP = 16
RANK = 32
TOP_K = 16
MASK_TOKEN = VOCAB - 1


def _qwen3_sizes(**overrides) -> dict:
    sizes = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
    )
    sizes.update(overrides)
    return sizes


def _fill(parameter: torch.Tensor, generator: torch.Generator, std: float, mean: float = 0.0) -> None:
    with torch.no_grad():
        parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float64) * std + mean)


def randomise_dflash2_modules(model: nn.Module, generator: torch.Generator) -> None:
    """Move every conv and selector off its identity start, so that the dynamic taps and
    the transition scores carry weight (both inits make them vanish: zero projection,
    upstream NeMo's zero successor codebook) and every gradient is exercised."""
    for name, parameter in model.named_parameters():
        if name.endswith("base_kernel"):
            _fill(parameter, generator, 0.2, mean=0.5)
        elif name.endswith("kernel_projection.weight"):
            _fill(parameter, generator, 0.1)
        elif name.endswith(("predecessor_codebook", "successor_codebook")):
            _fill(parameter, generator, 0.5)
        elif name.endswith("hidden_projection.weight"):
            _fill(parameter, generator, 0.2)


# --- speculators ------------------------------------------------------------------------


def speculators_draft(seed: int = 0, *, randomise: bool = True, vocab: int = VOCAB) -> nn.Module:
    """A tiny ``speculators.models.dflash2.DFlash2DraftModel`` (fp32, train mode).

    Built directly from a ``DFlash2SpeculatorConfig`` (``from_training_args`` would
    read the verifier's config and weights from the Hub). The verifier-owned weights
    that speculators fills with NaN until ``load_verifier_weights`` (``embed_tokens``,
    ``lm_head``, ``verifier_lm_head``) get seeded random values instead. Eager
    attention: flex attention would compile its block mask.
    """
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config

    layer_config = Qwen3Config(**_qwen3_sizes(vocab_size=vocab))
    layer_config._attn_implementation = "eager"
    config = DFlash2SpeculatorConfig(
        transformer_layer_config=layer_config,
        draft_vocab_size=vocab,
        block_size=BLOCK,
        aux_hidden_state_layer_ids=[0, 1],
        mask_token_id=vocab - 1,
        conv_kernel_size=TAPS,
        conv_group_size=GROUP,
        selector_rank=RANK,
        selector_top_k=TOP_K,
        speculators_config=SpeculatorsConfig(
            algorithm="dflash2",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=BLOCK - 1)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=[]),
        ),
    )
    torch.manual_seed(seed)
    model = DFlash2DraftModel(config)
    generator = torch.Generator().manual_seed(seed + 1)
    # Unit-variance hidden states times std 1/sqrt(H)-ish weights: logits of order 1,
    # whose top-k gaps are far above fp32 rounding (a flipped candidate would make the
    # loss jump between implementations).
    for weight in (model.embed_tokens.weight, model.lm_head.weight, model.verifier_lm_head.weight):
        _fill(weight, generator, 0.15)
    if randomise:
        randomise_dflash2_modules(model, generator)
    return model.train()


@dataclass
class SpeculatorsBatch:
    """The inputs of ``DFlash2DraftModel.forward`` for one packed sequence of T tokens.

    hidden_states [1, T, 2H] (two auxiliary verifier layers), input_ids [1, T] int64,
    loss_mask [1, T] (last block masked out, as select_anchors would), verifier last
    hidden states [1, T, H], document_ids [1, T] (two documents), all float in ``dtype``.
    ``max_anchors`` anchors of ``BLOCK`` rows each are drawn by ``torch.randperm``:
    seed the global generator identically before each forward that must agree.
    """

    hidden_states: torch.Tensor
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    verifier_last_hidden_states: torch.Tensor
    document_ids: torch.Tensor
    max_anchors: int

    def to(self, dtype: torch.dtype) -> SpeculatorsBatch:
        return SpeculatorsBatch(self.hidden_states.to(dtype), self.input_ids, self.loss_mask,
                                self.verifier_last_hidden_states.to(dtype), self.document_ids, self.max_anchors)

    def kwargs(self) -> dict:
        return dict(hidden_states=self.hidden_states, input_ids=self.input_ids, loss_mask=self.loss_mask,
                    verifier_last_hidden_states=self.verifier_last_hidden_states,
                    document_ids=self.document_ids, max_anchors=self.max_anchors)


def speculators_batch(seed: int = 0, *, tokens: int = 48, max_anchors: int = 6,
                      vocab: int = VOCAB) -> SpeculatorsBatch:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab - 1, (1, tokens), generator=generator)
    loss_mask = torch.ones(1, tokens, dtype=torch.long)
    loss_mask[:, : BLOCK // 2] = 0  # a prompt the loss skips
    document_ids = torch.zeros(1, tokens, dtype=torch.long)
    document_ids[:, tokens // 2 :] = 1
    return SpeculatorsBatch(
        hidden_states=torch.randn(1, tokens, 2 * HIDDEN, generator=generator),
        input_ids=input_ids,
        loss_mask=loss_mask,
        verifier_last_hidden_states=torch.randn(1, tokens, HIDDEN, generator=generator),
        document_ids=document_ids,
        max_anchors=max_anchors,
    )


def speculators_loss(model: nn.Module, batch: SpeculatorsBatch, seed: int = 0) -> tuple[torch.Tensor, dict]:
    """speculators' training step: (loss = unary + selector_loss_alpha * selector, metrics),
    with ``get_trainer_kwargs``'s arguments (KL unary loss, alpha 1).

    The anchors come from the global generator, seeded here, so two models see the
    same anchors."""
    from speculators.models.dflash2 import DFlash2DraftModel

    # The trainer's own keyword arguments, with the eager losses: the fused ones are
    # Triton kernels that need a GPU.
    train_kwargs, _ = DFlash2DraftModel.get_trainer_kwargs(loss_fn="kl_div", loss_implementation="eager")
    train_kwargs.update(batch.kwargs())
    torch.manual_seed(seed)
    _, loss, metrics = model(**train_kwargs)
    return loss, metrics


# --- NeMo Automodel --------------------------------------------------------------------


NUM_TARGET_LAYERS = 4
TARGET_LAYER_IDS = [1, 2]


def nemo_draft_config(vocab: int = VOCAB):
    """The draft's ``Qwen3Config``: DFlash 2 settings in ``dflash_config``, eager attention
    (the trainer builds a dense SDPA-style mask for it)."""
    from transformers import Qwen3Config

    config = Qwen3Config(**_qwen3_sizes(vocab_size=vocab))
    config.num_target_layers = NUM_TARGET_LAYERS
    config.block_size = BLOCK
    config.dflash_config = {
        "block_size": BLOCK,
        "mask_token_id": vocab - 1,
        "target_layer_ids": TARGET_LAYER_IDS,
        "conv_kernel_size": TAPS,
        "conv_group_size": GROUP,
        "selector_rank": RANK,
        "selector_top_k": TOP_K,
    }
    config._attn_implementation = "eager"
    return config


def nemo_draft(seed: int = 0, *, randomise: bool = True, vocab: int = VOCAB) -> nn.Module:
    """A tiny NeMo ``Qwen3DFlash2DraftModel`` (fp32, train mode), built from whatever
    ``draft_qwen3_dflash2`` holds now (so after ``patch_nemo()`` from ours)."""
    from nemo_automodel.components.speculative.dflash import draft_qwen3_dflash2

    torch.manual_seed(seed)
    model = draft_qwen3_dflash2.Qwen3DFlash2DraftModel(nemo_draft_config(vocab))
    if randomise:
        randomise_dflash2_modules(model, torch.Generator().manual_seed(seed + 1))
    return model.train()


def qwen3_target(seed: int = 0, *, prior: float = 1.5, spread: float = 0.15, vocab: int = VOCAB,
                 bias: bool = True) -> nn.Module:
    """A tiny random ``transformers.Qwen3ForCausalLM`` verifier (fp32, eval), the same
    vocabulary and width as the drafts here, ``NUM_TARGET_LAYERS`` layers.

    Its ``lm_head`` carries a bias, a Zipf-like log-prior (token i ~ (i + 1)^-prior),
    beside a context-dependent part (weights of std ``spread``: logits of std about
    8 * spread). HF's own init (std 0.02, no bias) gives near-uniform next-token
    distributions that a random draft's 16 candidates cannot cover, so nothing would
    ever be accepted. The draft reads the target's head, so shares the prior: with the
    defaults drafts are accepted often and rejected often (both branches of
    verification run); a weaker prior and a larger spread (1.0, 0.3) give varied
    greedy continuations instead of one token repeated. ``bias=False``: a bias-free
    head, as real verifiers have (the fused head refuses a biased one).
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**_qwen3_sizes(num_hidden_layers=NUM_TARGET_LAYERS, vocab_size=vocab),
                         tie_word_embeddings=False)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    target = Qwen3ForCausalLM(config)
    head = nn.Linear(HIDDEN, vocab, bias=bias)
    _fill(head.weight, torch.Generator().manual_seed(seed + 1), spread)
    if bias:
        with torch.no_grad():
            head.bias.copy_(-prior * torch.arange(1, vocab + 1, dtype=torch.float64).log())
    target.lm_head = head.requires_grad_(False)
    return target.eval()


def nemo_trainer(draft: nn.Module, target: nn.Module):
    """``DFlash2TrainerModule`` around ``draft`` with ``target``'s head and embeddings,
    SDPA-style dense masks, loss decay on (gamma 4) and selector weight 1."""
    from nemo_automodel.components.speculative.dflash.dflash2_core import DFlash2TrainerModule

    return DFlash2TrainerModule(
        draft_model=draft,
        target_lm_head=target.lm_head,
        target_embed_tokens=target.get_input_embeddings(),
        mask_token_id=target.config.vocab_size - 1,
        block_size=BLOCK,
        attention_backend="sdpa",
        num_anchors=8,
        loss_decay_gamma=4.0,
        selector_loss_weight=1.0,
    )


@dataclass
class NemoBatch:
    """The inputs of ``DFlash2TrainerModule.forward``: input_ids [B, S] int64, the target
    context features hidden_states [B, S, len(TARGET_LAYER_IDS) * H] float, loss_mask
    [B, S]. Anchors come from the global generator (torch.rand): seed it identically
    before each forward that must agree."""

    input_ids: torch.Tensor
    hidden_states: torch.Tensor
    loss_mask: torch.Tensor

    def to(self, dtype: torch.dtype) -> NemoBatch:
        return NemoBatch(self.input_ids, self.hidden_states.to(dtype), self.loss_mask)


def nemo_batch(seed: int = 0, *, batch: int = 2, tokens: int = 40, vocab: int = VOCAB) -> NemoBatch:
    generator = torch.Generator().manual_seed(seed)
    loss_mask = torch.ones(batch, tokens)
    loss_mask[:, :2] = 0
    return NemoBatch(
        input_ids=torch.randint(0, vocab - 1, (batch, tokens), generator=generator),
        hidden_states=torch.randn(batch, tokens, len(TARGET_LAYER_IDS) * HIDDEN, generator=generator),
        loss_mask=loss_mask,
    )


def nemo_loss(trainer: nn.Module, batch: NemoBatch, seed: int = 0):
    """NeMo's training step: the ``DFlash2StepMetrics`` (``loss`` = base + selector)."""
    torch.manual_seed(seed)
    return trainer(input_ids=batch.input_ids, hidden_states=batch.hidden_states, loss_mask=batch.loss_mask)


# --- checking that our kernels ran -----------------------------------------------------


class _OpCounter(TorchDispatchMode):
    def __init__(self, namespace: str, record: tuple[str, ...]) -> None:
        super().__init__()
        self.namespace, self.record = namespace, record
        self.counts: collections.Counter = collections.Counter()
        self.outputs: dict[str, list] = collections.defaultdict(list)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == self.namespace:
            name = func.__name__.split(".")[0]
            self.counts[name] += 1
            if name in self.record:
                self.outputs[name].append(out)
        return out


@contextlib.contextmanager
def count_dflash2_ops(namespace: str = "dflash2", *, record: tuple[str, ...] = ()):
    """Count every ``torch.ops.<namespace>`` call below autograd while the block runs,
    backward passes included: yields a counter whose ``counts`` map op names
    (``grouped_dynamic_conv``, ``selector_scores_backward``, ...) to calls, and whose
    ``outputs[name]`` lists the results of each op named in ``record``. A dispatch mode
    sees the op however it was looked up (cached handles included), so nothing in the
    package is patched."""
    counter = _OpCounter(namespace, record)
    with counter:
        yield counter


@pytest.fixture(scope="module")
def one_thread():
    """One OpenMP thread for a module of tests on these tiny models: with two threads on
    a busy two-core machine every op waits on a thread wake-up, 100x slower than the work
    itself. Use: ``pytestmark = pytest.mark.usefixtures("one_thread")`` after importing it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
