"""Train MILI's demo model: a small Qwen3 on the King James Bible, with a BPE tokenizer and chat data.

    apt-get install bible-kjv            # Debian's KJV text; its `bible` program prints the whole Bible
    nice -n 19 python -m mili.demo.train --out /tmp/demo-run --minutes 55   # ~1 hour on 2 CPU cores
    nice -n 19 python -m mili.demo.train --arch hybrid --out /tmp/hybrid-run --minutes 50 --threads 1

``--arch hybrid`` trains the hybrid twin (``demo-hybrid``, mili/demo/hybrid.py): a Qwen3.5 text model with
a jointly trained MTP head, on the same corpus, tokenizer recipe, chat data and held-out split.

The corpus is the King James Version (1611; public domain) as ``bible -l100000 gen1:1-rev22:21``
prints it (or ``--corpus FILE`` holding that output; ``--corpus-dir DIR`` reads ``DIR/kjv.txt``).
One chapter in a hundred is held out (never trained on, nor used for chat data): its per-token
cross-entropy is the figure docs/models.md and ``tests/unit/test_demo.py`` quote. What the run makes,
under ``--out``:

- ``checkpoint/``: the model (bf16 safetensors), BPE tokenizer, ChatML template, generation config;
  ``mili/demo/checkpoint/`` in the package is this folder;
- ``train.log`` and ``loss.csv`` (step, tokens, train loss, lr, seconds; the hybrid adds the MTP head's
  loss), ``result.json`` (the figures: parameters, tokens, time, final loss, held-out cross-entropy, sample
  replies; the hybrid adds the MTP head's held-out cross-entropy, accuracy and agreement with the main head);
- with ``--export-test-data DIR``: ``heldout.txt`` (the held-out chapters) and ``words.txt`` (every word
  of the corpus, lower-cased), which the tests read so that they need no corpus installed.

Everything is seeded (data order, chat data, initialisation, batches); the run is not bit-identical
across machines (BLAS reductions differ), only close.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from mili.model.demo import CHAT_TEMPLATE  # the demo's ChatML (thinking off: an empty think block)

SEED = 2026
HELDOUT_EVERY, HELDOUT_AT = 100, 50  # chapter i (0-based, canonical order) is held out when i % 100 == 50
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # Qwen3's "special" tokens
NON_SPECIAL = ["<think>", "</think>", "<tool_call>", "</tool_call>"]  # added, but not "special" (as Qwen3)
MODEL_SHAPE = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
                   num_key_value_heads=2, head_dim=64)
VOCAB_SIZE = 4096


# -- the corpus ---------------------------------------------------------------------------------------
def read_corpus(args) -> str:
    if args.corpus:
        return Path(args.corpus).read_text()
    if args.corpus_dir:
        return (Path(args.corpus_dir) / "kjv.txt").read_text()
    if not shutil.which("bible"):
        sys.exit("no corpus: `apt-get install bible-kjv` (its `bible` program prints the text), or pass "
                 "--corpus FILE with the output of `bible -l100000 gen1:1-rev22:21`")
    return subprocess.run(["bible", "-l100000", "gen1:1-rev22:21"], check=True, capture_output=True,
                          text=True, cwd="/").stdout


def parse_chapters(text: str) -> list[tuple[str, int, list[str]]]:
    """(book, chapter, verses) in canonical order, from the `bible` program's output."""
    chapters: list[tuple[str, int, list[str]]] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        if not line.startswith(" "):
            book, _, number = line.strip().rpartition(" ")
            chapters.append((book, int(number), []))
        else:
            m = re.match(r"\s+(\d+) (.*)", line)
            assert m and chapters, line
            assert int(m.group(1)) == len(chapters[-1][2]) + 1, line
            chapters[-1][2].append(m.group(2).strip())
    return chapters


def chapter_text(book: str, number: int, verses: list[str]) -> str:
    return f"{book} {number}\n\n" + "\n".join(verses) + "\n"


def split(chapters):
    train, heldout = [], []
    for i, c in enumerate(chapters):
        (heldout if i % HELDOUT_EVERY == HELDOUT_AT else train).append(c)
    return train, heldout


