#!/usr/bin/env python3
"""GGUF files with a SentencePiece vocabulary, as llama.cpp's converter writes every real Gemma 3, Llama 2 and
Phi-3 file (`tokenizer.ggml.model = "llama"`: tokens, scores, token types, the 256 `<0xXX>` byte pieces, no
merges), and what transformers makes of them, for `holo-runtime/tests/model/gguf_spm.rs`.

    ~/.cache/holo-peers/venv/bin/python scripts/gguf_spm.py [--train] [--llama-cpp]

Per family (FAMILIES: gemma3, llama, phi3) a SentencePiece BPE model is trained with `sentencepiece` on
`model_fixtures.py`'s synthetic corpus and a few accented lines, with the options real vocabularies have
(byte fallback, digits split, identity normalization, whitespace-only pieces; Gemma's special ids and its
`<start_of_turn>` / `<end_of_turn>` user-defined pieces and no dummy prefix, Llama 2's `<unk>` `<s>` `</s>` and
the dummy prefix, with Phi-3's `<|user|>`... for phi3), to exactly the 512 pieces of the committed family fixture so that its weights are reused. The
trained `tokenizer.model` is committed (`converted/spm/<family>.model`) and trained again only with `--train`.
A Hugging Face folder is made in a temporary folder: the fixture's config and weights with the vocabulary's
special ids, the `tokenizer.model`, and the tokenizer transformers builds from it (GemmaTokenizer /
LlamaTokenizer) saved beside it with a chat template of the family's shape. llama.cpp's own converter
(`gguf_converted.py`'s, of llama-cpp-python 0.3.36) turns it into `converted/<family>-spm.gguf`: Gemma 3 and
Llama through `_set_vocab_sentencepiece`, Phi-3 through its own reading of `tokenizer.model`.

Into `holo-runtime/tests/fixtures/models/gguf/converted/spm.json`: the versions and, per file, the converter's
arguments and sha256, the folder's config, transformers' logits of `gguf_converted.py`'s SEQUENCES (of the
model llama.cpp reads, `AS_READ`), and for TEXTS and CHATS the ids of
  folder    the folder's tokenizer (`encode(text)`, with the BOS it adds; a chat rendered by its template and
            encoded without special tokens, as `apply_chat_template` does; `decoded`: each text's ids without
            BOS decoded),
  gguf      transformers' own tokenizer of the file (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`,
            gguf-py of the same llama.cpp on the path), the same way,
  prefixed  (not Gemma) transformers' tokenizer of the file as it builds Phi-3 files, a `▁` prefixed to each
            stretch of text between added tokens, as llama.cpp does (transformers' Llama class does not),
  spm       sentencepiece itself (`encode`, BOS first), for the texts without control or user-defined
            pieces: the tokenizer llama.cpp's `llm_tokenizer_spm` reimplements;
  llama_cpp (with `--llama-cpp`) llama.cpp's own ids of the texts (BOS, special tokens parsed) and of the
            chats, and its logits of SEQUENCES (`gguf_llama_cpp.py`'s, keys and values cached in f32): llama-cpp-python's C library of the same sdist, built for the
            CPU into the converter's folder (`CMAKE_ARGS="-DGGML_NATIVE=OFF" pip install --no-deps --target
            ~/.cache/holo-peers/llama-cpp-python-0.3.36-site ~/.cache/holo-peers/llama-cpp-python-0.3.36`, and
            `diskcache` there too, which its Python module imports);
and under `vocabularies`, for llama.cpp's own Llama 2 and Phi-3 vocabularies (copied with its tokenizer test's
texts and ids into `converted/vocab/`), transformers' ids of those texts, as it builds the file and prefixed.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gguf_converted import (  # noqa: E402
    FIXTURES, LLAMA_CPP_COMMIT, LLAMA_CPP_PYTHON, OUT, SEQUENCES, as_read, gguf_module, gguf_py_version,
    llama_cpp, logits_of, run_converter, sha256)
from gguf_llama_cpp import llama_cpp_logits  # noqa: E402

MODELS = OUT / "spm"
VOCABULARIES = OUT / "vocab"
VOCAB = 512
GEMMA_TEMPLATE = (
    "{{ bos_token }}{%- for message in messages %}"
    "{{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' "
    "+ message['content'] | trim + '<end_of_turn>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)
LLAMA_TEMPLATE = (
    "{{ bos_token }}{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{- '<<SYS>>\\n' + message['content'] + '\\n<</SYS>>\\n\\n' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST] ' + message['content'] + ' [/INST]' }}"
    "{%- else %}{{- ' ' + message['content'] + ' ' + eos_token }}{%- endif %}{%- endfor %}"
)
PHI3_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)
# Phi-3's added tokens; llama.cpp refuses a Phi-3 vocabulary without `<|endoftext|>` (`unordered_map::at`).
PHI3_ADDED = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
# Per family: the sentencepiece trainer's special pieces, the transformers class, the chat template.
FAMILIES = {
    "gemma3": {
        "trainer": dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>",
                        bos_piece="<bos>", unk_piece="<unk>", add_dummy_prefix=False,
                        user_defined_symbols=["<mask>", "<start_of_turn>", "<end_of_turn>"]),
        "class": "GemmaTokenizer",
        "special": {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
                    "mask_token": "<mask>", "extra_special_tokens": ["<start_of_turn>", "<end_of_turn>"]},
        "template": GEMMA_TEMPLATE,
    },
    "llama": {
        "trainer": dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1, unk_piece="<unk>", bos_piece="<s>",
                        eos_piece="</s>", add_dummy_prefix=True),
        "class": "LlamaTokenizer",
        "special": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
        "template": LLAMA_TEMPLATE,
    },
    "phi3": {
        "trainer": dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1, unk_piece="<unk>", bos_piece="<s>",
                        eos_piece="</s>", add_dummy_prefix=True,
                        user_defined_symbols=PHI3_ADDED),
        "class": "LlamaTokenizer",
        "special": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                    "extra_special_tokens": PHI3_ADDED},
        "template": PHI3_TEMPLATE,
    },
}
# Leading, doubled and trailing spaces, newlines, digits, characters outside the vocabulary (byte fallback:
# CJK, an emoji, a combining accent) and the families' control tokens inside text.
TEXTS = [
    "What is 12+7? The answer is 19.",
    "  two  spaces\nand a line\n\n",
    " leading space",
    "trailing spaces   ",
    "numbers 1234567890 and 3.14159",
    "caf\u00e9 na\u00efve \u65e5\u672c\u8a9e \U0001f600 e\u0301",
    "\ttab\tand\r\nreturn",
    "",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<s>[INST] hi [/INST] hello</s> again",
    "<bos>what<eos>",
    "<|user|>\nhi<|end|>\n<|assistant|>\n",
]
CHATS = [
    [{"role": "user", "content": "What is 3*4?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "  caf\u00e9 \U0001f600\n\n12 items"}],
]


def corpus() -> list[str]:
    from model_fixtures import synthetic_corpus

    accented = ["caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00e0 la carte", "\u00fcber fa\u00e7ade se\u00f1or"]
    return [*synthetic_corpus(7, 1000), *accented * 20]


def train(family: str, model: Path) -> None:
    import sentencepiece as spm

    model.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(corpus()), model_prefix=str(Path(scratch) / "m"), model_type="bpe",
            vocab_size=VOCAB, byte_fallback=True, split_digits=True, normalization_rule_name="identity",
            remove_extra_whitespaces=False, allow_whitespace_only_pieces=True, character_coverage=1.0,
            num_threads=1, minloglevel=2, **FAMILIES[family]["trainer"])
        shutil.copy(Path(scratch) / "m.model", model)


def folder(family: str, model: Path, scratch: Path) -> Path:
    """The family fixture's config and weights with `model`'s special ids, `model` as `tokenizer.model`, and
    the tokenizer transformers builds from it saved beside it: `tokenizer.json`, and `tokenizer_config.json`
    with the `added_tokens_decoder` that real Gemma 3 and Llama 2 repositories carry (transformers 4 wrote it),
    from which the converter marks the special tokens CONTROL."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    out = scratch / family
    out.mkdir()
    processor = spm.SentencePieceProcessor(model_file=str(model))
    assert processor.vocab_size() == VOCAB, processor.vocab_size()
    ids = {"bos_token_id": processor.bos_id(), "eos_token_id": processor.eos_id(),
           "pad_token_id": processor.pad_id() if processor.pad_id() >= 0 else None}
    config = {**json.loads((FIXTURES / family / "config.json").read_text()), **ids}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(ids, indent=2) + "\n")
    shutil.copy(FIXTURES / family / "model.safetensors", out / "model.safetensors")
    shutil.copy(model, out / "tokenizer.model")
    spec = FAMILIES[family]
    tokenizer_config = {"tokenizer_class": spec["class"], "add_bos_token": True, "add_eos_token": False,
                        **spec["special"], "chat_template": spec["template"]}
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) == VOCAB, len(tokenizer)
    tokenizer.save_pretrained(out)
    added = json.loads((out / "tokenizer.json").read_text())["added_tokens"]
    saved = json.loads((out / "tokenizer_config.json").read_text())
    saved["added_tokens_decoder"] = {str(token.pop("id")): token for token in added}
    (out / "tokenizer_config.json").write_text(json.dumps(saved, indent=2) + "\n")
    return out


