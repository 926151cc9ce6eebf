"""Sampler: greedy, truncation (top_k / top_p / min_p, also against HF's warpers), seeding, penalties
(against HF and a plain reference), min_tokens, logprobs and the sampled distribution."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from mili.runtime.sampler import Sampler, SamplingMetadata, apply_min_p, apply_top_k_top_p
from mili.sampling_params import SamplingParams

CPU = torch.device("cpu")
sampler = Sampler()


def meta_for(params, logits, generators=None, prompts=None, outputs=None):
    b, v = logits.shape
    return SamplingMetadata.build(params, generators or [None] * b, prompts or [[] for _ in range(b)],
                                  outputs or [[] for _ in range(b)], v, CPU)


def sample(params, logits, **kw):
    return sampler(logits, meta_for(params, logits, **kw))


def gen(seed):
    return torch.Generator().manual_seed(seed)


# Hand-made distribution, deliberately not sorted by id: probabilities 0.4, 0.3, 0.15, 0.1, 0.05.
HAND_PROBS = torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15])
HAND = HAND_PROBS.log()


# ---------------------------------------------------------------------------------------------- greedy


def test_greedy_is_argmax_and_mixed_batch_keeps_greedy_rows_exact():
    torch.manual_seed(0)
    logits = torch.randn(16, 200) * 3
    out = sample([SamplingParams(temperature=0.0)] * 16, logits)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 16

    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.5, top_k=50 if i % 4 == 1 else -1,
                             top_p=0.9 if i % 4 == 3 else 1.0) for i in range(16)]
    expect = logits.argmax(-1)
    for _ in range(5):
        got = torch.tensor(sample(params, logits).token_ids)
        assert torch.equal(got[0::2], expect[0::2])
    # The sampled rows really sample (with flat-ish logits they do not all follow the argmax).
    flat = torch.randn(16, 200) * 0.1
    assert torch.tensor(sample(params, flat).token_ids)[1::2].tolist() != flat.argmax(-1)[1::2].tolist()


def test_bf16_logits_are_upcast_and_input_not_modified():
    torch.manual_seed(1)
    logits = (torch.randn(4, 64) * 4).to(torch.bfloat16)
    before = logits.clone()
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5, min_tokens=2,
                             eos_token_ids=[int(logits[0].float().argmax())])] * 4
    out = sample(params, logits, prompts=[[1, 2, 3]] * 4, outputs=[[4]] * 4)
    assert torch.equal(logits, before)
    assert all(isinstance(t, int) and 0 <= t < 64 for t in out.token_ids)


# ------------------------------------------------------------------------------------- top_k / top_p


def test_top_k_never_samples_outside_the_k_best():
    torch.manual_seed(2)
    base = torch.randn(30) * 2
    logits = base.expand(2000, 30).clone()
    best3 = set(base.topk(3).indices.tolist())
    got = sample([SamplingParams(temperature=2.0, top_k=3)] * 2000, logits).token_ids
    assert set(got) == best3  # never outside, and all three actually occur

    # top_k = 1 is greedy, whatever the temperature.
    rnd = torch.randn(64, 100)
    assert sample([SamplingParams(temperature=5.0, top_k=1)] * 64, rnd).token_ids == rnd.argmax(-1).tolist()


def kept(masked: torch.Tensor) -> set[int]:
    return set(torch.isfinite(masked).nonzero().flatten().tolist())


@pytest.mark.parametrize("top_k,top_p,expect", [
    (-1, 0.3, {1}),            # 0.4 alone reaches 0.3
    (-1, 0.6, {1, 3}),         # 0.4 < 0.6 <= 0.7
    (-1, 0.75, {1, 3, 4}),     # 0.7 < 0.75 <= 0.85
    (-1, 1.0, {0, 1, 2, 3, 4}),
    (-1, 1e-9, {1}),           # 1 - p rounds to 1 in float32: the best token must still be kept
    (2, 1.0, {1, 3}),
    (4, 1.0, {0, 1, 3, 4}),
    (2, 0.5, {1}),             # top_p sees the renormalised top-2: 4/7 >= 0.5
    (2, 0.6, {1, 3}),          # 4/7 < 0.6
    (10, 1.0, {0, 1, 2, 3, 4}),  # k > V keeps everything
])
def test_top_k_top_p_hand_made_masks_and_draws(top_k, top_p, expect):
    v = len(HAND)
    k = torch.tensor([v if top_k < 0 else min(top_k, v)])
    masked = apply_top_k_top_p(HAND.unsqueeze(0).clone(), k, torch.tensor([top_p]))
    assert kept(masked[0]) == expect
    assert torch.equal(masked[0][list(expect)], HAND[list(expect)])  # kept logits untouched
    got = sample([SamplingParams(top_k=top_k, top_p=top_p)] * 2000, HAND.expand(2000, v).clone()).token_ids
    assert set(got) == expect


@pytest.mark.parametrize("min_p,expect", [(0.0, {0, 1, 2, 3, 4}), (0.3, {1, 3, 4}), (0.5, {1, 3}),
                                          (0.9, {1}), (1.0, {1})])
def test_min_p_hand_made_masks_and_draws(min_p, expect):
    masked = apply_min_p(HAND.unsqueeze(0).clone(), torch.tensor([min_p]))
    assert kept(masked[0]) == expect
    got = sample([SamplingParams(min_p=min_p)] * 2000, HAND.expand(2000, 5).clone()).token_ids
    assert set(got) == expect


def test_masks_match_hf_warpers_on_random_logits():
    torch.manual_seed(3)
    b, v = 24, 300
    logits = torch.randn(b, v) * 3
    logits[:, :8] -= 200.0  # tokens whose probability underflows to exactly 0
    ks = torch.randint(1, 40, (b,))
    ps = torch.rand(b) * 0.95 + 0.03
    mps = torch.rand(b) * 0.3
    full_k, no_p = torch.full((b,), v), torch.ones(b)
    ours_k = apply_top_k_top_p(logits.clone(), ks, None)
    ours_p = apply_top_k_top_p(logits.clone(), None, ps)
    ours_kp = apply_top_k_top_p(logits.clone(), ks, ps)
    ours_mp = apply_min_p(logits.clone(), mps)
    for i in range(b):
        row = logits[i:i + 1]
        hf_k = TopKLogitsWarper(int(ks[i]))(None, row.clone())
        hf_p = TopPLogitsWarper(float(ps[i]))(None, row.clone())
        hf_kp = TopPLogitsWarper(float(ps[i]))(None, hf_k.clone())
        hf_mp = MinPLogitsWarper(float(mps[i]))(None, row.clone())
        for ours, hf in ((ours_k, hf_k), (ours_p, hf_p), (ours_kp, hf_kp), (ours_mp, hf_mp)):
            assert torch.equal(torch.isfinite(ours[i]), torch.isfinite(hf[0])), i
    # Rows whose top_k / top_p are disabled come back bit-identical, also in a mixed batch.
    mixed_k = torch.where(torch.arange(b) % 2 == 0, ks, full_k)
    mixed_p = torch.where(torch.arange(b) % 3 == 0, ps, no_p)
    out = apply_top_k_top_p(logits.clone(), mixed_k, mixed_p)
    untouched = (torch.arange(b) % 2 != 0) & (torch.arange(b) % 3 != 0)
    assert torch.equal(out[untouched], logits[untouched])
    assert torch.equal(apply_top_k_top_p(logits.clone(), full_k, no_p), logits)


# ---------------------------------------------------------------------------------------------- seeds


def run_steps(batch_params, row, seed, logits_seq, others_gen_seeds):
    """Sample len(logits_seq) steps; the tracked row (index ``row``) has its generator seeded with
    ``seed``; others get the seeds in others_gen_seeds (None = global RNG). Returns the row's tokens."""
    gens = [gen(s) if s is not None else None for s in others_gen_seeds]
    gens[row] = gen(seed)
    toks = []
    for step_logits in logits_seq:
        b = len(batch_params)
        logits = torch.randn(b, step_logits.shape[0]) * 0.5
        logits[row] = step_logits
        toks.append(sample(batch_params, logits, generators=gens).token_ids[row])
    return toks


