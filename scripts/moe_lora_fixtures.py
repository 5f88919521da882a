"""LoRA on the experts of the committed mixture-of-experts fixtures as PEFT computes it, for
holo-runtime/tests/train/moe_lora.rs: `tests/fixtures/models/NAME/moe_lora/`, and two more adapters of
the same kind: `qwen3_moe/moe_lora_all_linear/` (`target_modules="all-linear"`, which PEFT turns into the
router's and both stacks' `target_parameters` with a `rank_pattern` on the fused stack) and
`qwen3/lora_pattern/` (a dense model with `rank_pattern` and `alpha_pattern`), and `qwen3/lora_head/`,
`smollm3/lora_head/` (`lm_head` among the target modules: the output head adapted, untied and tied to
the embeddings; PEFT's folder then also holds the head's base weight, as `save_pretrained` saves an
adapted embedding layer's), and `qwen3/lora_regex/` (`target_modules` a regular expression: layer 1's
`q_proj` and `k_proj`, every `down_proj`). `peft_targets.json` in
`tests/fixtures/train/` records what PEFT wraps for several `target_modules` on both mixtures (and the
output head and regular expressions on dense models): its
resolved configuration and each adapter tensor's name and shape, or its error.

PEFT 0.21 adapts transformers 5's stacked expert parameters with `target_parameters` (its
`ParamWrapper`: one low-rank update per expert on `mlp.experts.gate_up_proj` and `mlp.experts.down_proj`).
The adapter here targets both stacks and `q_proj`, with every A and B set to deterministic nonzero values
(a B of zeros would hide a wrong update); `save_pretrained` writes the folder as PEFT lays it out
(`adapter_config.json`, `adapter_model.safetensors` in float64). The model runs in float64 over three
right-padded sequences (two sharing a prefix, as scripts/balance_fixtures.py); `expected.safetensors`
records the sequences (`input_ids`, `lengths`, `first_trained`), the first one's logits and, for the loss `0.1 · Σ log p(trained tokens)`, its value and the
gradient of every LoRA weight under the saved names (`grad.` + name).

Run from the repository root with the peers' venv:
    ~/.cache/holo-peers/venv/bin/python scripts/moe_lora_fixtures.py
"""

import json
import sys
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

FIXTURES = Path("holo-runtime/tests/fixtures/models")
LOGPROB_WEIGHT = 0.1
RANK, ALPHA = 2, 3
TARGET_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# (ids, first trained position): the first two share their first seven tokens.
SEQUENCES = [
    ([5, 17, 33, 2, 90, 41, 7, 300, 12, 8, 77, 150], 7),
    ([5, 17, 33, 2, 90, 41, 7, 61, 222, 19], 7),
    ([400, 3, 58, 121, 9, 260], 3),
]


def load(folder: Path):
    return AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager"
    )


def record(name: str, adapter: str, **targets) -> None:
    folder = FIXTURES / name
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, **targets)
    model = get_peft_model(load(folder), config)
    with torch.no_grad():
        for k, (weight, parameter) in enumerate(
            sorted((n, p) for n, p in model.named_parameters() if ".lora_" in n)
        ):
            steps = torch.arange(parameter.numel(), dtype=torch.float64)
            parameter.copy_((0.3 * torch.sin(0.37 * steps + k)).reshape(parameter.shape))
    width = max(len(ids) for ids, _ in SEQUENCES)
    input_ids = torch.zeros((len(SEQUENCES), width), dtype=torch.long)
    attention_mask = torch.zeros((len(SEQUENCES), width), dtype=torch.long)
    for row, (ids, _) in enumerate(SEQUENCES):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    logprobs = torch.log_softmax(logits, dim=-1)
    trained = [
        logprobs[row, position - 1, ids[position]]
        for row, (ids, first) in enumerate(SEQUENCES)
        for position in range(first, len(ids))
    ]
    loss = LOGPROB_WEIGHT * torch.stack(trained).sum()
    loss.backward()
    expected = {
        "input_ids": input_ids,
        "lengths": attention_mask.sum(dim=1),
        "first_trained": torch.tensor([first for _, first in SEQUENCES]),
        "logits": logits[0].detach().contiguous(),
        "loss": loss.detach().reshape(1),
    }
    for weight, parameter in model.named_parameters():
        if ".lora_" in weight:
            expected["grad." + weight.replace(".default", "")] = parameter.grad.contiguous()
    out = folder / adapter
    model.save_pretrained(out)
    # PEFT writes a model card template beside the adapter; the fixture needs none.
    (out / "README.md").unlink()
    save_file(expected, out / "expected.safetensors")
    with torch.no_grad(), model.disable_adapter():
        base = model(input_ids=input_ids[:1]).logits[0]
    print(
        f"{name}/{adapter}: loss {loss.item():.6f}, max |Δlogit| from the base {(base - logits[0]).abs().max():.3f}, "
        f"{sum(key.startswith('grad.') for key in expected)} gradients",
        file=sys.stderr,
    )


