#!/usr/bin/env python3
"""One GRPO step per model family, computed by TRL's own `GRPOTrainer`, for the Rust trainer's parity test.

Regenerate (from the repository root, offline; needs the Python peers' venv, `bash ../shared/peers/setup.sh`):

    ~/.cache/holo-peers/venv/bin/python scripts/grpo_family_fixtures.py

It writes `holo-runtime/tests/fixtures/grpo/families.json` and nothing else (layout in that folder's README).

`scripts/grpo_fixtures.py` checks every loss type and option on the tiny Qwen2; this script runs one case, the
same way (its `build_trainer` and `run_built_case`: TRL's `_generate_and_score_completions`, then `_compute_loss`
and `loss.backward()` per micro-batch, on its fixed rollouts, rewards and old/ref log-prob perturbations), on the
committed tiny model of every other family the local runtime trains (`holo-runtime/tests/fixtures/models/NAME`).
What a family changes in the training forward and backward (norm placement, q/k norms, fused projections, sliding
windows under left padding, layers without RoPE, attention sinks, linear attention, experts and their router's
load-balancing loss) is what the case exercises; the loss formulas are those of the Qwen2 cases.

The case: `loss_type="grpo"` with `beta=0.04` (the reference-model KL term), `temperature=0.7` (tempered
log-probs and entropies), two micro-batches of four completions (`gradient_accumulation_steps=2`), each holding
both prompts (3 and 6 tokens: the shorter left-padded) with completions of 2 to 7 tokens, so every sequence
crosses the fixtures' 4-token sliding windows. TRL enables the mixture-of-experts families' load-balancing loss
itself (their configs have `output_router_logits`; `router_aux_loss_coef` 0.001), added to each micro-batch's
loss divided by the accumulation steps, and logs it as `aux_loss`.

LoRA: the cases in LORA train PEFT's adapters with the base frozen: every family's `target_modules="all-linear"`
(`NAME/lora_all_linear/`, committed by `scripts/lora_family_fixtures.py`; Qwen3-MoE's `moe_lora_all_linear/`, by
`scripts/moe_lora_fixtures.py`), and `q_proj` with both expert stacks as `target_parameters` on Qwen3-MoE
(`qwen3_moe/moe_lora/`, by `moe_lora_fixtures.py`) and Qwen3.5-MoE (`qwen3_5_moe/moe_lora/`, by
`lora_family_fixtures.py`, its router's weight too), every A and B nonzero. The model TRL gets is `PeftModel.from_pretrained(base, folder,
is_trainable=True)`, and its gradients are recorded under the names PEFT saves the adapters by
(`get_peft_model_state_dict`'s: the adapter name `.default` left out), which are ours; each case also records the
targets its adapter was made with (`lora_targets`), which the Rust test resolves by its own rules.

Gradients: for every trained parameter its shape, L2 norm, sum and sum of absolute values; for the few parameters named
in GRAD_PARAMS (what is particular to the family) also the first entries and the seeded sample of
`fixture_gradients.grad_sample`, as `grpo_fixtures.py` records them.
"""

from __future__ import annotations

import importlib.metadata as md
import platform
import tempfile

from peft import PeftModel

from grpo_fixtures import (
    ROOT,
    TRL_LOGGER,
    Case,
    WarningLog,
    build_trainer,
    load_model,
    run_built_case,
    write,
)

MODELS = ROOT / "holo-runtime" / "tests" / "fixtures" / "models"
OUT = ROOT / "holo-runtime" / "tests" / "fixtures" / "grpo" / "families.json"

# The case's GRPOConfig keyword arguments (on top of grpo_fixtures.BASE_CONFIG); each family's case is named after it.
CONFIG = dict(
    loss_type="grpo", beta=0.04, temperature=0.7, gradient_accumulation_steps=2, per_device_train_batch_size=4
)

L0, L1 = "model.layers.0.", "model.layers.1."
EMBED = "model.embed_tokens.weight"

