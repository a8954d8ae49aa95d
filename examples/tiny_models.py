"""Tiny random upstream DFlash 2 models for the examples (nothing is downloaded).

One Qwen3 shape for all of them: H = 64 (4 conv groups of 16), 2 draft layers,
V = 512, draft block L = 4 with K = 2 taps, selector rank 32 and top-k 8. Each
builder takes a seed and returns an fp32 model on the CPU; move it with ``.to(device)``.

- :func:`speculators_draft`: ``speculators.models.dflash2.DFlash2DraftModel``.
- :func:`nemo_draft`: NeMo Automodel's ``Qwen3DFlash2DraftModel``, built from the
  classes ``draft_qwen3_dflash2`` holds at the call (ours after ``dk.patch_nemo()``).
- :func:`qwen3_target`: a ``transformers.Qwen3ForCausalLM`` verifier of the same
  vocabulary and width, for NeMo's ``spec_generate``.
- :func:`as_if_trained`: random weights on which every input matters (a fresh draft's
  identity convs, zero successor codebook and std-0.02 layers make every request draft
  the same block).
"""

from __future__ import annotations

import torch

HIDDEN, LAYERS, VOCAB, BLOCK = 64, 2, 512, 4
TAPS, GROUP, RANK, TOP_K = 2, 16, 32, 8
MASK_TOKEN = VOCAB - 1
TARGET_LAYERS, TARGET_LAYER_IDS = 4, [1, 2]  # the verifier layers whose hidden states feed NeMo's draft


def qwen3_config(**overrides):
    """A ``Qwen3Config`` of the tiny shape, eager attention (no compiled block masks)."""
    from transformers import Qwen3Config

    sizes = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    config = Qwen3Config(**{**sizes, **overrides})
    config._attn_implementation = "eager"
    return config


def speculators_draft(seed: int = 0):
    """A random ``DFlash2DraftModel``, built from its config rather than
    ``from_training_args`` (which reads the verifier's config and weights from the Hub)."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    config = DFlash2SpeculatorConfig(
        transformer_layer_config=qwen3_config(),
        draft_vocab_size=VOCAB,
        block_size=BLOCK,
        aux_hidden_state_layer_ids=[0, 1],
        mask_token_id=MASK_TOKEN,
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
    # The verifier-owned weights stay NaN until load_verifier_weights() reads the
    # verifier's checkpoint: random ones instead, scaled for logits of order 1.
    with torch.no_grad():
        for weight in (model.embed_tokens.weight, model.lm_head.weight, model.verifier_lm_head.weight):
            weight.normal_(std=0.15)
    return model


def nemo_draft(seed: int = 0, *, top_k: int = TOP_K):
    """A random NeMo ``Qwen3DFlash2DraftModel`` (identity convs, zero successor codebook:
    NeMo's own start), its DFlash 2 settings in ``config.dflash_config``; ``top_k``
    candidates per position."""
    from nemo_automodel.components.speculative.dflash import draft_qwen3_dflash2

    config = qwen3_config()
    config.num_target_layers = TARGET_LAYERS
    config.block_size = BLOCK
    config.dflash_config = {"block_size": BLOCK, "mask_token_id": MASK_TOKEN, "target_layer_ids": TARGET_LAYER_IDS,
                            "conv_kernel_size": TAPS, "conv_group_size": GROUP, "selector_rank": RANK,
                            "selector_top_k": top_k}
    torch.manual_seed(seed)
    return draft_qwen3_dflash2.Qwen3DFlash2DraftModel(config)


def qwen3_target(seed: int = 0):
    """A random ``Qwen3ForCausalLM`` verifier (eval mode) with TARGET_LAYERS layers."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    target = Qwen3ForCausalLM(qwen3_config(num_hidden_layers=TARGET_LAYERS, tie_word_embeddings=False))
    # HF's init (std 0.02) makes nearly uniform next-token distributions; a larger head
    # makes them peaked, as a trained model's are.
    with torch.no_grad():
        target.lm_head.weight.normal_(std=0.5)
    return target.eval()


def as_if_trained(model, seed: int = 0):
    """Redraw ``model``'s weights in place, seeded: every ``nn.Linear`` weight
    ~ N(0, 1/in_features) (unit-scale activations), conv base kernels ~ N(0.5, 0.2)
    (off the identity), codebooks ~ N(0, 0.15). Norms and embeddings stay. Returns it."""
    from torch import nn

    generator = torch.Generator().manual_seed(seed)

    def redraw(parameter, std, mean=0.0):
        parameter.copy_(torch.randn(parameter.shape, generator=generator) * std + mean)

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                redraw(module.weight, module.in_features ** -0.5)
        for name, parameter in model.named_parameters():
            if name.endswith("base_kernel"):
                redraw(parameter, 0.2, mean=0.5)
            elif name.endswith("codebook"):
                redraw(parameter, 0.15)
    return model
