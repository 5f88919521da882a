#!/usr/bin/env python3
"""Phi-3's LongRoPE switch point, as transformers takes it: greedy runs that cross it, from the committed phi3 fixture.

Regenerate (from the repository root, offline; needs the Python peers' venv):

    ~/.cache/holo-peers/venv/bin/python scripts/longrope_fixtures.py

The tiny `holo-runtime/tests/fixtures/models/phi3/` model (scripts/model_fixtures.py) has LongRoPE with
`original_max_position_embeddings` 64. transformers 5.23 picks the factors per forward pass
(`dynamic_rope_update`'s `longrope_frequency_update`): the long ones when the pass's largest position + 1 exceeds
64, for every position of the pass. Its `generate` keeps that consistent: Phi-3's `prepare_inputs_for_generation`
drops the KV cache at the step whose input reaches 65 tokens while the cache holds at most 64, so the whole
sequence runs again with the long factors. Each generated token's logits are then those of one forward over the
sequence so far; the script checks that, step by step, before writing anything.

Writes `holo-runtime/tests/fixtures/models/phi3/longrope.json`:

    original_max_position_embeddings   64
    runs[i]     {name, prompt (ids), greedy (ids), logprobs (each greedy token's log-softmax under the logits it
                was chosen from), margin (the smallest top-1 minus top-2 logit)}:
                `crossing`: a 60-token prompt and 12 greedy tokens, crossing the switch at the fifth token's
                step; `long_prompt`: a 70-token prompt (long from its first pass) and 6 greedy tokens
    forward     {ids, logprobs}: a 76-token sequence's next-token log-probabilities in one forward (long factors
                throughout, what a trainer's forward computes)

Prompts are seeded random ids below 500 (the tiny tokenizer's ordinary tokens); the seed moves on while a greedy
step's margin is under 1e-3.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

ROOT = Path(__file__).resolve().parent.parent
FOLDER = ROOT / "holo-runtime/tests/fixtures/models/phi3"
MIN_MARGIN = 1e-3


def f32(values) -> list:
    array = np.asarray(values, dtype=np.float32)
    if array.ndim == 0:
        return float(np.format_float_positional(array, unique=True, trim="-"))
    return [f32(row) for row in array]


@torch.no_grad()
def greedy(model, prompt: list, new: int) -> dict:
    ids = torch.tensor([prompt])
    config = GenerationConfig(do_sample=False, max_new_tokens=new, eos_token_id=None, pad_token_id=509,
                              bos_token_id=None, num_beams=1, output_scores=True, return_dict_in_generate=True)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    tokens = out.sequences[0, len(prompt):].tolist()
    assert len(tokens) == new, tokens
    logprobs, margins = [], []
    for step, scores in enumerate(out.scores):
        scores = scores[0].float()
        # The step's logits are one forward's over the sequence so far (the rule holo follows).
        prefix = out.sequences[:, : len(prompt) + step]
        whole = model(prefix).logits[0, -1].float()
        drift = (whole - scores).abs().max().item()
        assert drift < 1e-4, f"step {step}: generate's logits differ from the prefix's forward by {drift}"
        logprobs.append(torch.log_softmax(scores, -1)[tokens[step]].item())
        top = torch.topk(scores, 2).values
        margins.append((top[0] - top[1]).item())
    return {"prompt": prompt, "greedy": tokens, "logprobs": f32(logprobs), "margin": f32(min(margins))}


def main() -> None:
    model = AutoModelForCausalLM.from_pretrained(FOLDER, dtype=torch.float32, attn_implementation="eager").eval()
    # The folder's generation_config.json ends turns at 509 and 511, which generate would merge into ours.
    model.generation_config.eos_token_id = None
    original = model.config.rope_parameters["original_max_position_embeddings"]
    assert original == 64, original
    for seed in range(100):
        generator = torch.Generator().manual_seed(seed)
        crossing = torch.randint(0, 500, (60,), generator=generator).tolist()
        long_prompt = torch.randint(0, 500, (70,), generator=generator).tolist()
        runs = [("crossing", greedy(model, crossing, 12)), ("long_prompt", greedy(model, long_prompt, 6))]
        if all(run["margin"] >= MIN_MARGIN for _, run in runs):
            break
    else:
        raise SystemExit("no seed without a greedy near-tie")
    # The crossing run's steps before the switch were short: they differ from the long forward's.
    sequence = runs[0][1]["prompt"] + runs[0][1]["greedy"]
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0].float()
    picked = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(sequence[1:])[:, None])[:, 0]
    expected = {
        "original_max_position_embeddings": original,
        "seed": seed,
        "runs": [{"name": name, **run} for name, run in runs],
        "forward": {"ids": sequence, "logprobs": f32(picked)},
    }
    path = FOLDER / "longrope.json"
    path.write_text(json.dumps(expected) + "\n")
    print(f"wrote {path} (seed {seed})")


if __name__ == "__main__":
    main()