def ids_of(tokenizer) -> dict:
    """A tokenizer's ids of TEXTS (with its BOS) and of CHATS (rendered, then without special tokens), and
    its decoding of each text's ids without BOS."""
    texts = [tokenizer.encode(text) for text in TEXTS]
    decoded = [tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) for text in TEXTS]
    chats = []
    for chat in CHATS:
        rendered = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        chats.append(tokenizer.encode(rendered, add_special_tokens=False))
    return {"texts": texts, "decoded": decoded, "chats": chats}


def prefixed(path: Path):
    """transformers' tokenizer of the file at `path` as it builds Phi-3 files (`phi3_tokenizer`: a `▁`
    prepended to each stretch of text between added tokens, then every space `▁`), whatever its
    architecture: llama.cpp's spacing, where transformers' Llama class (`Metaspace`) differs."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        add_gguf_special_tokens, get_gguf_tokenizer, phi3_tokenizer)

    _, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(path))
    tokenizer = add_gguf_special_tokens(phi3_tokenizer(tokenizer_dict), tokenizer_dict)
    tokenizer.chat_template = tokenizer_config.get("chat_template")
    tokenizer.add_bos_token = tokenizer_config["add_bos_token"]
    return tokenizer


def vocabularies(vendored: Path) -> dict:
    """llama.cpp's own sentencepiece vocabularies (`models/ggml-vocab-{llama-spm,phi-3}.gguf`: Llama 2's
    and Phi-3's, vocabulary only) with the texts of its tokenizer test and the ids that test holds
    llama.cpp to (`.inp`, `.out`; `tests/test-tokenizer-0.cpp`, no BOS, special tokens as text), copied
    into VOCABULARIES; transformers' ids of the same texts from the file, as it builds it and prefixed."""
    from transformers import AutoTokenizer

    VOCABULARIES.mkdir(parents=True, exist_ok=True)
    out = {}
    for name in ["ggml-vocab-llama-spm.gguf", "ggml-vocab-phi-3.gguf"]:
        for suffix in ["", ".inp", ".out"]:
            shutil.copy(vendored / "models" / (name + suffix), VOCABULARIES / (name + suffix))
        texts = (VOCABULARIES / f"{name}.inp").read_text().split("\n__ggml_vocab_test__\n")
        gguf = AutoTokenizer.from_pretrained(VOCABULARIES, gguf_file=name)
        out[name] = {"sha256": sha256(VOCABULARIES / name),
                     "gguf": [gguf.encode(text, add_special_tokens=False) for text in texts],
                     "prefixed": [prefixed(VOCABULARIES / name).encode(text, add_special_tokens=False)
                                  for text in texts]}
    return out


