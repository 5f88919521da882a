#!/usr/bin/env python3
"""Parity fixtures for the local candle models (holo-runtime/holo-model/src/), computed by Hugging Face transformers.

Regenerate (from the repository root, offline; needs the Python peers' venv, `bash ../shared/peers/setup.sh`):

    ~/.cache/holo-peers/venv/bin/python scripts/model_fixtures.py [--only NAME ...]

then run the Rust parity tests. The script writes tiny random models with `save_pretrained` (safetensors,
f32, transformers' own file layout) under `holo-runtime/tests/fixtures/models/`:

- `qwen2/`: Qwen2ForCausalLM, hidden 64, 2 layers, intermediate 128, 4 heads / 2 kv heads (GQA), q/k/v biases,
  tied embeddings, rope_theta 1e6;
- `qwen3/`: Qwen3ForCausalLM, hidden 64, 2 layers, 6 heads / 2 kv heads of 24 dimensions (wider than hidden /
  heads, as Qwen3's are), per-head q/k RMSNorm, no biases, untied embeddings, rope_theta 1e6;
- `mistral/`: MistralForCausalLM, a sliding window of 4 positions on both layers (shorter than the prompts and
  the greedy runs, so the KV-cached decoding crosses it), 32-wide heads over hidden 64, untied;
- `ministral/`: MinistralForCausalLM, a windowed layer (4 positions) then a full one (`layer_types`);
- `smollm3/`: SmolLM3ForCausalLM, RoPE on the first layer only (`no_rope_layers` [1, 0]), tied embeddings;
- `olmo2/`: Olmo2ForCausalLM, norms after attention and the MLP and none before, q/k norms over the whole
  projections;
- `olmo3/`: Olmo3ForCausalLM, as olmo2 with a windowed first layer whose RoPE has its own base (1e4 against 5e5);
- `gemma3/`: Gemma3ForCausalLM (`gemma3_text`), four `(1 + w)` norms per layer, GeGLU (`gelu_pytorch_tanh`),
  embeddings scaled by √hidden, 32-wide heads, `query_pre_attn_scalar` 24, a windowed first layer with RoPE base
  1e4, a full second layer with base 1e6 and linear scaling (factor 2), tied embeddings;
- `gemma2/`: Gemma2ForCausalLM, gemma3's layers without q/k norms, one RoPE (base 1e4), `query_pre_attn_scalar`
  the head size (32, as gemma-2-2b's), a windowed first layer,
  `attn_logit_softcapping` 3 and `final_logit_softcapping` 6 (Gemma 2's are 50 and 30; these bend the scores);
- `gemma3_softcap/`: gemma3's model with `final_logit_softcapping` 6 (Gemma 2's is 30), small enough that
  `c · tanh(x / c)` is far from the identity on these logits (a cap of 3 left every seed a greedy near-tie), and
  `attn_logit_softcapping` 2, which transformers' Gemma 3 keeps in its config but never applies (its attention
  passes no `softcap`): the fixture holds a runtime to both;
- `phi3/`: Phi3ForCausalLM, fused `qkv_proj` and `gate_up_proj`, `partial_rotary_factor` 0.5, LongRoPE with
  `original_max_position_embeddings` 64 (short factors; attention factor √(1 + ln 8 / ln 64)), untied;
- `llama/`: LlamaForCausalLM, the same sizes as qwen2, untied embeddings, attention_bias false, rope_theta 5e5 with
  `rope_parameters` of type llama3 (factor 8, low_freq_factor 1, high_freq_factor 4,
  original_max_position_embeddings 64: with head_dim 16 the eight frequencies fall in all three bands, kept,
  smoothed and divided, so the scaling really changes the model);
- `qwen3_5/`: Qwen3_5ForCausalLM (`qwen3_5_text`), three layers: Gated DeltaNet linear attention, gated full
  attention, linear attention again (the recurrent state carried past an attention layer); 2 key heads of 16
  serving 4 value heads of 8, a convolution of width 4; full attention with 4 heads over 2 of 32 dimensions, a
  quarter of each rotated (rope_theta 1e7), `(1 + w)` norms, untied embeddings;
- `qwen3_moe/`: Qwen3MoeForCausalLM, Qwen3's attention (6 heads over 2 of 24) with a mixture of 8 experts of
  32 (3 per token, renormalised: `norm_topk_prob`) on the first and third layers and a dense MLP on the second
  (`mlp_only_layers` [1]), untied embeddings; saved as transformers 5 saves it, one module per expert
  (`mlp.experts.{e}.gate_proj`, ...). The seed is also moved on when some token's third and fourth expert are
  within 1e-3 in probability (a near-tie in routing would make parity flaky, as a greedy one would);
- `qwen3_5_moe/`: Qwen3_5MoeForCausalLM (`qwen3_5_moe_text`), qwen3_5's three layers and sizes, each with a
  mixture of 4 experts of 32 (2 per token, renormalised as `Qwen3_5MoeTopKRouter` always does) and a shared
  expert of 48 scaled by the sigmoid of its gate (`shared_expert_gate`); saved one module per expert, as
  qwen3_moe; the routing margin checked as qwen3_moe's, the routers' weights halved after the perturbation
  (its residual stream grows over the three layers, and routers at unit scale give most tokens one expert
  and near-equal tiny probabilities to the others: near-ties at almost every seed);
- `gpt_oss/`: GptOssForCausalLM, three layers (windowed at 4 positions, full, windowed), 4 heads over 2 of 16
  with q/k/v/o biases and attention sinks, YaRN (factor 8 over an original 64 positions, beta_fast 32,
  beta_slow 1, not truncated: with head_dim 16 the ramp keeps, blends and divides frequencies; attention
  factor 0.1 ln 8 + 1), 4 experts of 32 with 2 per token (softmax over the chosen logits), biases, gate and up
  interleaved (`gate_up_proj` [E, H, 2I]), the clamped SwiGLU at `swiglu_limit` 1.5 (so that the clamps bite
  on unit-scale activations), untied embeddings; the routing margin checked as qwen3_moe's. Beside it,
  `gpt_oss/mxfp4/`: the same model with its experts quantized to MXFP4 by `quantize_mxfp4` (OpenAI's
  `*_blocks`/`*_scales` layout, `quantization_config.quant_method` "mxfp4"), and `dequantized.safetensors`,
  those experts as transformers' `convert_moe_packed_tensors` dequantizes them (f32);

each with the 512-token byte-level BPE tokenizer of `../shared/peers/build_tiny_qwen2.py` (replicated here, same
corpus and seed, so `tokenizer.json` is identical to the peers' tiny-qwen2 one) and an `expected.json`.

Weights: transformers' initialisation (normal(0, 0.02), zero biases, unit norms) from a seed (the first from SEED
whose greedy runs have no near-tie, see below; recorded in expected.json), then perturbed
so that the outputs are far from uniform and every weight matters: each linear weight rescaled to std
1/sqrt(fan_in) (unit-scale activations, attention that is not uniform), embeddings (and the untied LM head) to
std 0.1, the layers' RMSNorm weights uniform in [0.5, 1.5], the final norm's in [1.5, 4.5] (logits with a standard
deviation of about 2.5), biases normal(0, 0.1). (Larger tied embeddings make the tied model repeat its input
token forever, a weak test of the KV cache.) The forward runs in f32 with
`attn_implementation="eager"`.

`expected.json` (all token ids are ints; logits and log-probs are f32 values written with the fewest digits that
round-trip in f32):

    versions            python, torch, transformers, tokenizers, safetensors
    model               folder name, class, parameter count, seed, perturbation description
    prompts[i]          {name, ids, text (decoded), positions: [p...], logits: [[vocab] per position in
                         `positions`], greedy: 12 ids from generate(do_sample=False, max_new_tokens=12) with EOS
                         disabled, greedy_margin: the smallest top-1 minus top-2 logit over the 12 steps}
                        lengths 1, 5 and 11; `positions` is every position for the 1- and 5-token prompts, the last
                        two for the 11-token one
    batch               the three prompts left-padded together with pad id 509: input_ids, attention_mask,
                        position_ids (attention_mask.cumsum(-1) - 1, 1 where padded, as generate computes them),
                        last_logits [3, vocab] (the logits at the last column), greedy [3][12] from a batched
                        generate (same settings)
    logprobs            {prompt, completion, logprobs}: log_softmax of the logits of prompt+completion at each
                        completion position, gathered at the completion token (what a trainer's forward computes)
    exact               (qwen3_5, qwen3_5_moe) {dtype, ids, logits}: the 11-token prompt's logits at every position in float64
                        throughout (export_check.float64_qwen3_5: transformers' own float32 casts in Gated DeltaNet
                        made float64), for a float64 forward
    gradients           {loss, tokens, weights: {name: {l2_norm, sum, head (16 entries), sample}}}: the gradients of every weight for the
                        mean negative log-likelihood of the batch's next tokens where input and target are both
                        real (the left padding excluded); `sample` as scripts/fixture_gradients.py draws it

The script reloads each folder with `from_pretrained` and computes everything from the reloaded model, checks that
the batched last-position logits match the unbatched ones (so left padding with per-row positions is exact up to
float noise), and fails when a greedy step has a top-1/top-2 margin under 1e-3 (a near-tie would make greedy
parity flaky), in which case it moves on to the next seed.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import json
import math
import platform
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    MinistralConfig,
    MinistralForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Olmo2Config,
    Olmo2ForCausalLM,
    Olmo3Config,
    Olmo3ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

from fixture_gradients import grad_sample

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "holo-runtime" / "tests" / "fixtures" / "models"

SEED = 0
NEW_TOKENS = 12
MIN_GREEDY_MARGIN = 1e-3

# ---- tokenizer: as ../shared/peers/build_tiny_qwen2.py ---------------------------------------------------------
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TARGET_VOCAB = 512
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def synthetic_corpus(seed: int, n: int = 4000) -> list[str]:
    rng = random.Random(seed)
    words = (
        "what is the answer sum of plus minus times equals please compute result think step by "
        "so we get first then add subtract number digits you are a helpful assistant user system "
        "reason reasoning final correct wrong check verify multiply divide product difference total "
        "carry borrow tens ones hundred thousand zero one two three four five six seven eight nine ten "
        "eleven twelve twenty thirty forty fifty sixty seventy eighty ninety question problem solve "
        "solution because therefore let us start with and the next value equal greater less than "
        "math arithmetic integer positive negative even odd count boxed format output only write"
    ).split()
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice(["+", "-", "*"])
        r = a + b if op == "+" else a - b if op == "-" else a * b
        lines.append(f"{a}{op}{b}={r}")
        lines.append(f"What is {a}{op}{b}? The answer is {r}.")
        lines.append("system\nYou are a helpful assistant.\nuser\nWhat is " f"{a}{op}{b}?\nassistant\n{r}")
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))))
    return lines


def build_tokenizer(seed: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                        byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = BpeTrainer(
        vocab_size=TARGET_VOCAB - len(SPECIALS),
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(synthetic_corpus(seed), trainer=trainer)
    assert tok.get_vocab_size() == TARGET_VOCAB - len(SPECIALS), tok.get_vocab_size()
    tok.add_special_tokens(SPECIALS)  # ids 509, 510, 511
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=512,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )
    hf.add_special_tokens({"additional_special_tokens": SPECIALS})
    hf.chat_template = CHAT_TEMPLATE
    return hf


# ---- models ------------------------------------------------------------------------------------------------------
COMMON = dict(
    vocab_size=TARGET_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    hidden_act="silu",
    initializer_range=0.02,
    attention_dropout=0.0,
    bos_token_id=509,
    eos_token_id=511,
)


def qwen2_model() -> torch.nn.Module:
    config = Qwen2Config(
        **COMMON,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    )
    return Qwen2ForCausalLM(config)


def llama_model() -> torch.nn.Module:
    config = LlamaConfig(
        **COMMON,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500_000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    return LlamaForCausalLM(config)


def qwen3_model() -> torch.nn.Module:
    # Odd shapes on purpose: three query heads per key head, heads wider than hidden / heads (6 × 24 = 144
    # against a hidden size of 64, as Qwen3's 128-wide heads are), untied embeddings (Qwen3 from 4B up).
    config = Qwen3Config(
        **{**COMMON, "num_attention_heads": 6, "num_key_value_heads": 2},
        head_dim=24,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attention_bias=False,
        use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    )
    return Qwen3ForCausalLM(config)


WINDOW = 4  # shorter than the 5- and 11-token prompts and the 12 greedy tokens


def mistral_model() -> torch.nn.Module:
    # Every layer windowed; heads of 32 over hidden 64 (an explicit head_dim, as Mistral NeMo's).
    config = MistralConfig(
        **COMMON,
        head_dim=32,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        sliding_window=WINDOW,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    )
    return MistralForCausalLM(config)


def ministral_model() -> torch.nn.Module:
    # A windowed layer, then a full one.
    config = MinistralConfig(
        **COMMON,
        head_dim=16,  # MinistralConfig leaves it None and its attention reads it
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 100_000_000.0},
    )
    return MinistralForCausalLM(config)


def smollm3_model() -> torch.nn.Module:
    # RoPE on the first layer only (`no_rope_layers`: 1 rotates, 0 does not).
    config = SmolLM3Config(
        **COMMON,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        no_rope_layers=[1, 0],
        pad_token_id=509,  # its default, 128004, is past this vocabulary
        use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0},
    )
    return SmolLM3ForCausalLM(config)


def olmo2_model() -> torch.nn.Module:
    # Norms after attention and the MLP (none before), q/k norms over the whole projections.
    config = Olmo2Config(
        **COMMON,
        pad_token_id=509,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500_000.0},
    )
    return Olmo2ForCausalLM(config)


def olmo3_model() -> torch.nn.Module:
    # OLMo 2's layer with a window on the first layer, whose RoPE has its own base.
    config = Olmo3Config(
        **COMMON,
        pad_token_id=509,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 500_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    )
    return Olmo3ForCausalLM(config)


def gemma3_model() -> torch.nn.Module:
    # Four offset norms per layer, GeGLU, embeddings scaled by √hidden, heads of 32 over hidden 64, a
    # query scale of its own (1/√24), a windowed layer with its own RoPE base, then a full one with
    # linear scaling.
    config = Gemma3TextConfig(
        **COMMON,
        pad_token_id=509,
        head_dim=32,
        query_pre_attn_scalar=24,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    )
    return Gemma3ForCausalLM(config)


def gemma2_model() -> torch.nn.Module:
    # Gemma 3's decoder without q/k norms and with one RoPE: four offset norms, GeGLU, scaled embeddings,
    # `query_pre_attn_scalar` the head size (as gemma-2-2b's and 9b's, and as llama.cpp reads every Gemma 2
    # file; gemma3's fixture has a scale of its own), a windowed first layer, and both soft-caps, small
    # (attention 3, logits 6) for the reason gemma3_softcap's are.
    config = Gemma2Config(
        **COMMON,
        pad_token_id=509,
        head_dim=32,
        query_pre_attn_scalar=32,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        attn_logit_softcapping=3.0,
        final_logit_softcapping=6.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
    )
    return Gemma2ForCausalLM(config)


def gemma3_softcap_model() -> torch.nn.Module:
    # gemma3's model with both soft-caps set: the final one small enough (6) that tanh bends most logits, so
    # that a path that drops it misses the fixture by far more than rounding; the attention one (2), which
    # transformers' Gemma 3 does not apply, so that a path that applies it misses too.
    model = gemma3_model()
    model.config.attn_logit_softcapping = 2.0
    model.config.final_logit_softcapping = 6.0
    return Gemma3ForCausalLM(model.config)


def phi3_model() -> torch.nn.Module:
    # Fused qkv_proj and gate_up_proj, half of each head rotated, LongRoPE (short factors: every
    # sequence here is shorter than original_max_position_embeddings; the attention factor from the
    # context's growth, 512 / 64).
    config = Phi3Config(
        **COMMON,
        pad_token_id=509,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        original_max_position_embeddings=64,
        partial_rotary_factor=0.5,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10_000.0,
            "partial_rotary_factor": 0.5,
            "original_max_position_embeddings": 64,
            "short_factor": [1.0, 1.5, 2.0, 3.0],
            "long_factor": [1.0, 2.0, 4.0, 8.0],
        },
    )
    return Phi3ForCausalLM(config)


def qwen3_5_model() -> torch.nn.Module:
    # Linear attention, then gated full attention, then linear attention again (the state carried past an
    # attention layer); two key heads serving four value heads of another width; a quarter of each
    # attention head rotated; untied embeddings.
    config = Qwen3_5TextConfig(
        **{**COMMON, "num_hidden_layers": 3},
        head_dim=32,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    )
    return Qwen3_5ForCausalLM(config)


def qwen3_5_moe_model() -> torch.nn.Module:
    # qwen3_5's layers with a mixture on each: routed experts and a shared expert of another width.
    config = Qwen3_5MoeTextConfig(
        **{**{key: value for key, value in COMMON.items() if key != "intermediate_size"}, "num_hidden_layers": 3},
        head_dim=32,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    )
    return Qwen3_5MoeForCausalLM(config)


def qwen3_moe_model() -> torch.nn.Module:
    # Experts on the first and third layers, a dense MLP between them; Qwen3's wide heads.
    config = Qwen3MoeConfig(
        **{**COMMON, "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 2},
        head_dim=24,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attention_bias=False,
        use_sliding_window=False,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    )
    return Qwen3MoeForCausalLM(config)


def gpt_oss_model() -> torch.nn.Module:
    # Windowed, full, windowed; sinks, biases and YaRN; clamps that bite at unit-scale activations.
    config = GptOssConfig(
        **{**COMMON, "num_hidden_layers": 3, "intermediate_size": 32},
        head_dim=16,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attention_bias=True,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        num_local_experts=4,
        num_experts_per_tok=2,
        swiglu_limit=1.5,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150_000.0,
            "factor": 8.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
    )
    return GptOssForCausalLM(config)


MODELS = {
    "qwen2": qwen2_model,
    "llama": llama_model,
    "qwen3": qwen3_model,
    "mistral": mistral_model,
    "ministral": ministral_model,
    "smollm3": smollm3_model,
    "olmo2": olmo2_model,
    "olmo3": olmo3_model,
    "gemma2": gemma2_model,
    "gemma3": gemma3_model,
    "gemma3_softcap": gemma3_softcap_model,
    "phi3": phi3_model,
    "qwen3_5": qwen3_5_model,
    "qwen3_5_moe": qwen3_5_moe_model,
    "qwen3_moe": qwen3_moe_model,
    "gpt_oss": gpt_oss_model,
}

PERTURBATION = (
    "from normal(0, 0.02): linear weights rescaled to std 1/sqrt(fan_in), embeddings and lm_head to std 0.1, "
    "layer RMSNorm weights uniform [0.5, 1.5], final norm weights uniform [1.5, 4.5], biases normal(0, 0.1); "
    "Gated DeltaNet: conv1d weights normal(0, 1/sqrt(kernel)), dt_bias normal(0, 1), A_log as initialised; "
    "experts' matrices as linear weights; gpt-oss: attention sinks normal(0, 1), experts' biases as biases; "
    "Qwen3.5's mixture: routers then halved"
)


@torch.no_grad()
def perturb(model: torch.nn.Module, generator: torch.Generator) -> None:
    for name, param in model.named_parameters():
        if name == "model.norm.weight":
            param.copy_(torch.rand(param.shape, generator=generator) * 3.0 + 1.5)
        elif name.endswith("norm.weight"):
            param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
        elif name.endswith((".bias", "_proj_bias")):
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
        elif name.endswith("self_attn.sinks"):
            param.copy_(torch.randn(param.shape, generator=generator))
        elif name.endswith("conv1d.weight"):
            param.copy_(torch.randn(param.shape, generator=generator) / math.sqrt(param.shape[-1]))
        elif name.endswith("dt_bias"):
            param.copy_(torch.randn(param.shape, generator=generator))
        elif name.endswith("A_log"):
            pass
        elif "embed_tokens" in name or name.startswith("lm_head"):
            param.mul_(0.1 / 0.02)
        elif param.dim() == 2:
            param.mul_(1.0 / (0.02 * math.sqrt(param.shape[1])))
        elif name.endswith(("experts.gate_up_proj", "experts.down_proj")) and "GptOss" in type(model).__name__:
            param.mul_(1.0 / (0.02 * math.sqrt(param.shape[1])))  # [experts, in, out]
        elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [experts, out, in]
            param.mul_(1.0 / (0.02 * math.sqrt(param.shape[2])))
        else:
            raise AssertionError(f"unexpected parameter {name}")
        if name.endswith("mlp.gate.weight") and "Qwen3_5Moe" in type(model).__name__:
            param.mul_(0.5)


# ---- expected values ---------------------------------------------------------------------------------------------
def f32(values) -> list:
    """Nested lists of the f32 values, each written with the fewest digits that round-trip in f32."""
    array = np.asarray(values, dtype=np.float32)
    if array.ndim == 0:
        return float(np.format_float_positional(array, unique=True, trim="-"))
    return [f32(row) for row in array]


class NearTie(Exception):
    """A greedy step whose two best logits are closer than MIN_GREEDY_MARGIN."""


class EarlyEnd(Exception):
    """A greedy run that draws the end-of-text token before NEW_TOKENS: `generate` stops there although
    `greedy_config` says `eos_token_id=None` (transformers 5 falls back to the model's generation config)."""


def greedy_config(pad: int) -> GenerationConfig:
    return GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=pad,
                            bos_token_id=None, num_beams=1, output_scores=True, return_dict_in_generate=True)