def test_seeded_rows_are_reproducible_and_batch_independent():
    torch.manual_seed(4)
    v = 1000
    steps = [torch.randn(v) * 0.5 for _ in range(8)]  # flat-ish: many plausible tokens per step
    mine = SamplingParams(temperature=0.9, top_p=0.95, seed=123)

    alone = run_steps([mine], 0, 123, steps, [None])
    assert run_steps([mine], 0, 123, steps, [None]) == alone  # same seed, same tokens
    assert run_steps([mine], 0, 124, steps, [None]) != alone  # (and a different seed differs)
    assert len(set(alone)) > 1

    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.7, top_k=5, seed=9), SamplingParams(min_p=0.1, seed=10)]
    for row in (0, 2, 4):
        batch = others[:row] + [mine] + others[row:]
        seeds = [None, None, 9, 10]
        gen_seeds = seeds[:row] + [None] + seeds[row:]
        assert run_steps(batch, row, 123, steps, gen_seeds) == alone, row


# ------------------------------------------------------------------------------------------ penalties


def test_repetition_penalty_matches_hf():
    torch.manual_seed(5)
    b, v = 5, 120
    logits = torch.randn(b, v) * 3
    penalties = [1.0, 1.3, 0.7, 2.0, 1.1]
    prompts = [[1, 2, 3, 3], [5, 6, 119], [], [7] * 30 + [8], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]]
    outputs = [[4], [6, 6, 9], [10, 11], [], [50]]
    params = [SamplingParams(temperature=0.0, repetition_penalty=r) for r in penalties]
    meta = meta_for(params, logits, prompts=prompts, outputs=outputs)
    ours = Sampler.process_logits(logits.clone(), meta)
    for i in range(b):
        ids = torch.tensor([prompts[i] + outputs[i]], dtype=torch.long)
        hf = RepetitionPenaltyLogitsProcessor(penalties[i])(ids, logits[i:i + 1].clone())
        assert torch.equal(ours[i], hf[0]), i


