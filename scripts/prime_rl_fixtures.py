#!/usr/bin/env python3
"""prime-rl's default RL loss computed by prime-rl's own code, for `holo-runtime/tests/grpo_parity.rs`
(`dppo_loss_is_prime_rl_s`: holo's `loss_type = "dppo"` must give the same loss and gradients).

    ~/.cache/holo-peers/venv/bin/python scripts/prime_rl_fixtures.py --prime-rl PATH [--out FILE]

`PATH` is a checkout of https://github.com/PrimeIntellect-ai/prime-rl (a work tree, or a bare git
directory, whose HEAD is read). prime-rl is not on PyPI and needs a GPU stack to install, so the script
imports only the loss module, `src/prime_rl/trainer/rl/loss.py`, executed as prime-rl ships it, with the
modules it imports stubbed: `beartype` and `jaxtyping` (type checks only), `prime_rl.configs.trainer`
(the loss configuration: the fields and defaults of `DefaultLossConfig`, read from
`packages/prime-rl-configs/src/prime_rl/configs/trainer.py` of the same checkout) and
`prime_rl.utils.utils`. Then `compute_loss` with `setup_rl_loss_fn(DefaultLossConfig(...))`, on CPU, in
float64, for packed samples of random log-probabilities, as prime-rl's trainer calls it (`rl_scale`: the
step's count of loss tokens).

Writes `holo-runtime/tests/fixtures/grpo/prime_rl.json`:

    source      the prime-rl commit and its date, and the files read
    cases[i]    {name, config: {dppo_mask_low, dppo_mask_high, adv_tau, kl_tau},
                 samples: [{trainer_logprobs, inference_logprobs, advantage, mask}],
                 rl_scale, loss, gradients: [d loss / d trainer_logprobs per sample]}
"""

import argparse
import ast
import json
import os
import subprocess
import sys
import types

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOSS = "src/prime_rl/trainer/rl/loss.py"
CONFIGS = "packages/prime-rl-configs/src/prime_rl/configs/trainer.py"


def read(checkout, path):
    """`path` of the checkout: a file of its work tree, or HEAD's blob in a bare repository."""
    if os.path.isfile(os.path.join(checkout, path)):
        with open(os.path.join(checkout, path)) as file:
            return file.read()
    return subprocess.run(
        ["git", "--git-dir", git_dir(checkout), "show", f"HEAD:{path}"],
        check=True, capture_output=True, text=True,
    ).stdout


def git_dir(checkout):
    dotgit = os.path.join(checkout, ".git")
    return dotgit if os.path.exists(dotgit) else checkout


def commit(checkout):
    out = subprocess.run(
        ["git", "--git-dir", git_dir(checkout), "log", "-1", "--format=%H %cI"],
        check=True, capture_output=True, text=True,
    ).stdout.split()
    return {"commit": out[0], "date": out[1]}


def default_loss_fields(source):
    """`DefaultLossConfig`'s fields and defaults (`name: float = Field(default, ...)`)."""
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "DefaultLossConfig":
            fields = {}
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.value, ast.Call):
                    fields[item.target.id] = ast.literal_eval(item.value.args[0])
            return fields
    raise SystemExit("DefaultLossConfig not found in " + CONFIGS)


