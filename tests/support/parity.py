"""MILI's greedy outputs and logprobs against transformers' reference models (random weights: near-ties allowed)."""

from __future__ import annotations

import torch

from support.engine_state import prefill_outputs


def greedy_matches(llm, reference, prompts: list[dict], params) -> None:
    """``llm``'s greedy tokens are HF model ``reference``'s for each prompt ({"prompt_token_ids": ...}), but
    for at most one prompt whose paths part where HF's top two logits nearly tie (random weights meet such
    ties; the dense parity test's rule)."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    exact = 0
    for p, out in zip(prompts, outs):
        ids = torch.tensor([p["prompt_token_ids"]])
        with torch.no_grad():
            ref = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=params.max_tokens,
                                     do_sample=False, output_scores=True, return_dict_in_generate=True,
                                     pad_token_id=0)
        got, want = out.outputs[0].token_ids, ref.sequences[0, ids.shape[1]:].tolist()
        parted = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if parted is None:
            exact += 1
        else:
            top2 = ref.scores[parted][0].topk(2).values
            assert top2[0] - top2[1] < 1e-3, f"diverged at step {parted} without a near-tie"
    assert exact >= len(prompts) - 1


def prompt_logprobs(llm, prompt: list[int]) -> torch.Tensor:
    """The next-token log-distribution after every position of ``prompt`` ([len, vocab], float32), from one
    prefill through the engine's own runner (its kernels, its KV cache)."""
    return prefill_outputs(llm, prompt).float().log_softmax(-1).cpu()


NEAR_TIE = 1e-3  # greedy paths may part only where HF's own top-2 logits are closer than this


def hf_greedy(model, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], torch.Tensor]]:
    """HF ``model``'s greedy continuation of each prompt: (tokens, raw logits [steps, V]), what
    ``assert_greedy_matches_hf`` compares against. Its own eos ids do not stop it (as ignore_eos)."""
    model.generation_config.eos_token_id = None
    results = []
    for ids in prompts:
        with torch.no_grad():
            # an explicit mask: otherwise HF masks every prompt token equal to pad_token_id
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=max_tokens, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True, pad_token_id=0)
        results.append((out.sequences[0, len(ids):].tolist(), torch.stack(out.scores)[:, 0]))
    return results


def assert_greedy_matches_hf(outs, reference, max_tokens: int, logprobs: bool = True, float64=None) -> None:
    """MILI's greedy outputs against HF's (tokens, [steps, V] scores) per prompt: the same tokens, or a parting
    only at a step where HF itself had a near-tie; the logprob of every shared token within 1e-4 of HF's own
    (``logprobs``); and all prompts but at most one matched to the end.

    ``float64``: HF's same run in float64 (``hf_greedy`` of the model in float64), where HF's own float32 is
    itself that far from exact: each logprob's bound then widens by how far HF's float32 lies from its float64
    there (while the float64 run follows the same tokens)."""
    import pytest

    exact = 0
    for i, (out, (ref_tokens, scores)) in enumerate(zip(outs, reference)):
        got = out.outputs[0].token_ids
        assert len(got) == max_tokens
        parted = next((j for j, (a, b) in enumerate(zip(got, ref_tokens)) if a != b), None)
        if parted is None:
            exact += 1
        else:
            top2 = scores[parted].topk(2).values
            assert top2[0] - top2[1] < NEAR_TIE, (
                f"diverged at step {parted} where HF had no near-tie (gap {top2[0] - top2[1]:.2e})")
        if logprobs:
            ref_logprobs = torch.log_softmax(scores.double(), -1)
            slack = torch.zeros(max_tokens, dtype=torch.float64)
            if float64 is not None:
                tokens64, scores64 = float64[i]
                same = next((j for j, (a, b) in enumerate(zip(got, tokens64)) if a != b), max_tokens)
                exact_logprobs = torch.log_softmax(scores64.double(), -1)
                for j in range(same + 1 if same < max_tokens else max_tokens):  # (step `same` still shares a context)
                    slack[j] = abs(ref_logprobs[j, got[j]] - exact_logprobs[j, got[j]])
            for j in range(parted if parted is not None else max_tokens):
                ours = out.outputs[0].logprobs[j][got[j]].logprob
                assert ours == pytest.approx(ref_logprobs[j, got[j]].item(), rel=1e-4, abs=1e-5 + slack[j].item()), (
                    f"prompt {i} step {j}: {ours} against HF's {ref_logprobs[j, got[j]].item()} (HF float32 is "
                    f"{slack[j].item():.1e} from its float64 there)")
    assert exact >= len(outs) - 1, f"only {exact}/{len(outs)} prompts matched exactly"
