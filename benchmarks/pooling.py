"""Embeddings and reranking on the CPU, side by side in one run, on the Qwen3-0.6B shape (random weights, bf16 on
MILI's CPU kernels; Qwen3-Embedding-0.6B and Qwen3-Reranker-0.6B have this shape, with a vocabulary of 151,669
where this has 151,936).

  embed   --docs documents of --doc-len tokens: MILI's ``LLM.embed`` against sentence-transformers' ``encode``
          (last-token Pooling, Normalize; float32 as it loads by default, and bfloat16), documents/s
  rerank  --docs documents of --rerank-doc-len tokens behind one --query-len-token query (Qwen3-Reranker's prompt):
          MILI's ``LLM.score`` with the prefix cache on and off, against HF's batched recipe (the official code:
          one left-padded batch through AutoModelForCausalLM, P(yes) from the last position's logits)

Each figure is the median of --repeats timed runs after a warm-up; MILI's prefix cache is emptied before each run
(each run computes what it shares within itself, as a new query would). The texts are random words of the real
vocabulary; their token counts are printed.

    python benchmarks/pooling.py [--docs 64] [--doc-len 256] [--query-len 64] [--rerank-doc-len 128]
                                 [--threads 2] [--repeats 3] [--device cpu|cuda]

On CUDA (``--device cuda``) the same rows run on the GPU (MILI in bf16 on its Triton kernels and CUDA graphs;
sentence-transformers' rows where it is installed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from common import CACHE, machine, print_table, qwen3_checkpoint

from mili import LLM
from mili.engine.pooling import RERANK_PREFIX, RERANK_SUFFIX, DEFAULT_RERANK_INSTRUCTION
from mili.kernels import cpu


def embedding_checkpoint(base: str) -> str:
    """The 0.6B random checkpoint as a sentence-transformers model (the hub's Qwen3-Embedding files): links to its
    weights, with modules.json, a last-token Pooling and a Normalize module."""
    path = CACHE / (Path(base).name + "-embedding")
    if (path / "modules.json").is_file():
        return str(path)
    path.mkdir(parents=True, exist_ok=True)
    for f in Path(base).iterdir():
        if not (path / f.name).exists():
            os.symlink(f, path / f.name)
    hidden = json.loads((Path(base) / "config.json").read_text())["hidden_size"]
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "2_Normalize").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": hidden,
                                                                 "pooling_mode_lasttoken": True}))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 8192, "do_lower_case": False}))
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    return str(path)


def random_texts(tokenizer, count: int, length: int, seed: int) -> list[str]:
    """Texts of about ``length`` tokens: random words of the vocabulary (whole words, so they re-encode alike)."""
    g = torch.Generator().manual_seed(seed)
    words = [w for w in (tokenizer.decode([i]) for i in range(1000, 30000)) if w.startswith(" ") and w[1:].isalpha()]
    texts = []
    for _ in range(count):
        picks = torch.randint(0, len(words), (length,), generator=g).tolist()
        text = "".join(words[i] for i in picks).strip()
        while len(tokenizer.encode(text)) > length:
            text = text.rsplit(" ", 1)[0]
        texts.append(text)
    return texts


def timed(run, repeats: int, before=lambda: None) -> float:
    """The median seconds of ``repeats`` runs after one warm-up (``before`` each)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    before()
    run()
    times = []
    for _ in range(repeats):
        before()
        sync()
        t = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def embed_rows(args, path: str, texts: list[str]) -> list[list]:
    llm = LLM(path, task="embed", num_threads=args.threads, max_model_len=2048, device=args.device)
    mili_s = timed(lambda: llm.embed(texts, use_tqdm=False), args.repeats, llm.reset_prefix_cache)
    tokens = sum(len(o.prompt_token_ids) for o in llm.embed(texts, use_tqdm=False))
    del llm
    rows = [[f"MILI (bf16, {'CPU kernels' if args.device == 'cpu' else 'CUDA'})", mili_s, len(texts) / mili_s, 1.0]]
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModel.from_pretrained(path, dtype=torch.bfloat16).to(args.device).eval()

    def hf():  # what sentence-transformers runs, in batches of 32: the last token's hidden state, normalised
        for i in range(0, len(texts), 32):
            batch = tokenizer(texts[i:i + 32], padding=True, return_tensors="pt").to(args.device)
            with torch.inference_mode():
                torch.nn.functional.normalize(model(**batch).last_hidden_state[:, -1].float(), dim=1)

    seconds = timed(hf, args.repeats)
    rows.append(["transformers AutoModel (bfloat16)", seconds, len(texts) / seconds, seconds / mili_s])
    del model
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        print("(sentence-transformers is not installed: its rows are left out)")
        return rows
    for dtype in [getattr(torch, d) for d in args.baseline_dtypes.split(",")]:
        st = SentenceTransformer(path, device=args.device, model_kwargs={"dtype": dtype})
        seconds = timed(lambda: st.encode(texts, batch_size=32, convert_to_tensor=True), args.repeats)
        rows.append([f"sentence-transformers ({str(dtype).removeprefix('torch.')})", seconds, len(texts) / seconds,
                     seconds / mili_s])
        del st
    print(f"\nembed: {len(texts)} documents, {tokens} tokens in all ({tokens / len(texts):.0f} each)")
    return rows


def hf_recipe(model, tokenizer, query: str, docs: list[str], device: str = "cpu") -> torch.Tensor:
    """Qwen3-Reranker's official code: prefix, pair and suffix tokenized apart, one left-padded batch."""
    prefix = tokenizer.encode(RERANK_PREFIX, add_special_tokens=False)
    suffix = tokenizer.encode(RERANK_SUFFIX, add_special_tokens=False)
    pairs = [f"<Instruct>: {DEFAULT_RERANK_INSTRUCTION}\n<Query>: {query}\n<Document>: {d}" for d in docs]
    inputs = tokenizer(pairs, padding=False, truncation="longest_first", return_attention_mask=False,
                       max_length=8192 - len(prefix) - len(suffix))
    inputs["input_ids"] = [prefix + ids + suffix for ids in inputs["input_ids"]]
    inputs = tokenizer.pad(inputs, padding=True, return_tensors="pt").to(device)
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    with torch.inference_mode():
        logits = model(**inputs).logits[:, -1, :]
    return torch.stack([logits[:, no], logits[:, yes]], dim=1).float().log_softmax(dim=1)[:, 1].exp()


def rerank_rows(args, path: str, query: str, docs: list[str]) -> list[list]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows, scores = [], {}
    for cache in (True, False):
        llm = LLM(path, task="rerank", num_threads=args.threads, max_model_len=2048, enable_prefix_caching=cache,
                  device=args.device)
        seconds = timed(lambda: llm.score(query, docs, use_tqdm=False), args.repeats, llm.reset_prefix_cache)
        llm.reset_prefix_cache()
        outs = llm.score(query, docs, use_tqdm=False)
        scores[cache] = torch.tensor([o.outputs.score for o in outs])
        cached = sum(o.num_cached_tokens for o in outs)
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        rows.append([f"MILI, prefix cache {'on' if cache else 'off'}", seconds, len(docs) / seconds, cached, tokens])
        del llm
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    for dtype in [getattr(torch, d) for d in args.baseline_dtypes.split(",")]:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(args.device).eval()
        seconds = timed(lambda: hf_recipe(model, tokenizer, query, docs, args.device), args.repeats)
        rows.append([f"HF recipe, one batch ({str(dtype).removeprefix('torch.')})", seconds, len(docs) / seconds,
                     0, tokens])
        del model
    base = rows[0][1]
    print(f"\nrerank: {len(docs)} documents behind one query; scores with the cache on and off differ by at most "
          f"{(scores[True] - scores[False]).abs().max():.1e}")
    return [r[:3] + [r[1] / base] + r[3:] for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=64)
    ap.add_argument("--doc-len", type=int, default=256)
    ap.add_argument("--query-len", type=int, default=64)
    ap.add_argument("--rerank-doc-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", choices=["embed", "rerank"], default=None)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--baseline-dtypes", default="float32,bfloat16",
                    help="the dtypes the baselines (sentence-transformers, the HF recipe) run in")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    base = qwen3_checkpoint("Qwen3-0.6B")
    tokenizer = AutoTokenizer.from_pretrained(base)
    flags = sorted(f for f in cpu.cpu_features() if f.startswith(("avx", "amx")))
    print(f"machine: {machine()}; kernels: {cpu.best_isa()}; flags: {' '.join(flags)}")
    if args.device == "cuda":
        print(f"GPU: {torch.cuda.get_device_name()}")
    if args.only in (None, "embed"):
        texts = random_texts(tokenizer, args.docs, args.doc_len - 1, seed=1)  # (+ <|endoftext|>)
        print_table("Embeddings (Qwen3-0.6B shape): seconds for all, documents/s, time against MILI's",
                    ["engine", "s", "docs/s", "x MILI's time"], embed_rows(args, embedding_checkpoint(base), texts))
    if args.only in (None, "rerank"):
        query = random_texts(tokenizer, 1, args.query_len, seed=2)[0]
        docs = random_texts(tokenizer, args.docs, args.rerank_doc_len, seed=3)
        print_table("Rerank (Qwen3-0.6B shape): seconds for all, documents/s, time against MILI with the cache on",
                    ["engine", "s", "docs/s", "x MILI's time", "cached tokens", "prompt tokens"],
                    rerank_rows(args, base, query, docs))


if __name__ == "__main__":
    main()
