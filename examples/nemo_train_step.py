"""One training step of a NeMo Automodel DFlash 2 draft model on the fused kernels.

Shows: ``dk.patch(draft)`` swapping every ``GroupedDynamicCausalConv`` and the
``CandidateSelector`` of NeMo's ``Qwen3DFlash2DraftModel`` for ours
(``dflash2_kernels.compat.nemo``, NeMo's signatures) in place, around the same
Parameters; then one step through NeMo's own training wrapper,
``DFlash2TrainerModule``: anchors, noise blocks and masks, the decay-weighted block
cross-entropy (``base_loss``) plus the selector's K-way cross-entropy
(``selector_loss``, scored by ``pair_scores``), backward and an AdamW update.

The draft is tiny and random (``examples/tiny_models.py``: H = 64, 2 layers, V = 512;
nothing is downloaded); the target's head and embeddings are random frozen modules and
its hidden states random tensors. Runs in seconds on a CPU, unchanged on a GPU::

    python examples/nemo_train_step.py
"""

from __future__ import annotations

import torch
from nemo_automodel.components.speculative.dflash.dflash2_core import DFlash2TrainerModule
from tiny_models import BLOCK, HIDDEN, MASK_TOKEN, TARGET_LAYER_IDS, VOCAB, nemo_draft
from torch import nn

import dflash2_kernels as dk

BATCH, TOKENS, ANCHORS = 2, 48, 8
# A random draft's candidates hold the true token with probability k / V: 64 of 512
# gives the selector loss some positions to learn from (8 would give about none).
TOP_K = 64


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    draft = nemo_draft(seed=0, top_k=TOP_K).to(device).train()
    print(dk.patch(draft))

    # The frozen target pieces the trainer borrows: its output head and input embeddings.
    target_lm_head = nn.Linear(HIDDEN, VOCAB, bias=False).to(device).requires_grad_(False)
    target_embed_tokens = nn.Embedding(VOCAB, HIDDEN).to(device).requires_grad_(False)
    # SDPA-style dense masks: NeMo's default, flex attention, compiles a block mask.
    trainer = DFlash2TrainerModule(draft, target_lm_head, target_embed_tokens, mask_token_id=MASK_TOKEN,
                                   block_size=BLOCK, attention_backend="sdpa", num_anchors=ANCHORS,
                                   loss_decay_gamma=4.0, selector_loss_weight=1.0)

    # A batch as NeMo's DFlash data pipeline hands it over: token ids [B, S], the
    # target's hidden states at TARGET_LAYER_IDS concatenated [B, S, 2H], a loss mask
    # (no loss on the first tokens, a prompt).
    # Drawn on the CPU, so that every device sees the same batch.
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, VOCAB - 1, (BATCH, TOKENS), generator=generator).to(device)
    hidden_states = torch.randn(BATCH, TOKENS, len(TARGET_LAYER_IDS) * HIDDEN, generator=generator).to(device)
    loss_mask = torch.ones(BATCH, TOKENS, device=device)
    loss_mask[:, :2] = 0
    torch.manual_seed(0)  # the trainer draws its anchors from the global generator

    optimizer = torch.optim.AdamW(draft.parameters(), lr=1e-3)
    metrics = trainer(input_ids=input_ids, hidden_states=hidden_states, loss_mask=loss_mask)
    metrics.loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"loss: {metrics.loss.item():.4f} (base {metrics.base_loss.item():.4f} + selector "
          f"{metrics.selector_loss.item():.4f}), candidate recall {metrics.candidate_recall.item():.3f} on {device}")


if __name__ == "__main__":
    main()
