#!/usr/bin/env python3
"""GRPO parity fixtures for the Rust trainer (holo-runtime/holo-train/src/), every number computed by TRL's own code.

Regenerate (from the repository root, offline; needs the Python peers' venv, `bash ../shared/peers/setup.sh`):

    ~/.cache/holo-peers/venv/bin/python scripts/grpo_fixtures.py

It writes `holo-runtime/tests/fixtures/grpo/cases.json` and nothing else; the layout of that file, and which TRL
function produced each number, are in `holo-runtime/tests/fixtures/grpo/README.md`.

For each case the script builds a real `trl.GRPOTrainer` (CPU, f32, eager attention) on the committed tiny model
`holo-runtime/tests/fixtures/models/qwen2`, then:

1. Generation and scoring. `_tokenize_prompts` and `_generate_single_turn` are replaced by stubs returning fixed
   prompt ids, completion ids and (for the vLLM importance-sampling cases) sampling log-probs, and
   `_calculate_rewards` by a stub returning a fixed reward matrix with NaN entries (NaN = the reward function
   returned None) and one all-NaN row. Everything in between is TRL's: `_generate` (decoding, the `completions/*`
   metrics, truncation), then `_generate_and_score_completions` (padding, `mask_truncated_completions`,
   `num_items_in_batch`, old / importance-sampling log-probs, advantages, reward metrics).
2. Loss. The batch TRL returned gets fixed `old_per_token_logps` (so that ratios differ from 1 and are clipped on
   both sides) and, when beta > 0, fixed `ref_per_token_logps`; it is split into micro-batches as
   `_prepare_inputs` does (a fixed permutation instead of its random shuffle), and each micro-batch goes through
   `_compute_loss` and `loss.backward()` as `Trainer.training_step` does. The per-token log-probs and entropies
   that `_get_per_token_logps_and_entropies` returned inside `_compute_loss`, the masks and weights of
   `get_high_entropy_mask`, `get_gamma_weights` and `get_off_policy_mask`, the losses, the logged metrics and the
   accumulated gradients are recorded.

The vLLM importance-sampling (IS) correction needs `use_vllm`, which needs vLLM at construction; the trainer is
built without it and `trainer.use_vllm` is set afterwards, so TRL's own lines in `_generate_and_score_completions`
compute the IS ratio from the sampling log-probs the stub returned (and `_compute_loss` applies it).

Log-prob perturbations (old = π_θ − δ, ref = π_θ + κ, sampling = π_θ − σ) are fixed patterns chosen so that every
clipping rule fires for some tokens; the script checks that no ratio lies within MARGIN of a threshold it is
compared with, so that float noise on the Rust side cannot flip a clipping decision.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import importlib.metadata as md
import json
import logging
import math
import platform
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from fixture_gradients import grad_sample
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import pad, split_tensor_dict

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "holo-runtime" / "tests" / "fixtures" / "models" / "qwen2"
OUT = ROOT / "holo-runtime" / "tests" / "fixtures" / "grpo" / "cases.json"

MAX_COMPLETION_LENGTH = 7
EOS = 511  # <|im_end|>; the model's generation_config also lists 509 (<|endoftext|>, the pad token) as EOS

# ---- rollouts -------------------------------------------------------------------------------------------------
# Two prompts of different lengths (so the shorter one is left-padded), G = 4 completions each of different
# lengths (right padding). A completion is truncated, for TRL, when its last id is neither an EOS id nor the pad
# id; here the truncated ones are exactly MAX_COMPLETION_LENGTH long. One completion ends with the pad id 509,
# which TRL counts as terminated. G = 3 cases use the first three completions of each group.
PROMPTS = [
    [37, 201, 88],
    [412, 5, 150, 299, 61, 230],
]
COMPLETIONS = [
    [  # group 0
        [104, 77, 311, EOS],
        [12, 400, 95, 260, 33, 178, 49],  # truncated
        [251, EOS],
        [0, 1, 381, 72, 140, EOS],
    ],
    [  # group 1
        [90, 222, 17, 305, EOS],
        [333, 64, 181, 509],  # ends with the pad id: not truncated
        [77, 450, 3, 200, 119, 48, 260],  # truncated
        [501, 22, EOS],
    ],
]

# ---- rewards --------------------------------------------------------------------------------------------------
# Three reward functions (names as TRL logs them); they are never called, `_calculate_rewards` is replaced.
NAN = float("nan")
REWARD_WEIGHTS = [1.0, 0.5, -0.25]
REWARDS = [  # [completion][function] for G = 4; NaN = the function returned None
    [1.0, 0.2, NAN],
    [0.0, NAN, 1.0],
    [NAN, NAN, NAN],  # unscorable: advantage forced to 0
    [0.5, 0.8, 0.3],
    [0.0, 0.0, 0.0],
    [1.0, 0.6, NAN],
    [0.0, 0.9, 0.4],
    [2.0, NAN, 0.7],
]
# Group 1 with weighted sums all exactly 1.0 (different components): zero group std, `frac_reward_zero_std` 0.5.
REWARDS_ZERO_STD_GROUP = REWARDS[:4] + [
    [1.0, NAN, NAN],
    [0.5, 1.0, NAN],
    [0.0, 2.0, NAN],
    [1.0, 0.5, 1.0],
]


def accuracy(**kwargs):
    raise AssertionError("reward functions are stubbed out")


def format_reward(**kwargs):
    raise AssertionError("reward functions are stubbed out")


def length_penalty(**kwargs):
    raise AssertionError("reward functions are stubbed out")


REWARD_FUNCS = [accuracy, format_reward, length_penalty]

# ---- log-prob perturbations -----------------------------------------------------------------------------------
# With ℓ = the policy's log-prob of completion i's token t: old = ℓ − δ (ratio exp(δ)), ref = ℓ + κ (KL
# k3(κ)), sampling = ℓ − σ (IS ratio exp(σ)).
DELTA_ROW = [0.30, -0.30, 0.05, 0.42, -0.35, 0.15, 0.25, -0.12]
DELTA_TOKEN = [0.20, -0.25, 0.10, -0.05, 0.31, -0.16, 0.03]
KAPPA_TOKEN = [0.40, -0.30, 0.15, -0.50, 0.25, 0.05, -0.20]
SIGMA_ROW = [0.00, 0.05, -0.10, 0.08, -0.25, 0.02, 0.14, -0.08]
SIGMA_TOKEN = [0.70, -0.62, 0.12, -0.20, 0.35]


def delta(i: int, t: int) -> float:
    return DELTA_ROW[i] + DELTA_TOKEN[(i + t) % len(DELTA_TOKEN)]


def kappa(i: int, t: int) -> float:
    return KAPPA_TOKEN[(3 * i + t) % len(KAPPA_TOKEN)]


def sigma(i: int, t: int) -> float:
    return SIGMA_ROW[i] + SIGMA_TOKEN[(2 * i + t) % len(SIGMA_TOKEN)]


MARGIN = 1e-3  # smallest allowed distance between a ratio and a threshold it is compared with

# ---- gradients ------------------------------------------------------------------------------------------------
GRAD_PARAMS = [
    "model.embed_tokens.weight",  # tied with lm_head: gets both the input-embedding and the LM-head gradient
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.q_proj.bias",
    "model.layers.1.mlp.down_proj.weight",
    "model.norm.weight",
]
GRAD_HEAD = 64  # first entries (row-major) recorded per gradient tensor


# ---- cases ----------------------------------------------------------------------------------------------------
@dataclass
class Case:
    name: str
    config: dict  # GRPOConfig keyword arguments (TRL names) on top of BASE_CONFIG
    num_generations: int = 4
    rewards: list = field(default_factory=lambda: REWARDS)
    vllm_is: bool = False  # emulate vLLM sampling: sampling log-probs given, trainer.use_vllm forced on
    note: str = ""


BASE_CONFIG = dict(
    # TRL's configs default to bf16=True, which on CPU too runs the forward under bf16 autocast (log-probs off by
    # ~0.02 from the f32 model); the fixtures are f32 throughout.
    bf16=False,
    max_completion_length=MAX_COMPLETION_LENGTH,
    reward_weights=REWARD_WEIGHTS,
    gradient_accumulation_steps=1,
)

LOSS_TYPES = ["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"]
SCALE_REWARDS = ["group", "batch", "none"]
# CISPO clamps the ratio at epsilon_high itself (not 1 + epsilon_high); TRL recommends 5.0. 1.3 clips some tokens.
CISPO_EPSILON_HIGH = 1.3


def core_cases() -> list[Case]:
    """Every loss type at both importance-sampling levels, scale_rewards cycling through its three values."""
    cases = []
    for k, (loss_type, level) in enumerate((lt, lv) for lt in LOSS_TYPES for lv in ("token", "sequence")):
        config = dict(loss_type=loss_type, importance_sampling_level=level, scale_rewards=SCALE_REWARDS[k % 3])
        if loss_type == "cispo":
            config["epsilon_high"] = CISPO_EPSILON_HIGH
        cases.append(Case(f"{loss_type}_{level}", config, num_generations=3 if loss_type in ("dr_grpo", "sapo") else 4))
    return cases


def extra_cases() -> list[Case]:
    is_bounds = dict(vllm_importance_sampling_clip_min=0.6, vllm_importance_sampling_clip_max=1.8)
    return [
        Case("cispo_default_epsilon_high", dict(loss_type="cispo"),
             note="epsilon_high unset: CISPO clamps every ratio at epsilon = 0.2"),
        Case("zero_std_group", dict(loss_type="grpo"), rewards=REWARDS_ZERO_STD_GROUP,
             note="group 1's weighted rewards are all 1.0: zero std, advantages 0"),
        Case("normalize_then_sum", dict(loss_type="grpo", multi_objective_aggregation="normalize_then_sum")),
        Case("beta_kl", dict(loss_type="grpo", beta=0.04)),
        Case("beta_kl_no_bias_correction_sequence",
             dict(loss_type="bnpo", beta=0.04, use_bias_correction_kl=False, importance_sampling_level="sequence")),
        Case("epsilon_high", dict(loss_type="dapo", epsilon_high=0.28)),
        Case("delta", dict(loss_type="grpo", delta=1.5)),
        Case("mask_truncated_completions", dict(loss_type="dapo", mask_truncated_completions=True)),
        Case("top_entropy_quantile", dict(loss_type="grpo", top_entropy_quantile=0.5)),
        Case("temperature", dict(loss_type="grpo", temperature=0.7, beta=0.04),
             note="the old/ref perturbations are relative to the temperature-0.7 log-probs, so the loss is close to "
             "beta_kl's; log-probs, entropies and gradients are not"),
        Case("num_iterations_2", dict(loss_type="grpo", num_iterations=2),
             note="TRL computes old_per_token_logps (= the current policy's); they are replaced by fixed ones, as "
             "after one update"),
        Case("off_policy_mask", dict(loss_type="grpo", off_policy_mask_threshold=0.1)),
        Case("entropy_bonus", dict(loss_type="dapo", entropy_coef=0.01)),
        Case("grad_accum_grpo", dict(loss_type="grpo", gradient_accumulation_steps=2, per_device_train_batch_size=3),
             num_generations=3),
        Case("grad_accum_dapo", dict(loss_type="dapo", gradient_accumulation_steps=2, per_device_train_batch_size=4)),
        Case("is_token_truncate", dict(loss_type="grpo", vllm_importance_sampling_mode="token_truncate", **is_bounds),
             vllm_is=True),
        Case("is_token_mask", dict(loss_type="dapo", vllm_importance_sampling_mode="token_mask", **is_bounds),
             vllm_is=True),
        Case("is_sequence_truncate",
             dict(loss_type="bnpo", vllm_importance_sampling_mode="sequence_truncate", **is_bounds), vllm_is=True),
        Case("is_sequence_mask", dict(loss_type="grpo", importance_sampling_level="sequence"), vllm_is=True,
             note="TRL's defaults: mode sequence_mask, clip_max 3.0, no clip_min"),
        Case("is_token_truncate_vespo",
             dict(loss_type="vespo", vllm_importance_sampling_mode="token_truncate", **is_bounds), vllm_is=True,
             note="VESPO folds the IS ratio into its sequence weight instead of multiplying the loss by it"),
    ]


# Configurations TRL refuses (raises); tried with use_vllm=True at construction, where TRL checks them.
REFUSED = [
    ("vespo_is_sequence_mask", dict(loss_type="vespo", use_vllm=True, vllm_importance_sampling_mode="sequence_mask")),
    ("vespo_is_sequence_truncate",
     dict(loss_type="vespo", use_vllm=True, vllm_importance_sampling_mode="sequence_truncate")),
]


# ---- TRL plumbing ---------------------------------------------------------------------------------------------
class WarningLog(logging.Handler):
    """Collects the warnings TRL's GRPO trainer logs while a case is built and run."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


