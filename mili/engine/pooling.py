"""The API side of pooling: which task a server runs (``--task``), and the prompts and answers of the retrieval
models Qwen ships beside its chat models.

- **Qwen3-Embedding**: a Qwen3 decoder with sentence-transformers files (``modules.json``, a ``1_Pooling`` module
  with last-token pooling, a ``Normalize`` module). The embedding is the last token's final hidden state,
  L2-normalised; the tokenizer appends ``<|endoftext|>`` (its ``tokenizer.json`` post-processor; appended here
  when an older tokenizer does not, as llama.cpp learned to). Queries carry an instruction
  (``Instruct: {task}\\nQuery:{query}``); documents none. Matryoshka: the first ``d`` dimensions, renormalised.
- **Qwen3-Reranker**: a ``Qwen3ForCausalLM``; the score is P("yes") = softmax over the logits of "no" and "yes" at
  the last position of its judging prompt (``RERANK_PREFIX``, the formatted pair, ``RERANK_SUFFIX``), each part
  tokenized apart and joined as the official recipe does. A converted sequence-classification checkpoint
  (``Qwen3ForSequenceClassification``, one label) scores the same prompt through the sigmoid of its head.

The engine computes a pooling request like a prefill-only one (``SamplingParams.pooling``); the prefix cache shares
what the prompts share (the reranker's system prompt, instruction and query across a request's documents).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mili.errors import InvalidRequest, ModelLoadError
from mili.sampling_params import PoolingParams

TASKS = ("auto", "generate", "embed", "rerank")
DEFAULT_RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
RERANK_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
                 "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
EMBED_EOS = "<|endoftext|>"  # what Qwen3-Embedding's last-token pooling expects at the end of every input
# the most inputs (texts, documents) one request may carry: a bound on what one request can queue
MAX_POOLING_INPUTS = 2048

_POOLING_MODES = {"pooling_mode_lasttoken": "lasttoken", "pooling_mode_cls_token": "cls",
                  "pooling_mode_mean_tokens": "mean", "pooling_mode_max_tokens": "max",
                  "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                  "pooling_mode_weightedmean_tokens": "weightedmean"}


@dataclass(frozen=True)
class Task:
    """What a server (or an offline ``LLM``) does with its model: ``generate``, ``embed`` or ``rerank``."""

    name: str
    why: str  # how it was chosen, in words (the start-up log)
    normalize: bool = True  # embed: L2-normalise (a Normalize module, or no sentence-transformers files)
    eos_id: int | None = None  # embed: the token every input ends with (<|endoftext|>)
    score_token_ids: tuple[int, int] | None = None  # rerank on a causal LM: the ids of "no" and "yes"

    @property
    def pooling(self) -> PoolingParams:
        if self.name == "embed":
            return PoolingParams("embed")
        return PoolingParams("score", list(self.score_token_ids) if self.score_token_ids else None)


def resolve_task(asked: str, model_path: str, model_config, tokenizer) -> Task:
    """The task ``asked`` (``auto``: from the checkpoint: sentence-transformers files with a Pooling module ->
    embed, a sequence-classification head -> rerank, otherwise generate), checked against what the checkpoint
    can do; ModelLoadError naming why it cannot."""
    classifier = bool(model_config.num_labels)
    st = sentence_transformers_pooling(model_path)
    if asked == "auto":
        asked = "rerank" if classifier else "embed" if st is not None else "generate"
        why = ("a sequence-classification head" if classifier else
               "sentence-transformers files with a Pooling module" if st is not None else "a causal LM")
    else:
        why = "--task"
    if classifier and asked != "rerank":
        raise ModelLoadError(f"this checkpoint is a sequence-classification model ({model_config.num_labels} "
                             f"label(s), no language-model head): it runs --task rerank, not {asked}", param="task")
    if classifier and model_config.num_labels > 2:
        raise ModelLoadError(f"a sequence-classification head with {model_config.num_labels} labels: MILI scores "
                             "with one label (a sigmoid) or two (the second's softmax)", param="task")
    if asked == "generate":
        return Task("generate", why)
    if asked == "embed":
        normalize = st[1] if st is not None else True
        eos = tokenizer.convert_tokens_to_ids(EMBED_EOS) if EMBED_EOS in tokenizer.get_vocab() else None
        return Task("embed", why, normalize=normalize, eos_id=eos)
    if classifier:
        return Task("rerank", why)
    vocab = tokenizer.get_vocab()
    missing = [t for t in ("no", "yes") if t not in vocab]
    if missing:
        raise ModelLoadError(f"--task rerank on a causal LM scores with the tokens 'no' and 'yes' (Qwen3-Reranker's "
                             f"recipe); this tokenizer has no {' or '.join(map(repr, missing))}", param="task")
    ids = (vocab["no"], vocab["yes"])
    if max(ids) >= model_config.vocab_size:
        raise ModelLoadError(f"the tokens 'no' and 'yes' ({ids}) lie outside the model's vocabulary "
                             f"({model_config.vocab_size})", param="task")
    return Task("rerank", why, score_token_ids=ids)


def sentence_transformers_pooling(model_path: str) -> tuple[str, bool] | None:
    """(pooling mode, normalize) from a checkpoint's sentence-transformers files, or None when it has none (or no
    Pooling module). Either spelling of the pooling config (``pooling_mode_lasttoken: true``, the hub's Qwen3-Embedding;
    ``pooling_mode: "lasttoken"``, sentence-transformers 5+). A pipeline MILI cannot run as a whole (another pooling
    than the last token's, a Dense layer after it) is refused by name: its embeddings would be wrong."""
    folder = Path(model_path)
    try:
        modules = json.loads((folder / "modules.json").read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"modules.json cannot be read: {e}") from e
    kinds = [(str(m.get("type", "")).rsplit(".", 1)[-1], m.get("path", "")) for m in modules if isinstance(m, dict)]
    pooling = [path for kind, path in kinds if kind == "Pooling"]
    if not pooling:
        return None
    others = [kind for kind, _ in kinds if kind not in ("Transformer", "Pooling", "Normalize")]
    if others:
        raise ModelLoadError(f"its sentence-transformers pipeline has module(s) {others} after the model: MILI runs "
                             "the Transformer, last-token Pooling and Normalize only")
    try:
        config = json.loads((folder / pooling[0] / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"the Pooling module's {pooling[0]}/config.json cannot be read: {e}") from e
    mode = config.get("pooling_mode")
    if isinstance(mode, list):
        mode = mode[0] if len(mode) == 1 else "+".join(mode)
    if mode is None:
        on = [name for key, name in _POOLING_MODES.items() if config.get(key)]
        mode = "+".join(on) if on else None
    if mode != "lasttoken":
        raise ModelLoadError(f"its Pooling module asks for {mode!r} pooling: MILI pools the last token "
                             "(Qwen3-Embedding's pooling)")
    return mode, any(kind == "Normalize" for kind, _ in kinds)


# -- prompts -------------------------------------------------------------------------------------
def query_text(text: str, instruction: str | None) -> str:
    """Qwen3-Embedding's query form: ``Instruct: {instruction}\\nQuery:{text}`` (documents carry no instruction)."""
    return text if instruction is None else f"Instruct: {instruction}\nQuery:{text}"


def embedding_ids(tokenizer, task: Task, text: str | list[int]) -> list[int]:
    """An input's token ids: a text as the tokenizer encodes it with its specials (Qwen3-Embedding's appends
    <|endoftext|>), then <|endoftext|> where it did not; token ids as they are."""
    if not isinstance(text, str):
        return list(text)
    ids = list(tokenizer.encode(text, add_special_tokens=True))
    if task.eos_id is not None and (not ids or ids[-1] != task.eos_id):
        ids.append(task.eos_id)
    return ids


class RerankPrompt:
    """Qwen3-Reranker's judging prompt, as its official recipe builds it: the prefix, the formatted pair and the
    suffix tokenized apart, their ids joined (so a request's documents share the prefix's and the query's ids)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.prefix = list(tokenizer.encode(RERANK_PREFIX, add_special_tokens=False))
        self.suffix = list(tokenizer.encode(RERANK_SUFFIX, add_special_tokens=False))

    def ids(self, query: str, document: str, instruction: str | None = None, limit: int | None = None) -> list[int]:
        """The prompt's ids; ``limit``: the most tokens it may have, the pair's ids cut at the end to fit (the
        recipe's truncation); None: as long as it comes."""
        pair = (f"<Instruct>: {instruction or DEFAULT_RERANK_INSTRUCTION}\n<Query>: {query}\n"
                f"<Document>: {document}")
        ids = list(self.tokenizer(pair)["input_ids"])  # (the recipe's call: the tokenizer's specials as it adds them)
        if limit is not None:
            room = limit - len(self.prefix) - len(self.suffix)
            if room < 1:
                raise InvalidRequest(f"truncate_prompt_tokens {limit} leaves no room for the document: the reranker's "
                                     f"prompt alone takes {len(self.prefix) + len(self.suffix)} tokens",
                                     param="truncate_prompt_tokens")
            ids = ids[:room]
        return self.prefix + ids + self.suffix


# -- answers -------------------------------------------------------------------------------------
def embedding(hidden: list[float], dimensions: int | None, normalize: bool) -> list[float]:
    """The embedding from a last token's hidden state: its first ``dimensions`` (Matryoshka), then L2-normalised
    (when the model normalises), in float32 as sentence-transformers' Normalize computes it."""
    import torch

    vector = torch.tensor(hidden[:dimensions] if dimensions else hidden, dtype=torch.float32)
    if normalize:
        vector = torch.nn.functional.normalize(vector, p=2.0, dim=0)
    return vector.tolist()


def check_dimensions(dimensions: int | None, hidden_size: int) -> None:
    if dimensions is not None and not 1 <= dimensions <= hidden_size:
        raise InvalidRequest(f"dimensions must be in [1, {hidden_size}] (the model's hidden size), got {dimensions}",
                             param="dimensions")


def check_count(count: int, param: str) -> None:
    if count < 1:
        raise InvalidRequest(f"{param} must not be empty", param=param)
    if count > MAX_POOLING_INPUTS:
        raise InvalidRequest(f"{param} holds {count} items; one request takes at most {MAX_POOLING_INPUTS} (send "
                             "several requests)", param=param)


def truncate_embedding_input(ids: list[int], limit: int | None) -> list[int]:
    """``truncate_prompt_tokens``: an input longer than ``limit`` keeps its last ``limit`` tokens (vLLM's rule; the
    pooled last token and the closing <|endoftext|> stay)."""
    return ids[-limit:] if limit is not None and len(ids) > limit else ids


class PoolingInputs:
    """A pooling request's prompts, checked: each input's (or pair's) token ids within the context, cut where the
    request allows it (``truncate_prompt_tokens``: N, or -1 for the context length), else an InvalidRequest naming
    the input. Shared by the server's routes and the offline ``LLM``."""

    def __init__(self, tokenizer, task: Task, max_model_len: int):
        self.tokenizer, self.task, self.max_model_len = tokenizer, task, max_model_len
        self._rerank: RerankPrompt | None = None

    def _limit(self, truncate: int | None) -> int | None:
        if truncate is None:
            return None
        if truncate == -1:
            return self.max_model_len
        if not 1 <= truncate <= self.max_model_len:
            raise InvalidRequest(f"truncate_prompt_tokens must be -1 (the context) or in [1, {self.max_model_len}] "
                                 f"(the context length), got {truncate}", param="truncate_prompt_tokens")
        return truncate

    def _fits(self, ids: list[int], param: str, i: int) -> list[int]:
        if not ids:
            raise InvalidRequest(f"{param}[{i}] is empty", param=param)
        if len(ids) > self.max_model_len:
            raise InvalidRequest(f"{param}[{i}] has {len(ids)} tokens, more than the model's context "
                                 f"({self.max_model_len}); set truncate_prompt_tokens to cut it", param=param)
        return ids

    def embed(self, inputs: list[str | list[int]], instruction: str | None = None, truncate: int | None = None,
              param: str = "input") -> list[list[int]]:
        check_count(len(inputs), param)
        limit = self._limit(truncate)
        return [self._fits(truncate_embedding_input(
            embedding_ids(self.tokenizer, self.task, query_text(x, instruction) if isinstance(x, str) else x), limit),
            param, i) for i, x in enumerate(inputs)]

    def score(self, pairs: list[tuple[str, str]], instruction: str | None = None, truncate: int | None = None,
              param: str = "documents") -> list[list[int]]:
        """The judging prompt of each (query, document) pair."""
        check_count(len(pairs), param)
        if self._rerank is None:
            self._rerank = RerankPrompt(self.tokenizer)
        limit = self._limit(truncate)
        return [self._fits(self._rerank.ids(query, doc, instruction, limit), param, i)
                for i, (query, doc) in enumerate(pairs)]
