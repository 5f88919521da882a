#!/usr/bin/env python3
"""GGUF files of the committed random fixtures, as llama.cpp's `convert_hf_to_gguf.py` writes them, and
transformers' logits of the folders they come from, for `holo-runtime/tests/model/gguf_families.rs` (each
file must load to its folder's config and to transformers' logits).

    ~/.cache/holo-peers/venv/bin/python scripts/gguf_families.py

Written with the `gguf` package (gguf-py, llama.cpp's own writer; in the peers' venv, `pip install gguf`
otherwise) into `holo-runtime/tests/fixtures/models/gguf/`:

    phi3.gguf      `phi3`: the fused `attn_qkv` and `ffn_up` (gate then up) as they are, `rope.dimension_count`
                   the rotated part of a head, LongRoPE's factors as the tensors `rope_factors_long` /
                   `rope_factors_short` with `rope.scaling.attn_factor` and
                   `rope.scaling.original_context_length`, `attention.sliding_window` 0 for none
                   (`Phi3MiniModel`);
    olmo3.gguf     `olmo2` (llama.cpp writes OLMo 3 as OLMo 2): `attention.sliding_window`, the windowed layers
                   as `attention.sliding_window_pattern` (one flag per layer, from `layer_types`), the
                   windowed layers' RoPE base as `rope.freq_base_swa` (`Olmo2Model`, `TextModel`);
    mistral.gguf   `llama` (llama.cpp writes `MistralForCausalLM` as Llama, `LlamaModel`): q / k rows permuted
                   as `LlamaModel.permute` does, `attention.key_length` / `value_length` for heads wider than
                   hidden / heads, `rope.dimension_count`. llama.cpp's converter writes no window for Mistral
                   (its Llama graph has none); this file carries the folder's `sliding_window` under
                   `llama.attention.sliding_window`, gguf-py's key for every architecture's window
                   (`add_sliding_window`), where this loader looks for a Mistral window;
    ministral.gguf as mistral.gguf, with `layer_types` as `llama.attention.sliding_window_pattern`, one flag
                   per layer (`add_sliding_window_pattern`, as OLMo 3's);
    smollm3.gguf   `smollm3`: Llama's tensors, q / k rows permuted as `LlamaModel.permute` does. llama.cpp
                   writes no key for the layers without RoPE (neither does gguf-py 0.19 have one): its graph
                   leaves RoPE out of every fourth layer (`n_no_rope_layer_step = 4`), transformers' default
                   `no_rope_layer_interval`. The committed fixture leaves it out of its second of two layers,
                   which a GGUF file cannot say, so the file is made from `smollm3/` (next to it): a
                   `SmolLM3ForCausalLM` of four layers, the fixture's two twice over, saved by transformers
                   with `no_rope_layers` derived by its config from `no_rope_layer_interval` 4 ([1, 1, 1, 0]).

Tensor names come from gguf-py's `get_tensor_name_map` (llama.cpp's `tensor_mapping.py`); the tokenizer is the
fixtures' byte-level BPE (`tokenizer.ggml.model` gpt2, its merges, the added tokens as control tokens). Every
tensor is F32, so the files load to the folders' logits exactly but for the order of sums.

`expected.json` beside them: for each file, its folder and transformers' logits (f32, eager attention) of
SEQUENCES at the positions listed, past the fixtures' windows (4 positions) and past Phi-3's original context
(64 positions).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM, SmolLM3Config, SmolLM3ForCausalLM

from model_fixtures import f32, versions

try:
    import gguf
except ImportError:
    sys.exit("the gguf package is missing: ~/.cache/holo-peers/venv/bin/pip install gguf")

FIXTURES = Path(__file__).resolve().parent.parent / "holo-runtime/tests/fixtures/models"
OUT = FIXTURES / "gguf"
# llama.cpp's SmolLM3 graph: RoPE left out where (layer + 1) % 4 == 0, whatever the checkpoint says.
NO_ROPE_STEP = 4
# The sequences whose logits the test compares, and at which positions: past the windows of 4, and past
# Phi-3's original context of 64 (where LongRoPE takes its long factors).
SEQUENCES = [
    ([1, 2, 3, 4, 5, 6, 7, 8, 9], [4, 8]),
    ([509, 100, 200, 300, 7], [4]),
    ([i * 37 % 500 for i in range(80)], [63, 64, 79]),
]


def permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """`LlamaModel.permute`: each head's rows from the half-split rotary order to llama.cpp's interleaved one."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def rope_parameters(config: dict) -> dict:
    return config.get("rope_parameters") or {}


