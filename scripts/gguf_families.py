#!/usr/bin/env python3
"""GGUF files that llama.cpp's reader loads but its converter (`convert_hf_to_gguf.py`) does not write from
the committed random fixtures, written with the `gguf` package (gguf-py, llama.cpp's own writer) as the
converter would, and transformers' logits of the folders they come from, for
`holo-runtime/tests/model/gguf_families.rs` and `gguf_gpt_oss.rs`. Every family the converter does write is
converted by the converter itself in `scripts/gguf_converted.py` (`gguf/converted/`); Phi-3, OLMo 3 and
SmolLM3 files this script used to write were tensor for tensor and key for key the converter's (but for
`general.*` and the BOS id), and are gone.

    ~/.cache/holo-peers/venv/bin/python scripts/gguf_families.py [mistral ministral smollm3 gpt_oss gemma2]

Written with the `gguf` package (in the peers' venv, `pip install gguf` otherwise) into
`holo-runtime/tests/fixtures/models/gguf/`:

    mistral.gguf   `llama` (llama.cpp writes `MistralForCausalLM` as Llama, `LlamaModel`): q / k rows permuted
                   as `LlamaModel.permute` does, `attention.key_length` / `value_length` for heads wider than
                   hidden / heads, `rope.dimension_count`. llama.cpp's converter writes no window for Mistral
                   (its Llama graph has none); this file carries the folder's `sliding_window` under
                   `llama.attention.sliding_window`, gguf-py's key for every architecture's window
                   (`add_sliding_window`), where this loader looks for a Mistral window;
    ministral.gguf as mistral.gguf, with `layer_types` as `llama.attention.sliding_window_pattern`, one flag
                   per layer (`add_sliding_window_pattern`, as OLMo 3's);
    gemma2.gguf    `gemma2` as `Gemma2Model` writes it (llama.cpp's converter reads Gemma 2's vocabulary only from
                   sentencepiece's `tokenizer.model`, which the fixture's byte-level BPE has not, so it refuses
                   the folder): its keys (`attention.key_length` / `value_length`,
                   `attn_logit_softcapping`, `final_logit_softcapping`, `attention.sliding_window`), the norms
                   stored as `1 + w`, no `output.weight` (tied), q / k rows unpermuted; the tokenizer as the
                   other files'. llama.cpp windows every other layer from the first (`set_swa_pattern(2)`) and
                   scales queries by 1/√head_dim, as the fixture's `layer_types` and `query_pre_attn_scalar`
                   say;
    smollm3/       not a file but the folder `gguf_converted.py` converts: llama.cpp writes no key for the
                   layers without RoPE (neither does gguf-py 0.19 have one): its graph leaves RoPE out of
                   every fourth layer (`n_no_rope_layer_step = 4`), transformers' default
                   `no_rope_layer_interval`. The committed fixture leaves it out of its second of two layers,
                   which a GGUF file cannot say, so `smollm3/` is a `SmolLM3ForCausalLM` of four layers, the
                   fixture's two twice over, saved by transformers with `no_rope_layers` derived by its
                   config from `no_rope_layer_interval` 4 ([1, 1, 1, 0]);
    gpt_oss.gguf   `gpt-oss`, its experts in MXFP4 as `GptOssModel` repacks OpenAI's `*_blocks`/`*_scales`
                   (`repack_mxfp4`, `transform_nibble_layout`: one E8M0 byte then sixteen bytes whose low
                   nibbles are the block's first sixteen values and high nibbles its last sixteen), gate and
                   up split from their interleaved rows into `ffn_gate_exps` / `ffn_up_exps` with their
                   biases, the router as `ffn_gate_inp`, `attn_sinks`, `post_attention_norm`,
                   `attention.sliding_window`, `expert_feed_forward_length` and YaRN's type, factor,
                   original context and betas; gpt_oss-fused.gguf the same with the converter's
                   `--fuse-gate-up-exps` (`ffn_gate_up_exps`, gate rows then up rows). llama.cpp's graph
                   clamps the experts' SwiGLU at 7 (`swiglu_oai`, a constant: no key holds it), so the files
                   are made from `gpt_oss/mxfp4/` with `swiglu_limit` 7 and the gate/up blocks' scales four
                   times larger (E8M0 exponents + 2, the same codes), so that the clamp still bites (a
                   folder written to a temporary directory); `gpt_oss.json` holds transformers' logits and
                   greedy tokens of that model, its experts dequantized by `convert_moe_packed_tensors`.
                   llama.cpp's converter writes gpt_oss.gguf too (`gguf/converted/gpt_oss.gguf`, the same
                   tensors), but not the fused one: its `GptOssModel` splits gate and up itself, bypassing
                   `--fuse-gate-up-exps`. `benches/gguf_memory.py` reads this script's gpt_oss.gguf.

Tensor names come from gguf-py's `get_tensor_name_map` (llama.cpp's `tensor_mapping.py`); the tokenizer is the
fixtures' byte-level BPE (`tokenizer.ggml.model` gpt2, its merges, the added tokens as control tokens). Every
tensor but gpt-oss's experts is F32, so the files load to the folders' logits exactly but for the order of sums.

`expected.json` beside them: for mistral.gguf and ministral.gguf, its folder and transformers' logits (f32,
eager attention) of SEQUENCES at the positions listed, past the fixtures' windows (4 positions).
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
# 64 positions (gguf_converted.py's, where Phi-3's LongRoPE takes its long factors).
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
    """`gguf/smollm3/`, the four-layer folder `gguf_converted.py` converts (see the module's documentation)."""
    fixture = FIXTURES / "smollm3"
    config = json.loads((fixture / "config.json").read_text())
    layers = config["num_hidden_layers"]
    wanted = [int((layer + 1) % NO_ROPE_STEP != 0) for layer in range(layers)]
    if config["no_rope_layers"] != wanted:
        print(
            f"smollm3: the fixture's no_rope_layers {config['no_rope_layers']} are not llama.cpp's fixed "
            f"pattern {wanted} (RoPE left out of every fourth layer, no GGUF key): a GGUF file cannot hold "
            "it; writing the four-layer gguf/smollm3/ for gguf_converted.py"
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
    return folder


def gemma2() -> dict:
    """gemma2.gguf, from the `gemma2/` fixture (see the module's documentation)."""
    folder = FIXTURES / "gemma2"
    config = json.loads((folder / "config.json").read_text())
    head_dim = config["head_dim"]

    def extra(writer: gguf.GGUFWriter) -> None:
        # `Gemma2Model.set_gguf_parameters`' keys beyond `add_common`'s (which writes the key and value
        # lengths of heads wider than hidden / heads, as the fixture's are).
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
        writer.add_sliding_window(config["sliding_window"])

    def transform(hf_name: str, tensor: np.ndarray) -> np.ndarray:
        # `Gemma2Model.modify_tensors`: llama.cpp's norms multiply by the weight itself.
        return tensor + 1 if hf_name.endswith("norm.weight") else tensor

    layers = config["num_hidden_layers"]
    if config["layer_types"] != ["sliding_attention" if layer % 2 == 0 else "full_attention" for layer in range(layers)]:
        sys.exit(f"gemma2: layer_types {config['layer_types']} are not llama.cpp's every other layer")
    if config["query_pre_attn_scalar"] != head_dim:
        sys.exit(f"gemma2: query_pre_attn_scalar {config['query_pre_attn_scalar']} is not llama.cpp's head_dim")
    return {write("gemma2", gguf.MODEL_ARCH.GEMMA2, folder, config, extra, transform): folder}


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


# llama.cpp's `swiglu_oai`: the clamp of gpt-oss's experts, a constant of its graph.
OAI_SWIGLU_LIMIT = 7.0
# E8M0 exponents added to the gate/up blocks' scales: the weights times 4, so that the clamp at 7 bites.
GATE_UP_EXPONENT = 2


def transform_nibble_layout(blocks: np.ndarray) -> np.ndarray:
    """`GptOssModel.transform_nibble_layout`: OpenAI's bytes hold values (2i, 2i + 1) in their (low, high)
    nibbles; ggml's MXFP4 block holds values (i, i + 16)."""
    values = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    return (values[..., :16] | (values[..., 16:] << 4)).astype(np.uint8)


def mxfp4_tensor(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """`repack_mxfp4_parts`: each block's scale byte, then its nibbles in ggml's order, `[E, rows, G · 17]`."""
    packed = np.concatenate([scales[..., None], transform_nibble_layout(blocks)], axis=-1)
    return packed.reshape(packed.shape[0], packed.shape[1], -1)


def gpt_oss_folder(folder: Path) -> Path:
    """`folder`: `gpt_oss/mxfp4/` with llama.cpp's clamp and the gate/up weights four times larger."""
    from safetensors.torch import load_file as load_torch, save_file as save_torch

    fixture = FIXTURES / "gpt_oss" / "mxfp4"
    config = json.loads((fixture / "config.json").read_text())
    config["swiglu_limit"] = OAI_SWIGLU_LIMIT
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = load_torch(str(fixture / "model.safetensors"))
    for name in [name for name in tensors if name.endswith("gate_up_proj_scales")]:
        assert int(tensors[name].max()) + GATE_UP_EXPONENT < 255, name
        tensors[name] = tensors[name] + GATE_UP_EXPONENT
    save_torch(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    for name in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]:
        shutil.copy(fixture / name, folder / name)
    return folder


def gpt_oss_gguf(folder: Path, fused: bool, out: Path) -> Path:
    """`GptOssModel` of `convert_hf_to_gguf.py` on the MXFP4 checkpoint `folder`, written to `out`,
    `--fuse-gate-up-exps` when `fused`."""
    config = json.loads((folder / "config.json").read_text())
    rope = rope_parameters(config)

    def extra(writer: gguf.GGUFWriter) -> None:
        # `TextModel.set_gguf_parameters`: experts, the explicit head size, YaRN; then `GptOssModel`'s own.
        writer.add_expert_count(config["num_local_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        writer.add_sliding_window(config["sliding_window"])
        writer.add_expert_feed_forward_length(config["intermediate_size"])

    tensors = load_file(str(folder / "model.safetensors"))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, config["num_hidden_layers"])
    plain, experts = {}, []
    for hf_name, tensor in sorted(tensors.items()):
        layer_prefix, _, part = hf_name.partition(".mlp.experts.")
        if not part:
            # `filter_tensors`: the sinks gain `.weight`.
            plain[hf_name + ".weight" if hf_name.endswith("sinks") else hf_name] = tensor
            continue
        layer = int(layer_prefix.removeprefix("model.layers."))
        blk = f"blk.{layer}"
        if part == "down_proj_blocks":
            scales = tensors[f"{layer_prefix}.mlp.experts.down_proj_scales"]
            experts.append((f"{blk}.ffn_down_exps.weight", mxfp4_tensor(tensor, scales), True))
        elif part == "down_proj_bias":
            experts.append((f"{blk}.ffn_down_exps.bias", tensor.astype(np.float32), False))
        elif part == "gate_up_proj_blocks":
            scales = tensors[f"{layer_prefix}.mlp.experts.gate_up_proj_scales"]
            # Rows interleaved gate, up, gate, up, …
            gate = mxfp4_tensor(tensor[:, ::2], scales[:, ::2])
            up = mxfp4_tensor(tensor[:, 1::2], scales[:, 1::2])
            if fused:
                experts.append((f"{blk}.ffn_gate_up_exps.weight", np.concatenate([gate, up], axis=1), True))
            else:
                experts.append((f"{blk}.ffn_gate_exps.weight", gate, True))
                experts.append((f"{blk}.ffn_up_exps.weight", up, True))
        elif part == "gate_up_proj_bias":
            gate, up = tensor[..., ::2].astype(np.float32), tensor[..., 1::2].astype(np.float32)
            if fused:
                experts.append((f"{blk}.ffn_gate_up_exps.bias", np.concatenate([gate, up], axis=-1), False))
            else:
                experts.append((f"{blk}.ffn_gate_exps.bias", gate, False))
                experts.append((f"{blk}.ffn_up_exps.bias", up, False))
        elif not part.endswith("_scales"):
            sys.exit(f"gpt_oss: unexpected expert tensor {hf_name}")

    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GPT_OSS])
    add_common(writer, config)
    extra(writer)
    add_tokenizer(writer, folder, config["vocab_size"])
    for hf_name, tensor in plain.items():
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            sys.exit(f"gpt_oss: llama.cpp has no name for {hf_name}")
        writer.add_tensor(gguf_name, tensor.astype(np.float32))
    for gguf_name, tensor, mxfp4 in experts:
        if mxfp4:
            writer.add_tensor(gguf_name, tensor, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        else:
            writer.add_tensor(gguf_name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def check_mxfp4(path: Path, folder: Path) -> None:
    """gguf-py's own MXFP4 reading of the written experts is transformers' dequantization of the folder's."""
    import torch
    from safetensors.torch import load_file as load_torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tensors = load_torch(str(folder / "model.safetensors"))
    read = {tensor.name: tensor for tensor in gguf.GGUFReader(str(path)).tensors}
    for layer in range(json.loads((folder / "config.json").read_text())["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp.experts"
        for stack in ["gate_up_proj", "down_proj"]:
            # [E, in, out] as transformers holds it.
            theirs = convert_moe_packed_tensors(tensors[f"{prefix}.{stack}_blocks"],
                                                tensors[f"{prefix}.{stack}_scales"], dtype=torch.float32).numpy()
            if stack == "down_proj":
                ours = [read[f"blk.{layer}.ffn_down_exps.weight"]]
            elif f"blk.{layer}.ffn_gate_up_exps.weight" in read:
                ours = [read[f"blk.{layer}.ffn_gate_up_exps.weight"]]
                theirs = np.concatenate([theirs[..., ::2], theirs[..., 1::2]], axis=-1)
            else:
                ours = [read[f"blk.{layer}.ffn_gate_exps.weight"], read[f"blk.{layer}.ffn_up_exps.weight"]]
                theirs = np.concatenate([theirs[..., ::2], theirs[..., 1::2]], axis=-1)
            assert all(t.tensor_type == gguf.GGMLQuantizationType.MXFP4 for t in ours), stack
            values = np.concatenate([gguf.quants.dequantize(t.data, t.tensor_type) for t in ours], axis=1)
            assert np.array_equal(values, theirs.transpose(0, 2, 1)), (path.name, layer, stack)


def gpt_oss_expected(folder: Path) -> Path:
    """transformers' logits (eager attention and experts) and greedy tokens of `folder`, its experts
    dequantized; and evidence that llama.cpp's clamp changes them."""
    import torch
    from safetensors.torch import load_file as load_torch
    from transformers import GenerationConfig, GptOssConfig, GptOssForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config")
    tensors = load_torch(str(folder / "model.safetensors"))
    state = {}
    for name, tensor in tensors.items():
        if name.endswith("_blocks"):
            base = name.removesuffix("_blocks")
            state[base] = convert_moe_packed_tensors(tensor, tensors[f"{base}_scales"], dtype=torch.float32)
        elif not name.endswith("_scales"):
            state[name] = tensor

    def model(limit: float):
        built = GptOssForCausalLM(GptOssConfig(**{**config, "swiglu_limit": limit}))
        built.config._attn_implementation = "eager"
        built.config._experts_implementation = "eager"
        built.load_state_dict(state, strict=True)
        return built.to(torch.float32).eval()

    long = [(i * 37) % 500 for i in range(80)]
    sequences = {"nine": list(range(1, 10)), "five": [509, 100, 200, 300, 7], "long": long}
    clamped, loose = model(OAI_SWIGLU_LIMIT), model(1e9)
    out = {"swiglu_limit": OAI_SWIGLU_LIMIT, "sequences": []}
    # Every token's experts chosen by a clear margin: a near-tie could flip on the order of sums.
    from model_fixtures import MIN_ROUTING_MARGIN, RoutingMargins

    margins = RoutingMargins(clamped)
    with torch.no_grad():
        for name, ids in sequences.items():
            logits = clamped(torch.tensor([ids])).logits[0]
            unclamped = loose(torch.tensor([ids])).logits[0]
            # The long sequence's logits every eighth position and at its last (the file stays small).
            positions = list(range(len(ids))) if len(ids) < 16 else [*range(0, len(ids), 8), len(ids) - 1]
            out["sequences"].append({
                "name": name, "ids": ids, "positions": positions,
                "logits": [[float(np.format_float_positional(np.float32(v), unique=True, trim="-"))
                            for v in logits[position].tolist()] for position in positions],
                "clamp_effect": (logits - unclamped).abs().max().item()})
        prompt = [509, 100, 200, 300, 7]
        # The mask given: generate would otherwise mask the prompt's 509, the pad token, out.
        generated = clamped.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                     generation_config=GenerationConfig(
            do_sample=False, max_new_tokens=12, eos_token_id=None, pad_token_id=509, bos_token_id=None,
            output_scores=True, return_dict_in_generate=True))
    margins.remove()
    assert margins.smallest > MIN_ROUTING_MARGIN, f"routing near-tie {margins.smallest}"
    out["routing_margin"] = margins.smallest
    margin = min((torch.topk(step[0], 2).values[0] - torch.topk(step[0], 2).values[1]).item()
                 for step in generated.scores)
    assert margin > 1e-3, f"greedy near-tie {margin}"
    out["greedy"] = {"prompt": prompt, "tokens": generated.sequences[0, len(prompt):].tolist(), "margin": margin}
    effect = max(sequence["clamp_effect"] for sequence in out["sequences"])
    assert effect > 1e-2, f"the clamp at {OAI_SWIGLU_LIMIT} changes the logits by only {effect}"
    path = OUT / "gpt_oss.json"
    path.write_text(json.dumps(out) + "\n")
    return path


def gpt_oss() -> list[Path]:
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        folder = gpt_oss_folder(Path(scratch))
        files = [gpt_oss_gguf(folder, fused=False, out=OUT / "gpt_oss.gguf"),
                 gpt_oss_gguf(folder, fused=True, out=OUT / "gpt_oss-fused.gguf")]
        for path in files:
            check_mxfp4(path, folder)
        return [*files, gpt_oss_expected(folder)]


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    torch.use_deterministic_algorithms(True)
    only = sys.argv[1:]
    # Each maker writes its files and returns them with the folder whose transformers logits
    # `expected.json` records for them (None: gpt-oss records its own, in gpt_oss.json; smollm3/ is a folder).
    makers = {
        "mistral": lambda: {mistral("mistral"): FIXTURES / "mistral"},
        "ministral": lambda: {mistral("ministral"): FIXTURES / "ministral"},
        "smollm3": lambda: {smollm3(): None},
        "gpt_oss": lambda: {made: None for made in gpt_oss()},
        "gemma2": gemma2,
    }
    unknown = [name for name in only if name not in makers]
    if unknown:
        sys.exit(f"unknown fixture(s) {unknown}; choose from {sorted(makers)}")
    files = {}
    for name, make in makers.items():
        if not only or name in only:
            files.update(make())
    for made in files:
        print(f"wrote {made.relative_to(FIXTURES.parent.parent.parent)} ({made.stat().st_size} bytes)")
    folders = {made.name: folder for made, folder in files.items() if folder is not None}
    if folders:
        # A run that makes some of the files keeps the others' recorded logits.
        path = OUT / "expected.json"
        recorded = expected(folders)
        if only and path.exists():
            recorded["files"] = {**json.loads(path.read_text())["files"], **recorded["files"]}
        with open(path, "w") as f:
            json.dump(recorded, f, separators=(",", ":"))
            f.write("\n")


if __name__ == "__main__":
    main()