# PEFT's adapters trained in cases of their own: (case name, family, adapter folder in the family's folder,
# the LoraConfig targets it was made with, parameters recorded entry by entry under PEFT's saved names).
PEFT = "base_model.model."
LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"
EXPERT_STACKS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# The all-linear adapters (scripts/lora_family_fixtures.py; Qwen3-MoE's, scripts/moe_lora_fixtures.py's, also
# adapts the router and both expert stacks, as PEFT converts them): an attention projection's B and an MLP
# projection's A, and what is particular to the family.
ALL_LINEAR_DETAIL = {
    family: [PEFT + L0 + "self_attn.q_proj" + LORA_B, PEFT + L0 + "mlp.down_proj" + LORA_A]
    for family in (
        "qwen2", "llama", "mistral", "ministral", "qwen3", "gemma2", "gemma3", "gemma3_softcap", "smollm3", "olmo2",
        "olmo3",
    )
}
ALL_LINEAR_DETAIL |= {
    "phi3": [PEFT + L0 + "self_attn.qkv_proj" + LORA_B, PEFT + L0 + "mlp.gate_up_proj" + LORA_A],
    "gpt_oss": [PEFT + L0 + "self_attn.q_proj" + LORA_B, PEFT + L0 + "self_attn.o_proj" + LORA_A],
    "qwen3_moe": [
        PEFT + L0 + "mlp.gate" + LORA_B,
        PEFT + L0 + "mlp.experts.base_layer" + LORA_B,
        PEFT + L0 + "self_attn.k_proj" + LORA_A,
    ],
    # Layer 0 is linear attention, layer 1 full attention.
    "qwen3_5": [PEFT + L0 + "linear_attn.in_proj_qkv" + LORA_A, PEFT + L1 + "self_attn.q_proj" + LORA_B],
    "qwen3_5_moe": [
        PEFT + L0 + "linear_attn.in_proj_qkv" + LORA_A,
        PEFT + L0 + "mlp.shared_expert_gate" + LORA_B,
        PEFT + L1 + "self_attn.q_proj" + LORA_B,
    ],
}
LORA = [
    (
        "qwen3_moe_lora",
        "qwen3_moe",
        "moe_lora",
        {"target_modules": ["q_proj"], "target_parameters": EXPERT_STACKS},
        [
            PEFT + L0 + "self_attn.q_proj" + LORA_B,
            PEFT + L0 + "mlp.experts" + LORA_A,
            PEFT + L0 + "mlp.experts.base_layer" + LORA_B,
        ],
    ),
    # Qwen3.5-MoE's expert stacks and router as target parameters (and q_proj, on its full-attention layer 1).
    (
        "qwen3_5_moe_lora",
        "qwen3_5_moe",
        "moe_lora",
        {"target_modules": ["q_proj"], "target_parameters": EXPERT_STACKS + ["mlp.gate.weight"]},
        [
            PEFT + L1 + "self_attn.q_proj" + LORA_B,
            PEFT + L0 + "mlp.gate" + LORA_A,
            PEFT + L0 + "mlp.experts" + LORA_A,
            PEFT + L0 + "mlp.experts.base_layer" + LORA_B,
        ],
    ),
] + [
    (
        f"{family}_lora_all_linear",
        family,
        "moe_lora_all_linear" if family == "qwen3_moe" else "lora_all_linear",
        {"target_modules": "all-linear"},
        detail,
    )
    for family, detail in ALL_LINEAR_DETAIL.items()
]

# Per family (a folder under MODELS): the parameters whose gradients are recorded entry by entry.
GRAD_PARAMS = {
    "llama": [EMBED, L0 + "self_attn.q_proj.weight", "lm_head.weight"],
    "mistral": [L0 + "self_attn.q_proj.weight", L1 + "mlp.down_proj.weight", "lm_head.weight"],
    "ministral": [L0 + "self_attn.k_proj.weight", L1 + "self_attn.q_proj.weight", "lm_head.weight"],
    "qwen3": [L0 + "self_attn.q_norm.weight", L0 + "self_attn.k_norm.weight", L0 + "self_attn.q_proj.weight"],
    # Tied embeddings scaled by √hidden; (1 + w) norms around attention and MLP; layer 0 slides, layer 1 is full.
    "gemma3": [
        EMBED,
        L0 + "pre_feedforward_layernorm.weight",
        L0 + "post_feedforward_layernorm.weight",
        L0 + "self_attn.q_proj.weight",
        L1 + "self_attn.k_norm.weight",
    ],
    # Gemma 3's layers without q/k norms, with both soft-caps (attention 3, logits 6): the gradients pass through
    # tanh's derivative at the scores and at the logits.
    "gemma2": [
        EMBED,
        L0 + "self_attn.q_proj.weight",
        L0 + "self_attn.k_proj.weight",
        L1 + "post_attention_layernorm.weight",
    ],
    # gemma3's model with a soft-cap on the logits (6; its attention cap, 2, transformers' Gemma 3 does not apply).
    "gemma3_softcap": [EMBED, L0 + "self_attn.q_proj.weight", L1 + "self_attn.k_norm.weight"],
    # no_rope_layers [1, 0]: layer 1 has no rotary embedding.
    "smollm3": [EMBED, L0 + "self_attn.q_proj.weight", L1 + "self_attn.q_proj.weight"],
    # Norms after attention and MLP (none before), q/k norms over all heads.
    "olmo2": [
        L0 + "post_attention_layernorm.weight",
        L0 + "post_feedforward_layernorm.weight",
        L0 + "self_attn.q_norm.weight",
        L0 + "self_attn.k_proj.weight",
    ],
    "olmo3": [
        L0 + "post_attention_layernorm.weight",
        L0 + "self_attn.q_norm.weight",
        L0 + "self_attn.k_proj.weight",
        L1 + "self_attn.q_proj.weight",
    ],
    "phi3": [L0 + "self_attn.qkv_proj.weight", L0 + "mlp.gate_up_proj.weight", L1 + "self_attn.qkv_proj.weight"],
    "qwen3_moe": [L0 + "mlp.gate.weight", L0 + "mlp.experts.gate_up_proj", L0 + "mlp.experts.down_proj"],
    "gpt_oss": [
        L0 + "self_attn.sinks",
        L0 + "mlp.router.weight",
        L0 + "mlp.router.bias",
        L0 + "mlp.experts.gate_up_proj",
        L0 + "mlp.experts.gate_up_proj_bias",
    ],
    # Qwen3.5's layers with a mixture on each: the router, the experts' stacks, the shared expert and its gate.
    "qwen3_5_moe": [
        L0 + "mlp.gate.weight",
        L0 + "mlp.experts.gate_up_proj",
        L0 + "mlp.shared_expert.down_proj.weight",
        L0 + "mlp.shared_expert_gate.weight",
        L1 + "self_attn.q_proj.weight",
    ],
    # Layer 0 is a gated-delta-net (linear attention) layer, layer 1 full attention with an output gate.
    "qwen3_5": [
        L0 + "linear_attn.A_log",
        L0 + "linear_attn.dt_bias",
        L0 + "linear_attn.conv1d.weight",
        L0 + "linear_attn.in_proj_qkv.weight",
        L1 + "self_attn.q_proj.weight",
    ],
}