def min_margin(scores) -> float:
    margins = []
    for step in scores:  # [batch, vocab] per generated token
        top = torch.topk(step.float(), 2, dim=-1).values
        margins.append((top[:, 0] - top[:, 1]).min().item())
    return min(margins)


MIN_ROUTING_MARGIN = 1e-3


class RoutingMargins:
    """The smallest gap between the k-th and (k+1)-th expert probability of any token a mixture's router
    sees while installed (forward hooks on every `Qwen3MoeTopKRouter`); infinite without experts."""

    def __init__(self, model):
        self.smallest = math.inf
        self.hooks = [module.register_forward_hook(self.hook) for module in model.modules()
                      if type(module).__name__.endswith("TopKRouter")]

    def hook(self, module, inputs, outputs):
        probabilities = torch.softmax(outputs[0].float(), dim=-1)
        top = torch.topk(probabilities, module.top_k + 1, dim=-1).values
        self.smallest = min(self.smallest, (top[:, -2] - top[:, -1]).min().item())

    def remove(self):
        for hook in self.hooks:
            hook.remove()


@torch.no_grad()
def expected(model, tok) -> dict:
    margins = RoutingMargins(model)
    try:
        out = expected_values(model, tok)
    finally:
        margins.remove()
    if margins.smallest < MIN_ROUTING_MARGIN:
        raise NearTie(f"routing near-tie (margin {margins.smallest})")
    if margins.hooks:
        out["routing_margin"] = f32(margins.smallest)
    return out


