"""The sampler's arithmetic is total (hypothesis): for any valid SamplingParams, however extreme (0, denormals,
1e38, 1e39, inf), with every kind of mask (min_tokens over stop tokens, grammar bitmasks, NaN and +-inf
logits), the ids it returns are in the vocabulary or NO_TOKEN, NO_TOKEN exactly when no token is left,
a sampled token is one its masks allow, and logprobs are finite or -inf. Both sampling paths: the CPU's
(MILI's kernels for argmax and bitmasks where the CPU has them, else torch's; the inverse CDF) and the GPU's (torch's argmax, xgrammar's
bitmask, the exponential race; under TRITON_INTERPRET its Triton kernels need CUDA, so its torch
backend applies the same mask)."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mili.runtime.plan import DrawKind
from mili.runtime.sampler import DRAWS, NO_TOKEN, Sampler, SamplingMetadata
from mili.sampling_params import SamplingParams

INVERSE_CDF, EXPONENTIAL_RACE = DRAWS[DrawKind.INVERSE_CDF], DRAWS[DrawKind.EXPONENTIAL_RACE]  # (the plan's draws)
V = 48  # vocabulary (the bitmask's last word is partial: 48 = 32 + 16)
EXTREME = [0.0, 5e-324, 1e-45, 1e-38, 1e-30, 1e-6, 1e-5, 1.0000001e-5, 0.3, 1.0, 2.0, 1e4, 1e30, 1e38, 1e39,
           1e300, math.inf]


def _cpu_sampler() -> Sampler:
    from mili.kernels import cpu as cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("MILI's CPU kernels need AVX-512")
    from mili.kernels.cpu import ops

    return Sampler(ops.argmax, apply_bitmask=ops.apply_bitmask, draw=INVERSE_CDF)


def _gpu_path_sampler() -> Sampler:
    from xgrammar import apply_token_bitmask_inplace

    def apply(logits, bitmask, rows, vocab_size):
        apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=rows, backend="torch_native")

    return Sampler(apply_bitmask=apply, draw=EXPONENTIAL_RACE)


SAMPLERS = {"cpu_kernels": _cpu_sampler, "cpu_torch": lambda: Sampler(draw=INVERSE_CDF), "gpu": _gpu_path_sampler}

unit = st.one_of(st.sampled_from([5e-324, 1e-45, 1e-38, 0.01, 0.5, 0.99, 1.0]),
                 st.floats(0, 1, exclude_min=True))
penalty = st.one_of(st.sampled_from([-2.0, -1e-45, 0.0, 1e-45, 2.0]), st.floats(-2, 2))


@st.composite
def row(draw):
    params = SamplingParams(
        temperature=draw(st.one_of(st.sampled_from(EXTREME), st.floats(0, 1e300))),
        top_p=draw(unit), min_p=draw(st.one_of(st.just(0.0), unit)),
        top_k=draw(st.sampled_from([-1, 1, 2, V - 1, V, V + 7, 10**9])),
        repetition_penalty=draw(st.one_of(st.sampled_from([x for x in EXTREME if x > 0]),
                                          st.floats(0, 1e300, exclude_min=True))),
        presence_penalty=draw(penalty), frequency_penalty=draw(penalty),
        min_tokens=draw(st.sampled_from([0, 0, 3])), max_tokens=8,
        # stop ids: a few, or every token of the vocabulary (min_tokens then leaves nothing)
        eos_token_ids=draw(st.one_of(st.lists(st.integers(0, V + 3), max_size=4), st.just(list(range(V))))),
        stop_token_ids=draw(st.lists(st.integers(0, V + 3), max_size=2)),
        logprobs=draw(st.sampled_from([None, 0, 5, 20])), seed=draw(st.one_of(st.none(), st.integers(0, 2**63 - 1))))
    prompt = draw(st.lists(st.integers(0, V - 1), max_size=6))
    output = draw(st.lists(st.integers(0, V - 1), max_size=2))
    # the grammar's allowed tokens: none (no mask), all, none at all, or a random subset
    allowed = draw(st.one_of(st.none(), st.just([True] * V), st.just([False] * V),
                             st.lists(st.booleans(), min_size=V, max_size=V)))
    scale = draw(st.sampled_from([1e-3, 1.0, 30.0, 1e30, 3e38]))
    specials = draw(st.lists(st.tuples(st.integers(0, V - 1),
                                       st.sampled_from([math.nan, math.inf, -math.inf, 3.4e38, -3.4e38])), max_size=4))
    return params, prompt, output, allowed, scale, specials


def _bitmask(rows_allowed: list[list[bool]]) -> torch.Tensor:
    words = (V + 31) // 32
    mask = torch.zeros(len(rows_allowed), words, dtype=torch.int64)
    for r, allowed in enumerate(rows_allowed):
        for t, ok in enumerate(allowed):
            if ok:
                mask[r, t // 32] |= 1 << (t % 32)
    return torch.where(mask >= 2**31, mask - 2**32, mask).to(torch.int32)


@pytest.mark.parametrize("path", SAMPLERS)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(row(), min_size=1, max_size=5), seed=st.integers(0, 2**32 - 1),
       bf16=st.booleans())
def test_any_params_and_masks_give_a_token_in_the_vocabulary_or_none(path, rows, seed, bf16):
    sampler = SAMPLERS[path]()
    torch.manual_seed(seed)
    logits = torch.randn(len(rows), V + 3)  # (columns past the vocabulary: padding, never sampled)
    for r, (_, _, _, _, scale, specials) in enumerate(rows):
        logits[r] *= scale
        for t, value in specials:
            logits[r, t] = value
    if bf16:
        logits = logits.to(torch.bfloat16)
    before = logits.clone()
    params = [r[0] for r in rows]
    meta = SamplingMetadata.build(params, [torch.Generator().manual_seed(p.seed) if p.seed is not None else None
                                           for p in params],
                                  [r[1] for r in rows], [r[2] for r in rows], V, torch.device("cpu"))
    constrained = [i for i, r in enumerate(rows) if r[3] is not None]
    if constrained:
        meta.grammar_rows = constrained
        meta.grammar_bitmask = _bitmask([r[3] if r[3] is not None else [True] * V for r in rows])

    out = sampler(logits, meta)

    assert torch.equal(logits.float().nan_to_num(), before.float().nan_to_num())  # the input is not modified
    raw = logits[:, :V].float()
    for r, (p, _, output, allowed, _, _) in enumerate(rows):
        # what the row's masks leave: the grammar's tokens, not a stop token while min_tokens blocks them,
        # and not a logit that is NaN or -inf
        blocked = p.stop_ids() if len(output) < p.min_tokens else set()
        left = {t for t in range(V) if (allowed is None or allowed[t]) and t not in blocked
                and not math.isnan(raw[r, t]) and raw[r, t] != -math.inf}
        token = out.token_ids[r]
        assert token == NO_TOKEN or 0 <= token < V, token
        if not meta.greedy_rows.numel() == meta.num_rows or meta.grammar_rows or meta.blocked_rows is not None \
                or meta.penalty_rows is not None or meta.logprob_rows is not None:
            # (the all-greedy fast path with nothing masked takes the model's argmax as it is)
            assert (token == NO_TOKEN) == (not left), (token, sorted(left))
            assert token == NO_TOKEN or token in left
        lp = out.logprobs[r]
        if p.logprobs is None:
            assert lp is None
        else:
            values = [lp.sampled_logprob] + [v for _, v in lp.top]
            assert all(not math.isnan(v) and v != math.inf for v in values), values
            assert len(lp.top) == min(p.logprobs, V) and all(0 <= t < V for t, _ in lp.top)


@pytest.mark.parametrize("path", SAMPLERS)
def test_the_reported_pairs(path):
    """The issue's hostile values, each pair in one batch: a token of the vocabulary every time."""
    sampler = SAMPLERS[path]()
    extremes = [dict(temperature=1e39), dict(top_p=1e-45), dict(min_p=1.0), dict(repetition_penalty=1e39),
                dict(presence_penalty=-2.0), dict(min_tokens=4), dict(top_k=1)]
    torch.manual_seed(0)
    for i, a in enumerate(extremes):
        for b in extremes[i:]:
            params = SamplingParams(**{**a, **b}, max_tokens=8, eos_token_ids=[0, 1])
            logits = torch.randn(3, V) * 5
            meta = SamplingMetadata.build([params] * 3, [None] * 3, [[0, 1, 2]] * 3, [[3]] * 3, V,
                                          torch.device("cpu"))
            for token in sampler(logits, meta).token_ids:
                assert 0 <= token < V and (token not in (0, 1) or not params.min_tokens), (a, b, token)


def test_a_row_with_nothing_left_samples_no_token_and_others_are_unaffected():
    """min_tokens over a vocabulary that is all stop tokens leaves nothing; the row beside it samples as before."""
    torch.manual_seed(0)
    sampler = Sampler(draw=partial(INVERSE_CDF))
    logits = torch.randn(2, V)
    everything = SamplingParams(temperature=1e39, min_tokens=4, max_tokens=8, eos_token_ids=list(range(V)))
    greedy = SamplingParams(temperature=0.0)
    meta = SamplingMetadata.build([everything, greedy], [None, None], [[], []], [[], []], V, torch.device("cpu"))
    assert sampler(logits, meta).token_ids == [NO_TOKEN, int(logits[1].argmax())]
