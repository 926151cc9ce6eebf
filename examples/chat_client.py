"""Chat with a running `mili serve` through the official openai client (pip install openai).

    mili serve                              # in another terminal: the built-in demo model
    python examples/chat_client.py "Who are you?"
    python examples/chat_client.py --base-url http://HOST:8000/v1 --model NAME "Hello"
"""

import argparse

from openai import OpenAI


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("message", nargs="?", default="Hello!")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="demo", help="the served model's name (mili serve --served-model-name)")
    parser.add_argument("--api-key", default="unused", help="what mili serve --api-key set, if it did")
    args = parser.parse_args(argv)

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    messages = [{"role": "user", "content": args.message}]
    reply = client.chat.completions.create(model=args.model, messages=messages, max_tokens=128)
    message = reply.choices[0].message
    # Qwen3 thinks first: the thinking comes back apart from the answer
    print("thinking:", (getattr(message, "reasoning_content", None) or "").strip())
    print("answer:", message.content.strip())

    # a second turn: send the whole conversation; the prefix cache computes only the new part
    messages += [{"role": "assistant", "content": message.content}, {"role": "user", "content": "Say it again."}]
    again = client.chat.completions.create(model=args.model, messages=messages, max_tokens=128,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    print("again:", again.choices[0].message.content.strip())
    print("prompt tokens served from the prefix cache:", again.usage.prompt_tokens_details.cached_tokens)


if __name__ == "__main__":
    main()
