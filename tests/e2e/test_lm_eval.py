"""lm-evaluation-harness for real: a tiny local multiple-choice task scored by lm-eval's ``hf`` backend (HF
transformers in float32) and by its ``local-completions`` backend against `mili serve` of the same
checkpoint (echo + logprobs on /v1/completions, token-id prompts): the same loglikelihoods, the same
accuracy. Nothing downloads: the dataset is a JSON file written here, the task a YAML beside it."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

DOCS = [
    ("The capital of France is", [" Paris", " Berlin", " a small village by the sea"], 0),
    ("Two plus two equals", [" four", " five", " twenty-two"], 0),
    ("Water freezes at a temperature of", [" zero degrees Celsius", " one hundred degrees", " noon"], 0),
    ("The opposite of hot is", [" cold", " warm", " a question nobody has asked before today"], 0),
    ("Cats are animals that usually", [" purr", " fly south for the winter", " bark"], 2),
]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval_task")
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in DOCS))
    (root / "mili_tiny_mc.yaml").write_text(f"""task: mili_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
    return root


@pytest.fixture(scope="module")
def chunked_server(serve, random_model):
    return serve(random_model, "--max-num-batched-tokens", "8")  # every prompt prefilled (and scored) in chunks


def _evaluate(task_dir, model: str, model_args: dict):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(model=model, model_args=model_args, tasks=["mili_tiny_mc"], batch_size=1,
                              device="cpu", log_samples=True, task_manager=TaskManager(include_path=str(task_dir)))
    samples = sorted(results["samples"]["mili_tiny_mc"], key=lambda s: s["doc_id"])
    return results["results"]["mili_tiny_mc"]["acc,none"], samples


def test_local_completions_matches_hf(task_dir, chunked_server, random_model):
    acc_hf, hf = _evaluate(task_dir, "hf", {"pretrained": str(random_model), "dtype": "float32",
                                            "tokenizer": str(random_model)})
    acc_mili, mili = _evaluate(task_dir, "local-completions", {
        "model": "test", "base_url": f"{chunked_server.url}/v1/completions", "tokenizer_backend": "huggingface",
        "tokenizer": str(random_model), "tokenized_requests": True, "max_retries": 1})
    assert len(hf) == len(mili) == len(DOCS)
    for a, b in zip(hf, mili):
        assert a["doc_id"] == b["doc_id"]
        ours = [r[0] for r in b["resps"]]  # one (loglikelihood, is_greedy) per choice
        ref = [r[0] for r in a["resps"]]
        assert len(ours) == len(ref) == len(DOCS[a["doc_id"]][1])
        for (ll, greedy), (ll_ref, greedy_ref) in zip(ours, ref):
            assert ll == pytest.approx(ll_ref, abs=1e-3)
            assert ll < -5  # a real sum over the continuation (a random model: ~-12 a token)
            assert greedy == greedy_ref
        assert [f[0] for f in b["filtered_resps"]] == pytest.approx([f[0] for f in a["filtered_resps"]], abs=1e-3)
    assert acc_mili == acc_hf
