#!/usr/bin/env python3
"""GGUF files of the committed random fixtures written by llama.cpp's OWN converter (`convert_hf_to_gguf.py`),
and transformers' logits of the models they hold, for `holo-runtime/tests/model/gguf_converted.rs`.

    ~/.cache/holo-peers/venv/bin/python scripts/gguf_converted.py [FAMILY ...]

The converter is llama.cpp as llama-cpp-python LLAMA_CPP_PYTHON (its sdist on PyPI vendors llama.cpp whole:
`convert_hf_to_gguf.py`, `conversion/`, `gguf-py/`; its CHANGELOG names the llama.cpp commit, LLAMA_CPP_COMMIT).
The script fetches it with pip into `~/.cache/holo-peers/llama-cpp-python-<version>/` when it is not there
(`pip download --no-deps --no-binary llama-cpp-python`, then unpacked), and installs the one converter dependency the
peers' venv lacks, `sentencepiece` (llama.cpp's `requirements-convert_legacy_llama.txt`), into a folder beside
it (`pip install --target`), so the venv itself is unchanged. Each conversion runs in its own process of the
peers' Python (torch, transformers 5.23) with the vendored `gguf-py` first on the path, so that the converter
and the writer are the same commit's, as `convert_hf_to_gguf.py` itself arranges.

What is patched, and why: one function. The fixtures' tokenizer (`model_fixtures.py`'s 512-token byte-level
BPE, the same in every family folder) splits text with Qwen 2's pre-tokenizer regex, but it is not a real
model's tokenizer, so the hash of its encoding of the converter's check text (`get_vocab_base_pre`) is in no
list and the converter refuses it. The wrapper lets the converter try first and, only where it refuses, checks
that the folder's `tokenizer.json` splits with exactly Qwen 2's regex then byte-level, and answers `qwen2`
(what the converter answers for Qwen 2's own tokenizer). Everything else — keys, tensor names, permutations,
tensor types, the vocabulary, merges, special tokens, the chat template — is the converter's.

Where the converter cannot take a fixture as it is, it converts a copy made in a temporary folder (FAMILIES):
qwen3_moe without its dense layer (llama.cpp's `qwen3moe` has experts on every layer and cannot name
`mlp_only_layers`' `mlp.down_proj`), phi3 with `tokenizer_class` `GPT2Tokenizer` as Phi-4-mini's (otherwise it
wants sentencepiece's `tokenizer.model`), gpt_oss as `gguf_families.py`'s `gpt_oss_folder` makes it (llama.cpp's
clamp at 7); smollm3 is the committed four-layer `gguf/smollm3/` whose fourth layer has no RoPE (llama.cpp's
fixed pattern, as `gguf_families.py` explains). Where the file says less than the folder, its logits are those
of the model llama.cpp reads from it (AS_READ): Gemma 3 without `query_pre_attn_scalar` (queries scaled by
1/√head_dim) and with every sixth layer global, whatever `layer_types` said; Mistral without its window, a
Llama that attends fully. The converter refuses outright (REFUSED, recorded in converter.json):
`MinistralForCausalLM`, and `--fuse-gate-up-exps` for gpt-oss (ignored: written split) and Qwen3-MoE (an
error); `gguf_families.py` writes those files with gguf-py's writer instead.

Into `holo-runtime/tests/fixtures/models/gguf/converted/`:

    <family>.gguf        `--outtype f32`: qwen2, llama (Llama 3's rope scaling as the `rope_freqs` tensor),
                         qwen3, qwen3_moe, gemma3, olmo2, olmo3, phi3, smollm3, mistral, gpt_oss (its experts
                         stay MXFP4), qwen3_5 and qwen3_5_moe (`--no-mtp`: the fixtures have no
                         multi-token-prediction layers); gpt_oss's logits are `gguf/gpt_oss.json`'s, of the
                         same folder;
    qwen3_5_equal.gguf, qwen3_5_moe_equal.gguf  `--outtype f32` of Qwen3.5's fixtures with linear
                         attention's key heads narrowed to its value heads' width (`equal_heads`), which
                         llama.cpp requires (it refuses the fixtures themselves), for `gguf_llama_cpp.py`;
    qwen2-qkv.gguf, llama-qkv-q8_0.gguf, qwen3_5-qkv.gguf  with `--fuse-qkv` (FUSED_QKV): q, k and v in one
                         `attn_qkv` (Qwen3.5's full-attention layer's: its linear layers' `attn_qkv` is
                         their own `in_proj_qkv` either way);
    qwen3_5_moe-fused.gguf  with `--fuse-qkv --fuse-gate-up-exps` (FUSED): the full-attention layer's q, k and
                         v in one `attn_qkv`, each layer's experts' gate and up in one `ffn_gate_up_exps`;
    <family>-q8_0.gguf   `--outtype q8_0` for QUANTIZED: the converter's own Q8_0 (llama.cpp's reference
                         quantizer in gguf-py: the 2-D weights in blocks of 32 with an f16 scale, norms and
                         other 1-D tensors f32). The converter writes no k-quant: its `--outtype` is f32, f16,
                         bf16, q8_0, tq1_0, tq2_0 or auto; k-quants come from llama.cpp's C++ `llama-quantize`;
    converter.json       llama-cpp-python's version, llama.cpp's commit, gguf-py's version, the Python packages,
                         and per file its folder, outtype, the converter's arguments and the file's sha256;
    expected.json        per file, transformers' logits (f32, eager attention) of SEQUENCES at the positions
                         listed (Qwen3.5's and its mixture's in float64, `"dtype": "float64"`, from transformers' module with its
                         float32 casts in Gated DeltaNet made float64: its float32 delta rule drifts 1e-4 from
                         the float64 result over the 80-token sequence): of the folder for f32 files, and for q8_0 files of the same model with every
                         weight replaced by the file's own weights dequantized (gguf-py's `dequantize`, the
                         q / k rows put back in Hugging Face's order where the converter permuted them), so that
                         holo's dequantized load must match to float rounding, not to a quantization tolerance;
                         and the folder tokenizer's ids of TEXTS and of CHATS through its chat template (what the
                         tokenizer and template read from each file must give).
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent.parent / "holo-runtime/tests/fixtures/models"
OUT = FIXTURES / "gguf" / "converted"
LLAMA_CPP_PYTHON = "0.3.36"
# llama-cpp-python 0.3.36's CHANGELOG: "update llama.cpp to ggml-org/llama.cpp@0c1e57098".
LLAMA_CPP_COMMIT = "0c1e57098"
HOME = Path.home() / ".cache/holo-peers"

# The folder each family's file is converted from: a fixture folder, or the name of a function that makes
# one from a fixture in a temporary folder where the converter cannot take the fixture as it is.
FAMILIES = {
    "qwen2": "qwen2",
    "llama": "llama",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe_all_experts",
    "gemma3": "gemma3",
    "olmo2": "olmo2",
    "olmo3": "olmo3",
    "phi3": "phi3_gpt2_tokenizer",
    "smollm3": "gguf/smollm3",
    "mistral": "mistral",
    "qwen3_5": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    # Qwen3.5 as llama.cpp can run it (`gguf_llama_cpp.py`): its value heads as wide as its key heads.
    "qwen3_5_equal": "qwen3_5_equal_heads",
    "qwen3_5_moe_equal": "qwen3_5_moe_equal_heads",
    # Its logits are `gguf/gpt_oss.json`'s, of the same folder.
    "gpt_oss": "gpt_oss_folder",
}
# The converter's own arguments beyond `--outtype` and `--outfile`, by family: the fixture has no
# multi-token-prediction layers, which the converter otherwise expects of Qwen3.5.
ARGUMENTS = {family: ["--no-mtp"] for family in ["qwen3_5", "qwen3_5_moe", "qwen3_5_equal", "qwen3_5_moe_equal"]}
# The families the converter refuses, and why (recorded in converter.json): their hand-written files stay.
REFUSED = {
    "ministral": "`MinistralForCausalLM` is not a registered architecture (only `Ministral3ForCausalLM`): "
                 "`Model MinistralForCausalLM is not supported`",
    "gpt_oss --fuse-gate-up-exps": "`GptOssModel` splits gate and up itself and bypasses the base class's "
                                   "fusion: the file holds `ffn_gate_exps` and `ffn_up_exps` as without the flag",
    "qwen3_moe --fuse-gate-up-exps": "`Missing MODEL_TENSOR.FFN_GATE_UP_EXP for MODEL_TENSORS of "
                                     "MODEL_ARCH.QWEN3MOE`",
}
# The families also converted at q8_0: a fused-projection family, a permuted one, and one whose heads
# are wider than hidden / heads (some of its matrices fall back to f16: 144 inputs are no blocks of 32).
QUANTIZED = ["phi3", "llama", "qwen3"]
# Files with the layers' q, k and v fused into one `attn_qkv` (`--fuse-qkv`): Qwen2's with its biases,
# Llama's permuted q / k rows in Q8_0 blocks, and Qwen3.5's gated queries (each head's queries and gate)
# beside the linear-attention layers' own `attn_qkv`.
FUSED_QKV = {"qwen2": "f32", "llama": "q8_0", "qwen3_5": "f32"}
# Files with both of the converter's fusions (`--fuse-qkv --fuse-gate-up-exps`): Qwen3.5's mixture, its
# full-attention layer's gated q, k and v in one `attn_qkv` and every layer's expert stacks of gate and up in
# one `ffn_gate_up_exps`.
FUSED = {"qwen3_5_moe": "f32"}
# Families whose logits are not recorded here: gpt_oss (its logits and greedy tokens are gguf/gpt_oss.json's,
# of the same temporary folder).
NO_LOGITS = {"gpt_oss"}
# As `gguf_families.py`'s: past the fixtures' windows (4 positions) and Phi-3's original context (64).
SEQUENCES = [
    ([1, 2, 3, 4, 5, 6, 7, 8, 9], [4, 8]),
    ([509, 100, 200, 300, 7], [4]),
    ([i * 37 % 500 for i in range(80)], [63, 64, 79]),
]
TEXTS = ["What is 12+7? The answer is 19.", "  two  spaces\nand a line\n\n", "<|im_start|>user\nhi<|im_end|>"]
CHATS = [
    [{"role": "user", "content": "What is 3*4?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"}],
]


def llama_cpp() -> tuple[Path, Path]:
    """The vendored llama.cpp of llama-cpp-python LLAMA_CPP_PYTHON and the folder holding `sentencepiece`,
    fetched with pip the first time."""
    root = HOME / f"llama-cpp-python-{LLAMA_CPP_PYTHON}"
    vendored = root / "vendor/llama.cpp"
    site = HOME / f"llama-cpp-python-{LLAMA_CPP_PYTHON}-site"
    pip = [sys.executable, "-m", "pip"]
    if not (vendored / "convert_hf_to_gguf.py").is_file():
        with tempfile.TemporaryDirectory() as scratch:
            subprocess.run([*pip, "download", "--no-deps", "--no-binary", "llama-cpp-python", "-d", scratch,
                            f"llama-cpp-python=={LLAMA_CPP_PYTHON}"], check=True)
            (sdist,) = Path(scratch).glob("llama_cpp_python-*.tar.gz")
            with tarfile.open(sdist) as tar:
                tar.extractall(scratch, filter="data")
            (unpacked,) = [p for p in Path(scratch).iterdir() if p.is_dir()]
            if root.exists():
                shutil.rmtree(root)
            shutil.move(str(unpacked), root)
    if not (site / "sentencepiece").is_dir():
        subprocess.run([*pip, "install", "--no-deps", "--target", str(site),
                        "sentencepiece>=0.1.98,<0.3.0"], check=True)
    return vendored, site


# ---- folders made for the converter ---------------------------------------------------------------------

def qwen3_moe_all_experts(scratch: Path) -> Path:
    """`qwen3_moe/` without its dense layer: llama.cpp's `qwen3moe` has experts on every layer (the converter
    cannot name `mlp_only_layers`' dense `mlp.down_proj`), so its first and third layers, renumbered."""
    from safetensors.numpy import load_file, save_file

    fixture, folder = FIXTURES / "qwen3_moe", scratch / "qwen3_moe"
    folder.mkdir()
    config = json.loads((fixture / "config.json").read_text())
    kept = [layer for layer in range(config["num_hidden_layers"]) if layer not in config["mlp_only_layers"]]
    config.update(num_hidden_layers=len(kept), mlp_only_layers=[])
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {}
    for name, tensor in load_file(str(fixture / "model.safetensors")).items():
        if name.startswith("model.layers."):
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            if int(layer) not in kept:
                continue
            name = f"model.layers.{kept.index(int(layer))}.{rest}"
        tensors[name] = tensor
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    for name in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]:
        shutil.copy(fixture / name, folder / name)
    return folder


