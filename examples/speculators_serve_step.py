"""One serving step of a speculators DFlash 2 draft on the fused kernels: draft a block,
walk the patched selector, verify.

speculators trains drafters and leaves serving to engines (vLLM, SGLang); this shows
the step such an engine runs per request batch, on the pieces of a patched
``DFlash2DraftModel``:

1. draft one block per request in a single forward: ``[anchor, MASK, ...]`` (the
   anchor is the last verified token) attending to the verifier's context features;
   the draft hidden states and logits of the D = L - 1 predicted positions;
2. ``model.candidate_selector.walk`` (ours after ``dk.patch``): fused top-k, edge
   scores and the walk, greedy (temperature 0) and sampled (temperature 1, returning
   the proposal q);
3. verify against the verifier's distributions for the D + 1 positions:
   ``dk.greedy_verify`` (longest prefix equal to the argmax) and ``dk.rejection_sample``
   (lossless: the emitted tokens follow the verifier's own distribution).

The model is tiny, with random weights (``examples/tiny_models.py``; nothing is
downloaded), and there is no verifier model: its context features are random tensors and its
distributions over the block a noisy copy of the draft's. Runs in seconds on a CPU,
unchanged on a GPU::

    python examples/speculators_serve_step.py
"""

from __future__ import annotations

import torch
from tiny_models import BLOCK, HIDDEN, MASK_TOKEN, VOCAB, as_if_trained, speculators_draft

import dflash2_kernels as dk

REQUESTS, CONTEXT = 4, 12  # requests in the batch, verified tokens of context each


@torch.no_grad()
def draft_block(model, context_features: torch.Tensor, anchor_ids: torch.Tensor):
    """context_features [B, C, 2H] (the verifier's auxiliary hidden states at the C
    verified positions), anchor_ids [B] int64 -> (hidden [B, D, H], logits [B, D, V])."""
    batch, context = context_features.shape[:2]
    block = torch.full((batch, BLOCK), MASK_TOKEN, dtype=torch.long, device=anchor_ids.device)
    block[:, 0] = anchor_ids
    hidden = model.embed_tokens(block)
    target_hidden = model.hidden_norm(model.fc(context_features))
    # The block sits right after the context: positions C .. C + L - 1.
    position_ids = torch.arange(context + BLOCK, device=anchor_ids.device).expand(batch, -1)
    position_embeddings = model.rotary_emb(hidden, position_ids)
    for layer in model.layers:
        # No mask: the block attends to all of its context and to itself (non-causal).
        hidden = layer(hidden_states=hidden, target_hidden=target_hidden, attention_mask=None,
                       position_ids=position_ids, position_embeddings=position_embeddings)
    hidden = model.norm(hidden)[:, 1:]  # position 0 holds the anchor: not a prediction
    return hidden, model.lm_head(hidden)


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = as_if_trained(speculators_draft(seed=0)).to(device).eval()
    print(dk.patch(model))
    selector = model.candidate_selector
    # Inputs drawn on the CPU, the same on every device; the walk and the verification
    # draw their uniforms from a generator on the device.
    inputs = torch.Generator().manual_seed(0)
    generator = torch.Generator(device=device).manual_seed(0)

    context_features = torch.randn(REQUESTS, CONTEXT, 2 * HIDDEN, generator=inputs).to(device)
    anchor_ids = torch.randint(0, VOCAB - 1, (REQUESTS,), generator=inputs).to(device)
    hidden, logits = draft_block(model, context_features, anchor_ids)
    # Stand-in for the verifier's forward over [anchor, path]: its next-token logits at
    # the D + 1 block positions [B, D + 1, V], here the draft's own logits plus noise (a
    # verifier that mostly agrees with the draft, which is what training aims at) and,
    # after the block, the verifier's head on a random hidden state.
    with torch.no_grad():
        noise = torch.randn(logits.shape, generator=inputs).to(device)
        after = model.verifier_lm_head(torch.randn(REQUESTS, 1, HIDDEN, generator=inputs).to(device))
        target_logits = torch.cat([logits + 0.3 * logits.std() * noise, after], dim=1)

    greedy_path, _, _ = selector.walk(hidden, logits, anchor_ids, 0.0)
    accepted, bonus = dk.greedy_verify(greedy_path, target_logits)
    for b in range(REQUESTS):
        print(f"greedy  request {b}: path {greedy_path[b].tolist()} accepted {accepted[b].item()} "
              f"bonus {bonus[b].item()}")

    temperature = 1.0
    path, candidate_ids, draft_probs = selector.walk(hidden, logits, anchor_ids, temperature, generator=generator)
    target_probs = torch.softmax(target_logits / temperature, dim=-1)
    accepted, bonus = dk.rejection_sample(path, target_probs, draft_probs, candidate_ids, generator=generator)
    for b in range(REQUESTS):
        print(f"sampled request {b}: path {path[b].tolist()} accepted {accepted[b].item()} bonus {bonus[b].item()}")


if __name__ == "__main__":
    main()