# (model, target_modules, other LoraConfig arguments) whose wrapping peft_targets.json records.
TARGET_CASES = [
    ("qwen3_moe", "all-linear", {}),
    ("qwen3_moe", ["q_proj", "gate_proj", "up_proj", "down_proj"], {}),
    ("qwen3_moe", ["self_attn.v_proj", "mlp.gate"], {}),
    ("qwen3_moe", ["down_proj"], {}),
    ("qwen3_moe", ["gate_proj"], {}),
    (
        "qwen3_moe",
        ["q_proj", "gate_proj", "up_proj"],
        {"rank_pattern": {"layers.0.mlp.experts.gate_up_proj": 3, "q_proj": 5}, "alpha_pattern": {"q_proj": 7}},
    ),
    ("gpt_oss", "all-linear", {}),
    ("gpt_oss", ["q_proj"], {"target_parameters": ["mlp.router.weight", "gate_up_proj"]}),
    # The output head: named, and left out of all-linear (on a model whose head is tied, too).
    ("qwen3", ["q_proj", "lm_head"], {}),
    ("smollm3", "all-linear", {}),
    # A string is a regular expression the whole module name must match (`re.fullmatch`).
    ("qwen3", r".*\.(q_proj|v_proj)", {}),
    ("qwen3", r"model\.layers\.1\.self_attn\.(q|k)_proj", {}),
    ("qwen3", r".*\.o_proj|lm_head", {}),
    ("qwen3", "q_proj", {}),
    ("qwen3", r".*\.nothing_proj", {}),
    ("gpt_oss", r"model\.layers\.[02]\.self_attn\.(q|o)_proj", {}),
    # On Qwen3-MoE, PEFT turns the expression into the last parts of the names it matches (the layer
    # is lost), the experts' transformers-4 names among them, before converting those.
    ("qwen3_moe", r"model\.layers\.0\.(self_attn\.q_proj|mlp\.experts\.(gate|up)_proj)", {}),
    ("qwen3_moe", r".*\.mlp\.(gate|experts\.down_proj)", {}),
]


def targets() -> None:
    cases = []
    for name, target_modules, other in TARGET_CASES:
        case = {"model": name, "target_modules": target_modules, **other}
        try:
            model = get_peft_model(
                load(FIXTURES / name),
                LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=target_modules, **other),
            )
        except ValueError as error:
            case["error"] = str(error)
            cases.append(case)
            continue
        config = model.peft_config["default"]
        case["resolved"] = {
            "target_modules": (
                config.target_modules
                if isinstance(config.target_modules, str)
                else sorted(config.target_modules or [])
            ),
            "target_parameters": sorted(config.target_parameters or []),
            "rank_pattern": config.rank_pattern,
            "alpha_pattern": config.alpha_pattern,
        }
        case["adapters"] = {
            weight.replace(".default", ""): list(parameter.shape)
            for weight, parameter in model.named_parameters()
            if ".lora_" in weight
        }
        cases.append(case)
    out = Path("holo-runtime/tests/fixtures/train/peft_targets.json")
    out.write_text(json.dumps(cases, indent=1) + "\n")
    print(f"{out}: {len(cases)} cases", file=sys.stderr)


if __name__ == "__main__":
    for name in ("qwen3_moe", "gpt_oss"):
        record(name, "moe_lora", target_modules=["q_proj"], target_parameters=TARGET_PARAMETERS)
    record("qwen3_moe", "moe_lora_all_linear", target_modules="all-linear")
    record(
        "qwen3",
        "lora_pattern",
        target_modules=["q_proj", "v_proj", "down_proj"],
        rank_pattern={"model.layers.1.mlp.down_proj": 4, "q_proj": 3},
        alpha_pattern={"v_proj": 5, "down_proj": 1.5},
    )
    # LoRA on the output head (`lm_head` as a target module): untied on Qwen3, tied to the embeddings
    # on SmolLM3, where PEFT wraps the head's use of the shared weight only.
    record("qwen3", "lora_head", target_modules=["q_proj", "lm_head"])
    record("smollm3", "lora_head", target_modules=["v_proj", "lm_head"])
    record("qwen3", "lora_regex", target_modules=r"model\.layers\.1\.self_attn\.(q|k)_proj|.*\.down_proj")
    targets()