def phi3_gpt2_tokenizer(scratch: Path) -> Path:
    """`phi3/` with `tokenizer_class` `GPT2Tokenizer`, as Phi-4-mini's byte-level BPE says: the converter reads
    a Phi-3 vocabulary from sentencepiece's `tokenizer.model` unless the class is that one."""
    folder = scratch / "phi3"
    shutil.copytree(FIXTURES / "phi3", folder)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config["tokenizer_class"] = "GPT2Tokenizer"
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return folder


def gpt_oss_folder(scratch: Path) -> Path:
    """`gguf_families.py`'s: `gpt_oss/mxfp4/` with llama.cpp's clamp at 7 and gate/up weights large enough for
    it to bite."""
    from gguf_families import gpt_oss_folder as make

    folder = scratch / "gpt_oss"
    folder.mkdir()
    return make(folder)


def equal_heads(fixture: str, scratch: Path) -> Path:
    """`fixture/` (Qwen3.5's, dense or the mixture) with linear attention's key heads narrowed to its value
    heads' width (the first `linear_value_head_dim` of each key head's query and key rows, in `in_proj_qkv`
    and the convolution): llama.cpp takes both widths from `ssm.state_size` and refuses the fixture, whose key
    heads are twice as wide; released Qwen3.5 checkpoints have both 128 wide."""
    from safetensors.numpy import load_file, save_file

    folder = scratch / f"{fixture}_equal"
    shutil.copytree(FIXTURES / fixture, folder)
    config = json.loads((folder / "config.json").read_text())
    heads, width = config["linear_num_key_heads"], config["linear_key_head_dim"]
    narrow = config["linear_value_head_dim"]
    # The rows kept of `in_proj_qkv` and the convolution: q's and k's heads narrowed, v whole.
    keys = heads * width
    kept = [start + head * width + i for start in (0, keys) for head in range(heads) for i in range(narrow)]
    kept += list(range(2 * keys, 2 * keys + config["linear_num_value_heads"] * narrow))
    tensors = load_file(str(folder / "model.safetensors"))
    for name in tensors:
        if name.endswith(("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight")):
            tensors[name] = tensors[name][kept]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config["linear_key_head_dim"] = narrow
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def qwen3_5_equal_heads(scratch: Path) -> Path:
    return equal_heads("qwen3_5", scratch)


