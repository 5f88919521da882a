#!/usr/bin/env python3
"""Greedy continuations of one GGUF file from `holo serve` (its quantized blocks with `--quantized`, and f32) and from
llama.cpp's `llama-server`, side by side: how often the three agree.

    python3 benches/greedy_compare.py --model MODEL.gguf [--holo target/release/holo] [--llama-server PATH]
        [--max-tokens 48]

Each server in turn gets the same plain-text prompts with temperature 0 (greedy). Printed: per pair of
servers, how many continuations are identical, and the mean length of their common prefix in characters
against the mean length of a continuation. holo's blocks and llama.cpp both round each row of activations
to 8 bits per block before multiplying quantized weights; without `--quantized` holo multiplies f32
weights by f32 activations. Standard library only; reuses `serve_compare.py`'s server start-up.
"""

import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_compare import free_port, post, start_holo, start_llama, wait_ready  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "To make a cup of tea, first",
    "The three primary colors are",
    "Question: What is 12 times 7?\nAnswer:",
    "Photosynthesis is the process by which",
    "The best way to learn a new language is",
    "import numpy as np\n\n# Compute the mean of a list\n",
    "In 1969, the first humans",
    "A haiku about autumn:\n",
    "The difference between a list and a tuple in Python is",
]


def continuations(start, max_tokens):
    port = free_port()
    process, model_name = start(port)
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", process)
        out = []
        for prompt in PROMPTS:
            answer = post(f"http://127.0.0.1:{port}/v1/completions",
                          {"model": model_name, "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0.0})
            out.append(answer["choices"][0]["text"])
        return out
    finally:
        process.terminate()
        process.wait()


def common_prefix(a, b):
    return len(os.path.commonprefix([a, b]))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--holo", default="target/release/holo")
    parser.add_argument("--llama-server")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    runs = {
        "holo blocks": continuations(lambda port: start_holo(args.holo, args.model, port, 1, ["--quantized"]),
                                     args.max_tokens),
        "holo f32": continuations(lambda port: start_holo(args.holo, args.model, port, 1, []), args.max_tokens),
    }
    if args.llama_server:
        runs["llama.cpp"] = continuations(lambda port: start_llama(args.llama_server, args.model, port, 1),
                                          args.max_tokens)
    for (name_a, a), (name_b, b) in itertools.combinations(runs.items(), 2):
        same = sum(x == y for x, y in zip(a, b))
        prefix = sum(common_prefix(x, y) for x, y in zip(a, b)) / len(PROMPTS)
        length = sum(len(x) + len(y) for x, y in zip(a, b)) / (2 * len(PROMPTS))
        print(f"{name_a:>11} vs {name_b:<11} identical {same}/{len(PROMPTS)}, common prefix {prefix:.0f} "
              f"of {length:.0f} characters on average")


if __name__ == "__main__":
    sys.exit(main())
