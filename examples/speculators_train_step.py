"""One training step of a speculators DFlash 2 draft model on the fused kernels.

Shows: ``dk.patch(model)`` swapping every ``GroupedDynamicCausalConv`` and the
``CandidateSelector`` of a ``speculators.models.dflash2.DFlash2DraftModel`` for ours in
place (around the same Parameters, so the optimizer and the checkpoint see no change),
then one step of speculators' own training objective (``DFlash2DraftModel.forward``:
unary KL to the verifier + the selector's K-way cross-entropy) with backward and an
AdamW update.

The model is tiny and random (``examples/tiny_models.py``: H = 64, 2 layers, V = 512;
nothing is downloaded) and the verifier's hidden states are random tensors. Runs in seconds on a CPU, unchanged on a
GPU (then speculators compiles its forward with torch.compile, which takes a while
once)::

    python examples/speculators_train_step.py
"""

from __future__ import annotations

import torch
from speculators.models.dflash2 import DFlash2DraftModel
from tiny_models import BLOCK, HIDDEN, VOCAB, speculators_draft

import dflash2_kernels as dk

TOKENS, ANCHORS = 64, 8  # one packed sequence of TOKENS verifier positions, ANCHORS draft blocks


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = speculators_draft(seed=0).to(device).train()
    print(dk.patch(model))

    # One packed sequence (speculators' batch layout): the verifier's auxiliary hidden
    # states [1, T, 2H] and last hidden states [1, T, H], token ids, a loss mask (no
    # loss on the prompt) and two documents.
    # Drawn on the CPU, so that every device sees the same batch.
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, VOCAB - 1, (1, TOKENS), generator=generator)
    loss_mask = torch.ones(1, TOKENS, dtype=torch.long)
    loss_mask[:, :BLOCK] = 0
    document_ids = (torch.arange(TOKENS) >= TOKENS // 2).long().unsqueeze(0)
    batch = dict(hidden_states=torch.randn(1, TOKENS, 2 * HIDDEN, generator=generator), input_ids=input_ids,
                 loss_mask=loss_mask, verifier_last_hidden_states=torch.randn(1, TOKENS, HIDDEN, generator=generator),
                 document_ids=document_ids)
    batch = {name: tensor.to(device) for name, tensor in batch.items()}
    torch.manual_seed(0)  # the model draws its anchors from the global generator

    # speculators' trainer arguments (KL unary loss, selector weight alpha = 1); the
    # eager loss implementation, since the fused one is Triton and needs a GPU.
    train_kwargs, _ = DFlash2DraftModel.get_trainer_kwargs(loss_fn="kl_div", loss_implementation="eager",
                                                           max_anchors=ANCHORS)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    _, loss, metrics = model(**batch, **train_kwargs)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()

    unary = (metrics["unary_loss_sum"] / metrics["unary_loss_total"]).item()
    selector = (metrics["selector_loss_sum"] / metrics["selector_loss_total"]).item()
    print(f"loss: {loss.item():.4f} (unary {unary:.4f} + selector {selector:.4f}) on {device}")


if __name__ == "__main__":
    main()