def qwen3_5_moe_equal_heads(scratch: Path) -> Path:
    return equal_heads("qwen3_5_moe", scratch)


# ---- the models llama.cpp reads from the files, where the converter drops a key ---------------------------

def gemma3_as_read(config: dict) -> dict:
    """Gemma 3 as llama.cpp reads the converter's file: every sixth layer global (`load_swa_pattern(ml, 6)`,
    the converter writes no `layer_types`) and queries scaled by 1/√head_dim (`f_attention_scale`, the
    converter writes no `query_pre_attn_scalar`); both are what every released Gemma 3 but the 27B has."""
    layers = config["num_hidden_layers"]
    return {**config, "query_pre_attn_scalar": config["head_dim"],
            "layer_types": ["full_attention" if (layer + 1) % 6 == 0 else "sliding_attention"
                            for layer in range(layers)]}


def mistral_as_read(config: dict) -> dict:
    """Mistral as llama.cpp reads the converter's file: a Llama model that attends fully (the converter
    writes it as `llama`, without its `sliding_window`)."""
    read = {key: value for key, value in config.items() if key != "sliding_window"}
    return {**read, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}


# Per family, the config of the model its file holds where that is not the folder's.
AS_READ = {"gemma3": gemma3_as_read, "mistral": mistral_as_read}


