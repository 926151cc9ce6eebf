"""Generate in your own process, with no server: a few prompts, then a chat turn.

    python examples/offline_generate.py              # the built-in demo model
    python examples/offline_generate.py Qwen/Qwen3-0.6B
"""

import sys

from mili import LLM, SamplingParams


def main(model: str = "demo") -> None:
    llm = LLM(model)

    # plain completions: one SamplingParams for every prompt, outputs in input order
    prompts = ["In the beginning God", "And the LORD said unto"]
    for out in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16)):
        print(f"{out.prompt!r} -> {out.outputs[0].text!r} ({out.outputs[0].finish_reason})")

    # a chat turn through the model's chat template, thinking off
    chat = llm.chat([{"role": "user", "content": "Who are you?"}], SamplingParams(temperature=0, max_tokens=64),
                    chat_template_kwargs={"enable_thinking": False})
    print("chat ->", chat[0].outputs[0].text)


if __name__ == "__main__":
    main(*sys.argv[1:2])
