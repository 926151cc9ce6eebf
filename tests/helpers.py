"""Builders shared by the tests: tiny random and scripted Qwen3 checkpoints, the real Qwen3 tokenizer."""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

import torch

DATA = Path(__file__).resolve().parent / "data"  # what the tests read: tests/data/README.md says where it came from
QWEN3_TOKENIZER = DATA / "qwen3-tokenizer"

# Three shapes: GQA with head_dim != hidden/heads and untied embeddings; MHA tied; GQA 4:1 on the
# real vocabulary size.
SHAPES = {
    "gqa_untied": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False),
    "mha_tied": dict(vocab_size=384, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4, head_dim=24, tie_word_embeddings=True),
    # heavy enough (~50M parameters, ~10 ms a decode step) that a request lasts about a second
    "slow": dict(vocab_size=4096, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                 num_attention_heads=12, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True),
    "gqa4_realvocab": dict(vocab_size=151936, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                           num_attention_heads=8, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
}


def build_checkpoint(path: Path, shape: str, seed: int = 0, weight_scale: float = 8.0,
                     with_tokenizer: bool = True, **overrides) -> Path:
    """A random Qwen3 checkpoint folder. Non-embedding matrices are scaled up so logits are not flat
    (HF's default init gives near-ties everywhere, which makes greedy parity meaningless)."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(max_position_embeddings=1024, rope_theta=10000.0, eos_token_id=None,
                      bos_token_id=None, pad_token_id=None, **{**SHAPES[shape], **overrides})
    model = Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.mul_(weight_scale)
            elif "norm" in name:  # non-trivial norm weights exercise the q/k norms
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    if with_tokenizer:
        AutoTokenizer.from_pretrained(QWEN3_TOKENIZER).save_pretrained(path)
    return path


def build_moe_checkpoint(path: Path, seed: int = 0, weight_scale: float = 8.0, hub_spelling: bool = False,
                         **overrides) -> Path:
    """A random Qwen3 MoE checkpoint (saved in the hub layout: one tensor per expert and projection).
    ``hub_spelling``: config.json says num_experts (as Qwen's releases) rather than num_local_experts."""
    import json

    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1,
                 mlp_only_layers=[], tie_word_embeddings=False)
    cfg = Qwen3MoeConfig(max_position_embeddings=1024, rope_theta=10000.0, eos_token_id=None, bos_token_id=None,
                         pad_token_id=None, **{**shape, **overrides})
    model = Qwen3MoeForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "embed" not in name:
                p.mul_(weight_scale)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    if hub_spelling:
        config = json.loads((path / "config.json").read_text())
        config["num_experts"] = config.pop("num_local_experts")
        (path / "config.json").write_text(json.dumps(config))
    AutoTokenizer.from_pretrained(QWEN3_TOKENIZER).save_pretrained(path)
    return path


def build_scripted_checkpoint(path: Path, chain: dict[int, int], hidden: int = 32) -> Path:
    """A real Qwen3 checkpoint whose greedy next token is ``chain[current token]``.

    Each token of the chain gets a one-hot embedding; every layer's residual branch is zeroed (o_proj,
    down_proj), so the final hidden state is the current token's (normalised) embedding, and an untied
    lm_head maps it to its successor. Tokens outside the chain get small random embeddings."""
    from transformers import AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    tokens = list(dict.fromkeys([*chain, *chain.values()]))
    assert len(chain) <= hidden
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=151936, hidden_size=hidden, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=2048,
                      tie_word_embeddings=False, eos_token_id=151645, bos_token_id=None, pad_token_id=151643)
    model = Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb.normal_(0, 0.01)
        head.zero_()
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        for i, (current, nxt) in enumerate(chain.items()):
            emb[current].zero_()
            emb[current, i] = 1.0
            head[nxt, i] = 4.0  # a margin of 4 * sqrt(hidden) logits over every other token
        del tokens
    model.generation_config = GenerationConfig(eos_token_id=[151645, 151643], pad_token_id=151643)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(QWEN3_TOKENIZER).save_pretrained(path)
    return path


# The scripted model's greedy answer to a chat prompt: "<think>Let me think</think>\n\nHello!" with
# thinking on; "Hello!" with it off (the template then ends the prompt with "</think>\n\n").
CHAIN = {198: 151667, 151667: 10061, 10061: 752, 752: 1744, 1744: 151668, 151668: 271, 271: 9707,
         9707: 0, 0: 151645}