def test_presence_frequency_match_reference_loop():
    torch.manual_seed(6)
    b, v = 4, 80
    logits = torch.randn(b, v) * 3
    cfg = [(0.5, 0.0), (0.0, 1.2), (-0.7, 0.3), (2.0, -2.0)]  # (presence, frequency)
    prompts = [[1, 2, 3], [9, 9], [], [4]]  # prompt tokens must NOT count for these two
    outputs = [[3, 3, 7], [9, 10, 10, 10], [0, 79, 79], []]
    params = [SamplingParams(presence_penalty=p, frequency_penalty=f) for p, f in cfg]
    meta = meta_for(params, logits, prompts=prompts, outputs=outputs)
    ours = Sampler.process_logits(logits.clone(), meta)
    ref = logits.clone().tolist()
    for i, (pres, freq) in enumerate(cfg):
        for tok in set(outputs[i]):
            ref[i][tok] -= freq * outputs[i].count(tok) + pres
    assert torch.allclose(ours, torch.tensor(ref), atol=1e-5, rtol=0)


def test_penalties_only_touch_their_rows_and_change_greedy_choice():
    torch.manual_seed(7)
    logits = torch.randn(3, 50)
    logits[:, 3] = 10.0  # token 3 is everyone's argmax ...
    logits[:, 5] = 8.0
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, repetition_penalty=2.0,
                                                              presence_penalty=0.5, frequency_penalty=0.5),
              SamplingParams(temperature=0.0)]
    hist = [[3, 5, 6], [3, 3], [3, 3, 3]]
    meta = meta_for(params, logits, prompts=[[1]] * 3, outputs=hist)
    processed = Sampler.process_logits(logits.clone(), meta)
    assert torch.equal(processed[0], logits[0]) and torch.equal(processed[2], logits[2])
    assert not torch.equal(processed[1], logits[1])
    # ... but row 1 has repeated it: 10 / 2 - 2 * 0.5 - 0.5 = 3.5 < 8.
    assert sampler(logits, meta).token_ids == [3, 5, 3]
    assert processed[1, 3].item() == pytest.approx(3.5)


