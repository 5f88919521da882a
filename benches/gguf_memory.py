#!/usr/bin/env python3
"""Peak memory of loading a gpt-oss GGUF file (MXFP4 experts, read and dequantized one expert at a time)
against the same weights as OpenAI's MXFP4 folder (dequantized whole, then split a layer at a time), both
loaded by `holo serve` in f32 and stopped once it listens: the peak RSS of each (`VmHWM`), beside the
model's f32 size and one layer's experts.

Usage: ~/.cache/holo-peers/venv/bin/python benches/gguf_memory.py --holo target/debug/holo \\
           [--work DIR] [--hidden 1024] [--experts 16] [--layers 4]

The model is random (MXFP4 codes and scales drawn at random; the loader's work does not depend on them),
its tokenizer the fixtures'; the GGUF file is `scripts/gguf_families.py`'s conversion of the folder, as
llama.cpp's `convert_hf_to_gguf.py` converts gpt-oss. A tiny fixture's peak is the process's own floor.
"""

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import gguf_families  # noqa: E402

FIXTURE = ROOT / "holo-runtime/tests/fixtures/models/gpt_oss/mxfp4"


def folder(out: Path, hidden: int, experts: int, layers: int) -> dict:
    """An MXFP4 gpt-oss folder of the given shapes: heads of 64, a quarter of them key/value heads, experts
    as wide as the model, 2 per token. Returns the counts of values."""
    rng = np.random.default_rng(0)
    heads, head_dim, inner = hidden // 64, 64, hidden
    config = json.loads((FIXTURE / "config.json").read_text())
    config.update(hidden_size=hidden, intermediate_size=inner, num_attention_heads=heads,
                  num_key_value_heads=heads // 4, head_dim=head_dim, num_hidden_layers=layers,
                  num_local_experts=experts, num_experts_per_tok=2, swiglu_limit=7.0,
                  layer_types=["sliding_attention", "full_attention"] * (layers // 2))
    vocab = config["vocab_size"]
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]:
        shutil.copy(FIXTURE / name, out / name)
    dense = lambda *shape: (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])).astype(np.float32)
    tensors = {"model.embed_tokens.weight": dense(vocab, hidden), "lm_head.weight": dense(vocab, hidden),
               "model.norm.weight": np.ones(hidden, np.float32)}
    counts = {"experts_per_layer": experts * 3 * inner * hidden}
    for layer in range(layers):
        prefix = f"model.layers.{layer}"
        kv = config["num_key_value_heads"] * head_dim
        for name, shape in [("q_proj", (heads * head_dim, hidden)), ("k_proj", (kv, hidden)),
                            ("v_proj", (kv, hidden)), ("o_proj", (hidden, heads * head_dim))]:
            tensors[f"{prefix}.self_attn.{name}.weight"] = dense(*shape)
            tensors[f"{prefix}.self_attn.{name}.bias"] = np.zeros(shape[0], np.float32)
        tensors[f"{prefix}.self_attn.sinks"] = np.zeros(heads, np.float32)
        tensors[f"{prefix}.input_layernorm.weight"] = np.ones(hidden, np.float32)
        tensors[f"{prefix}.post_attention_layernorm.weight"] = np.ones(hidden, np.float32)
        tensors[f"{prefix}.mlp.router.weight"] = dense(experts, hidden)
        tensors[f"{prefix}.mlp.router.bias"] = np.zeros(experts, np.float32)
        for stack, rows, columns in [("gate_up_proj", 2 * inner, hidden), ("down_proj", hidden, inner)]:
            name = f"{prefix}.mlp.experts.{stack}"
            tensors[f"{name}_blocks"] = rng.integers(0, 256, (experts, rows, columns // 32, 16), dtype=np.uint8)
            tensors[f"{name}_scales"] = rng.integers(120, 128, (experts, rows, columns // 32), dtype=np.uint8)
            tensors[f"{name}_bias"] = np.zeros((experts, rows), np.float32)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    counts["total"] = counts["experts_per_layer"] * layers + sum(
        t.size for name, t in tensors.items() if not name.endswith(("_blocks", "_scales")))
    return counts


def peak(holo: str, model: Path) -> int:
    """`holo serve model`'s peak RSS in bytes, once it listens."""
    child = subprocess.Popen([holo, "serve", str(model), "--port", "0", "--dtype", "f32"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    for line in child.stderr:
        if "http://" in line:
            break
    else:
        sys.exit(f"holo serve {model} ended before listening")
    # The kernel's high-water mark of the process's resident set (wait4's would count the memory of this
    # Python process, which the child shares between fork and exec).
    status = Path(f"/proc/{child.pid}/status").read_text()
    child.send_signal(signal.SIGTERM)
    child.wait()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--holo", required=True)
    parser.add_argument("--work", type=Path)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.work) as scratch:
        hf = Path(scratch) / "mxfp4"
        counts = folder(hf, args.hidden, args.experts, args.layers)
        gguf_file = gguf_families.gpt_oss_gguf(hf, fused=False, out=Path(scratch) / "gpt_oss.gguf")
        mib = lambda count: count / 2**20
        print(f"model: hidden {args.hidden}, {args.experts} experts, {args.layers} layers; "
              f"f32 weights {mib(4 * counts['total']):.0f} MiB, one layer's experts "
              f"{mib(4 * counts['experts_per_layer']):.0f} MiB; files: GGUF "
              f"{mib(gguf_file.stat().st_size):.0f} MiB, folder {mib((hf / 'model.safetensors').stat().st_size):.0f} MiB")
        floor = peak(args.holo, ROOT / "holo-runtime/tests/fixtures/models/gguf/gpt_oss.gguf")
        print(f"peak RSS, tiny fixture (the process's floor): {mib(floor):.0f} MiB")
        for label, model in [("GGUF (MXFP4 experts)", gguf_file), ("MXFP4 folder", hf)]:
            bytes_ = peak(args.holo, model)
            print(f"peak RSS, {label}: {mib(bytes_):.0f} MiB; over the floor and the f32 weights: "
                  f"{mib(bytes_ - floor - 4 * counts['total']):.0f} MiB")


if __name__ == "__main__":
    main()