# A scripted model that thinks, talks and calls a tool: with thinking on, "<think>Let me think</think>\n\n"
# then CALLER_TEXT; with it off (the prompt then ends with "</think>\n\n", token 271), CALLER_TEXT alone.
CALLER_THINKING = {198: 151667, 151667: 10061, 10061: 752, 752: 1744, 1744: 151668, 151668: 271}
CALLER_TEXT = 'I will check.\n<tool_call>\n{"name": "get_time", "arguments" : {"zone":"CET"}}\n</tool_call>'


def build_caller_checkpoint(path: Path) -> tuple[Path, dict[int, int]]:
    """The scripted checkpoint above, and its chain."""
    chain = {**CALLER_THINKING, **script_text(271, CALLER_TEXT, avoid=tuple(CALLER_THINKING))}
    return build_scripted_checkpoint(path, chain, hidden=64), chain


def chain_length(chain: dict[int, int], start: int, end: int = 151645) -> int:
    """How many tokens the scripted model writes after ``start``, ``end`` included."""
    n, token = 0, start
    while token != end:
        token, n = chain[token], n + 1
    return n


@functools.cache
def _qwen3_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(QWEN3_TOKENIZER)


def prompt_tokens(messages: list[dict], **kwargs) -> int:
    """How many tokens HF's Qwen3 chat template makes of ``messages`` (with the generation prompt);
    ``kwargs`` go to the template (tools, enable_thinking)."""
    tokenizer = _qwen3_tokenizer()
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return len(tokenizer(text, add_special_tokens=False).input_ids)


@functools.cache
def _vocab_pieces() -> dict[str, list[int]]:
    """The Qwen3 vocabulary by decoded text: each piece's token ids (pieces that are not whole characters left out)."""
    backend = _qwen3_tokenizer().backend_tokenizer
    pieces: dict[str, list[int]] = {}
    for token, i in backend.get_vocab().items():
        piece = backend.decoder.decode([token])
        if "\ufffd" not in piece:
            pieces.setdefault(piece, []).append(i)
    return pieces


