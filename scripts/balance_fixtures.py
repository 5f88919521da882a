"""The load-balancing loss of the committed mixture-of-experts fixtures as transformers computes it, for
holo-runtime/tests/train/balance.rs: `tests/fixtures/models/NAME/balance.json`.

Three right-padded sequences (two sharing a prefix, so that the trainer may pack them as a tree) go
through the model in float64 with `output_router_logits=True`; the loss is TRL's shape of it,
`0.1 · Σ log p(trained tokens) + COEF · aux_loss`, and the fixture records its value, `aux_loss`, and the
gradients of every router and of a few other weights.

Run from the repository root with the peers' venv:
    ~/.cache/holo-peers/venv/bin/python scripts/balance_fixtures.py
"""

import json
import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

FIXTURES = Path("holo-runtime/tests/fixtures/models")
COEF = 0.5
LOGPROB_WEIGHT = 0.1
# (ids, first trained position): the first two share their first seven tokens.
SEQUENCES = [
    ([5, 17, 33, 2, 90, 41, 7, 300, 12, 8, 77, 150], 7),
    ([5, 17, 33, 2, 90, 41, 7, 61, 222, 19], 7),
    ([400, 3, 58, 121, 9, 260], 3),
]


def record(name: str) -> None:
    folder = FIXTURES / name
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager"
    )
    model.train()
    width = max(len(ids) for ids, _ in SEQUENCES)
    input_ids = torch.zeros((len(SEQUENCES), width), dtype=torch.long)
    attention_mask = torch.zeros((len(SEQUENCES), width), dtype=torch.long)
    for row, (ids, _) in enumerate(SEQUENCES):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
    outputs = model(input_ids=input_ids, attention_mask=attention_mask, output_router_logits=True)
    logprobs = torch.log_softmax(outputs.logits, dim=-1)
    trained = []
    for row, (ids, first) in enumerate(SEQUENCES):
        for position in range(first, len(ids)):
            trained.append(logprobs[row, position - 1, ids[position]])
    logprob_sum = torch.stack(trained).sum()
    loss = LOGPROB_WEIGHT * logprob_sum + COEF * outputs.aux_loss
    loss.backward()
    gradients = {}
    for weight, parameter in model.named_parameters():
        if parameter.grad is None:
            continue
        if ".mlp.gate." in weight or ".mlp.router." in weight:
            gradients[weight] = {"values": parameter.grad.flatten().tolist()}
        elif weight in ("model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight"):
            grad = parameter.grad.flatten()
            gradients[weight] = {"norm": grad.norm().item(), "sum": grad.sum().item()}
    fixture = {
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "sequences": [{"ids": ids, "first_trained": first} for ids, first in SEQUENCES],
        "coef": COEF,
        "logprob_weight": LOGPROB_WEIGHT,
        "aux_loss": outputs.aux_loss.item(),
        "logprob_sum": logprob_sum.item(),
        "loss": loss.item(),
        "gradients": gradients,
    }
    (folder / "balance.json").write_text(json.dumps(fixture, indent=1) + "\n")
    print(f"{name}: aux_loss {outputs.aux_loss.item():.6f}, {len(gradients)} gradients", file=sys.stderr)


if __name__ == "__main__":
    for name in ("qwen3_moe", "gpt_oss"):
        record(name)