@torch.no_grad()
def expected_values(model, tok) -> dict:
    pad = tok.pad_token_id
    chat = tok.apply_chat_template([{"role": "user", "content": "What is 3*4?"}], tokenize=False,
                                   add_generation_prompt=True)
    prompts = [
        ("one_token", tok.encode("<|im_start|>", add_special_tokens=False)),
        ("five_tokens", tok.encode("What is 12+7? The", add_special_tokens=False)[:5]),
        ("eleven_tokens", tok.encode(chat, add_special_tokens=False)[:11]),
    ]
    for name, ids in prompts:
        assert len(ids) == {"one_token": 1, "five_tokens": 5, "eleven_tokens": 11}[name], (name, ids)

    out = {"prompts": []}
    single_last = []
    for name, ids in prompts:
        input_ids = torch.tensor([ids])
        logits = model(input_ids).logits[0]
        single_last.append(logits[-1])
        positions = list(range(len(ids))) if len(ids) <= 5 else [len(ids) - 2, len(ids) - 1]
        gen = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=greedy_config(pad))
        greedy = gen.sequences[0, len(ids):].tolist()
        if len(greedy) < NEW_TOKENS:
            raise EarlyEnd(f"{name}: greedy run ends after {len(greedy)} tokens")
        margin = min_margin(gen.scores)
        if margin < MIN_GREEDY_MARGIN:
            raise NearTie(f"{name}: greedy near-tie (margin {margin})")
        out["prompts"].append({
            "name": name,
            "ids": ids,
            "text": tok.decode(ids),
            "positions": positions,
            "logits": f32(logits[positions]),
            "greedy": greedy,
            "greedy_margin": f32(margin),
        })

    # Left-padded batch, positions counted from each row's first real token (as generate does).
    width = max(len(ids) for _, ids in prompts)
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for _, ids in prompts])
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, ids in prompts])
    position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
    last = model(input_ids, attention_mask=attention_mask, position_ids=position_ids).logits[:, -1]
    drift = (last - torch.stack(single_last)).abs().max().item()
    assert drift < 1e-4, f"batched logits differ from unbatched ones by {drift}"
    gen = model.generate(input_ids, attention_mask=attention_mask, generation_config=greedy_config(pad))
    batch_greedy = gen.sequences[:, width:].tolist()
    assert batch_greedy == [p["greedy"] for p in out["prompts"]], (batch_greedy, out["prompts"])
    out["batch"] = {
        "input_ids": input_ids.tolist(),
        "attention_mask": attention_mask.tolist(),
        "position_ids": position_ids.tolist(),
        "last_logits": f32(last),
        "greedy": batch_greedy,
        "greedy_margin": f32(min_margin(gen.scores)),
        "max_abs_diff_to_unbatched": f32(drift),
    }

    # Log-probabilities of a given completion.
    prompt = prompts[1][1]
    completion = tok.encode(" answer is 19.<|im_end|>", add_special_tokens=False)
    ids = torch.tensor([prompt + completion])
    logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
    gathered = logprobs[positions, torch.tensor(completion)]
    out["logprobs"] = {"prompt": prompt, "completion": completion, "logprobs": f32(gathered)}
    out["gradients"] = gradients(model, out["batch"])
    return out