def script_text(start: int, text: str, end: int = 151645, avoid: tuple[int, ...] = ()) -> dict[int, int]:
    """A chain (for ``build_scripted_checkpoint``) whose greedy output after token ``start`` decodes to
    ``text``, then ``end``. The chain is first-order, so no token may appear twice: repeated pieces of
    ``text`` are spelled with other tokens (longest unused vocabulary piece first), and none of ``avoid``
    (the tokens of another chain this one joins) is used."""
    pieces = _vocab_pieces()
    import random

    rng = random.Random(0)
    for _ in range(5000):  # random spellings (longer pieces likelier) until one uses no token twice
        used, ids, pos = {start, end, *avoid}, [], 0
        while pos < len(text):
            options = [(length, i) for length in range(min(16, len(text) - pos), 0, -1)
                       for i in pieces.get(text[pos:pos + length], []) if i not in used]
            if not options:
                break
            length, i = rng.choices(options, weights=[n * n for n, _ in options])[0]
            ids.append(i)
            used.add(i)
            pos += length
        if pos == len(text):
            break
    else:
        raise ValueError(f"no spelling of {text!r} found that uses each token once")
    chain = [start, *ids, end]
    return dict(zip(chain, chain[1:]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: Path | str, *args: str, env: dict | None = None, log_dir: Path | None = None):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = (log_dir or Path(model).parent) / f"server-{self.port}.log"
        self.log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "mili.cli", "serve", str(model), "--port", str(self.port),
               "--served-model-name", "test", "--dtype", "float32", "--max-model-len", "1024", *args]
        # MILI_TEST_API_SERVER_COUNT=2: every server test runs with that many API processes
        if os.environ.get("MILI_TEST_API_SERVER_COUNT") and "--api-server-count" not in args:
            cmd += ["--api-server-count", os.environ["MILI_TEST_API_SERVER_COUNT"]]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "MILI_NO_PROGRESS": "1", **(env or {})})
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError(f"server did not start: {self.output()}")

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def stop(self) -> int:
        """SIGTERM, as an orchestrator would; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.flush()
        return self.proc.returncode


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def wait_for(predicate, timeout: float = 20.0) -> bool:
    """Poll ``predicate`` until it holds (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


# -- quantized checkpoints in their exact on-disk layouts ----------------------------------------------------
def write_quantized_checkpoint(dense: Path, dest: Path, tensors: dict, qconfig: dict) -> Path:
    """A copy of checkpoint ``dense`` holding ``tensors`` and declaring ``qconfig`` in its config.json."""
    import json
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(dense, dest)
    save_file(tensors, dest / "model.safetensors")
    cfg = json.loads((dest / "config.json").read_text())
    cfg["quantization_config"] = qconfig
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


QUANT_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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
    from mili import SamplingParams

    core = llm.engine.core
    request = llm.engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
    sched = core.scheduler.schedule()
    assert [s.num_new_tokens for s in sched.scheduled] == [len(prompt)]  # the whole prompt in one step
    batch, _ = core.runner.batches.prepare(sched.scheduled)
    batch.logits_indices = torch.arange(len(prompt), device=batch.input_ids.device)
    with torch.inference_mode():
        logits = core.runner.model.compute_logits(core.runner.model(batch, core.runner.kv_caches))
    core.scheduler.after_step(sched.scheduled)
    llm.engine.abort_request(request.request_id)
    return logits.float().log_softmax(-1).cpu()


def autoawq_pack(values: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's WQLinear_GEMM packing, as it is written there: [rows, cols] 4-bit -> [rows, cols / 8] int32,
    word nibble i holding column order_map[i] of its 8."""
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    packed = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int32)
    for col in range(values.shape[1] // 8):
        for i in range(8):
            packed[:, col] |= values[:, col * 8 + order_map[i]].to(torch.int32) << (i * 4)
    return packed


def awq_layout(weights: dict, group: int) -> tuple[dict, dict]:
    """(AutoAWQ's GEMM layout, the dequantized weights): asymmetric 4-bit per group of input channels."""
    from mili.model.quant import quantize_awq

    out, dequantized = {}, {}
    for name, w in weights.items():
        if not name.endswith(tuple(f"{p}.weight" for p in QUANT_LINEARS)):
            out[name] = dequantized[name] = w
            continue
        q, zeros, scales = quantize_awq(w, group)  # AWQ stores [in, out]
        k, n = q.shape
        stem = name.removesuffix("weight")
        out[stem + "qweight"] = autoawq_pack(q)
        out[stem + "qzeros"] = autoawq_pack(zeros)
        out[stem + "scales"] = scales
        deq = (q.reshape(k // group, group, n) - zeros[:, None]).float() * scales.float()[:, None]
        dequantized[name] = deq.reshape(k, n).t().contiguous()
    return out, dequantized


NEAR_TIE = 1e-3  # greedy paths may part only where HF's own top-2 logits are closer than this


def assert_greedy_matches_hf(outs, reference, max_tokens: int, logprobs: bool = True) -> None:
    """MILI's greedy outputs against HF's (tokens, [steps, V] scores) per prompt: the same tokens, or a parting
    only at a step where HF itself had a near-tie; the logprob of every shared token within 1e-4 of HF's own
    (``logprobs``); and all prompts but at most one matched to the end."""
    import pytest

    exact = 0
    for out, (ref_tokens, scores) in zip(outs, reference):
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
            ref_logprobs = torch.log_softmax(scores, -1)
            for j in range(parted if parted is not None else max_tokens):
                ours = out.outputs[0].logprobs[j][got[j]].logprob
                assert ours == pytest.approx(ref_logprobs[j, got[j]].item(), rel=1e-4, abs=1e-5)
    assert exact >= len(outs) - 1, f"only {exact}/{len(outs)} prompts matched exactly"


def process_gone(pid: int) -> bool:
    """The process has exited (a zombie not yet reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _stream_into(client: httpx.Client, body: dict, sink: list, started: threading.Event) -> None:
    try:
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    sink.append((time.monotonic(), line))
                    started.set()
    except httpx.HTTPError as e:
        sink.append((time.monotonic(), f"transport error: {e}"))
    started.set()


def start_streams(clients: list[httpx.Client], body: dict, wait_s: float = 60):
    """One streamed /v1/completions ``body`` per client (``base_url`` set), each in a thread, returned once each
    has its first event: (a list per stream of (arrival time, "data: ..." line or "transport error: ..."), the
    threads)."""
    sinks = [[] for _ in clients]
    events = [threading.Event() for _ in clients]
    threads = [threading.Thread(target=_stream_into, args=(c, body, sink, ev))
               for c, sink, ev in zip(clients, sinks, events)]
    for t in threads:
        t.start()
    assert all(ev.wait(wait_s) for ev in events)
    return sinks, threads