def add_tokenizer(writer: gguf.GGUFWriter, folder: Path, vocab_size: int) -> None:
    """The fixture's byte-level BPE as `_set_vocab_gpt2` writes one."""
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokens = [""] * vocab_size
    types = [gguf.TokenType.NORMAL] * vocab_size
    for token, id in tokenizer["model"]["vocab"].items():
        tokens[id] = token
    for added in tokenizer["added_tokens"]:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = gguf.TokenType.CONTROL
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    # The fixtures split as Qwen 2's tokenizer does.
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokens.index(tokenizer_config["eos_token"]))
    writer.add_pad_token_id(tokens.index(tokenizer_config["pad_token"]))
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer_config["chat_template"])


def add_common(writer: gguf.GGUFWriter, config: dict) -> None:
    """`TextModel.set_gguf_parameters`' keys of these models."""
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = rope_parameters(config)
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    if "sliding_attention" in rope:
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if head_dim * config["num_attention_heads"] != config["hidden_size"]:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)


def write(name: str, arch: gguf.MODEL_ARCH, folder: Path, config: dict, extra, transform=None) -> Path:
    out = OUT / f"{name}.gguf"
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    add_common(writer, config)
    extra(writer)
    add_tokenizer(writer, folder, config["vocab_size"])
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    tensors = load_file(str(folder / "model.safetensors"))
    for hf_name in sorted(tensors):
        tensor = tensors[hf_name].astype(np.float32)
        if transform is not None:
            tensor = transform(hf_name, tensor)
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            sys.exit(f"{name}: llama.cpp has no name for {hf_name}")
        writer.add_tensor(gguf_name, tensor)
    for gguf_name, tensor in getattr(extra, "tensors", []):
        writer.add_tensor(gguf_name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def phi3() -> Path:
    folder = FIXTURES / "phi3"
    config = json.loads((folder / "config.json").read_text())
    rope = rope_parameters(config)
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    rope_dims = int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads
    original = rope["original_max_position_embeddings"]
    scale = config["max_position_embeddings"] / original

    def extra(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_dimension_count(rope_dims)
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_sliding_window(config.get("sliding_window") or 0)
        if rope.get("rope_type") != "longrope":
            sys.exit("phi3: the fixture is expected to use LongRoPE")
        attn_factor = (1 + np.log(scale) / np.log(original)) ** 0.5 if scale > 1 else 1.0
        writer.add_rope_scaling_attn_factors(float(attn_factor))

    extra.tensors = [
        ("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32)),
        ("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32)),
    ]
    return write("phi3", gguf.MODEL_ARCH.PHI3, folder, config, extra)


def olmo3() -> Path:
    folder = FIXTURES / "olmo3"
    config = json.loads((folder / "config.json").read_text())

    def extra(writer: gguf.GGUFWriter) -> None:
        writer.add_sliding_window(config["sliding_window"])
        writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in config["layer_types"]])

    return write("olmo3", gguf.MODEL_ARCH.OLMO2, folder, config, extra)


def llama_permuted(config: dict):
    """`LlamaModel.modify_tensors`' q / k permutation, for the architectures llama.cpp writes as Llama."""
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]

    def transform(hf_name: str, tensor: np.ndarray) -> np.ndarray:
        if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            return permute(tensor, heads)
        if hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            return permute(tensor, kv_heads)
        return tensor

    return transform


def mistral(name: str) -> Path:
    """Mistral (`sliding_window` on every layer) or Ministral (`layer_types` too), written as `llama`."""
    folder = FIXTURES / name
    config = json.loads((folder / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]

    def extra(writer: gguf.GGUFWriter) -> None:
        # `LlamaModel.set_gguf_parameters`.
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(head_dim)
        # What llama.cpp's converter leaves out: the window, under gguf-py's key.
        writer.add_sliding_window(config["sliding_window"])
        if "layer_types" in config:
            writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in config["layer_types"]])

    return write(name, gguf.MODEL_ARCH.LLAMA, folder, config, extra, llama_permuted(config))