def as_read(family: str, folder: Path, scratch: Path) -> Path:
    """`folder`, or a copy whose config is AS_READ's for `family`."""
    if family not in AS_READ:
        return folder
    read = scratch / f"{family}-as-read"
    shutil.copytree(folder, read)
    config = AS_READ[family](json.loads((folder / "config.json").read_text()))
    (read / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return read


# ---- in the converter's process -------------------------------------------------------------------------

# Qwen 2's pre-tokenizer regex, as `model_fixtures.py` trains the fixtures' tokenizer with it.
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")


def splits_as_qwen2(folder: Path) -> bool:
    pre = json.loads((folder / "tokenizer.json").read_text())["pre_tokenizer"]
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    return (len(steps) == 2 and steps[0].get("type") == "Split"
            and steps[0]["pattern"].get("Regex") == QWEN2_REGEX and steps[0].get("behavior") == "Isolated"
            and steps[1].get("type") == "ByteLevel" and steps[1].get("use_regex") is False)


def convert(vendored: str, folder: str, *arguments: str) -> None:
    """`convert_hf_to_gguf.py FOLDER ARGUMENTS`, its pre-tokenizer lookup answering `qwen2` for a folder
    whose tokenizer splits as Qwen 2's where the hash is unknown."""
    sys.path.insert(0, vendored)
    from conversion.base import TextModel

    lookup = TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return lookup(self, tokenizer)
        except NotImplementedError:
            if not splits_as_qwen2(Path(self.dir_model)):
                raise
            return "qwen2"

    TextModel.get_vocab_base_pre = get_vocab_base_pre
    import runpy

    sys.argv = ["convert_hf_to_gguf.py", folder, *arguments]
    runpy.run_path(str(Path(vendored) / "convert_hf_to_gguf.py"), run_name="__main__")


# ---- driver ---------------------------------------------------------------------------------------------

def run_converter(vendored: Path, site: Path, folder: Path, out: Path, outtype: str, extra: list[str]) -> list:
    arguments = ["--outtype", outtype, "--outfile", str(out), *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(vendored / "gguf-py"), str(site)])}
    subprocess.run([sys.executable, __file__, "--convert", str(vendored), str(folder), *arguments],
                   check=True, env=env, cwd=Path(__file__).parent)
    return arguments


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def gguf_module(vendored: Path):
    sys.path.insert(0, str(vendored / "gguf-py"))
    import gguf

    assert Path(gguf.__file__).is_relative_to(vendored), gguf.__file__
    return gguf


