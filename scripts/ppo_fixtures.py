#!/usr/bin/env python3
"""PPO parity fixtures for the Rust trainer (holo-runtime/holo-train/src/ppo/), every number computed by TRL's own code.

Regenerate (from the repository root; needs the Python peers' venv, `bash ../shared/peers/setup.sh`):

    ~/.cache/holo-peers/venv/bin/python scripts/ppo_fixtures.py

It writes `holo-runtime/tests/fixtures/ppo/cases.json` and nothing else.

TRL's `PPOTrainer` left TRL after 1.12.0 (it was `trl.experimental.ppo`; the peer venv has TRL 1.16). The script
takes TRL 1.12.0's `trl/experimental/ppo/ppo_trainer.py` from its wheel on PyPI (downloaded once into
`~/.cache/holo-peers/trl-1.12.0/`, never installed) and runs TRL's own code from it on fixed inputs:

- the module's functions `masked_mean`, `masked_var`, `masked_whiten`, `forward` and its class
  `PolicyAndValueWrapper`, compiled from the file as they are;
- two blocks of `PPOTrainer.train`, cut out of the file's text between fixed marker lines and executed as they are:
  steps 4-6 (per-token rewards with the `k1`/`k3` KL, `whiten_rewards`, GAE, returns, whitened advantages), and
  the micro-batch loss (the forward of policy and value model, the clipped policy loss, the clipped value loss,
  `pg_loss + vf_coef * vf_loss`, the clip fractions).

The inputs: the committed tiny Qwen2 (`holo-runtime/tests/fixtures/models/qwen2`) as the policy, and the same
weights as a `Qwen2ForSequenceClassification` with one label as the value model (its `score` head drawn with
torch's seed 0 and committed here, so the Rust side uses the same). Two prompts of 4 tokens, four responses of
lengths 5, 3, 6, 2 right-padded with the pad id, scores per response. Sampling log-probabilities are the policy's
(at the temperature, as TRL's generation computes them) minus a fixed pattern, the reference's plus another, the
values at sampling the value model's plus a third, so that ratios, KL and value clipping all fire for some
tokens; the script refuses inputs where a ratio or a value lies within MARGIN of a clipping bound.

One input is TRL's on purpose only in form: TRL puts a rollout's score one position after its last token when it
ended early (`sequence_lengths_p1`), and trains the value there (`padding_mask_p1`). Holoware puts the score on the
last sampled token and trains values on sampled tokens only (the state after the last is terminal). The blocks get
`sequence_lengths_p1 = sequence_lengths` and `padding_mask_p1 = padding_mask`, so TRL's arithmetic runs on
Holoware's placement; for a response that fills its width the two placements are the same.

Micro-batches: `gradient_accumulation_steps = 2`, rows [2, 0] then [3, 1]; each loss is divided by 2 before its
backward (as `accelerator.backward` does under accumulation), and the gradients summed over both are recorded.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import ast
import importlib.metadata as md
import json
import math
import platform
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from types import SimpleNamespace

import torch
from fixture_gradients import grad_sample
import torch.nn as nn
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
from transformers.utils import ModelOutput
from trl.trainer.utils import selective_log_softmax

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "holo-runtime" / "tests" / "fixtures" / "models" / "qwen2"
OUT = ROOT / "holo-runtime" / "tests" / "fixtures" / "ppo" / "cases.json"
TRL_VERSION = "1.12.0"
TRL_CACHE = Path.home() / ".cache" / "holo-peers" / f"trl-{TRL_VERSION}"
PPO_FILE = "trl/experimental/ppo/ppo_trainer.py"

PAD = 509
INVALID_LOGPROB = 1.0
TEMPERATURE = 0.7
MARGIN = 1e-3
PROMPTS = [[37, 201, 88, 5], [412, 150, 299, 61]]
RESPONSES = [  # (prompt, response ids)
    (0, [104, 77, 311, 12, 511]),
    (0, [251, 33, 511]),
    (1, [12, 400, 95, 260, 33, 178]),
    (1, [0, 381]),
]
SCORES = [1.0, -0.5, 0.25, 2.0]
MICRO_BATCHES = [[2, 0], [3, 1]]
POLICY_GRADS = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight", "model.embed_tokens.weight"]
VALUE_GRADS = ["model.layers.0.self_attn.q_proj.weight", "model.norm.weight", "score.weight"]
GRAD_HEAD = 8


CASES = [
    {"name": "k1", "kl_estimator": "k1", "whiten_rewards": False, "kl_coef": 0.05, "gamma": 1.0, "lam": 0.95,
     "cliprange": 0.2, "cliprange_value": 0.2, "vf_coef": 0.1},
    {"name": "k3_whitened", "kl_estimator": "k3", "whiten_rewards": True, "kl_coef": 0.2, "gamma": 0.9, "lam": 0.8,
     "cliprange": 0.1, "cliprange_value": 0.3, "vf_coef": 0.5},
]


# ---- TRL's code ---------------------------------------------------------------------------------------------
def trl_source() -> str:
    wheels = sorted(TRL_CACHE.glob(f"trl-{TRL_VERSION}-*.whl"))
    if not wheels:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", f"trl=={TRL_VERSION}", "-d", str(TRL_CACHE)],
            check=True,
        )
        wheels = sorted(TRL_CACHE.glob(f"trl-{TRL_VERSION}-*.whl"))
    with zipfile.ZipFile(wheels[0]) as wheel:
        return wheel.read(PPO_FILE).decode()


def trl_namespace(source: str) -> dict:
    """The module-level functions and the wrapper class of TRL's PPO file, compiled as they are."""
    wanted = {"masked_mean", "masked_var", "masked_whiten", "forward", "PolicyAndValueWrapper"}
    tree = ast.parse(source)
    nodes = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in wanted]
    assert {n.name for n in nodes} == wanted, {n.name for n in nodes}
    namespace = {"torch": torch, "nn": nn, "ModelOutput": ModelOutput}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), PPO_FILE, "exec"), namespace)
    return namespace