def stub_modules(fields):
    """Modules the loss file imports that are not needed to run it."""

    class Shape:
        def __class_getitem__(cls, item):
            return cls

    jaxtyping = types.ModuleType("jaxtyping")
    jaxtyping.Float = jaxtyping.Bool = jaxtyping.Int = Shape
    jaxtyping.jaxtyped = lambda typechecker=None: (lambda function: function)
    beartype = types.ModuleType("beartype")
    beartype.beartype = lambda function: function

    class DefaultLossConfig:
        def __init__(self, **values):
            for key, value in {**fields, **values}.items():
                setattr(self, key, value)

    configs = types.ModuleType("prime_rl.configs.trainer")
    configs.DefaultLossConfig = DefaultLossConfig
    configs.IPOLossConfig = type("IPOLossConfig", (), {})
    configs.CustomLossConfig = type("CustomLossConfig", (), {})
    configs.LossConfig = object
    utils = types.ModuleType("prime_rl.utils.utils")
    utils.import_object = None
    for name, module in {
        "jaxtyping": jaxtyping,
        "beartype": beartype,
        "prime_rl": types.ModuleType("prime_rl"),
        "prime_rl.configs": types.ModuleType("prime_rl.configs"),
        "prime_rl.configs.trainer": configs,
        "prime_rl.utils": types.ModuleType("prime_rl.utils"),
        "prime_rl.utils.utils": utils,
    }.items():
        sys.modules[name] = module
    return DefaultLossConfig


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prime-rl", required=True, help="a prime-rl checkout (work tree or bare)")
    parser.add_argument(
        "--out", default=os.path.join(ROOT, "holo-runtime/tests/fixtures/grpo/prime_rl.json")
    )
    args = parser.parse_args()

    fields = default_loss_fields(read(args.prime_rl, CONFIGS))
    DefaultLossConfig = stub_modules(fields)
    loss_module = types.ModuleType("prime_rl_loss")
    exec(compile(read(args.prime_rl, LOSS), LOSS, "exec"), loss_module.__dict__)

    generator = torch.Generator().manual_seed(0)
    cases = []
    for name, config in [
        ("defaults", {}),
        ("tight", {"dppo_mask_low": 0.02, "dppo_mask_high": 0.03, "adv_tau": 0.5, "kl_tau": 0.1}),
    ]:
        # Four samples: advantages of both signs and zero, one sample masked whole (holo masks whole
        # completions); the trainer's log-probabilities near the sampler's, some far enough to be masked.
        lengths, advantages, masked = [7, 5, 9, 4], [1.25, -0.75, 0.0, 0.5], [False, False, False, True]
        samples = []
        for length, advantage, mask_off in zip(lengths, advantages, masked):
            inference = -torch.rand(length, generator=generator, dtype=torch.float64) * 3.0
            trainer = inference + torch.randn(length, generator=generator, dtype=torch.float64) * 0.15
            samples.append((trainer, inference, advantage, not mask_off))
        trainer = [t.clone().requires_grad_(True) for t, _, _, _ in samples]
        rl_scale = sum(len(t) for t, _, _, keep in samples if keep)
        loss, _ = loss_module.compute_loss(
            trainer_logprobs=trainer,
            inference_logprobs=[i for _, i, _, _ in samples],
            ref_logprobs=None,
            advantages=[torch.full((len(t),), a, dtype=torch.float64) for t, _, a, _ in samples],
            loss_mask=[torch.full((len(t),), keep, dtype=torch.bool) for t, _, _, keep in samples],
            rl_weights=None,
            ce_weights=None,
            ref_kl_weights=None,
            rl_loss_fn=loss_module.setup_rl_loss_fn(DefaultLossConfig(**config)),
            rl_scale=rl_scale,
            ce_scale=1,
            ref_kl_scale=1,
        )
        loss.backward()
        cases.append({
            "name": name,
            "config": {**fields, **config},
            "samples": [
                {
                    "trainer_logprobs": t.tolist(),
                    "inference_logprobs": i.tolist(),
                    "advantage": a,
                    "mask": keep,
                }
                for t, i, a, keep in samples
            ],
            "rl_scale": rl_scale,
            "loss": loss.item(),
            "gradients": [t.grad.tolist() for t in trainer],
        })
    out = {
        "source": {**commit(args.prime_rl), "files": [LOSS, CONFIGS], "torch": torch.__version__},
        "cases": cases,
    }
    with open(args.out, "w") as file:
        json.dump(out, file, indent=1)
        file.write("\n")
    print(f"wrote {args.out}: " + ", ".join(f"{c['name']} loss {c['loss']:.6g}" for c in cases))


if __name__ == "__main__":
    main()
