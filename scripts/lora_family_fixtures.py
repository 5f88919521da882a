#!/usr/bin/env python3
"""PEFT's LoRA adapters on the committed tiny model of every family, for the GRPO parity test's LoRA cases
(`scripts/grpo_family_fixtures.py`, `holo-runtime/tests/grpo_parity.rs`).

Regenerate (from the repository root, offline; needs the Python peers' venv, `bash ../shared/peers/setup.sh`):

    ~/.cache/holo-peers/venv/bin/python scripts/lora_family_fixtures.py

It writes, under `holo-runtime/tests/fixtures/models/`:

- `NAME/lora_all_linear/` for every family but Qwen3-MoE: `get_peft_model` with `target_modules="all-linear"`,
  what PEFT resolves that to on the family (every attention, MLP, linear-attention and shared-expert
  projection; not the output head, nor a router or expert stack unless PEFT converts the family's experts
  into target parameters, which 0.21 does for Qwen3-MoE alone). Qwen3-MoE's all-linear adapter is
  `qwen3_moe/moe_lora_all_linear/`, made by `scripts/moe_lora_fixtures.py`.
- `qwen3_5_moe/moe_lora/`: `q_proj` and, as `target_parameters`, both expert stacks (what
  `qwen3_moe/moe_lora/` adapts on Qwen3-MoE) and the router's weight (which Qwen3-MoE's all-linear adapter
  adapts there; Qwen3.5-MoE's all-linear leaves it out).

Rank 2, alpha 3 and no dropout (as `moe_lora_fixtures.py`), every A and B set to deterministic nonzero values
(PEFT's zero B would leave the forward unadapted and B's gradient the only one); float32 (the parity step's
dtype), saved by `save_pretrained` as PEFT lays the folder out (`adapter_config.json`,
`adapter_model.safetensors`; the model-card template it writes beside them is removed). The adapters' bytes
are the same on every run; `adapter_config.json` lists the resolved `target_modules` in the order of the set PEFT
keeps them in, which changes between runs.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import sys
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

# Relative, as `adapter_config.json` records the base model's path: run from the repository root.
MODELS = Path("holo-runtime/tests/fixtures/models")
RANK, ALPHA = 2, 3
# Amplitude of the adapters' values: large enough that every adapter moves the logits (by up to 5.7 to 18.5 on these
# models), small enough that the adapted models' logits stay in the range of the base's (up to 13.6).
AMPLITUDE = 0.2

# The families whose all-linear adapter this script writes (Qwen3-MoE's is moe_lora_fixtures.py's).
ALL_LINEAR = [
    "qwen2",
    "llama",
    "mistral",
    "ministral",
    "qwen3",
    "gemma2",
    "gemma3",
    "gemma3_softcap",
    "smollm3",
    "olmo2",
    "olmo3",
    "phi3",
    "gpt_oss",
    "qwen3_5",
    "qwen3_5_moe",
]
ALL_LINEAR_FOLDER = "lora_all_linear"
EXPERT_STACKS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ROUTER = "mlp.gate.weight"


def write_adapter(family: str, folder: str, **targets) -> None:
    """PEFT's adapter of `targets` on `family`'s fixture, seeded, saved to `family/folder`."""
    base = AutoModelForCausalLM.from_pretrained(
        MODELS / family, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    )
    model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, **targets))
    adapters = sorted((n, p) for n, p in model.named_parameters() if ".lora_" in n)
    with torch.no_grad():
        for k, (_, parameter) in enumerate(adapters):
            steps = torch.arange(parameter.numel(), dtype=torch.float64)
            parameter.copy_((AMPLITUDE * torch.sin(0.37 * steps + k)).reshape(parameter.shape))
    out = MODELS / family / folder
    model.save_pretrained(out)
    (out / "README.md").unlink()
    config = model.peft_config["default"]
    print(
        f"{family}/{folder}: {len(adapters)} adapter tensors, {sum(p.numel() for _, p in adapters)} values; "
        f"target_modules {sorted(config.target_modules)}, target_parameters {sorted(config.target_parameters or [])}",
        file=sys.stderr,
    )


def main() -> None:
    for family in ALL_LINEAR:
        write_adapter(family, ALL_LINEAR_FOLDER, target_modules="all-linear")
    write_adapter(
        "qwen3_5_moe", "moe_lora", target_modules=["q_proj"], target_parameters=EXPERT_STACKS + [ROUTER]
    )


if __name__ == "__main__":
    main()
