"""Batched sampling: logprobs, min_tokens, penalties, greedy / temperature / min_p / top_k / top_p.

Processing order follows vLLM v1: logprobs come from the raw model logits; then a grammar's bitmask masks
the tokens it does not allow (structured outputs); then min_tokens blocks stop tokens; then repetition / presence / frequency penalties; greedy rows take the argmax of the penalised
logits; the other rows are divided by their temperature, truncated (min_p, then top_k, then top_p) and
sampled: on the CPU by inverse CDF (one uniform per row against its cumulative probabilities), elsewhere
with the exponential race ``argmax(probs / q)``, ``q ~ Exp(1)`` (no host sync). A row with its own generator
draws from it alone, so a seeded sequence's tokens do not depend on what else is in the batch.

The stages are functions of their own, the sampler's unit API (each checked against HF's logits processors):
``Sampler.process_logits`` (min_tokens, then the penalties: ``apply_penalties``), ``apply_min_p`` and
``apply_top_k_top_p``; ``DRAWS`` holds the draws, by the plan's ``DrawKind``.

The arithmetic is total (docs/serving/errors.md): every float parameter is clamped into the range float32 computes
faithfully (``SAMPLING_BOUNDS``) when the metadata is built; before a draw, a NaN logit counts as masked
and +inf as float32's largest value; a row left with no probability mass at all (every token masked)
samples ``NO_TOKEN`` rather than a random id, and the engine ends that request with an error. Logprobs are
finite or -inf (a NaN is reported as -inf).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mili.host_copy import tensor_on
from mili.runtime.plan import DrawKind
from mili.sampling_params import GREEDY_EPS, SamplingParams

_NEG_INF = float("-inf")
NO_TOKEN = -1  # a row's "token" when no token has any probability left (every one was masked)
_F32_MAX = torch.finfo(torch.float32).max
# The float parameters' ranges in float32 (past them a value would overflow to inf or underflow to 0, and
# inf / inf or 0 * inf is NaN). Clamping there is faithful: a temperature of 1e30 already flattens any
# model's logits to a uniform draw in float32, and a repetition penalty of 1e30 (or 1e-30) already sends a
# seen token's logit to 0 or far past every other one, as 1e39 would.
SAMPLING_BOUNDS = {"temperature": (0.0, 1e30), "repetition_penalty": (1e-30, 1e30)}
# Penalised logits stay below this, so that even the smallest temperature (GREEDY_EPS) leaves them finite: a
# +inf logit makes the softmax NaN (inf - inf), and a NaN row would draw a token outside the vocabulary.
_PENALISED_MAX = torch.finfo(torch.float32).max * GREEDY_EPS / 2


@dataclass
class TokenLogprobs:
    sampled_logprob: float  # logprob of the sampled token
    sampled_rank: int  # 1-based rank of the sampled token in the raw distribution
    top: list[tuple[int, float]]  # the top-N (token_id, logprob), best first; N = params.logprobs


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row; NO_TOKEN where nothing could be sampled
    logprobs: list[TokenLogprobs | None]  # None for rows whose params.logprobs is None
    errors: dict[int, str] = field(default_factory=dict)  # row -> why sampling it failed (its token: NO_TOKEN)


class PendingSample:
    """A step's draw still on the device (``Sampler(..., defer=True)``): ``ids`` [rows] stay there, where the next
    step's inputs read them, while their copy to the host runs (through pinned memory, without blocking);
    ``result()`` waits for that copy alone and gives the ``SamplerOutput`` (the logprobs are read then too)."""

    def __init__(self, ids: torch.Tensor, logprobs=None, done: SamplerOutput | None = None):
        self.ids, self._logprobs, self._done = ids, logprobs, done
        self._host, self._event = ids, None
        if done is None and ids.is_cuda:
            self._host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            self._host.copy_(ids, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    @classmethod
    def of(cls, out: SamplerOutput, device: torch.device) -> "PendingSample":
        """A draw already on the host (the per-row fallback) in the same wrapper."""
        return cls(tensor_on(out.token_ids, device), done=out)

    def result(self) -> SamplerOutput:
        if self._done is None:
            if self._event is not None:
                self._event.synchronize()
            token_ids = self._host.tolist()
            logprobs = self._logprobs() if self._logprobs is not None else [None] * len(token_ids)
            self._done = SamplerOutput(token_ids, logprobs)
        return self._done


_TOP_K_PARTIAL_MAX = 1024  # top-k up to this ranks only each row's k best (a topk), not the whole vocabulary


def _pad(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """[len(rows), max_len] long tensor, right-padded with ``pad``; ids above ``pad`` are clamped to it."""
    width = max(1, max(len(r) for r in rows))
    return tensor_on([r + [pad] * (width - len(r)) for r in rows], device).clamp_(0, pad)


def _rows(idx: list[int], device: torch.device) -> torch.Tensor:
    return tensor_on(idx, device)


@dataclass
class SamplingMetadata:
    """Per-step sampling state as tensors on ``device``. Fields that no row uses are None."""

    num_rows: int
    vocab_size: int
    greedy_rows: torch.Tensor  # long [G]: rows decoded greedily
    random_rows: torch.Tensor  # long [R]: rows sampled; the tensors below marked [R] are in this order
    temperature: torch.Tensor | None  # float [R]; None when every sampled row has temperature 1
    min_p: torch.Tensor | None  # float [R] (0 where disabled)
    top_k: torch.Tensor | None  # long [R] (vocab_size where disabled)
    top_p: torch.Tensor | None  # float [R] (1 where disabled)
    seeded: list[tuple[int, torch.Generator]]  # (index into random_rows, that row's generator)
    unseeded: torch.Tensor  # long: indices into random_rows that use the global RNG
    # min_tokens: logits[blocked_rows[j], blocked_tokens[j]] = -inf
    blocked_rows: torch.Tensor | None
    blocked_tokens: torch.Tensor | None
    # Penalties, for the rows in penalty_rows only ([P] / [P, L]); ids padded with vocab_size.
    penalty_rows: torch.Tensor | None
    repetition_penalty: torch.Tensor | None
    presence_penalty: torch.Tensor | None
    frequency_penalty: torch.Tensor | None
    seen_ids: torch.Tensor | None  # prompt + output ids (repetition penalty)
    output_ids: torch.Tensor | None  # output ids (presence / frequency penalties)
    # Logprobs: the rows that want them, and N per row (entries of num_logprobs follow logprob_rows).
    logprob_rows: torch.Tensor | None
    num_logprobs: list[int]
    max_logprobs: int
    # Structured outputs: rows constrained by a grammar, and their allowed tokens as xgrammar's bitmask
    # ([num_rows, ceil(V / 32)] int32, one bit a token); set by the model runner.
    grammar_rows: list[int] | None = None
    grammar_bitmask: torch.Tensor | None = None
    # Rows whose token is forced whatever the logits say (a thinking budget's end): sampled[forced_rows] = tokens
    forced_rows: torch.Tensor | None = None
    forced_tokens: torch.Tensor | None = None
    # Speculative decoding: each sampled row's draft token (-1: none), in random_rows' order ([R]); a row with
    # a draft accepts it with its probability, else draws from the rest (``_verify_drafts``). Greedy rows take
    # their argmax: the caller accepts a draft equal to it.
    drafts: torch.Tensor | None = None
    num_drafted_rows: int = 0  # random rows with a draft
    draft_seeded: list[tuple[int, torch.Generator]] = field(default_factory=list)  # those rows' own generators

    @classmethod
    def build(cls, params: list[SamplingParams], generators: list[torch.Generator | None],
              prompt_token_ids: list[list[int]], output_token_ids: list[list[int]],
              vocab_size: int, device: torch.device, drafts: list[int] | None = None,
              forced: list[tuple[int, int]] | None = None) -> "SamplingMetadata":
        """``forced``: (row, token) pairs drawn as given."""
        n = len(params)
        assert len(generators) == len(prompt_token_ids) == len(output_token_ids) == n
        greedy = [i for i, p in enumerate(params) if p.greedy]
        rand = [i for i, p in enumerate(params) if not p.greedy]
        rp = [params[i] for i in rand]

        def per_random(values: list, dtype: torch.dtype, needed: bool) -> torch.Tensor | None:
            return tensor_on(values, device, dtype) if needed else None

        temps = [_bounded("temperature", p.temperature) for p in rp]
        top_k = [vocab_size if p.top_k < 0 else min(p.top_k, vocab_size) for p in rp]
        seeded = [(j, generators[i]) for j, i in enumerate(rand) if generators[i] is not None]

        blocked = [(i, t) for i, p in enumerate(params) if len(output_token_ids[i]) < p.min_tokens
                   for t in sorted(p.stop_ids()) if t < vocab_size]
        pen = [i for i, p in enumerate(params) if p.uses_penalties]
        lp = [i for i, p in enumerate(params) if p.logprobs is not None]
        num_lp = [params[i].logprobs for i in lp]

        def per_pen(attr: str) -> torch.Tensor | None:
            return tensor_on([_bounded(attr, getattr(params[i], attr)) for i in pen], device, torch.float32) \
                if pen else None

        rand_drafts = [drafts[i] for i in rand] if drafts is not None else []
        return cls(
            drafts=tensor_on(rand_drafts, device) if any(d >= 0 for d in rand_drafts)
            else None,
            num_drafted_rows=sum(d >= 0 for d in rand_drafts),
            draft_seeded=[(j, g) for j, g in seeded if rand_drafts[j] >= 0] if rand_drafts else [],
            num_rows=n, vocab_size=vocab_size,
            greedy_rows=_rows(greedy, device), random_rows=_rows(rand, device),
            temperature=per_random(temps, torch.float32, any(t != 1.0 for t in temps)),
            min_p=per_random([p.min_p for p in rp], torch.float32, any(p.min_p > 0 for p in rp)),
            top_k=per_random(top_k, torch.long, any(k < vocab_size for k in top_k)),
            top_p=per_random([p.top_p for p in rp], torch.float32, any(p.top_p < 1 for p in rp)),
            seeded=seeded,
            unseeded=_rows([j for j, i in enumerate(rand) if generators[i] is None], device),
            blocked_rows=_rows([b[0] for b in blocked], device) if blocked else None,
            blocked_tokens=_rows([b[1] for b in blocked], device) if blocked else None,
            penalty_rows=_rows(pen, device) if pen else None,
            repetition_penalty=per_pen("repetition_penalty"),
            presence_penalty=per_pen("presence_penalty"),
            frequency_penalty=per_pen("frequency_penalty"),
            seen_ids=_pad([prompt_token_ids[i] + output_token_ids[i] for i in pen], vocab_size, device)
            if pen else None,
            output_ids=_pad([output_token_ids[i] for i in pen], vocab_size, device) if pen else None,
            logprob_rows=_rows(lp, device) if lp else None,
            num_logprobs=num_lp, max_logprobs=min(max(num_lp, default=0), vocab_size),
            forced_rows=_rows([r for r, _ in forced], device) if forced else None,
            forced_tokens=_rows([t for _, t in forced], device) if forced else None,
        )


def _bounded(name: str, value: float) -> float:
    low, high = SAMPLING_BOUNDS.get(name, (-_F32_MAX, _F32_MAX))
    return min(max(value, low), high)


def apply_penalties(logits: torch.Tensor, seen_ids: torch.Tensor, output_ids: torch.Tensor,
                     repetition: torch.Tensor, presence: torch.Tensor,
                     frequency: torch.Tensor) -> torch.Tensor:
    """Penalised copy of ``logits`` [P, V]. Id tensors are padded with V (a scratch column, dropped)."""
    p, v = logits.shape
    # Repetition penalty (HF semantics) over every token seen in prompt + output.
    seen = torch.zeros(p, v + 1, dtype=torch.bool, device=logits.device)
    seen.scatter_(1, seen_ids, True)
    rep = repetition.unsqueeze(1).clamp(max=_PENALISED_MAX)  # finite: 0 * inf would be NaN
    penalised = torch.where(logits > 0, logits / rep, logits * rep).clamp_(-_PENALISED_MAX, _PENALISED_MAX)
    logits = torch.where(seen[:, :v] & (logits != _NEG_INF), penalised, logits)  # (a masked token stays masked)
    # OpenAI presence / frequency penalties over output tokens only.
    counts = torch.zeros(p, v + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=logits.dtype))
    counts = counts[:, :v]
    return logits - (frequency.unsqueeze(1) * counts + presence.unsqueeze(1) * (counts > 0))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf, in place) tokens whose probability is below min_p * the row's best probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill_(probs < threshold, _NEG_INF)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                       top_p: torch.Tensor | None) -> torch.Tensor:
    """Masked copy of ``logits`` [R, V]: keep the top_k best (ties with the k-th kept; k = V disables),
    then the smallest set of best tokens whose (renormalised) probability reaches top_p (1 disables)."""
    if top_k is None and top_p is None:
        return logits
    v = logits.shape[-1]
    if top_k is not None:
        k_max = int(top_k.max())
        if k_max <= _TOP_K_PARTIAL_MAX and k_max < v:
            partial = _top_k_top_p_partial(logits, top_k, top_p, k_max)
            if partial is not None:
                return partial
    ascending, order = logits.sort(dim=-1)
    if top_k is not None:
        kth_best = ascending.gather(1, (v - top_k).clamp(0, v - 1).unsqueeze(1))
        ascending.masked_fill_(ascending < kth_best, _NEG_INF)
    if top_p is not None:
        _mask_top_p_(ascending, top_p)
    return torch.empty_like(logits).scatter_(1, order, ascending)


def _mask_top_p_(ascending: torch.Tensor, top_p: torch.Tensor) -> None:
    """Top-p in place on logits sorted ascending per row: drop a token when the mass of it and
    everything worse is <= 1 - p, i.e. when the tokens strictly better than it already reach p. The
    best token is always kept; rows with p = 1 are left alone (the cumsum can be exactly 0 on
    underflowing tokens)."""
    cum = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= (1 - top_p).unsqueeze(1)
    drop[:, -1] = False
    drop &= (top_p < 1).unsqueeze(1)
    ascending.masked_fill_(drop, _NEG_INF)


def _top_k_top_p_partial(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor | None,
                         k_max: int) -> torch.Tensor | None:
    """``apply_top_k_top_p`` without sorting the vocabulary: every row keeps at most its k best, so
    only the ``k_max`` best of each row (one ``topk``) are ranked, and top-p runs on those survivors
    (the renormalised distribution top-p sees is theirs alone). None when a tie with some row's k-th
    best reaches past ``k_max`` (the full sort then decides, keeping every tied token)."""
    best, order = logits.topk(k_max, dim=-1)  # descending
    kth_best = best.gather(1, (top_k - 1).clamp(max=k_max - 1).unsqueeze(1))
    if bool(((logits >= kth_best).sum(dim=-1) > k_max).any()):
        return None
    ascending, order = best.flip(-1), order.flip(-1)  # as the sorted path holds them
    ascending = ascending.masked_fill(ascending < kth_best, _NEG_INF)
    if top_p is not None:
        _mask_top_p_(ascending, top_p)
    return torch.full_like(logits, _NEG_INF).scatter_(1, order, ascending)


def _exponential_race(probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """argmax(probs / q) with q ~ Exp(1) i.i.d.: a draw from ``probs`` (the Gumbel-max trick in disguise)."""
    q = torch.empty_like(probs)
    if meta.unseeded.numel() == probs.shape[0]:
        q.exponential_()
    elif meta.unseeded.numel():
        q[meta.unseeded] = torch.empty(meta.unseeded.numel(), probs.shape[1], device=probs.device,
                                       dtype=probs.dtype).exponential_()
    for j, gen in meta.seeded:  # each seeded row consumes exactly V draws of its own generator
        q[j].exponential_(generator=gen)
    # exponential_ can return exactly 0; a 0/0 would be NaN, which argmax would pick.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return (probs / q).argmax(dim=-1)


def _inverse_cdf(probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """A draw from ``probs`` with one uniform per row against the row's cumulative sum: the CPU's sampler,
    ~20x cheaper there than drawing V exponentials per row (``exponential_`` runs at ~20 ns an element).
    The float32 sum shifts the boundaries by ~1e-5 of the mass at most, as the top-p mask's does. Seeded
    rows draw their uniform from their own generator."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    u = torch.empty(probs.shape[0], 1, dtype=probs.dtype, device=probs.device)
    if meta.unseeded.numel() == probs.shape[0]:
        u.uniform_()
    elif meta.unseeded.numel():
        u[meta.unseeded] = torch.rand(meta.unseeded.numel(), 1, dtype=probs.dtype, device=probs.device)
    for j, gen in meta.seeded:
        u[j] = torch.rand(1, dtype=probs.dtype, device=probs.device, generator=gen)
    # u < total, so the first index whose cumulative sum passes u has a non-zero probability
    u = torch.minimum(u.mul_(total), torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True).squeeze(1)


