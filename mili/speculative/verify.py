"""Verification: which drafted tokens a step accepts, from the sampler's draw at each drafted position."""

from __future__ import annotations

from dataclasses import dataclass, field

from mili.runtime.sampler import SamplerOutput, TokenLogprobs


@dataclass(eq=False)
class SampleRow:
    """One row the sampler draws: ``seq``'s next token as if ``ahead`` (the drafts before this position) were
    accepted; ``draft`` is the draft at this position (-1: none, the row after the last draft or no drafts)."""

    seq: object  # Sequence
    ahead: list[int]
    draft: int = -1


@dataclass
class StepTokens:
    """Per sampling sequence of a step (``SchedulerOutput.sample_rows`` order): its new tokens (accepted drafts,
    then the step's own token), their logprobs, how many drafts it verified and accepted; ``errors``: sampling
    row -> why it failed (its request ends)."""

    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs | None]]
    num_drafted: list[int]
    num_accepted: list[int]
    errors: dict[int, str] = field(default_factory=dict)


def accept_drafts(out: SamplerOutput, drafts: list[tuple[object, list[int]]]) -> StepTokens:
    """``out`` has 1 + len(draft) rows per (sequence, draft) of ``drafts``, in order. A sequence takes the draw
    of each position while it equals the draft there (the draft is accepted); the first draw that differs,
    or the one after the last draft, is its last new token. A draw that ends the sequence (a stop token)
    ends it there too. A failed row fails the sequence, unless an earlier draft was rejected."""
    result = StepTokens([], [], [], [])
    row = 0
    for i, (seq, draft) in enumerate(drafts):
        tokens, logprobs = [], []
        stop_ids = seq.params.stop_ids() if draft else ()
        for j in range(len(draft) + 1):
            r = row + j
            if r in out.errors:
                result.errors[i] = out.errors[r]
                break
            tokens.append(out.token_ids[r])
            logprobs.append(out.logprobs[r])
            if j == len(draft) or out.token_ids[r] != draft[j] or out.token_ids[r] in stop_ids:
                break
        result.token_ids.append(tokens)
        result.logprobs.append(logprobs)
        result.num_drafted.append(len(draft))
        result.num_accepted.append(sum(1 for t, d in zip(tokens, draft) if t == d) if i not in result.errors
                                   else 0)
        row += len(draft) + 1
    return result
