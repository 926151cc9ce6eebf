"""Pooling: a pooling request's answer from its last token's final hidden state (``ForwardBatch.num_pool_rows``'s
rows, final-normed as the model returns every row it is asked for).

- ``embed``: the hidden state itself, as float32 (the API side truncates and L2-normalises it: Qwen3-Embedding's
  last-token pooling and Normalize, as sentence-transformers runs them).
- ``score`` with ``score_token_ids`` (no, yes): a causal LM's P(yes) = softmax over those two tokens' logits at the
  last position, Qwen3-Reranker's recipe (the full logits row is made, as HF's recipe makes it, then two columns
  taken).
- ``score`` without: a sequence-classification head's logit through a sigmoid (one label; with more, the softmax's
  last column), as sentence-transformers' CrossEncoder scores a converted reranker.

Every tensor-parallel rank calls ``pool`` with the same rows (the logits gather over the ranks)."""

from __future__ import annotations

import torch


def pool(model, hidden: torch.Tensor, specs: list) -> list[list[float]]:
    """Each row's answer: a list of floats (an embedding, or [score])."""
    out: list[list[float] | None] = [None] * len(specs)
    embed = [i for i, s in enumerate(specs) if s.task == "embed"]
    if embed:
        for i, values in zip(embed, hidden[embed].float().tolist()):
            out[i] = values
    by_tokens = [i for i, s in enumerate(specs) if s.task == "score" and s.score_token_ids]
    if by_tokens:
        logits = model.compute_logits(hidden[by_tokens]).float()
        ids = torch.tensor([specs[i].score_token_ids for i in by_tokens], dtype=torch.long, device=logits.device)
        scores = logits.gather(1, ids).softmax(dim=-1)[:, -1]
        for i, score in zip(by_tokens, scores.tolist()):
            out[i] = [score]
    by_head = [i for i, s in enumerate(specs) if s.task == "score" and not s.score_token_ids]
    if by_head:
        logits = model.score(hidden[by_head]).float()
        scores = logits[:, 0].sigmoid() if logits.shape[1] == 1 else logits.softmax(dim=-1)[:, -1]
        for i, score in zip(by_head, scores.tolist()):
            out[i] = [score]
    return out