def unpermute(weights, heads: int):
    """The inverse of `LlamaModel.permute`: each head's rows from llama.cpp's interleaved rotary order back to
    the half-split one."""
    return (weights.reshape(heads, weights.shape[0] // heads // 2, 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def dequantized_state(gguf, path: Path, folder: Path, model) -> dict:
    """The Hugging Face state of `model` (from `folder`) with each weight replaced by `path`'s own tensor of
    it, dequantized: the tensors matched by name through gguf-py's map, q / k rows unpermuted where the
    converter permuted them (every architecture written as `llama` or `smollm3`)."""
    import numpy as np
    import torch

    reader = gguf.GGUFReader(str(path))
    arch_name = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch_name)
    config = model.config
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    read = {t.name: t for t in reader.tensors}
    # Where `--fuse-qkv` wrote q, k and v as one `attn_qkv`, their rows in it.
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    fused_rows = {"attn_q": slice(0, q), "attn_k": slice(q, q + kv), "attn_v": slice(q + kv, q + 2 * kv)}
    state = {}
    for hf_name, tensor in model.state_dict().items():
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        # `blk.N.attn_q.weight` → `attn_q`, `blk.N.attn_qkv.weight`.
        parts = (gguf_name or "").split(".")
        module = parts[2] if len(parts) == 4 else None
        fused = ".".join([*parts[:2], "attn_qkv", parts[-1]])
        if gguf_name in read:
            t = read[gguf_name]
            values = gguf.quants.dequantize(t.data, t.tensor_type)
        elif module in fused_rows and fused in read:
            t = read[fused]
            values = gguf.quants.dequantize(t.data, t.tensor_type)[fused_rows[module]]
        elif hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        else:
            sys.exit(f"{path.name}: no tensor for {hf_name} ({gguf_name})")
        values = values.reshape(tensor.shape).astype(np.float32)
        if arch_name in ("llama", "smollm3") and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in hf_name else config.num_key_value_heads
            values = unpermute(values, heads)
        state[hf_name] = torch.from_numpy(np.ascontiguousarray(values))
    return state


def logits_of(name: str, model, exact: bool = False) -> list:
    """`model`'s logits of SEQUENCES at their positions (in float64 when `exact`, float32 otherwise); a
    mixture's of the sequences on which every token's experts are chosen by a clear margin (a near-tie could
    flip on the order of sums), the short ones at least."""
    import torch

    from model_fixtures import MIN_ROUTING_MARGIN, RoutingMargins, f32

    out = []
    with torch.no_grad():
        for ids, positions in SEQUENCES:
            margins = RoutingMargins(model)
            row = model(torch.tensor([ids])).logits[0]
            margins.remove()
            if margins.smallest < MIN_ROUTING_MARGIN:
                assert len(ids) > 16, f"{name}: routing near-tie {margins.smallest} on {ids}"
                print(f"{name}: the {len(ids)}-token sequence left out (routing near-tie {margins.smallest})")
                continue
            logits = row[positions].tolist() if exact else f32(row[positions].numpy())
            out.append({"ids": ids, "positions": positions, "logits": logits})
    return out


def expected(gguf, files: dict) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from model_fixtures import versions

    out = {"versions": versions(), "files": {}}
    for name, (folder, outtype) in files.items():
        config = json.loads((folder / "config.json").read_text())
        # Qwen3.5 (dense or the mixture) in float64: transformers computes Gated DeltaNet in float32
        # whatever the model's dtype, which drifts 1e-4 from the float64 result over SEQUENCES' 80 tokens;
        # `float64_qwen3_5` makes its casts float64, as `model_fixtures.py`'s `exact` logits do.
        exact = config["model_type"] in ("qwen3_5_text", "qwen3_5_moe_text")
        if exact:
            from export_check import float64_qwen3_5

            module = float64_qwen3_5(config["model_type"].removesuffix("_text"))
            # The mixture's experts by transformers' loop: its grouped products take no float64.
            experts = {"experts_implementation": "eager"} if "num_experts" in config else {}
            model = getattr(module, config["architectures"][0]).from_pretrained(
                folder, config=AutoConfig.from_pretrained(folder), dtype=torch.float64,
                attn_implementation="eager", **experts).eval()
        else:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                         attn_implementation="eager").eval()
        if outtype != "f32":
            missing, unexpected = model.load_state_dict(
                dequantized_state(gguf, OUT / name, folder, model), strict=False)
            assert not unexpected and missing in ([], ["lm_head.weight"]), (name, missing, unexpected)
        out["files"][name] = {"outtype": outtype, "config": config, **({"dtype": "float64"} if exact else {}),
                              "logits": logits_of(name, model, exact)}
    tokenizer = AutoTokenizer.from_pretrained(FIXTURES / "qwen2")
    out["texts"] = [{"text": text, "ids": tokenizer.encode(text, add_special_tokens=False)} for text in TEXTS]
    out["chats"] = [{"messages": chat, "ids": tokenizer.apply_chat_template(
        chat, tokenize=True, add_generation_prompt=True, return_dict=False)} for chat in CHATS]
    return out


