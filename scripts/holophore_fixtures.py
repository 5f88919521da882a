#!/usr/bin/env python3
"""Parity fixtures for the Holophore (holo-runtime/holo-core/src/holophore.rs).

Builds a small byte-level BPE tokenizer offline (vocab 500 incl. the ChatML special tokens), saves it with
transformers, and records, for several conversations and chat templates, the ids of
`tokenizer.apply_chat_template(messages, tokenize=True)` and the token spans of every assistant content.

Usage (no torch needed):
    python3 -m venv /tmp/hvenv && /tmp/hvenv/bin/pip install transformers tokenizers jinja2
    /tmp/hvenv/bin/python scripts/holophore_fixtures.py [--out holo-runtime/tests/fixtures/holophore]

Outputs: tokenizer.json, tokenizer_config.json (ChatML template), templates/*.jinja, cases.json.
Deterministic: the corpus is generated from a fixed seed and BPE training is deterministic.
"""
import argparse
import json
import os
import random

from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 500
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

TEMPLATES = {
    # Plain ChatML.
    "chatml": (
        "{%- for message in messages %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    ),
    # Qwen2.5-style: a default system prompt when the conversation does not start with one.
    "qwen_default_system": (
        "{%- if messages[0]['role'] != 'system' %}"
        "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
        "{%- endif %}"
        "{%- for message in messages %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    ),
    # A BOS token at the start (Llama-style), ChatML turns without the trailing newline.
    "bos_chatml": (
        "{{- bos_token }}"
        "{%- for message in messages %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    ),
}

CONVERSATIONS = [
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 17 * 23?"},
        {"role": "assistant", "content": "The answer is 391."},
    ],
    [
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": "Compute 2 + 2, then add 5."},
        {"role": "assistant", "content": "<tool>{\"expression\": \"2 + 2\"}</tool>"},
        {"role": "user", "content": "<result>4</result>"},
        {"role": "assistant", "content": "<answer>9</answer>"},
    ],
    [
        {"role": "system", "content": "Réponds en français. Ünïcödé ✓ — 数学 🙂"},
        {"role": "user", "content": "Combien font ½ + ¼ ?"},
        {"role": "assistant", "content": "Ça fait ¾ — trois quarts. 🙂"},
        {"role": "user", "content": "Et en 日本語?"},
        {"role": "assistant", "content": "四分の三 です。"},
    ],
    [
        {"role": "system", "content": "Think step by step.\nThen answer."},
        {"role": "user", "content": "Line one\nline two\n\nline four"},
        {"role": "assistant", "content": "<think>\nfirst, second\n</think>\nfinal: 42"},
    ],
]


def corpus(seed: int) -> list[str]:
    rng = random.Random(seed)
    words = (
        "what is the answer sum of plus minus times equals please compute result think step by so we get "
        "first then add you are a helpful assistant user system reason final correct check tool result "
        "hello there how can help line one two four expression fait trois quarts"
    ).split()
    lines = []
    for _ in range(300):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        lines.append(f"What is {a} * {b}? The answer is {a * b}.")
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 10))))
        lines.append('<tool>{"expression": "%d + %d"}</tool> <result>%d</result>' % (a, b, a + b))
    return lines


def build_tokenizer(seed: int):
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = BpeTrainer(
        vocab_size=VOCAB - len(SPECIALS),
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    tok.add_special_tokens(SPECIALS)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = TEMPLATES["chatml"]
    return hf


def ids_of(result):
    if isinstance(result, list):
        return [int(i) for i in result]
    return [int(i) for i in result["input_ids"]]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="holo-runtime/tests/fixtures/holophore")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    os.makedirs(os.path.join(args.out, "templates"), exist_ok=True)

    hf = build_tokenizer(args.seed)
    hf.save_pretrained(args.out)
    for name, source in TEMPLATES.items():
        with open(os.path.join(args.out, "templates", name + ".jinja"), "w", encoding="utf-8") as f:
            f.write(source)

    cases = []
    for template_name, source in TEMPLATES.items():
        for index, messages in enumerate(CONVERSATIONS):
            for generation in (False, True):
                convo = messages[:-1] if generation else messages
                text = hf.apply_chat_template(convo, chat_template=source, tokenize=False,
                                              add_generation_prompt=generation)
                ids = ids_of(hf.apply_chat_template(convo, chat_template=source, tokenize=True,
                                                    add_generation_prompt=generation))
                enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
                assert [int(i) for i in enc["input_ids"]] == ids, (template_name, index)
                offsets = enc["offset_mapping"]
                spans = []
                cursor = 0
                for message in convo:
                    start = text.index(message["content"], cursor)
                    end = start + len(message["content"])
                    cursor = end
                    if message["role"] != "assistant":
                        continue
                    toks = [i for i, (s, e) in enumerate(offsets) if s >= start and e <= end and e > s]
                    span = [toks[0], toks[-1] + 1]
                    assert toks == list(range(*span)), (template_name, index)
                    content_ids = hf.encode(message["content"], add_special_tokens=False)
                    assert ids[span[0]:span[1]] == content_ids, (template_name, index, message)
                    spans.append(span)
                cases.append({
                    "template": template_name,
                    "conversation": index,
                    "add_generation_prompt": generation,
                    "messages": convo,
                    "text": text,
                    "ids": ids,
                    "assistant_spans": spans,
                })
    with open(os.path.join(args.out, "cases.json"), "w", encoding="utf-8") as f:
        json.dump(cases, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"{len(cases)} cases, vocab {hf.backend_tokenizer.get_vocab_size()}")


if __name__ == "__main__":
    main()