def gradients(model, batch: dict) -> dict:
    """The gradients of every weight for the mean negative log-likelihood of the left-padded batch's next
    tokens, over the positions whose input and target are both real (norm, sum and `grad_sample` entries)."""
    input_ids = torch.tensor(batch["input_ids"])
    attention_mask = torch.tensor(batch["attention_mask"])
    position_ids = torch.tensor(batch["position_ids"])
    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        logits = model(input_ids, attention_mask=attention_mask, position_ids=position_ids).logits[:, :-1]
        logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, input_ids[:, 1:, None])[..., 0]
        real = (attention_mask[:, :-1] * attention_mask[:, 1:]).float()
        loss = -(logprobs * real).sum() / real.sum()
        loss.backward()
    grads = {}
    for name, param in model.named_parameters():
        g = param.grad.detach().flatten().double()
        grads[name] = {"l2_norm": g.norm().item(), "sum": g.sum().item(), "head": g[:16].tolist(),
                       "sample": grad_sample(g)}
    model.zero_grad(set_to_none=True)
    return {"loss": loss.item(), "tokens": int(real.sum().item()), "weights": grads}


def exact_logits(folder: Path, ids: list) -> dict:
    """Every position's logits of `ids` in float64 throughout: transformers computes Gated DeltaNet in
    float32 whatever the model's dtype, 1e-4 away from float64 on these prompts, so the float32 fixture
    leaves a float32 error unseen; this is the reference of a float64 forward (the rotary tables stay
    float32 on both sides, as transformers and holo build them)."""
    from export_check import float64_qwen3_5

    config = AutoConfig.from_pretrained(folder)
    module = float64_qwen3_5(config.model_type.removesuffix("_text"))
    # The mixture's experts by transformers' loop: its grouped products take no float64.
    experts = {"experts_implementation": "eager"} if hasattr(config, "num_experts") else {}
    model = getattr(module, config.architectures[0]).from_pretrained(
        folder, config=config, dtype=torch.float64, **experts).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return {"dtype": "float64", "ids": ids, "logits": logits.tolist()}


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OpenAI's MXFP4 layout of `weight` [E, rows, cols] (cols a multiple of 32): blocks [E, rows, cols / 32, 16]
    (two 4-bit E2M1 codes a byte, the even column in the low nibble) and scales [E, rows, cols / 32] (each block's
    power of two biased by 127): the smallest power that brings the block's largest magnitude to at most 6, each
    value rounded to the nearest code."""
    from transformers.integrations.mxfp4 import FP4_VALUES

    codes = torch.tensor(FP4_VALUES[:8], dtype=torch.float32)
    experts, rows, cols = weight.shape
    groups = weight.reshape(experts, rows, cols // 32, 32).float()
    largest = groups.abs().amax(-1).clamp_min(2.0 ** -120)
    exponent = torch.ceil(torch.log2(largest / 6.0))
    scaled = groups / torch.exp2(exponent)[..., None]
    index = (scaled.abs()[..., None] - codes).abs().argmin(-1)
    index = torch.where(scaled < 0, index + 8, index).to(torch.uint8)
    blocks = index[..., 0::2] | (index[..., 1::2] << 4)
    scales = (exponent + 127).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()


def write_mxfp4(folder: Path, model) -> None:
    """`folder/mxfp4/`: the model with its experts' matrices in MXFP4 (biases, attention and the rest as they are),
    and `dequantized.safetensors`: those matrices as transformers' `convert_moe_packed_tensors` reads them back."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    out = folder / "mxfp4"
    out.mkdir()
    tensors = load_file(folder / "model.safetensors")
    dequantized = {}
    for name in [name for name in tensors if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        # Stored transposed: blocks run along the input dimension of [E, out, in].
        blocks, scales = quantize_mxfp4(tensors.pop(name).transpose(1, 2).contiguous())
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        dequantized[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantized, out / "dequantized.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for file in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(folder / file, out / file)
    # Tiny values round to zero and every code occurs: the quantization is not trivial.
    for name, weight in dequantized.items():
        original = model.state_dict()[name]
        assert 0 < (weight - original).abs().max() < original.abs().max(), name


def versions() -> dict:
    return {
        "python": platform.python_version(),
        **{name: md.version(name) for name in ("torch", "transformers", "tokenizers", "safetensors")},
    }


def write_model(name: str, out: Path, tok: PreTrainedTokenizerFast) -> dict:
    """Saves the model of the first seed from SEED on whose greedy runs have no near-tie."""
    for seed in range(SEED, SEED + 20):
        try:
            return write_seed(name, out, tok, seed)
        except (NearTie, EarlyEnd) as tie:
            print(f"{name}: seed {seed}: {tie}; trying the next seed", file=sys.stderr)
    raise SystemExit(f"{name}: no seed without a greedy near-tie")


def write_seed(name: str, out: Path, tok: PreTrainedTokenizerFast, seed: int) -> dict:
    torch.manual_seed(seed)
    model = MODELS[name]().to(torch.float32).eval()
    perturb(model, torch.Generator().manual_seed(seed + 1))
    model.generation_config = GenerationConfig(bos_token_id=509, eos_token_id=[511, 509], pad_token_id=509)
    folder = out / name
    if folder.exists():
        shutil.rmtree(folder)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder, save_jinja_files=False)  # chat_template stays in tokenizer_config.json

    # gpt-oss's experts as its eager loop computes them (the grouped products are another implementation).
    experts = {"experts_implementation": "eager"} if name == "gpt_oss" else {}
    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                                    **experts).eval()
    rtok = AutoTokenizer.from_pretrained(folder)
    state, original = reloaded.state_dict(), model.state_dict()
    assert all(torch.equal(state[key], original[key]) for key in original), "reloaded weights differ"
    data = {
        "versions": versions(),
        "model": {
            "folder": name,
            "class": type(reloaded).__name__,
            "parameters": sum(p.numel() for p in reloaded.parameters()),
            "seed": seed,
            "perturbation": PERTURBATION,
            "attn_implementation": "eager",
            "dtype": "float32",
        },
        **expected(reloaded, rtok),
    }
    if name in ("qwen3_5", "qwen3_5_moe"):
        data["exact"] = exact_logits(folder, data["prompts"][-1]["ids"])
    if name == "gpt_oss":
        write_mxfp4(folder, reloaded)
    with open(folder / "expected.json", "w") as f:
        json.dump(data, f, separators=(",", ":"))
        f.write("\n")
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--only", choices=sorted(MODELS), action="append",
                        help="write these models only (the others' folders are left as they are)")
    args = parser.parse_args()
    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    args.out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(SEED)
    for name in args.only or MODELS:
        data = write_model(name, args.out, tok)
        folder = args.out / name
        files = sorted(p for p in folder.rglob("*") if p.is_file())
        sizes = {str(p.relative_to(folder)): p.stat().st_size for p in files}
        print(f"{name}: {data['model']['class']}, {data['model']['parameters']} parameters, "
              f"greedy margins {[p['greedy_margin'] for p in data['prompts']]}, "
              f"batch drift {data['batch']['max_abs_diff_to_unbatched']}, files {sizes}")
        for p in files:
            print(f"  {hashlib.sha256(p.read_bytes()).hexdigest()}  {name}/{p.relative_to(folder)}")
    print("versions:", versions(), file=sys.stderr)


if __name__ == "__main__":
    main()