TRL_LOGGER = logging.getLogger("trl.trainer.grpo_trainer")


def load_model(model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")


def build_trainer(
    output_dir: str, num_generations: int, config: dict, model_dir: Path = MODEL_DIR, model=None
) -> GRPOTrainer:
    """A trainer of the model in `model_dir` (its tokenizer too), or of `model` in its place when given (a PEFT
    model over it)."""
    config = {**BASE_CONFIG, **config}
    config.setdefault("per_device_train_batch_size", len(PROMPTS) * num_generations)
    args = GRPOConfig(
        output_dir=output_dir, use_cpu=True, report_to="none", num_generations=num_generations, **config
    )
    if model is None:
        model = load_model(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    dataset = Dataset.from_dict({"prompt": [tokenizer.decode(p) for p in PROMPTS]})
    return GRPOTrainer(
        model=model, reward_funcs=REWARD_FUNCS, args=args, train_dataset=dataset, processing_class=tokenizer
    )


def unpadded_logps(trainer: GRPOTrainer, prompt: list[int], completion: list[int]) -> list[float]:
    """TRL's forward (temperature included) on one unpadded prompt ++ completion row."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, torch.ones_like(ids), len(completion)
        )
    return logps[0].tolist()


def spy(trainer: GRPOTrainer, method: str, calls: list) -> None:
    """Wraps a trainer method so that each call's output is appended to `calls` (and still returned)."""
    original = getattr(trainer, method)

    def wrapper(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append(out)
        return out

    setattr(trainer, method, wrapper)


def pop_metrics(trainer: GRPOTrainer) -> dict:
    """The metrics TRL logged since the last call (one value each), then clears them."""
    metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    for name, values in trainer._metrics["train"].items():
        assert len(values) == 1, (name, values)
    trainer._metrics["train"].clear()
    return metrics


def rows(tensor: torch.Tensor, lengths: list[int]) -> list[list[float]]:
    """Unpads a right-padded (B, T) tensor into one list per completion."""
    return [tensor[i, :n].tolist() for i, n in enumerate(lengths)]


def padded(values: list[list[float]]) -> torch.Tensor:
    return pad([torch.tensor(v) for v in values], padding_value=0.0, padding_side="right")


def check_margin(what: str, values: torch.Tensor, thresholds: list[float]) -> None:
    for threshold in thresholds:
        gap = (values - threshold).abs().min().item() if values.numel() else math.inf
        assert gap > MARGIN, f"{what}: a value lies {gap:.2e} from the threshold {threshold}"


def grad_record(param: torch.Tensor) -> dict:
    g = param.grad.detach().flatten()
    return {
        "shape": list(param.shape),
        "l2_norm": g.norm().item(),
        "sum": g.sum().item(),
        "head": g[:GRAD_HEAD].tolist(), "sample": grad_sample(g),
    }


# ---- one case -------------------------------------------------------------------------------------------------
def run_case(case: Case, output_dir: str) -> dict:
    warnings = WarningLog()
    TRL_LOGGER.addHandler(warnings)
    try:
        trainer = build_trainer(output_dir, case.num_generations, case.config)
        return run_built_case(trainer, case, warnings)
    finally:
        TRL_LOGGER.removeHandler(warnings)


def run_built_case(
    trainer: GRPOTrainer, case: Case, warnings: WarningLog, grad_params: list[str] = GRAD_PARAMS
) -> dict:
    args = trainer.args
    G = case.num_generations
    group_of = [g for g in range(len(PROMPTS)) for _ in range(G)]
    prompt_ids = [PROMPTS[g] for g in group_of]
    completion_ids = [c for group in COMPLETIONS for c in group[:G]]
    rewards = [r for g in range(len(PROMPTS)) for r in case.rewards[4 * g : 4 * g + G]]
    lengths = [len(c) for c in completion_ids]
    B = len(completion_ids)

    # Training mode (the model loads in eval mode): TRL's metrics, normalizers and batch sizes depend on it.
    trainer.model.train()
    # Set by Trainer's training loop to the number of micro-batches in the optimizer step.
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    if case.vllm_is:
        trainer.use_vllm = True

    base = [unpadded_logps(trainer, p, c) for p, c in zip(prompt_ids, completion_ids)]
    sampling = [[l - sigma(i, t) for t, l in enumerate(row)] for i, row in enumerate(base)] if case.vllm_is else None

    # The stubs: TRL's `_generate` runs for real around them.
    trainer._tokenize_prompts = lambda prompts: ([list(p) for p in prompt_ids], None, {})
    # TRL's transformers generation returns no sampling log-probs; vLLM does.
    trainer._generate_single_turn = lambda *a, **k: ([list(c) for c in completion_ids], sampling)
    trainer._calculate_rewards = lambda *a, **k: torch.tensor(rewards, dtype=torch.float32)

    inputs = [{"prompt": trainer.processing_class.decode(p)} for p in prompt_ids]
    batch = trainer._generate_and_score_completions(inputs)
    generation_metrics = pop_metrics(trainer)
    mask = batch["completion_mask"]

    # Fixed old (and reference) log-probs: TRL computes both with the same masked forward, so they are 0 wherever
    # completion_mask is 0 (padding, and truncated completions under mask_truncated_completions).
    if case.vllm_is:
        old = rows(batch["old_per_token_logps"], lengths)  # TRL's: the policy at sampling time
    else:
        old = [[l - delta(i, t) for t, l in enumerate(row)] for i, row in enumerate(base)]
        batch["old_per_token_logps"] = padded(old) * mask
        old = rows(batch["old_per_token_logps"], lengths)
    ref = None
    if args.beta != 0.0:
        ref = [[l + kappa(i, t) for t, l in enumerate(row)] for i, row in enumerate(base)]
        batch["ref_per_token_logps"] = padded(ref) * mask
        ref = rows(batch["ref_per_token_logps"], lengths)

    # Micro-batches as `_prepare_inputs` makes them: the generation batch, shuffled, split in steps_per_generation.
    # A fixed permutation mixing the groups replaces the random shuffle.
    order = list(range(B))
    if args.steps_per_generation > 1:
        order = order[0::2] + order[1::2]
    perm = torch.tensor(order)
    shuffled = {k: (v[perm] if isinstance(v, torch.Tensor) and v.ndim > 0 else v) for k, v in batch.items()}
    micro_batches = split_tensor_dict(shuffled, args.steps_per_generation)
    size = B // args.steps_per_generation
    members = [order[m * size : (m + 1) * size] for m in range(args.steps_per_generation)]

    forwards, entropy_masks, gamma_weights, off_policy_masks = [], [], [], []
    spy(trainer, "_get_per_token_logps_and_entropies", forwards)
    spy(trainer, "get_high_entropy_mask", entropy_masks)
    spy(trainer, "get_gamma_weights", gamma_weights)
    spy(trainer, "get_off_policy_mask", off_policy_masks)

    # What `_compute_loss` computed, per completion (in completion order, whichever micro-batch it was in).
    from_loss = {key: [None] * B for key in ("logps", "entropies", "entropy_mask", "phi_seq", "off_policy_mask")}
    micro_records = []
    trainer.model.zero_grad(set_to_none=True)
    for micro, idx in zip(micro_batches, members):
        n_before = len(forwards)
        loss = trainer._compute_loss(trainer.model, micro)
        loss.backward()
        assert len(forwards) == n_before + 1
        logps, entropies, _ = forwards[-1]
        micro_lengths = [lengths[i] for i in idx]
        outputs = {"logps": rows(logps.detach(), micro_lengths), "entropies": rows(entropies.detach(), micro_lengths)}
        if args.top_entropy_quantile < 1.0:
            outputs["entropy_mask"] = rows(entropy_masks[-1].int(), micro_lengths)
        if args.loss_type == "vespo":  # (B, 1): one weight per sequence
            outputs["phi_seq"] = gamma_weights[-1][:, 0].tolist()
        if args.off_policy_mask_threshold is not None:  # (B, 1)
            outputs["off_policy_mask"] = off_policy_masks[-1][:, 0].tolist()
        for key, values in outputs.items():
            for i, v in zip(idx, values):
                from_loss[key][i] = v
        micro_records.append({"completions": idx, "loss": loss.item(), "metrics": pop_metrics(trainer)})

        check_ratios(trainer, micro, logps.detach(), entropies.detach())

    params = dict(trainer.model.named_parameters())
    gradients = {name: grad_record(params[name]) for name in grad_params}

    # The IS ratio TRL computed: (B, T) in the token modes, (B, 1) in the sequence modes.
    is_ratio = None
    if case.vllm_is:
        is_ratio = batch["importance_sampling_ratio"]
        is_ratio = is_ratio[:, 0].tolist() if is_ratio.shape[1] == 1 else rows(is_ratio, lengths)

    completions = []
    for i in range(B):
        record = {
            "group": group_of[i],
            "prompt_ids": prompt_ids[i],
            "completion_ids": completion_ids[i],
            "truncated": completion_ids[i][-1] not in [*trainer.eos_token_ids, trainer._tokenizer.pad_token_id],
            "completion_mask": batch["completion_mask"][i, : lengths[i]].tolist(),
            "advantage": batch["advantages"][i].item(),
            "old_logps": old[i],
        }
        if ref is not None:
            record["ref_logps"] = ref[i]
        if case.vllm_is:
            record["sampling_logps"] = sampling[i]
            record["importance_sampling_ratio"] = is_ratio[i]
        record["logps"] = from_loss["logps"][i]
        record["entropies"] = from_loss["entropies"][i]
        for key in ("entropy_mask", "phi_seq", "off_policy_mask"):
            if from_loss[key][i] is not None:
                record[key] = from_loss[key][i]
        completions.append(record)

    # Sanity: the batched, left-padded forward (TRL's positions are arange over the padded row; RoPE is relative)
    # gives the log-probs of the unpadded rows the Rust side computes.
    drift = max(
        abs(a - b)
        for record, row in zip(completions, base)
        for a, b, m in zip(record["logps"], row, record["completion_mask"])
        if m
    )
    assert drift < 1e-4, f"padded vs unpadded log-probs differ by {drift}"

    return {
        "name": case.name,
        "note": case.note,
        "config": effective_config(trainer, case),
        "trl_warnings": warnings.messages,
        "reward_func_names": list(trainer.reward_func_names),
        "reward_weights": trainer.reward_weights.tolist(),
        "rewards_per_func": rewards,
        "num_items_in_batch": batch["num_items_in_batch"].item(),
        "generation_metrics": generation_metrics,
        "completions": completions,
        "micro_batches": micro_records,
        "gradients": gradients,
    }


def check_ratios(trainer: GRPOTrainer, micro: dict, logps: torch.Tensor, entropies: torch.Tensor) -> None:
    """Fails when a ratio, IS ratio, sequence KL or entropy sits within MARGIN of a threshold TRL compares it with."""
    args = trainer.args
    mask = micro["completion_mask"].bool()
    log_ratio = logps - micro["old_per_token_logps"]
    if args.importance_sampling_level == "sequence":
        ratio = torch.exp((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))
    else:
        ratio = torch.exp(log_ratio)[mask]
    if args.loss_type == "cispo":
        check_margin("cispo ratio", ratio, [trainer.epsilon_high])
    elif args.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        bounds = [1 - trainer.epsilon_low, 1 + trainer.epsilon_high] + ([args.delta] if args.delta else [])
        check_margin("ratio", ratio, bounds)
    if trainer.use_vllm:
        diff = ((micro["old_per_token_logps"] - micro["sampling_per_token_logps"]) * mask).nan_to_num(0.0)
        if args.vllm_importance_sampling_mode.startswith("sequence"):
            raw = torch.exp(diff.sum(-1))
        else:
            raw = torch.exp(diff)[mask]
        bounds = [b for b in (args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max) if b]
        check_margin("importance sampling ratio", raw, bounds)
    if args.off_policy_mask_threshold is not None:
        kl = ((micro["old_per_token_logps"] - logps) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        check_margin("off-policy sequence KL", kl, [args.off_policy_mask_threshold])
    if args.top_entropy_quantile < 1.0:
        values = entropies[mask]
        threshold = torch.quantile(values, 1 - args.top_entropy_quantile).item()
        others = values[values != threshold]  # an entropy equal to the threshold compares equal in Rust too
        check_margin("entropy", others, [threshold])


CONFIG_KEYS = [
    "bf16", "loss_type", "importance_sampling_level", "scale_rewards", "multi_objective_aggregation", "reward_weights",
    "num_generations", "max_completion_length", "per_device_train_batch_size", "gradient_accumulation_steps",
    "steps_per_generation", "generation_batch_size", "num_iterations", "temperature", "beta",
    "use_bias_correction_kl", "epsilon", "epsilon_high", "delta", "sapo_temperature_pos", "sapo_temperature_neg",
    "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "mask_truncated_completions",
    "top_entropy_quantile", "off_policy_mask_threshold", "entropy_coef", "use_vllm",
    "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_clip_max",
]


def effective_config(trainer: GRPOTrainer, case: Case) -> dict:
    """The GRPOConfig values (TRL names) after __post_init__, plus what the trainer derived or was forced to."""
    config = {key: getattr(trainer.args, key) for key in CONFIG_KEYS}
    config["use_vllm"] = trainer.use_vllm  # forced on for the IS cases
    config["epsilon_high_effective"] = trainer.epsilon_high  # epsilon when epsilon_high is None
    config["eos_token_ids"] = list(trainer.eos_token_ids)
    config["pad_token_id"] = trainer._tokenizer.pad_token_id
    config["set"] = sorted(case.config)  # the keys this case sets explicitly
    return config


def refused_cases(output_dir: str) -> list[dict]:
    refused = []
    for name, config in REFUSED:
        try:
            build_trainer(output_dir, 4, config)
        except ValueError as err:
            refused.append({"name": name, "config": config, "error": str(err)})
        else:
            raise AssertionError(f"TRL accepted {name}")
    return refused


# ---- output ---------------------------------------------------------------------------------------------------
def nan_to_null(value):
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: nan_to_null(v) for k, v in value.items()}
    if isinstance(value, list):
        return [nan_to_null(v) for v in value]
    return value


def write(doc: dict, out: Path = OUT) -> None:
    """JSON with one case per line (compact), the rest indented."""
    cases = doc.pop("cases")
    head = json.dumps(nan_to_null(doc), indent=1, allow_nan=False)
    lines = [json.dumps(nan_to_null(c), separators=(",", ":"), allow_nan=False) for c in cases]
    text = head[:-2] + ',\n "cases": [\n' + ",\n".join(lines) + "\n ]\n}\n"
    json.loads(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)


def main() -> None:
    cases = core_cases() + extra_cases()
    with tempfile.TemporaryDirectory() as output_dir:
        records = []
        for case in cases:
            record = run_case(case, output_dir)
            records.append(record)
            print(f"{case.name:40s} loss {[m['loss'] for m in record['micro_batches']]}")
        refused = refused_cases(output_dir)
    versions = {"python": platform.python_version()}
    versions.update({pkg: md.version(pkg) for pkg in ("torch", "transformers", "trl")})
    write({
        "versions": versions,
        "model": str(MODEL_DIR.relative_to(ROOT)),
        "gradient_params": GRAD_PARAMS,
        "gradient_head": GRAD_HEAD,
        "refused": refused,
        "cases": records,
    })
    print(f"wrote {OUT.relative_to(ROOT)} ({OUT.stat().st_size} bytes, {len(records)} cases, {len(refused)} refused)")


if __name__ == "__main__":
    main()
