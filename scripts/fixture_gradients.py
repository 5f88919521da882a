"""What the parity fixtures record of a gradient beyond its norm, sum and first entries (grpo_fixtures.py,
sft_fixtures.py, ppo_fixtures.py import it; they run from the repository root, so this folder is on the path)."""

import torch

GRAD_SAMPLE = 256  # entries at seeded random positions recorded per gradient tensor


def grad_sample(g: torch.Tensor) -> dict:
    """`GRAD_SAMPLE` entries of the flattened gradient `g` at positions spread over the whole tensor, drawn
    by a generator seeded with its size (the same positions on every run): with the norm and the sum, the
    whole tensor is checked, not only its first rows."""
    n = g.numel()
    if n <= GRAD_SAMPLE:
        positions = list(range(n))
    else:
        generator = torch.Generator().manual_seed(n)
        positions = sorted(torch.randperm(n, generator=generator)[:GRAD_SAMPLE].tolist())
    return {"positions": positions, "values": g[positions].tolist()}
