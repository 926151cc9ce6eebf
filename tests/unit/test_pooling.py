"""Embeddings and reranking in the engine (offline ``LLM.embed`` / ``LLM.score``), in float32 against the references:
sentence-transformers' ``encode`` for a Qwen3-Embedding-like checkpoint, Qwen3-Reranker's official recipe on
transformers for a causal reranker and for a converted one (a sequence-classification head). Plus what picks the
task, how the engine batches pooling requests (chunked, preempted, beside generating ones, through the prefix
cache), and bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from mili import LLM, SamplingParams
from mili.errors import InvalidRequest, ModelLoadError
from mili.engine.pooling import MAX_POOLING_INPUTS, PoolingInputs
from support.engine_state import assert_drained
from support.pooling import QUERY_PROMPT, hf_rerank_scores, st_embeddings

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Der schnelle braune Fuchs springt über den faulen Hund.",
         "敏捷的棕色狐狸跳过了懒狗。", "short", "Qwen3-Embedding tops MTEB's multilingual board " * 3]
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
QUERY = "What is the capital of China?"
DOCS = ["The capital of China is Beijing.", "Gravity is a force that attracts two bodies towards each other.",
        "北京是中华人民共和国的首都。", "Paris is the capital of France, and Berlin is the capital of Germany."]


def _vectors(outs) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in outs])


@pytest.fixture(scope="module")
def embed_model(retrieval_model):
    return retrieval_model("embed")


@pytest.fixture(scope="module")
def embedder(embed_model):
    return LLM(str(embed_model), dtype="float32", max_model_len=512)


def test_auto_picks_embed_and_matches_sentence_transformers(embedder, embed_model):
    task = embedder.engine.inputs.task
    assert (task.name, task.normalize, task.eos_id) == ("embed", True, 151643)
    ref = st_embeddings(embed_model, TEXTS)  # (one padded batch)
    alone = torch.cat([_vectors(embedder.embed([t], use_tqdm=False)) for t in TEXTS])
    batched = _vectors(embedder.embed(TEXTS, use_tqdm=False))
    torch.testing.assert_close(alone, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(batched, ref, atol=1e-5, rtol=0)
    norms = batched.norm(dim=1)
    torch.testing.assert_close(norms, torch.ones_like(norms))
    assert_drained(embedder)


def test_query_instruction_and_matryoshka(embedder, embed_model):
    queries = TEXTS[:3]
    ref = st_embeddings(embed_model, queries, prompt=QUERY_PROMPT)
    got = _vectors(embedder.embed(queries, instruction=INSTRUCTION, use_tqdm=False))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    for d in (32, 1):  # the first d dimensions, renormalised
        cut = _vectors(embedder.embed(queries, dimensions=d, instruction=INSTRUCTION, use_tqdm=False))
        torch.testing.assert_close(cut, torch.nn.functional.normalize(ref[:, :d], dim=1), atol=1e-5, rtol=0)
    ids = embedder.get_tokenizer()(TEXTS[0])["input_ids"]  # token ids in: as they are (here with the EOS)
    assert ids[-1] == 151643
    torch.testing.assert_close(_vectors(embedder.embed([ids], use_tqdm=False))[0], st_embeddings(embed_model, TEXTS[:1])[0],
                               atol=1e-5, rtol=0)


def test_eos_appended_where_the_tokenizer_does_not(tmp_path, embed_model, qwen3_tokenizer):
    """An older Qwen3-Embedding tokenizer without the post-processor: MILI appends <|endoftext|> itself (what
    sentence-transformers gives with the fixed tokenizer)."""
    folder = tmp_path / "old-tokenizer"
    shutil.copytree(embed_model, folder)
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok["post_processor"] = None
    (folder / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    llm = LLM(str(folder), dtype="float32", max_model_len=512)
    outs = llm.embed(TEXTS[:2], use_tqdm=False)
    assert [o.prompt_token_ids[-1] for o in outs] == [151643, 151643]
    torch.testing.assert_close(_vectors(outs), st_embeddings(embed_model, TEXTS[:2]), atol=1e-5, rtol=0)


def test_prefix_cache_shares_a_header_and_chunks_keep_results(embed_model):
    """Documents that share a long header: later ones find it in the prefix cache (cached_tokens) and their
    embeddings are unchanged; computed in chunks of 16 tokens, they are unchanged too."""
    header = "Title: a long shared header that every document of this batch starts with. " * 4
    docs = [header + t for t in TEXTS]
    ref = st_embeddings(embed_model, docs)
    cached = LLM(str(embed_model), dtype="float32", max_model_len=512, page_size=4)
    first = cached.embed(docs[:1], use_tqdm=False)
    rest = cached.embed(docs[1:], use_tqdm=False)
    assert first[0].num_cached_tokens == 0 and all(o.num_cached_tokens >= 32 for o in rest)
    torch.testing.assert_close(_vectors(first + rest), ref, atol=1e-5, rtol=0)
    assert_drained(cached)
    chunked = LLM(str(embed_model), dtype="float32", max_model_len=128, max_num_batched_tokens=16,
                  enable_prefix_caching=False)
    torch.testing.assert_close(_vectors(chunked.embed(docs, use_tqdm=False)), ref, atol=1e-5, rtol=0)
    assert_drained(chunked)


def test_embeddings_batched_with_generating_requests_and_preempted(embed_model):
    """The engine core runs what it is given in one step: pooling rows beside sampling rows and decodes (a server
    runs one task; the core does not care), on a KV pool so small that sequences are preempted and computed again.
    Both answers equal theirs alone."""
    gen = LLM(str(embed_model), dtype="float32", max_model_len=512, task="generate")
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = [gen.get_tokenizer().encode(t) for t in TEXTS[:2]]
    alone = [o.outputs[0].token_ids for o in gen.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                          use_tqdm=False)]
    embedder = LLM(str(embed_model), dtype="float32", max_model_len=64, page_size=4, num_kv_pages=20,
                   max_num_batched_tokens=48, enable_prefix_caching=False)
    engine = embedder.engine
    check = engine.inputs.check_task
    engine.inputs.check_task = lambda asked: None  # (the API side's rule, lifted for this test)
    try:
        for i, p in enumerate(prompts):
            engine.add_request(p, params, request_id=f"gen{i}")
        engine.step()  # the chats prefill, then decode while the embeddings come
        pooling = SamplingParams(max_tokens=0, pooling=engine.inputs.task.pooling)
        ids = PoolingInputs(engine.tokenizer, engine.inputs.task, engine.max_model_len).embed(TEXTS)
        for i, p in enumerate(ids):
            engine.add_request(p, pooling, request_id=f"emb{i}")
        finals = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
    finally:
        engine.inputs.check_task = check
    assert engine.stats().num_preemptions > 0
    assert [finals[f"gen{i}"].outputs[0].token_ids for i in range(2)] == alone
    got = torch.nn.functional.normalize(torch.tensor([finals[f"emb{i}"].pooled for i in range(len(TEXTS))]), dim=1)
    torch.testing.assert_close(got, st_embeddings(embed_model, TEXTS), atol=1e-5, rtol=0)
    assert_drained(engine)


@pytest.mark.parametrize("kind", ["rerank", "classifier"])
def test_reranker_scores_match_the_official_recipe(retrieval_model, kind):
    path = retrieval_model(kind)
    classifier = kind == "classifier"
    ref = hf_rerank_scores(path, QUERY, DOCS, classifier=classifier)
    ref_instructed = hf_rerank_scores(path, QUERY, DOCS, "Find the document that names a capital", classifier)
    for prefix_cache in (True, False):
        llm = LLM(str(path), dtype="float32", max_model_len=512, page_size=4, enable_prefix_caching=prefix_cache,
                  **({} if classifier else {"task": "rerank"}))  # (a classifier is picked by itself)
        assert llm.engine.inputs.task.name == "rerank"
        outs = llm.score(QUERY, DOCS, use_tqdm=False)  # (all in one step's budget)
        torch.testing.assert_close(torch.tensor([o.outputs.score for o in outs]), ref, atol=1e-5, rtol=0)
        # the system prompt, instruction and query are computed once, by the first document: the others wait a step
        # for them to be cached (the scheduler's in-batch prefix caching), then take them from the cache
        assert outs[0].num_cached_tokens == 0
        assert all((o.num_cached_tokens >= 40) == prefix_cache for o in outs[1:])
        got = llm.score([QUERY] * len(DOCS), DOCS, instruction="Find the document that names a capital",
                        use_tqdm=False)
        torch.testing.assert_close(torch.tensor([o.outputs.score for o in got]), ref_instructed, atol=1e-5, rtol=0)
        assert_drained(llm)


def test_task_is_picked_and_refused_by_name(tmp_path, retrieval_model, embed_model, tiny_checkpoint):
    assert LLM(str(tiny_checkpoint), dtype="float32").engine.inputs.task.name == "generate"
    with pytest.raises(ModelLoadError, match="sequence-classification model .* runs --task rerank"):
        LLM(str(retrieval_model("classifier")), dtype="float32", task="generate")
    # sentence-transformers 5+'s spelling of the Pooling config is read too; another pooling is refused by name
    folder = tmp_path / "st5"
    shutil.copytree(embed_model, folder)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"embedding_dimension": 64,
                                                                   "pooling_mode": "lasttoken"}))
    assert LLM(str(folder), dtype="float32").engine.inputs.task.name == "embed"
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"embedding_dimension": 64, "pooling_mode": "mean"}))
    with pytest.raises(ModelLoadError, match="'mean' pooling: MILI pools the last token"):
        LLM(str(folder), dtype="float32")


def test_requests_the_task_does_not_serve_are_refused(embedder, retrieval_model, tiny_checkpoint):
    with pytest.raises(InvalidRequest, match="runs the embed task: it serves embeddings .* not text generation"):
        embedder.generate(["hello"], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(InvalidRequest, match="start MILI with --task rerank .*Qwen3ForCausalLM"):
        embedder.score(QUERY, DOCS, use_tqdm=False)
    chat = LLM(str(tiny_checkpoint), dtype="float32")
    with pytest.raises(InvalidRequest, match="runs the generate task.*--task embed"):
        chat.embed(["hello"], use_tqdm=False)
    assert_drained(embedder)


def test_bad_input_is_refused_and_the_engine_goes_on(embedder, embed_model):
    cases = [(dict(texts=[]), "texts must not be empty"),
             (dict(texts=["word " * 600]), r"texts\[0\] has \d+ tokens, more than the model's context \(512\)"),
             (dict(texts=["a"], dimensions=0), r"dimensions must be in \[1, 64\]"),
             (dict(texts=["a"], dimensions=65), r"dimensions must be in \[1, 64\]"),
             (dict(texts=["a"] * (MAX_POOLING_INPUTS + 1)), f"at most {MAX_POOLING_INPUTS}"),
             (dict(texts=["a"], truncate_prompt_tokens=513), r"truncate_prompt_tokens must be -1 .* \[1, 512\]")]
    for kwargs, message in cases:
        with pytest.raises(InvalidRequest, match=message):
            embedder.embed(use_tqdm=False, **kwargs)
    long = "word " * 600  # cut to its last tokens: the closing <|endoftext|> stays
    out = embedder.embed([long], truncate_prompt_tokens=-1, use_tqdm=False)[0]
    assert len(out.prompt_token_ids) == 512 and out.prompt_token_ids[-1] == 151643
    assert_drained(embedder)
    torch.testing.assert_close(_vectors(embedder.embed(TEXTS[:1], use_tqdm=False)), st_embeddings(embed_model, TEXTS[:1]),
                               atol=1e-5, rtol=0)


def test_tensor_parallel_pooling_matches_one_rank(embedder, embed_model, retrieval_model):
    """Two ranks (gloo): every rank pools the same rows (the reranker's logits gathered over the vocabulary
    shards), so the answers equal one rank's; a classification head is refused by name."""
    ref = st_embeddings(embed_model, TEXTS)
    tp = LLM(str(embed_model), dtype="float32", max_model_len=512, tensor_parallel_size=2)
    try:
        torch.testing.assert_close(_vectors(tp.embed(TEXTS, use_tqdm=False)), ref, atol=1e-5, rtol=0)
    finally:
        tp.engine.shutdown()
    path = retrieval_model("rerank")
    tp = LLM(str(path), dtype="float32", max_model_len=512, tensor_parallel_size=2, task="rerank")
    try:
        got = torch.tensor([o.outputs.score for o in tp.score(QUERY, DOCS, use_tqdm=False)])
    finally:
        tp.engine.shutdown()
    torch.testing.assert_close(got, hf_rerank_scores(path, QUERY, DOCS), atol=1e-5, rtol=0)
    with pytest.raises(InvalidRequest, match="sequence-classification checkpoint runs on one rank"):
        LLM(str(retrieval_model("classifier")), dtype="float32", tensor_parallel_size=2)


def test_the_cli_prints_embeddings_and_rankings(embed_model, retrieval_model, capsys):
    from mili.cli import main

    assert main(["embed", str(embed_model), "--dtype", "float32", "--text", TEXTS[0], "--text", TEXTS[1],
                 "--dimensions", "32"]) == 0
    out = capsys.readouterr().out
    assert "[0] 32 dims" in out and "cosine similarities:" in out and "+1.0000" in out
    assert main(["rerank", str(retrieval_model("rerank")), "--dtype", "float32", "--query", QUERY,
                 "--document", DOCS[0], "--document", DOCS[1]]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("1. ") and lines[1].startswith("2. ") and len(lines) == 2
