"""Tiny random retrieval checkpoints, built with the real libraries' classes: a Qwen3-Embedding-like model
(sentence-transformers' Transformer, last-token Pooling and Normalize, saved by sentence-transformers), a
Qwen3-Reranker-like causal LM, and a converted reranker with a sequence-classification head; and their references
(sentence-transformers' ``encode``, the reranker's official recipe on transformers)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from support.checkpoints import build_checkpoint

# Qwen3-Embedding's tokenizer.json appends <|endoftext|> (151643) to every input: its post-processor
_APPEND_EOS = {"type": "TemplateProcessing",
               "single": [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}],
               "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                        {"Sequence": {"id": "B", "type_id": 1}}, {"SpecialToken": {"id": "<|endoftext|>", "type_id": 1}}],
               "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [151643], "tokens": ["<|endoftext|>"]}}}
# the hub's Qwen3-Embedding files, in sentence-transformers 2/3's spelling
_HUB_MODULES = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"


def build_embedding_checkpoint(path: Path, hub_layout: bool = True, append_eos: bool = True, seed: int = 0,
                               **shape) -> Path:
    """A Qwen3 decoder (the real vocabulary) saved as a sentence-transformers model by sentence-transformers
    itself; ``hub_layout``: its module files then rewritten in the spelling the hub's Qwen3-Embedding uses
    (``pooling_mode_lasttoken: true``); ``append_eos``: the tokenizer appends <|endoftext|> as Qwen3-Embedding's."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    build_checkpoint(path, "gqa4_realvocab", seed=seed, **shape)
    if append_eos:
        tok = json.loads((path / "tokenizer.json").read_text())
        tok["post_processor"] = _APPEND_EOS
        (path / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    transformer = Transformer(str(path))
    dim = json.loads((path / "config.json").read_text())["hidden_size"]
    SentenceTransformer(modules=[transformer, Pooling(dim, pooling_mode="lasttoken"), Normalize()]).save(str(path))
    if hub_layout:
        (path / "modules.json").write_text(json.dumps(_HUB_MODULES, indent=2))
        (path / "1_Pooling" / "config.json").write_text(json.dumps({
            "word_embedding_dimension": dim, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
            "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
            "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": True, "include_prompt": True},
            indent=2))
        (path / "2_Normalize").mkdir(exist_ok=True)
        # (sentence-transformers 6 reads its own spelling of this file as "format strings as chat messages": the hub's
        # says only the length, and plain text goes through the tokenizer as it is)
        (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 8192, "do_lower_case": False}))
        (path / "config_sentence_transformers.json").write_text(json.dumps({
            "prompts": {"query": QUERY_PROMPT, "document": ""}, "default_prompt_name": None,
            "similarity_fn_name": "cosine"}, indent=2))
    return path


def st_embeddings(path: Path, texts: list[str], prompt: str | None = None) -> torch.Tensor:
    """sentence-transformers' embeddings of ``texts`` (float32, as it loads the checkpoint), batched as it
    batches them (padded)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu")
    return model.encode(texts, prompt=prompt, convert_to_tensor=True, batch_size=len(texts)).float()


# Qwen3-Reranker's official recipe (its model card), on transformers
_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
           "provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
_DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def build_reranker_checkpoint(path: Path, classifier: bool = False, seed: int = 0) -> Path:
    """A Qwen3-Reranker-like causal LM on the real vocabulary (its head scores "no" and "yes"), or with
    ``classifier`` a converted one: ``Qwen3ForSequenceClassification`` with one label, saved by transformers."""
    if not classifier:
        return build_checkpoint(path, "gqa4_realvocab", seed=seed)
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    from support.checkpoints import SHAPES, add_tokenizer

    torch.manual_seed(seed)
    cfg = Qwen3Config(max_position_embeddings=1024, rope_theta=10000.0, eos_token_id=None, bos_token_id=None,
                      pad_token_id=151643, num_labels=1, **SHAPES["gqa4_realvocab"])
    model = Qwen3ForSequenceClassification(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.mul_(8.0)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    add_tokenizer(path)
    return path


def hf_rerank_scores(path: Path, query: str, documents: list[str], instruction: str | None = None,
                     classifier: bool = False) -> torch.Tensor:
    """The official recipe: prefix, formatted pair and suffix tokenized apart and joined, left-padded into one
    batch; P(yes) = softmax over the last position's logits of "no" and "yes" (``classifier``: the sigmoid of the
    sequence-classification head's logit, as a converted reranker is scored)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    prefix = tok.encode(_PREFIX, add_special_tokens=False)
    suffix = tok.encode(_SUFFIX, add_special_tokens=False)
    pairs = [f"<Instruct>: {instruction or _DEFAULT_INSTRUCTION}\n<Query>: {query}\n<Document>: {doc}"
             for doc in documents]
    inputs = tok(pairs, padding=False, truncation="longest_first", return_attention_mask=False,
                 max_length=8192 - len(prefix) - len(suffix))
    inputs["input_ids"] = [prefix + ids + suffix for ids in inputs["input_ids"]]
    inputs = tok.pad(inputs, padding=True, return_tensors="pt")
    with torch.no_grad():
        if classifier:
            model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
            return model(**inputs).logits[:, 0].sigmoid()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        logits = model(**inputs).logits[:, -1, :]
        yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
        pair = torch.stack([logits[:, no], logits[:, yes]], dim=1)
        return torch.nn.functional.log_softmax(pair, dim=1)[:, 1].exp()