def block(source: str, first: str, last: str) -> str:
    """The lines of TRL's file from the one containing `first` to the one containing `last`, dedented."""
    lines = source.splitlines()
    start = next(i for i, line in enumerate(lines) if first in line)
    end = next(i for i in range(start, len(lines)) if last in lines[i])
    return textwrap.dedent("\n".join(lines[start : end + 1]))


# ---- inputs -------------------------------------------------------------------------------------------------
def pattern(scale: float, a: float, b: float, c: float):
    return lambda i, t: scale * math.sin(a * i + b * t + c)


DELTA = pattern(0.45, 1.3, 0.9, 0.4)  # old = π − δ
KAPPA = pattern(0.3, 0.7, 1.1, 1.0)  # ref = π + κ
NU = pattern(0.5, 0.8, 1.7, 0.2)  # values at sampling = V + ν


def check_margin(what: str, values: torch.Tensor, bounds: list[float]) -> None:
    for bound in bounds:
        gap = (values - bound).abs().min().item()
        assert gap > MARGIN, f"{what}: a value lies {gap:.2e} from {bound}"


def main() -> None:
    source = trl_source()
    ns = trl_namespace(source)
    rewards_block = block(source, "# 4. compute rewards", "advantages = torch.masked_fill(advantages, padding_mask, 0)")
    loss_block = block(source, "output, vpred_temp = forward(model, mb_query_responses", "loss = pg_loss + args.vf_coef * vf_loss")
    clipfrac_block = block(source, "pg_clipfrac = masked_mean(", "prob_dist = torch.nn.functional.softmax(logits")

    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32, attn_implementation="eager")
    value_model = AutoModelForSequenceClassification.from_pretrained(
        MODEL_DIR, num_labels=1, dtype=torch.float32, attn_implementation="eager"
    )
    policy.eval()
    value_model.eval()
    model = ns["PolicyAndValueWrapper"](policy, value_model)
    head = value_model.score.weight.detach().clone()

    context_length = len(PROMPTS[0])
    width = max(len(r) for _, r in RESPONSES)
    lengths = [len(r) for _, r in RESPONSES]
    queries = torch.tensor([PROMPTS[p] for p, _ in RESPONSES])
    responses = torch.tensor([r + [PAD] * (width - len(r)) for _, r in RESPONSES])
    query_responses = torch.cat([queries, responses], 1)
    response_idxs = torch.arange(width).repeat(len(RESPONSES), 1)
    sequence_lengths = torch.tensor(lengths) - 1
    padding_mask = response_idxs > sequence_lengths.unsqueeze(1)

    with torch.no_grad():
        output, vpred_temp = ns["forward"](model, query_responses, PAD)
        logits = output.logits[:, context_length - 1 : -1] / (TEMPERATURE + 1e-7)
        policy_logprobs = selective_log_softmax(logits, responses)
        value_now = vpred_temp[:, context_length - 1 : -1].squeeze(-1)
    grid = [[(i, t) for t in range(width)] for i in range(len(RESPONSES))]
    delta = torch.tensor([[DELTA(i, t) for i, t in row] for row in grid])
    kappa = torch.tensor([[KAPPA(i, t) for i, t in row] for row in grid])
    nu = torch.tensor([[NU(i, t) for i, t in row] for row in grid])
    logprobs = torch.masked_fill(policy_logprobs - delta, padding_mask, INVALID_LOGPROB)
    ref_logprobs = torch.masked_fill(policy_logprobs + kappa, padding_mask, INVALID_LOGPROB)
    values = torch.masked_fill(value_now + nu, padding_mask, 0)
    scores = torch.tensor(SCORES)
    valid = ~padding_mask
    ratio = (policy_logprobs - logprobs).exp()[valid]
    check_margin("ratio", ratio, [1 - c["cliprange"] for c in CASES] + [1 + c["cliprange"] for c in CASES])
    for c in CASES:
        check_margin("value", (value_now - values)[valid], [-c["cliprange_value"], c["cliprange_value"]])

    def unpad(tensor: torch.Tensor) -> list[list[float]]:
        return [tensor[i, :n].tolist() for i, n in enumerate(lengths)]

    records = []
    for case in CASES:
        args = SimpleNamespace(temperature=TEMPERATURE, **{k: v for k, v in case.items() if k != "name"})
        scope = dict(ns)
        scope.update(
            args=args, logprobs=logprobs.clone(), ref_logprobs=ref_logprobs.clone(), values=values.clone(),
            scores=scores.clone(), responses=responses, sequence_lengths=sequence_lengths,
            # Holoware's placement (see the module's docstring): the score on the last sampled token.
            sequence_lengths_p1=sequence_lengths, padding_mask=padding_mask, padding_mask_p1=padding_mask,
            empty_cache=lambda: None,
        )
        exec(compile(rewards_block, PPO_FILE, "exec"), scope)

        policy.zero_grad(set_to_none=True)
        value_model.zero_grad(set_to_none=True)
        micro = []
        for inds in MICRO_BATCHES:
            inds = torch.tensor(inds)
            mb = dict(scope)
            mb.update(
                model=model, processing_class=SimpleNamespace(pad_token_id=PAD), context_length=context_length,
                micro_batch_inds=inds, mb_advantage=scope["advantages"][inds], mb_responses=responses[inds],
                mb_query_responses=query_responses[inds], mb_logprobs=logprobs[inds],
                mb_return=scope["returns"][inds], mb_values=values[inds],
                selective_log_softmax=selective_log_softmax, INVALID_LOGPROB=INVALID_LOGPROB,
            )
            exec(compile(loss_block, PPO_FILE, "exec"), mb)
            (mb["loss"] / len(MICRO_BATCHES)).backward()
            with torch.no_grad():
                exec(compile(clipfrac_block, PPO_FILE, "exec"), mb)
            micro.append({
                "rows": inds.tolist(),
                "loss": mb["loss"].item(),
                "pg_loss": mb["pg_loss"].item(),
                "vf_loss": mb["vf_loss"].item(),
                "pg_clipfrac": mb["pg_clipfrac"].item(),
                "vf_clipfrac": mb["vf_clipfrac"].item(),
            })

        def grads(module: nn.Module, names: list[str]) -> dict:
            params = dict(module.named_parameters())
            out = {}
            for name in names:
                g = params[name].grad.detach().flatten()
                out[name] = {"shape": list(params[name].shape), "l2_norm": g.norm().item(), "sum": g.sum().item(),
                             "head": g[:GRAD_HEAD].tolist(), "sample": grad_sample(g)}
            return out

        records.append({
            "name": case["name"],
            "config": {k: v for k, v in case.items() if k != "name"},
            "kl": unpad(scope["kl"]),
            "rewards": unpad(scope["rewards"]),
            "advantages": unpad(scope["advantages"]),
            "returns": unpad(scope["returns"]),
            "micro_batches": micro,
            "policy_gradients": grads(policy, POLICY_GRADS),
            "value_gradients": grads(value_model, VALUE_GRADS),
        })
        print(f"{case['name']:12s} losses {[round(m['loss'], 6) for m in micro]}")

    versions = {"python": platform.python_version(), "trl_ppo_source": TRL_VERSION}
    versions.update({pkg: md.version(pkg) for pkg in ("torch", "transformers")})
    doc = {
        "versions": versions,
        "model": str(MODEL_DIR.relative_to(ROOT)),
        "temperature": TEMPERATURE,
        "gradient_accumulation_steps": len(MICRO_BATCHES),
        "prompts": [PROMPTS[p] for p, _ in RESPONSES],
        "responses": [r for _, r in RESPONSES],
        "scores": SCORES,
        "value_head": head.flatten().tolist(),
        "logprobs": unpad(logprobs),
        "ref_logprobs": unpad(ref_logprobs),
        "values": unpad(values),
        "cases": records,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