@pytest.mark.parametrize("penalty", [1e-308, 1e-40, 1e-30, 1e30, 1e308])  # (float32: 0, subnormal, ..., inf)
@pytest.mark.parametrize("temperature", [0.0, 1e-5, 1.0])
def test_extreme_repetition_penalties_never_draw_outside_the_vocabulary(penalty, temperature):
    """A penalty of ~0 or ~inf once made a logit infinite, the softmax NaN and the draw an id past the vocab."""
    torch.manual_seed(8)
    logits = torch.randn(4, 60) * 5
    logits[:, 7] = 0.0  # 0 * inf is NaN
    prompts = [[1, 2, 7, 9], [7], list(range(60)), [3, 7, 40]]
    params = [SamplingParams(temperature=temperature, repetition_penalty=penalty, seed=i) for i in range(4)]
    meta = meta_for(params, logits, prompts=prompts, generators=[gen(i) for i in range(4)])
    processed = Sampler.process_logits(logits.clone(), meta)
    assert not processed.isnan().any() and not (processed == float("inf")).any()
    for _ in range(20):
        tokens = sampler(logits, meta).token_ids
        assert all(0 <= t < 60 for t in tokens), tokens


# ----------------------------------------------------------------------------------------- min_tokens


def test_min_tokens_blocks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(4, 20)
    logits[:, 2] = 9.0  # EOS is the favourite, then stop id 5, then 7
    logits[:, 5] = 8.0
    logits[:, 7] = 7.0
    kw = dict(temperature=0.0, min_tokens=3, eos_token_ids=[2], stop_token_ids=[5])
    params = [SamplingParams(**kw), SamplingParams(**kw), SamplingParams(**kw, ignore_eos=True),
              SamplingParams(temperature=0.0, eos_token_ids=[2], stop_token_ids=[5])]
    outputs = [[1], [1, 1, 1], [1], []]
    meta = meta_for(params, logits, outputs=outputs)
    assert sampler(logits, meta).token_ids == [7, 2, 2, 2]
    processed = Sampler.process_logits(logits.clone(), meta)
    assert processed[0, 2] == -math.inf and processed[0, 5] == -math.inf
    assert processed[2, 2] == 9.0 and processed[2, 5] == -math.inf  # ignore_eos: only EOS is free
    assert torch.equal(processed[1], logits[1]) and torch.equal(processed[3], logits[3])
    # Sampled rows never draw a blocked token either.
    many = sample([SamplingParams(min_tokens=1, eos_token_ids=[2], stop_token_ids=[5])] * 500,
                  logits[:1].expand(500, 20).clone())
    assert not {2, 5} & set(many.token_ids)


# ------------------------------------------------------------------------------------------- logprobs


def test_logprobs_come_from_raw_logits():
    torch.manual_seed(8)
    b, v = 5, 60
    logits = torch.randn(b, v) * 2
    nlp = [None, 0, 3, 7, 20]
    params = [SamplingParams(temperature=t, logprobs=n, repetition_penalty=1.5, top_k=10)
              for t, n in zip([1.0, 0.0, 1.3, 0.5, 0.0], nlp)]
    out = sample(params, logits, prompts=[[0, 1, 2]] * b, outputs=[list(range(3, 20))] * b)
    raw_lp = logits.log_softmax(-1)
    assert out.logprobs[0] is None
    for i in range(1, b):
        lp, tok = out.logprobs[i], out.token_ids[i]
        assert lp.sampled_logprob == pytest.approx(raw_lp[i, tok].item(), abs=1e-6)
        assert lp.sampled_rank == 1 + int((logits[i] > logits[i, tok]).sum())
        assert len(lp.top) == nlp[i]
        vals = [x for _, x in lp.top]
        assert vals == sorted(vals, reverse=True)
        assert [t for t, _ in lp.top] == raw_lp[i].topk(nlp[i]).indices.tolist()
        for t, x in lp.top:
            assert x == pytest.approx(raw_lp[i, t].item(), abs=1e-6)
    # The penalties moved greedy rows off the raw argmax here, so ranks > 1 are exercised.
    assert out.logprobs[1].sampled_rank > 1 or out.logprobs[4].sampled_rank > 1