DRAWS = {DrawKind.INVERSE_CDF: _inverse_cdf, DrawKind.EXPONENTIAL_RACE: _exponential_race}  # (the plan's ``draw``)


def _verify_drafts(probs: torch.Tensor, meta: SamplingMetadata, draw) -> torch.Tensor:
    """One token per row of ``probs`` [R, V] (the random rows, normalised), rows with a draft d verifying it:
    d with probability p(d), otherwise a draw from p without d (renormalised); so the token is distributed as
    p whatever the draft (speculative sampling with a draft that puts all its mass on d). Rows without a draft
    draw as ``draw`` does. A drafted row takes one uniform (from its own generator when seeded) before its
    draw."""
    drafts = meta.drafts
    has = drafts >= 0
    d = drafts.clamp(min=0).unsqueeze(1)
    u = torch.ones(probs.shape[0], dtype=probs.dtype, device=probs.device)  # (1: never accepts)
    seeded = {j for j, _ in meta.draft_seeded}
    unseeded = [j for j in has.nonzero().flatten().tolist() if j not in seeded]
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), dtype=probs.dtype, device=probs.device)
    for j, gen in meta.draft_seeded:
        u[j] = torch.rand(1, dtype=probs.dtype, device=probs.device, generator=gen)
    accept = has & (u < probs.gather(1, d).squeeze(1))
    rest = probs.scatter(1, d, torch.zeros_like(d, dtype=probs.dtype)).where(has.unsqueeze(1), probs)
    return torch.where(accept, drafts, draw(rest, meta))