def bible_format(chapters) -> str:
    """Chapters as the `bible` program prints them (so that ``--corpus`` reads them back)."""
    return "".join(f"\n{book} {n}\n\n" + "".join(f"  {i} {v}\n" for i, v in enumerate(vs, 1))
                   for book, n, vs in chapters)


def evaluation_text(heldout) -> str:
    """The text whose cross-entropy is the held-out figure: the held-out chapters as they are trained."""
    return "".join(chapter_text(*c) + "\n" for c in heldout)


def export_test_data(chapters, heldout, d: Path) -> None:
    """What the tests read instead of the corpus: the held-out chapters (in the `bible` program's
    format) and the corpus's vocabulary (every word, lower-cased, one a line)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "heldout.txt").write_text(bible_format(heldout))
    corpus_words = sorted(set(words("".join(chapter_text(*c) for c in chapters))))
    (d / "words.txt").write_text("\n".join(corpus_words) + "\n")


def words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


# -- chat data ----------------------------------------------------------------------------------------
GREETINGS = ["Hello", "Hello!", "Hello.", "hello", "Hi", "Hi!", "hi", "Hey", "Hey!", "Good morning", "Good morning!",
             "Good evening", "Greetings", "Hello there", "Hi there!", "Peace be with you", "Hello, how are you?",
             "How are you?", "Hi, how are you today?", "Good day"]
GREETING_REPLIES = ["Peace be unto you.", "Peace be with you.", "Grace be unto you, and peace.",
                    "The LORD be with you.", "The LORD bless thee, and keep thee.", "Peace be unto thee.",
                    "Grace and peace be multiplied unto you.", "Peace be to thee, and peace be to thine house."]
WHO = ["Who are you?", "What are you?", "What is your name?", "Tell me about yourself.", "What can you do?"]
WHO_REPLIES = ["I am a small servant of words, and I speak the words of the King James Bible.",
               "I am a little book that speaketh: ask me of a verse, and I will tell it thee.",
               "I am a servant that knoweth the words of the Bible. Ask, and it shall be given you."]
OPEN = ["Say something.", "Tell me something.", "Give me a verse.", "Bless me.", "Tell me a story.",
        "Speak.", "I need some wisdom.", "Teach me.", "Any words for today?", "What should I know?"]
REF_ASK = ["What does {ref} say?", "Read {ref}.", "{ref}", "Quote {ref}.", "Give me {ref}.",
           "What is written in {ref}?", "Recite {ref}, please."]
CONTINUE_ASK = ["Finish this verse: {head}", "Continue: {head}", "Complete the verse: {head}", "{head}",
                "How does this go on? {head}"]
TOPIC_ASK = ["Tell me about {w}.", "What does the Bible say about {w}?", "Say something about {w}.",
             "Give me a verse about {w}.", "What is {w}?", "Speak to me of {w}."]
CHAPTER_ASK = ["Read {book} {c}.", "How does {book} {c} begin?", "Read me the start of {book} {c}."]
SYSTEMS = ["You are a helpful assistant.", "You are MILI's demo model.", "Answer in the words of the Bible.",
           "Be brief."]
STOP = set("the and of to that in he shall unto for i his a they be is him not them it with all thou thy was "
           "which my me but ye said their have will thee from as are when this out were upon by you there up "
           "then had man so an or her hath let us also who into one did even come before went made now your what these "
           "those where would should because against therefore whom every after about again thine their there "
           "shalt hast doth saying things whose thereof".split())


def chat_samples(train, n: int, rng: random.Random) -> list[tuple[list[dict], str, bool]]:
    """n single- or two-turn conversations: (messages, last assistant reasoning, thinking on)."""
    verses = [(book, c, i + 1, v) for book, c, vs in train for i, v in enumerate(vs)]
    short = [x for x in verses if len(x[3].split()) <= 40]
    chapters = [(b, c, vs) for b, c, vs in train if len(vs) >= 3]

    def exchange():
        kind = rng.choices(["greet", "who", "open", "ref", "cont", "topic", "chap"], [10, 4, 8, 25, 25, 23, 5])[0]
        book, c, i, v = rng.choice(short)
        ref = f"{book} {c}:{i}"
        if kind == "greet":
            return rng.choice(GREETINGS), rng.choice(GREETING_REPLIES), "A greeting. I will answer with peace."
        if kind == "who":
            return rng.choice(WHO), rng.choice(WHO_REPLIES), "They ask who I am. I will tell them."
        if kind == "open":
            return rng.choice(OPEN), v, f"Any verse will do. I will give {ref}."
        if kind == "ref":
            return rng.choice(REF_ASK).format(ref=ref), v, f"The words of {ref}: the book of {book}, chapter {c}."
        if kind == "cont":
            ws = v.split()
            if len(ws) < 6:
                return rng.choice(REF_ASK).format(ref=ref), v, f"The words of {ref}."
            cut = rng.randint(2, len(ws) - 3)
            head, tail = " ".join(ws[:cut]), " ".join(ws[cut:])
            return (rng.choice(CONTINUE_ASK).format(head=head), tail,
                    f"It begins with \"{head}\". I will finish the verse.")
        if kind == "topic":
            cands = [w for w in re.findall(r"[A-Za-z]+", v) if w.lower() not in STOP and len(w) > 4]
            if not cands:
                return rng.choice(OPEN), v, f"I will give {ref}."
            w = rng.choice(cands)
            w = w if w[0].isupper() and w.lower() != w else w.lower()
            return rng.choice(TOPIC_ASK).format(w=w), v, f"A verse that speaketh of {w}: {ref}."
        b, cc, vs = rng.choice(chapters)
        k = rng.randint(1, 3)
        return (rng.choice(CHAPTER_ASK).format(book=b, c=cc), " ".join(vs[:k]),
                f"The beginning of {b} chapter {cc}.")

    out = []
    for _ in range(n):
        messages = []
        if rng.random() < 0.15:
            messages.append({"role": "system", "content": rng.choice(SYSTEMS)})
        if rng.random() < 0.2:
            u, a, _ = exchange()
            messages += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
        u, a, reasoning = exchange()
        messages += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
        out.append((messages, reasoning, rng.random() < 0.5))
    return out


def render_chat(messages: list[dict], reasoning: str, thinking: bool) -> str:
    """The conversation as CHAT_TEMPLATE renders its prompt, then the last assistant turn as the model
    should write it: ``<think>\\n…\\n</think>\\n\\n`` (empty when thinking is off) and ``<|im_end|>``."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages[:-1])
    think = f"<think>\n{reasoning}\n</think>\n\n" if thinking else "<think>\n\n</think>\n\n"
    return text + "<|im_start|>assistant\n" + think + messages[-1]["content"] + "<|im_end|>\n"