def saved_name(name: str) -> str:
    """A PEFT model's parameter name as `save_pretrained` writes it (a base model's comes back as it is)."""
    return name.replace(".default.", ".")


def run_family(
    name: str,
    family: str,
    output_dir: str,
    grad_params: list[str],
    adapter: str | None = None,
    lora_targets: dict | None = None,
) -> dict:
    """The case `name` on the fixture `family`, training PEFT's `adapter` folder beside it when given (made with
    the LoraConfig targets `lora_targets`); `grad_params` (saved names) recorded entry by entry."""
    case = Case(name, CONFIG)
    warnings = WarningLog()
    TRL_LOGGER.addHandler(warnings)
    try:
        model = load_model(MODELS / family)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, MODELS / family / adapter, is_trainable=True)
        trainer = build_trainer(
            output_dir, case.num_generations, case.config, model_dir=MODELS / family, model=model
        )
        by_saved = {saved_name(n): n for n, p in trainer.model.named_parameters() if p.requires_grad}
        record = run_built_case(trainer, case, warnings, grad_params=[by_saved[n] for n in grad_params])
    finally:
        TRL_LOGGER.removeHandler(warnings)
    record["gradients"] = {saved_name(n): g for n, g in record["gradients"].items()}
    # The gradients accumulated over both micro-batches are still on the parameters.
    record["gradient_norms"] = {
        saved_name(name): {
            "shape": list(p.shape),
            "l2_norm": p.grad.norm().item(),
            "sum": p.grad.sum().item(),
            "abs_sum": p.grad.abs().sum().item(),
        }
        for name, p in trainer.model.named_parameters()
        if p.requires_grad
    }
    return {
        "model": str((MODELS / family).relative_to(ROOT)),
        "adapter": adapter,
        "lora_targets": lora_targets,
        # What TRL adds the load-balancing loss with (before dividing by the accumulation steps); 0 without one.
        "router_aux_loss_coef": trainer.router_aux_loss_coef if trainer.aux_loss_enabled else 0.0,
        **record,
    }


def main() -> None:
    records = []
    with tempfile.TemporaryDirectory() as output_dir:
        for family, grad_params in GRAD_PARAMS.items():
            records.append(run_family(family, family, output_dir, grad_params))
        for name, family, adapter, lora_targets, grad_params in LORA:
            records.append(run_family(name, family, output_dir, grad_params, adapter, lora_targets))
        for record in records:
            print(f"{record['name']:28s} loss {[m['loss'] for m in record['micro_batches']]}")
    versions = {"python": platform.python_version()}
    versions.update({pkg: md.version(pkg) for pkg in ("torch", "transformers", "trl", "peft")})
    write({"versions": versions, "cases": records}, out=OUT)
    print(f"wrote {OUT.relative_to(ROOT)} ({OUT.stat().st_size} bytes, {len(records)} cases)")


if __name__ == "__main__":
    main()