def llama_cpp_ids(path: Path, rendered: list[str]) -> dict:
    """llama.cpp's own ids (llama-cpp-python's C library of the same sdist, `Llama(vocab_only=True)`):
    of TEXTS with BOS and special tokens parsed, and of the chats `rendered` by the template, without
    BOS."""
    from llama_cpp import Llama

    vocab = Llama(model_path=str(path), vocab_only=True, verbose=False)
    return {"texts": [vocab.tokenize(text.encode(), add_bos=True, special=True) for text in TEXTS],
            "chats": [vocab.tokenize(text.encode(), add_bos=False, special=True) for text in rendered]}


def spm_ids(model: Path) -> list:
    """sentencepiece's ids of the TEXTS that hold no control or user-defined piece (None for the others,
    which sentencepiece reads as text or as pieces inside the text, where llama.cpp and transformers split
    the text at them), BOS first."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model.read_bytes())
    kinds = sentencepiece_model_pb2.ModelProto.SentencePiece
    added = [piece.piece for piece in proto.pieces if piece.type in (kinds.CONTROL, kinds.USER_DEFINED)]
    processor = spm.SentencePieceProcessor(model_file=str(model))
    return [None if any(piece in text for piece in added) else [processor.bos_id(), *processor.encode(text)]
            for text in TEXTS]


def main() -> None:
    # `sentencepiece` (in the converter's folder beside the venv) on the path before transformers looks for it:
    # transformers reads a `tokenizer.model` only with it.
    vendored, site = llama_cpp()
    sys.path.insert(0, str(site))
    gguf_module(vendored)
    import sentencepiece as spm
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from model_fixtures import versions

    torch.use_deterministic_algorithms(True)

    recorded = {"versions": {**versions(), "sentencepiece": spm.__version__, "llama_cpp_python": LLAMA_CPP_PYTHON,
                             "llama_cpp_commit": LLAMA_CPP_COMMIT, "gguf_py": gguf_py_version(vendored)},
                "texts": TEXTS, "chats": CHATS, "files": {}}
    with tempfile.TemporaryDirectory() as scratch:
        for family in FAMILIES:
            model = MODELS / f"{family}.model"
            if "--train" in sys.argv or not model.exists():
                train(family, model)
            made = folder(family, model, Path(scratch))
            name = f"{family}-spm.gguf"
            arguments = run_converter(vendored, site, made, OUT / name, "f32", [])
            arguments[arguments.index("--outfile") + 1] = name
            print(f"wrote {name} ({(OUT / name).stat().st_size} bytes)")
            reference = as_read(family, made, Path(scratch))
            network = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
            gguf_tokenizer = AutoTokenizer.from_pretrained(OUT, gguf_file=name)
            recorded["files"][name] = {
                "arguments": arguments, "sha256": sha256(OUT / name), "tokenizer_model": f"spm/{family}.model",
                "config": json.loads((reference / "config.json").read_text()),
                "logits": logits_of(name, network),
                "folder": ids_of(AutoTokenizer.from_pretrained(made)),
                "gguf": ids_of(gguf_tokenizer),
                **({} if family == "gemma3" else {"prefixed": ids_of(prefixed(OUT / name))}),
                "spm": spm_ids(model),
            }
            if "--llama-cpp" in sys.argv:
                rendered = [gguf_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
                            for chat in CHATS]
                recorded["files"][name]["llama_cpp"] = {**llama_cpp_ids(OUT / name, rendered),
                                                        "logits": llama_cpp_logits(OUT / name)}
    recorded["vocabularies"] = vocabularies(vendored)
    with open(OUT / "spm.json", "w") as f:
        json.dump(recorded, f, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()
