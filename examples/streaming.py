"""Stream a reply from a running `mili serve`, printing each piece as it arrives (pip install openai).

    mili serve                              # in another terminal: the built-in demo model
    python examples/streaming.py "Tell me a story."
"""

import argparse

from openai import OpenAI


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("message", nargs="?", default="Tell me a story.")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="demo")
    parser.add_argument("--api-key", default="unused")
    args = parser.parse_args(argv)

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    stream = client.chat.completions.create(
        model=args.model, messages=[{"role": "user", "content": args.message}], max_tokens=128, stream=True,
        stream_options={"include_usage": True})
    for chunk in stream:
        if not chunk.choices:  # the last chunk: usage only
            print(f"\n[{chunk.usage.completion_tokens} tokens]")
            continue
        delta = chunk.choices[0].delta
        thinking = getattr(delta, "reasoning_content", None)
        if thinking:
            print(thinking, end="", flush=True)
        if delta.content:
            print(delta.content, end="", flush=True)


if __name__ == "__main__":
    main()
