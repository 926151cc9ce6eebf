"""A step's sampling: the sampler's metadata from the rows' sequences, and the per-row fallback that keeps a
step alive when some rows' sampling fails (their requests end with the error; the other rows' tokens stand)."""

from __future__ import annotations

import logging
from concurrent.futures import Future

import torch

from mili.runtime.sampler import NO_TOKEN, PendingSample, Sampler, SamplerOutput, SamplingMetadata

log = logging.getLogger("mili")


def sampling_metadata(rows: list, vocab_size: int, device: torch.device) -> SamplingMetadata:
    """The sampler's tensors for ``rows`` (``SampleRow``s)."""
    # the token lists only where a row needs them (penalties; min_tokens counts outputs): copying
    # every prompt each step would cost O(context) per token
    penalties = any(r.seq.params.uses_penalties for r in rows)
    counts = penalties or any(r.seq.params.min_tokens for r in rows)
    drafts = [r.draft for r in rows]
    forced = [(j, r.seq.thinking.forced_next) for j, r in enumerate(rows) if not _drawn(r.seq)]
    return SamplingMetadata.build(
        [r.seq.params for r in rows], [r.seq.generator for r in rows],
        [r.seq.token_ids[:r.seq.prompt_len] if penalties else [] for r in rows],
        [r.seq.output_token_ids + r.ahead if counts else [] for r in rows], vocab_size,
        device, drafts=drafts if any(d >= 0 for d in drafts) else None, forced=forced)


def _drawn(seq) -> bool:
    """The sequence draws its own next token (none is forced: a thinking budget's end)."""
    return seq.thinking is None or seq.thinking.forced_next is None


def _argmax_only(params) -> bool:
    """A row whose token is its logits' argmax and nothing else: greedy, no logprobs, no penalties, no min_tokens
    (whose stop tokens the sampler blocks)."""
    return params.greedy and params.logprobs is None and not params.uses_penalties and not params.min_tokens


def sample_step(sampler: Sampler, logits: torch.Tensor, rows: list, grammar: Future | None, vocab_size: int,
                device: torch.device, defer: bool = False) -> SamplerOutput | PendingSample:
    """The step's tokens, one per row of ``logits`` (``defer``: still on the device, a ``PendingSample``). A failure
    that belongs to rows rather than to the step (their parameters, a grammar's bitmask, the draw) does not end
    the step: the rows are sampled again one by one, and those that fail alone come back in ``errors`` (their
    requests end with that error, the core goes on); the other rows' tokens stand."""
    try:
        if grammar is None and all(_argmax_only(r.seq.params) and _drawn(r.seq) for r in rows):  # (no metadata)
            return sampler.greedy(logits, vocab_size, defer)
        meta = sampling_metadata(rows, vocab_size, device)
        if grammar is not None:
            bitmask, meta.grammar_rows = grammar.result()
            meta.grammar_bitmask = bitmask.to(device, non_blocking=True)
        return sampler(logits, meta, defer)
    except Exception:
        log.exception("sampling a step of %d rows failed: sampling them one by one", len(rows))
    out = _sample_rows_apart(sampler, logits, rows, vocab_size, device)
    return PendingSample.of(out, device) if defer else out


def _sample_rows_apart(sampler: Sampler, logits: torch.Tensor, rows: list, vocab_size: int,
                       device: torch.device) -> SamplerOutput:
    """Each row on its own; a row that fails draws NO_TOKEN and its error."""
    out = SamplerOutput([], [])
    for row, each in enumerate(rows):
        try:
            meta = sampling_metadata([each], vocab_size, device)
            bitmask = each.seq.grammar.next_token_bitmask(vocab_size, each.ahead) \
                if each.seq.grammar is not None else None
            if bitmask is not None:
                meta.grammar_bitmask, meta.grammar_rows = bitmask.to(device), [0]
            one = sampler(logits[row:row + 1], meta)
            out.token_ids += one.token_ids
            out.logprobs += one.logprobs
        except Exception as e:
            out.token_ids.append(NO_TOKEN)
            out.logprobs.append(None)
            out.errors[row] = f"sampling its token failed: {type(e).__name__}: {e}"
    return out