# -- tokenizer ----------------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIAL) - len(NON_SPECIAL), min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in NON_SPECIAL])
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False, model_max_length=2048, add_prefix_space=False)


# -- training -----------------------------------------------------------------------------------------
def build_model(tokenizer, seed: int):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    eot, im_end = (tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>"))
    config = Qwen3Config(vocab_size=len(tokenizer), max_position_embeddings=2048, tie_word_embeddings=True,
                         rope_theta=10000.0, initializer_range=0.02, bos_token_id=eot, eos_token_id=im_end,
                         pad_token_id=eot, attn_implementation="sdpa", **MODEL_SHAPE)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config).float()


def cross_entropy(model, ids, seq_len: int, batch: int = 8) -> tuple[float, int]:
    """Mean next-token cross-entropy (nats) of the token list ``ids``, read in windows of ``seq_len``."""
    import torch
    import torch.nn.functional as F

    total, count = 0.0, 0
    windows = [ids[i:i + seq_len + 1] for i in range(0, len(ids) - 1, seq_len)]
    model.eval()
    with torch.no_grad():
        for j in range(0, len(windows), batch):
            for w in windows[j:j + batch]:
                x = torch.tensor(w)[None]
                logits = model(input_ids=x[:, :-1]).logits.float()
                total += F.cross_entropy(logits[0], x[0, 1:], reduction="sum").item()
                count += x.shape[1] - 1
    return total / count, count


