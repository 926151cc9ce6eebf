"""Verification: which drafted tokens a step accepts, from the sampler's draw at each drafted position; and a step's
drafts around its model run on the runner (``DraftedStep``), with what the step gives back (``StepResult``)."""

from __future__ import annotations

import itertools
from concurrent.futures import Future
from dataclasses import dataclass, field

from mili.host_copy import tensor_on
from mili.runtime.sampler import PendingSample, SamplerOutput, TokenLogprobs
from mili.runtime.sampling import sample_step


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


@dataclass
class StepResult:
    """What a step gives back to the engine core: the sampled tokens (None if no sequence samples), the prompt
    logprobs it scored (``ModelRunner.forward_logits``), per sequence that verified drafts, the positions of the step
    that stay uncomputed (``rejected_positions``), which the scheduler accounts, and the answers of pooling requests
    (``pooler.py``)."""

    tokens: StepTokens | None = None
    scored: list[tuple] = field(default_factory=list)
    num_rejected: dict = field(default_factory=dict)
    pooled: dict = field(default_factory=dict)  # pooling requests whose prompt completed: sequence -> its answer
    # a deferred step (``execute(defer=True)``): the draw, still on the device; ``tokens`` once it is read
    pending: PendingSample | None = None

    def resolve(self, sample_rows: list) -> StepTokens | None:
        """The step's tokens on the host: waits for a deferred draw (a step without drafts)."""
        if self.tokens is None and self.pending is not None:
            self.tokens = accept_drafts(self.pending.result(), [(seq, []) for seq, _ in sample_rows])
        return self.tokens


class DraftedStep:
    """A step's drafts around its model run (``ModelRunner.execute``). Made before the model runs: the drafts the
    scheduler left to the MTP head are made, and a hybrid's state before its drafts is kept in a spare row (as many as
    drafting). ``finish``, once the logits are in: the draw, which drafts it accepts, a state that took rejected
    drafts put back to before the chunk (computed again), and the MTP head told what stands.
    ``copy_states``: the runner's (rank 0 sends the copies to the other tensor-parallel ranks)."""

    def __init__(self, scheduled: list, mtp, hybrid: bool, states, copy_states):
        self.scheduled, self.mtp, self.hybrid, self.states, self.copy_states = scheduled, mtp, hybrid, states, \
            copy_states
        if mtp is not None:  # the drafts the scheduler left to the MTP head
            mtp.draft(scheduled)
        self.drafting = [s for s in scheduled if s.draft]
        if hybrid:  # a hybrid's state before its drafts, kept in a spare row (as many as drafting)
            copy_states([(s.seq.state_slot, row) for s, row in zip(self.drafting, states.spare_rows)])

    def finish(self, sample_rows: list, logits, scored: list, pooled: dict, sampler, grammar: Future | None,
               vocab_size: int, device, defer: bool) -> StepResult:
        """The step's result from its logits (``sample_rows``: the scheduler's; ``defer``: the draw stays on the
        device, ``StepResult.pending``, a step without drafts)."""
        scheduled = self.scheduled
        if not sample_rows:
            if self.mtp is not None:
                self.mtp.keep(scheduled, [], {}, {})
            return StepResult(None, scored, pooled=pooled)
        rows, logits_rows = verification_rows(scheduled, sample_rows)
        if logits_rows != list(range(logits.shape[0])):
            logits = logits.index_select(0, tensor_on(logits_rows, device))
        sampled = sample_step(sampler, logits, rows, grammar, vocab_size, device, defer)
        if defer:
            return StepResult(None, scored, pooled=pooled, pending=sampled)
        tokens = accept_drafts(sampled, [(seq, scheduled[i].draft) for seq, i in sample_rows])
        by_seq = {seq: n for (seq, _), n in zip(sample_rows, tokens.num_accepted)}
        rejected = rejected_positions(self.drafting, by_seq, self.hybrid)
        if self.hybrid:  # a state that took rejected drafts goes back to before the chunk, computed again
            self.copy_states([(row, s.seq.state_slot) for s, row in zip(self.drafting, self.states.spare_rows)
                              if rejected.get(s.seq)])
        if self.mtp is not None:
            self.mtp.keep(scheduled, sample_rows, by_seq, rejected)
        return StepResult(tokens, scored, rejected, pooled)