# ------------------------------------------------------------------------------------- distribution


@pytest.mark.parametrize("temperature,seeded", [(1.0, False), (0.5, False), (1.0, True)])
def test_empirical_distribution_matches_softmax(temperature, seeded):
    torch.manual_seed(9)
    n = 4000
    base = torch.tensor([1.0, 0.5, -0.5, 0.2])
    gens = [gen(1000 + i) for i in range(n)] if seeded else None
    got = sample([SamplingParams(temperature=temperature)] * n, base.expand(n, 4).clone(), generators=gens)
    freq = torch.bincount(torch.tensor(got.token_ids), minlength=4).float() / n
    assert torch.allclose(freq, (base / temperature).softmax(-1), atol=0.03), freq


@pytest.mark.parametrize("seed", range(4))
def test_partial_top_k_path_equals_the_full_sort(seed):
    """top-k (<= 1024) ranks only each row's k best; the masks equal the full-vocabulary sort's, ties too (a row
    whose k is the whole vocabulary sends the batch through the sort: the other rows' masks are the sort's)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 3000, generator=g) * 3
    logits[2, :50] = logits[2].max() + 1  # a 50-way tie at the top: a k below 50 keeps all of them
    ks = torch.tensor([1, 20, 5, 200, 1024, 40])
    ps = torch.tensor([0.9, 0.95, 1.0, 0.5, 0.99, 0.7])
    for top_p in (None, ps):
        fast = apply_top_k_top_p(logits.clone(), ks, top_p)
        sorted_ks = torch.cat([ks, torch.tensor([3000])])  # (k = V: no partial ranking)
        slow = apply_top_k_top_p(torch.cat([logits, logits[:1]]), sorted_ks,
                                 None if top_p is None else torch.cat([top_p, top_p[:1]]))[:6]
        assert torch.equal(torch.isinf(fast), torch.isinf(slow))
        assert torch.equal(fast[~torch.isinf(fast)], slow[~torch.isinf(slow)])
    assert (~torch.isinf(apply_top_k_top_p(logits.clone(), ks, None)[2])).sum() == 50


@pytest.mark.parametrize("draw", ["_inverse_cdf", "_exponential_race"])
def test_both_draws_follow_the_distribution_and_skip_masked_tokens(draw):
    """The CPU's inverse CDF and the GPU's exponential race, called directly (both run here on the CPU)."""
    from mili.runtime import sampler as S

    torch.manual_seed(3)
    n = 4000
    probs = torch.tensor([0.5, 0.0, 0.3, 0.0, 0.2]).expand(n, 5).clone()
    seeded = [(j, gen(50 + j)) for j in range(0, n, 7)]
    meta = S.SamplingMetadata.build([SamplingParams()] * n, [None] * n, [[]] * n, [[]] * n, 5, torch.device("cpu"))
    meta.seeded = seeded
    meta.unseeded = torch.tensor([j for j in range(n) if j % 7], dtype=torch.long)
    got = getattr(S, draw)(probs, meta)
    freq = torch.bincount(got, minlength=5).float() / n
    assert freq[1] == 0 and freq[3] == 0
    assert torch.allclose(freq, probs[0], atol=0.03), freq
    again = getattr(S, draw)(probs, S.SamplingMetadata.build([SamplingParams()] * n, [None] * n, [[]] * n, [[]] * n,
                                                              5, torch.device("cpu")))
    assert not torch.equal(got, again)  # unseeded rows draw afresh
    meta.seeded = [(j, gen(50 + j)) for j in range(0, n, 7)]
    repeat = getattr(S, draw)(probs, meta)
    rows = [j for j, _ in seeded]
    assert torch.equal(repeat[rows], got[rows])  # seeded rows repeat