def smollm3() -> Path:
    fixture = FIXTURES / "smollm3"
    config = json.loads((fixture / "config.json").read_text())
    layers = config["num_hidden_layers"]
    wanted = [int((layer + 1) % NO_ROPE_STEP != 0) for layer in range(layers)]
    if config["no_rope_layers"] != wanted:
        print(
            f"smollm3: the fixture's no_rope_layers {config['no_rope_layers']} are not llama.cpp's fixed "
            f"pattern {wanted} (RoPE left out of every fourth layer, no GGUF key): a GGUF file cannot hold "
            "it; writing the four-layer smollm3/ instead"
        )
    # Four layers, the fixture's two twice over; transformers derives which have RoPE from the interval.
    derived = {key: value for key, value in config.items() if key not in ("no_rope_layers", "layer_types")}
    derived["num_hidden_layers"] = 2 * layers
    derived["no_rope_layer_interval"] = NO_ROPE_STEP
    model = SmolLM3ForCausalLM(SmolLM3Config(**derived)).eval()
    tensors = load_file(str(fixture / "model.safetensors"))
    doubled = {}
    for hf_name, tensor in tensors.items():
        if hf_name.startswith("model.layers."):
            layer, rest = hf_name.removeprefix("model.layers.").split(".", 1)
            for copy in range(2):
                doubled[f"model.layers.{int(layer) + copy * layers}.{rest}"] = torch.from_numpy(tensor)
        else:
            doubled[hf_name] = torch.from_numpy(tensor)
    missing, unexpected = model.load_state_dict(doubled, strict=False)
    # The LM head is the embeddings (tied).
    if unexpected or missing != ["lm_head.weight"]:
        sys.exit(f"smollm3: missing {missing}, unexpected {unexpected}")
    if model.config.no_rope_layers != [int((layer + 1) % NO_ROPE_STEP != 0) for layer in range(2 * layers)]:
        sys.exit(f"smollm3: transformers derived no_rope_layers {model.config.no_rope_layers}")
    folder = OUT / "smollm3"
    if folder.exists():
        shutil.rmtree(folder)
    model.save_pretrained(folder, safe_serialization=True)
    for name in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]:
        shutil.copy(fixture / name, folder / name)
    saved = json.loads((folder / "config.json").read_text())
    return write("smollm3", gguf.MODEL_ARCH.SMOLLM3, folder, saved, lambda writer: None, llama_permuted(saved))


@torch.no_grad()
def expected(files: dict) -> dict:
    """Transformers' logits of each file's folder at SEQUENCES' positions."""
    out = {"versions": versions(), "sequences": [ids for ids, _ in SEQUENCES], "files": {}}
    for file, folder in files.items():
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        logits = []
        for ids, positions in SEQUENCES:
            row = model(torch.tensor([ids])).logits[0]
            logits.append({"positions": positions, "logits": f32(row[positions].numpy())})
        out["files"][file] = {"folder": str(folder.relative_to(FIXTURES)), "logits": logits}
    return out


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    torch.use_deterministic_algorithms(True)
    files = {
        phi3(): FIXTURES / "phi3",
        olmo3(): FIXTURES / "olmo3",
        mistral("mistral"): FIXTURES / "mistral",
        mistral("ministral"): FIXTURES / "ministral",
        smollm3(): OUT / "smollm3",
    }
    for made in files:
        print(f"wrote {made.relative_to(FIXTURES.parent.parent.parent)} ({made.stat().st_size} bytes)")
    with open(OUT / "expected.json", "w") as f:
        json.dump(expected({made.name: folder for made, folder in files.items()}), f, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()
