"""Verification: which drafted tokens a step accepts, from the sampler's draw at each drafted position."""

from __future__ import annotations

import itertools
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


def verification_rows(scheduled: list, sample_rows: list) -> tuple[list[SampleRow], list[int]]:
    """The rows the sampler draws for a step (each sampling sequence's 1 + len(draft) rows, its drafts checked
    in order; forked children repeat their parent's row, and none drafts then), and for each the row of the
    step's logits it reads (``scheduled`` order)."""
    first_row = dict(zip((i for i, s in enumerate(scheduled) if s.samples),
                         itertools.accumulate((1 + len(s.draft) for s in scheduled if s.samples), initial=0)))
    rows, logits_rows = [], []
    for seq, i in sample_rows:
        draft = scheduled[i].draft
        rows += [SampleRow(seq, draft[:j], draft[j] if j < len(draft) else -1) for j in range(len(draft) + 1)]
        logits_rows += range(first_row[i], first_row[i] + len(draft) + 1)
    return rows, logits_rows


def rejected_positions(drafting: list, num_accepted: dict, hybrid: bool) -> dict:
    """Per drafting ``ScheduledSeq``'s sequence, the positions of the step that stay uncomputed: its rejected
    drafts; a hybrid's whole chunk where any was rejected (its recurrent state cannot drop a token: it goes back
    to before the chunk, which is computed again)."""
    rejected = {}
    for s in drafting:
        n = len(s.draft) - num_accepted[s.seq]
        rejected[s.seq] = s.num_new_tokens if n and hybrid else n
    return rejected