def _sanitise_(logits: torch.Tensor) -> torch.Tensor:
    """In place: a NaN logit is masked (-inf) and +inf becomes float32's largest value, so that a softmax
    of the row has no NaN (inf - inf). Returns ``logits``."""
    return logits.nan_to_num_(nan=_NEG_INF, posinf=_F32_MAX, neginf=_NEG_INF)


def _no_mass(logits: torch.Tensor) -> torch.Tensor:
    """bool [rows]: the rows of sanitised ``logits`` where every token is masked (nothing can be drawn)."""
    return logits.amax(dim=-1) == _NEG_INF


def _apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab_size: int) -> None:
    from xgrammar import apply_token_bitmask_inplace  # (CUDA: its Triton/CUDA kernel)

    apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=rows)


def _float_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().argmax(dim=-1)


class Sampler:
    """``argmax``: the greedy rows' argmax over the model's logits (any dtype), when nothing else is asked
    of a step (all greedy, no min_tokens, penalties or logprobs): no float32 copy is made then. The CPU
    kernels give one that reads bf16 in place (a batch of 32 x 152k: ~0.4 ms, torch's ~9)."""

    def __init__(self, argmax=_float_argmax, apply_bitmask=_apply_bitmask, draw=_inverse_cdf):
        self.argmax = argmax
        self.apply_bitmask = apply_bitmask
        self.draw = draw  # (probs [R, V], meta) -> ids [R]: one of DRAWS, as the execution plan says

    def greedy(self, logits: torch.Tensor, vocab_size: int, defer: bool = False) -> SamplerOutput | PendingSample:
        """Each row's argmax over the vocabulary: what ``__call__`` gives rows that are all greedy with nothing else
        to apply (no logprobs, penalties, blocked tokens or grammar)."""
        ids = self.argmax(logits[:, :vocab_size])
        if defer:
            return PendingSample(ids)
        return SamplerOutput(token_ids=ids.tolist(), logprobs=[None] * logits.shape[0])

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata,
                 defer: bool = False) -> SamplerOutput | PendingSample:
        """``logits`` [B, >= vocab] in the model's dtype (a private float32 copy is made where needed). ``defer``: the
        draw stays on the device (a ``PendingSample``: nothing here waits for the device)."""
        assert logits.dim() == 2 and logits.shape[0] == meta.num_rows, logits.shape
        assert logits.shape[1] >= meta.vocab_size, (logits.shape, meta.vocab_size)
        if (meta.greedy_rows.numel() == meta.num_rows and meta.logprob_rows is None and meta.blocked_rows is None
                and meta.penalty_rows is None and meta.grammar_rows is None and meta.forced_rows is None):
            return self.greedy(logits, meta.vocab_size, defer)
        # A private float32 copy (modified in place); columns past the vocab (padding) are dropped.
        logits = logits[:, :meta.vocab_size].to(torch.float32, copy=True)
        raw = logits.index_select(0, meta.logprob_rows) if meta.logprob_rows is not None else None  # a copy
        if meta.grammar_rows is not None:  # structured outputs: the tokens each grammar allows
            self.apply_bitmask(logits, meta.grammar_bitmask, meta.grammar_rows, meta.vocab_size)
        logits = _sanitise_(self.process_logits(logits, meta))
        no_mass = _no_mass(logits)

        sampled = torch.empty(meta.num_rows, dtype=torch.long, device=logits.device)
        # (index_select rather than logits[rows]: row gathers of [B, 152k] are ~5x faster on the CPU)
        if meta.greedy_rows.numel() == meta.num_rows:
            sampled = logits.argmax(dim=-1)
        elif meta.greedy_rows.numel():
            sampled[meta.greedy_rows] = logits.index_select(0, meta.greedy_rows).argmax(dim=-1)
        if meta.random_rows.numel():
            x = logits if meta.random_rows.numel() == meta.num_rows else logits.index_select(0, meta.random_rows)
            if meta.temperature is not None:  # (x - max) / t: the best token stays at 0, nothing overflows
                _sanitise_(x.sub_(x.amax(dim=-1, keepdim=True)).div_(meta.temperature.unsqueeze(1)))
            if meta.min_p is not None:
                x = apply_min_p(x, meta.min_p)
            x = apply_top_k_top_p(x, meta.top_k, meta.top_p)
            probs = x.softmax(dim=-1)
            drawn = self.draw(probs, meta) if meta.drafts is None else _verify_drafts(probs, meta, self.draw)
            sampled[meta.random_rows] = drawn.clamp_(0, meta.vocab_size - 1)
            no_mass[meta.random_rows] = _no_mass(x)  # (truncation keeps a row's best token: this is the masks')
        sampled.masked_fill_(no_mass, NO_TOKEN)  # a row with no token left draws nothing
        if meta.forced_rows is not None:
            sampled[meta.forced_rows] = meta.forced_tokens

        def logprobs() -> list[TokenLogprobs | None]:
            out: list[TokenLogprobs | None] = [None] * meta.num_rows
            return self._logprobs(raw, sampled[meta.logprob_rows], meta, out) if raw is not None else out

        if defer:
            return PendingSample(sampled, logprobs if raw is not None else None)
        return SamplerOutput(token_ids=sampled.tolist(), logprobs=logprobs())

    @staticmethod
    def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """min_tokens and penalties, in place on float32 ``logits`` [B, V] (returned)."""
        if meta.blocked_rows is not None:
            logits[meta.blocked_rows, meta.blocked_tokens] = _NEG_INF
        if meta.penalty_rows is not None:
            rows = meta.penalty_rows
            logits[rows] = apply_penalties(logits[rows], meta.seen_ids, meta.output_ids,
                                            meta.repetition_penalty, meta.presence_penalty,
                                            meta.frequency_penalty)
        return logits

    @staticmethod
    def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, meta: SamplingMetadata,
                  out: list[TokenLogprobs | None]) -> list[TokenLogprobs | None]:
        """Fill ``out`` for the logprob rows, from the raw (unprocessed) logits ``raw`` [L, V]."""
        lps = raw.log_softmax(dim=-1).nan_to_num_(nan=_NEG_INF)  # finite or -inf (the server's stand-in)
        tok = tokens.clamp(min=0).unsqueeze(1)  # (NO_TOKEN rows: the request ends with an error instead)
        sampled_lp = lps.gather(1, tok).squeeze(1).tolist()
        rank = ((raw > raw.gather(1, tok)).sum(dim=-1) + 1).tolist()
        top_vals, top_ids = lps.topk(meta.max_logprobs, dim=-1)  # one batched topk, sliced per row
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
        for j, row in enumerate(meta.logprob_rows.tolist()):
            n = meta.num_logprobs[j]
            out[row] = TokenLogprobs(sampled_logprob=sampled_lp[j], sampled_rank=rank[j],
                                     top=list(zip(top_ids[j][:n], top_vals[j][:n])))
        return out