def main() -> None:
    if sys.argv[1:2] == ["--convert"]:
        convert(*sys.argv[2:])
        return
    import torch

    torch.use_deterministic_algorithms(True)
    only = sys.argv[1:]
    unknown = [name for name in only if name not in FAMILIES]
    if unknown:
        sys.exit(f"unknown family {unknown}; choose from {sorted(FAMILIES)}")
    vendored, site = llama_cpp()
    gguf = gguf_module(vendored)
    OUT.mkdir(parents=True, exist_ok=True)
    record_path = OUT / "converter.json"
    record = json.loads(record_path.read_text()) if only and record_path.exists() else {"files": {}}
    record.update({
        "llama_cpp_python": LLAMA_CPP_PYTHON,
        "llama_cpp_commit": LLAMA_CPP_COMMIT,
        "gguf_py": gguf_py_version(vendored),
        "python": sys.version.split()[0],
        "torch": md.version("torch"),
        "transformers": md.version("transformers"),
        "refused": REFUSED,
        "patched": "TextModel.get_vocab_base_pre answers qwen2 for a folder whose tokenizer.json splits "
                   "with Qwen 2's regex then byte-level, where the converter's hash lookup refuses it",
    })
    made = {}
    with tempfile.TemporaryDirectory() as scratch:
        for family, relative in FAMILIES.items():
            if only and family not in only:
                continue
            made_here = relative in globals()
            folder = globals()[relative](Path(scratch)) if made_here else FIXTURES / relative
            # The model transformers runs for the file's logits: the folder's, as llama.cpp reads it.
            reference = as_read(family, folder, Path(scratch))
            arguments = ARGUMENTS.get(family, [])
            runs = [(f"{family}.gguf", "f32", arguments)]
            if family in QUANTIZED:
                runs.append((f"{family}-q8_0.gguf", "q8_0", arguments))
            if family in FUSED_QKV:
                outtype = FUSED_QKV[family]
                suffix = "" if outtype == "f32" else f"-{outtype}"
                runs.append((f"{family}-qkv{suffix}.gguf", outtype, ["--fuse-qkv", *arguments]))
            if family in FUSED:
                runs.append((f"{family}-fused.gguf", FUSED[family],
                             ["--fuse-qkv", "--fuse-gate-up-exps", *arguments]))
            for name, outtype, extra in runs:
                arguments = run_converter(vendored, site, folder, OUT / name, outtype, extra)
                arguments[arguments.index("--outfile") + 1] = name
                record["files"][name] = {
                    "folder": f"{relative}()" if made_here else relative,
                    "outtype": outtype, "arguments": arguments, "sha256": sha256(OUT / name)}
                print(f"wrote {name} ({(OUT / name).stat().st_size} bytes)")
                if family not in NO_LOGITS:
                    made[name] = (reference, outtype)
        record["files"] = dict(sorted(record["files"].items()))
        record_path.write_text(json.dumps(record, indent=2) + "\n")
        if made:
            path = OUT / "expected.json"
            recorded = expected(gguf, made)
            if only and path.exists():
                recorded["files"] = {**json.loads(path.read_text())["files"], **recorded["files"]}
            recorded["files"] = dict(sorted(recorded["files"].items()))
            with open(path, "w") as f:
                json.dump(recorded, f, separators=(",", ":"))
                f.write("\n")


def gguf_py_version(vendored: Path) -> str:
    text = (vendored / "gguf-py/pyproject.toml").read_text()
    return re.search(r'^version = "([^"]+)"', text, re.M).group(1)


if __name__ == "__main__":
    main()
