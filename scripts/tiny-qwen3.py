#!/usr/bin/env python3
"""Writes a tiny random Qwen3ForCausalLM folder (SkyRL's JAX backend has no Qwen2) with the tokenizer of the
Qwen2 folder SRC: `tiny-qwen3.py SRC DST`. Needs torch and transformers (SkyRL's venv has them). The
Tinker end-to-end test (`holo-runtime/tests/engines/tinker.rs`) serves it with SkyRL's server on the CPU."""
import json, os, shutil, sys

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

src, dst = sys.argv[1], sys.argv[2]
q2 = json.load(open(os.path.join(src, "config.json")))
config = Qwen3Config(vocab_size=q2["vocab_size"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=q2.get("bos_token_id"),
    eos_token_id=q2.get("eos_token_id"), pad_token_id=q2.get("pad_token_id"),
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
torch.manual_seed(0)
Qwen3ForCausalLM(config).save_pretrained(dst)
for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    shutil.copy(os.path.join(src, name), dst)
print(dst)