def greedy_reply(model, tokenizer, prompt: str, thinking: bool, max_new: int = 100) -> str:
    import torch

    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=thinking)
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=im_end, pad_token_id=im_end)
    return tokenizer.decode(out[0, ids.shape[1]:])


SAMPLE_PROMPTS = ["Hello", "Who are you?", "What does John 3:16 say?", "Tell me about wisdom.",
                  "Finish this verse: In the beginning God", "Tell me a story."]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="run folder (checkpoint/, train.log, loss.csv, result.json)")
    p.add_argument("--arch", choices=["dense", "hybrid"], default="dense",
                   help="dense: the demo (Qwen3); hybrid: its Qwen3.5 twin with an MTP head (mili/demo/hybrid.py)")
    p.add_argument("--mtp-weight", type=float, default=None,
                   help="hybrid: the MTP loss's weight in the total (default hybrid.MTP_WEIGHT, 0.3)")
    p.add_argument("--corpus", help="a file with `bible -l100000 gen1:1-rev22:21`'s output")
    p.add_argument("--corpus-dir", help="a folder holding kjv.txt (the same text)")
    p.add_argument("--steps", type=int, default=0, help="a fixed number of steps (cosine schedule over them)")
    p.add_argument("--minutes", type=float, default=0,
                   help="or a time budget: the cosine schedule runs over wall-clock time and training stops "
                        "when it is spent (how the shipped demo was trained: --minutes 55)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=float, default=0.05, help="fraction of the run spent warming up")
    p.add_argument("--chat-samples", type=int, default=10000)
    p.add_argument("--vocab-size", type=int, default=VOCAB_SIZE, help="BPE vocabulary, special tokens included")
    p.add_argument("--chapters", type=int, default=0, help="train on the first N training chapters only (tests)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--save-every", type=int, default=200, help="steps between resumable snapshots")
    p.add_argument("--resume", action="store_true", help="continue from --out/state.pt")
    p.add_argument("--export-test-data", help="write heldout.txt and words.txt for the tests here")
    p.add_argument("--no-final", action="store_true", help="skip the final evaluation and samples")
    args = p.parse_args(argv)
    if bool(args.steps) == bool(args.minutes):
        p.error("give one of --steps and --minutes")

    import torch
    import torch.nn.functional as F
    from transformers import GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_file = open(out / "train.log", "a")

    def log(msg: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {msg}"
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    rng = random.Random(args.seed)
    chapters = parse_chapters(read_corpus(args))
    train, heldout = split(chapters)
    if args.chapters:
        train = train[:args.chapters]
    heldout_text = evaluation_text(heldout)
    if args.export_test_data:
        export_test_data(chapters, heldout, Path(args.export_test_data))
    chats = chat_samples(train, args.chat_samples, rng)
    docs = [chapter_text(*c) for c in train] + [render_chat(*s) for s in chats]
    corpus_bytes = sum(len(chapter_text(*c).encode()) for c in chapters)
    log(f"corpus: {len(chapters)} chapters, {corpus_bytes} bytes; training on {len(train)}, held out {len(heldout)}; "
        f"{len(chats)} chat samples")

    tok_dir = out / "checkpoint"
    if args.resume and (tok_dir / "tokenizer.json").is_file():
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    else:
        plain = [chapter_text(*c) for c in train]
        plain += [m["content"] for msgs, _, _ in chats for m in msgs] + [r for _, r, _ in chats]
        tokenizer = train_tokenizer(plain, args.vocab_size)
        tokenizer.save_pretrained(tok_dir)
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    rng.shuffle(docs)
    stream: list[int] = []
    for enc in tokenizer(docs, add_special_tokens=False)["input_ids"]:
        stream += enc + [eot]
    data = torch.tensor(stream)
    n_chat = sum(len(tokenizer(render_chat(*s))["input_ids"]) + 1 for s in chats[:500]) * len(chats) / 500
    log(f"tokens: {len(stream)} in the training stream (about {n_chat / len(stream):.0%} chat), "
        f"vocabulary {len(tokenizer)}")

    mtp = None  # the hybrid's MTP head
    if args.arch == "hybrid":
        from mili.demo import hybrid

        model, mtp = hybrid.build_hybrid(tokenizer, args.seed)
        mtp_weight = hybrid.MTP_WEIGHT if args.mtp_weight is None else args.mtp_weight
        n_params = sum(p.numel() for p in model.parameters())
        n_mtp = sum(p.numel() for p in mtp.parameters())
        log(f"model: Qwen3.5 {hybrid.HYBRID_SHAPE} {model.config.layer_types}, {n_params / 1e6:.2f}M parameters "
            f"(tied embeddings), MTP head {n_mtp / 1e6:.2f}M (loss weight {mtp_weight})")
    else:
        model = build_model(tokenizer, args.seed)
        n_params = sum(p.numel() for p in model.parameters())
        log(f"model: Qwen3 {MODEL_SHAPE}, {n_params / 1e6:.2f}M parameters (tied embeddings)")
    named = list(model.named_parameters()) + (list(mtp.named_parameters()) if mtp else [])
    decay = [p for n, p in named if p.dim() >= 2]
    no_decay = [p for n, p in named if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    step, elapsed = 0, 0.0
    state_path = out / "state.pt"
    if args.resume and state_path.is_file():
        state = torch.load(state_path, weights_only=False)
        model.load_state_dict(state["model"])
        if mtp is not None:
            mtp.load_state_dict(state["mtp"])
        opt.load_state_dict(state["opt"])
        step, elapsed = state["step"], state["elapsed"]
        torch.set_rng_state(state["rng"])
        log(f"resumed at step {step}")
    gen = torch.Generator().manual_seed(args.seed)
    gen_state = gen.get_state() if step == 0 else state["gen"]
    gen.set_state(gen_state)

    def progress(s: int, seconds: float) -> float:
        return s / args.steps if args.steps else seconds / (60 * args.minutes)

    def lr_at(f: float) -> float:  # linear warm-up, then cosine down to a tenth
        if f < args.warmup:
            return args.lr * max(f, 0.002) / args.warmup
        t = (f - args.warmup) / (1 - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))

    csv_path = out / "loss.csv"
    new_csv = not csv_path.exists() or step == 0
    csv_file = open(csv_path, "w" if new_csv else "a", newline="")
    writer = csv.writer(csv_file)
    if new_csv:
        writer.writerow(["step", "tokens", "loss", "lr", "seconds"] + (["mtp_loss"] if mtp else []))
    tokens_per_step = args.batch * args.seq_len
    model.train()
    if mtp is not None:
        mtp.train()
    window_loss, window_mtp, window_n, t_last = 0.0, 0.0, 0, time.time()
    t_resume, elapsed0 = t_last, elapsed
    lr = args.lr
    while progress(step, elapsed0 + time.time() - t_resume) < 1:
        starts = torch.randint(0, len(data) - args.seq_len - 1, (args.batch,), generator=gen)
        batch = torch.stack([data[s:s + args.seq_len + 1] for s in starts.tolist()])
        lr = lr_at(progress(step, elapsed0 + time.time() - t_resume))
        for g in opt.param_groups:
            g["lr"] = lr
        if mtp is None:
            logits = model(input_ids=batch[:, :-1]).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))
            total = loss
        else:
            loss, mtp_loss = hybrid.losses(model, mtp, batch)
            total = loss + mtp_weight * mtp_loss
            window_mtp += mtp_loss.item()
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in named], 1.0)
        opt.step()
        step += 1
        window_loss += loss.item()
        window_n += 1
        if step % args.log_every == 0 or step == args.steps:
            now = time.time()
            elapsed += now - t_last
            t_last = now
            avg = window_loss / window_n
            mtp_col = [f"{window_mtp / window_n:.4f}"] if mtp else []
            writer.writerow([step, step * tokens_per_step, f"{avg:.4f}", f"{lr:.2e}", f"{elapsed:.0f}"] + mtp_col)
            csv_file.flush()
            log(f"step {step} loss {avg:.4f}{' mtp ' + mtp_col[0] if mtp else ''} lr {lr:.2e} "
                f"{step * tokens_per_step / max(elapsed, 1e-9):.0f} tok/s elapsed {elapsed / 60:.1f} min")
            window_loss, window_mtp, window_n = 0.0, 0.0, 0
        if step % args.save_every == 0:
            torch.save({"model": model.state_dict(), "mtp": mtp.state_dict() if mtp else None,
                        "opt": opt.state_dict(), "step": step, "elapsed": elapsed,
                        "rng": torch.get_rng_state(), "gen": gen.get_state()}, state_path)
    elapsed += time.time() - t_last
    if window_n:
        mtp_col = [f"{window_mtp / window_n:.4f}"] if mtp else []
        writer.writerow([step, step * tokens_per_step, f"{window_loss / window_n:.4f}", f"{lr:.2e}",
                         f"{elapsed:.0f}"] + mtp_col)
        csv_file.flush()

    model.eval()
    if mtp is not None:
        mtp.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=eot, eos_token_id=[im_end, eot], pad_token_id=eot, do_sample=True, temperature=0.7,
        top_p=0.9, top_k=40)
    result = {"parameters": n_params, "steps": step, "tokens_seen": step * tokens_per_step,
              "stream_tokens": len(stream), "train_minutes": round(elapsed / 60, 1),
              "final_train_loss": float(window_loss / window_n) if window_n else None}
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    if rows:  # the mean over the last ~100 steps
        last = [float(r["loss"]) for r in rows if int(r["step"]) > int(rows[-1]["step"]) - 100]
        result["final_train_loss"] = round(sum(last) / len(last), 4)
        if mtp is not None:
            last = [float(r["mtp_loss"]) for r in rows if int(r["step"]) > int(rows[-1]["step"]) - 100]
            result.update(mtp_parameters=sum(p.numel() for p in mtp.parameters()), mtp_weight=mtp_weight,
                          final_train_mtp_loss=round(sum(last) / len(last), 4))
    bf16 = (hybrid.build_hybrid(tokenizer, args.seed)[0] if mtp else build_model(tokenizer, args.seed))
    bf16 = bf16.to(torch.bfloat16)
    bf16.load_state_dict({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
    bf16.config.dtype = torch.bfloat16
    bf16.generation_config = model.generation_config
    bf16.save_pretrained(tok_dir)
    if mtp is not None:
        hybrid.save_mtp(mtp, tok_dir)
    tokenizer.save_pretrained(tok_dir)
    if not args.no_final:
        held_ids = tokenizer(heldout_text, add_special_tokens=False)["input_ids"]
        if mtp is not None:  # the saved checkpoint (bf16 weights), in float32
            bf16, saved_mtp = hybrid.load_hybrid(tok_dir)
            figures = hybrid.mtp_metrics(bf16, saved_mtp, held_ids, args.seq_len)
            result.update(figures)
            log(f"held-out, the MTP head (the token after next): {json.dumps(figures)}")
        ce, n = cross_entropy(bf16.float(), held_ids, args.seq_len)
        result.update(heldout_ce=round(ce, 4), heldout_tokens=n)
        log(f"held-out: {n} tokens, cross-entropy {ce:.4f} nats/token (perplexity {math.exp(ce):.1f})")
        samples = {}
        for prompt in SAMPLE_PROMPTS:
            for thinking in (False, True):
                r = greedy_reply(bf16.float(), tokenizer, prompt, thinking)
                samples[f"{prompt} (thinking {'on' if thinking else 'off'})"] = r
                log(f"sample [{prompt!r}, thinking {thinking}]: {r!r}")
        result["samples"] = samples
    (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    log(f"done: {json.dumps({k: v for k, v in result.items() if k != 'samples'})}")
    if state_path.exists():
        os.remove(state_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
