#!/usr/bin/env python3
"""Checks that folders written by `holo export` load in Hugging Face transformers and PEFT and give our logits.

    ~/.cache/holo-peers/venv/bin/python scripts/export_check.py DIR BASE LOGITS.json [DIR BASE LOGITS.json ...]

(offline; `holo-runtime/tests/train/train_export.rs` runs it on fresh runs of `holo train`). Each triple is one export:

- `DIR`: the folder `holo export RUN --out DIR` wrote (`config.json`, `model.safetensors`, the base's tokenizer
  files and, for a LoRA run, `adapter/` in PEFT's layout);
- `BASE`: the base model folder the run trained;
- `LOGITS.json`: `{"sequences": [[id, ...], ...], "logits": [[[f32 x vocab] x len] x sequences]}`, the logits
  our model gives at every position of each sequence.

For each export it loads, in f32 with eager attention,

- (a) `AutoModelForCausalLM.from_pretrained(DIR)`, failing on any missing, unexpected or mismatched weight;
- (b) when `DIR/adapter/` exists, `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE),
  DIR/adapter)`, failing unless every tensor of `adapter_model.safetensors` was loaded into the adapter of the
  same name (and no adapted projection lacks its tensors); then PEFT's own `merge_and_unload()` is compared
  with `DIR/model.safetensors` weight by weight (but for an adapted head tied to the embeddings, whose update
  PEFT's merge also writes into the input embeddings: those are compared with the base's);

runs each sequence alone (no padding) and compares the logits with ours. It also loads `DIR`'s tokenizer with
`AutoTokenizer` and checks that it encodes a sample as `BASE`'s does.

Prints one JSON line per export (`ok`, the largest absolute logit differences `merged_max_abs_diff` and
`peft_max_abs_diff`, `peft_merge_weight_max_abs_diff`, and `errors`). Exit status: 0 when every export
matches, 1 when one does not, 2 on bad arguments, 3 when torch, transformers, peft or safetensors cannot be
imported (the test checks those imports before it runs this).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

EXIT_MISMATCH = 1
EXIT_USAGE = 2
EXIT_MISSING_PACKAGES = 3

SAMPLE_TEXT = "What is 3+4? <answer>7</answer>"


def float64_qwen3_5(family: str = "qwen3_5"):
    """transformers' Qwen3.5 modelling module (`family` `qwen3_5`, or `qwen3_5_moe` for the mixture) with
    every float32 cast made float64: it computes Gated DeltaNet's delta rule and decays in float32 whatever
    the model's dtype (`.float()`, `.to(torch.float32)`), which differs from the float64 result by 1e-5 to
    1e-3 on these tiny models; the mixture's router takes its softmax in `torch.float`, made float64 too.
    (Holo's float64 forward equals this one to 1e-13 on the linear-attention layers.)"""
    import importlib
    import types

    original = importlib.import_module(f"transformers.models.{family}.modeling_{family}")

    with open(original.__file__) as file:
        source = (file.read().replace("torch.float32", "torch.float64").replace(".float()", ".double()")
                  .replace("dtype=torch.float,", "dtype=torch.float64,"))
    module = types.ModuleType(original.__name__)
    # Under the original's name: transformers resolves the classes' annotations through it.
    module.__dict__.update({"__package__": original.__package__, "__file__": original.__file__})
    exec(compile(source, original.__file__, "exec"), module.__dict__)
    return module


def as_saved(state: dict, name: str):
    """The tensor of `state` that checkpoint name `name` stores, `None` if none: transformers 5 holds a
    mixture's experts fused (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) and
    saves them one module per expert (`mlp.experts.{e}.gate_proj.weight`)."""
    if name in state or ".mlp.experts." not in name:
        return state.get(name)
    layer, rest = name.split(".mlp.experts.")
    expert, projection = rest.split(".")[:2]
    if projection == "down_proj":
        fused = state.get(f"{layer}.mlp.experts.down_proj")
        return None if fused is None else fused[int(expert)]
    fused = state.get(f"{layer}.mlp.experts.gate_up_proj")
    if fused is None:
        return None
    half = fused.shape[1] // 2
    return fused[int(expert), :half] if projection == "gate_proj" else fused[int(expert), half:]


def load_causal_lm(path: str):
    from transformers import AutoConfig, AutoModelForCausalLM
    import torch

    # float64, so that the reference's own rounding does not count.
    loader, config = AutoModelForCausalLM, AutoConfig.from_pretrained(path)
    if config.model_type in ("qwen3_5_text", "qwen3_5_moe_text"):
        module = float64_qwen3_5(config.model_type.removesuffix("_text"))
        loader = getattr(module, config.architectures[0])
    # A mixture's experts by the plain loop: the grouped products take no float64.
    mixtures = ("qwen3_moe", "gpt_oss", "qwen3_5_moe_text")
    experts = {"experts_implementation": "eager"} if config.model_type in mixtures else {}
    model, info = loader.from_pretrained(
        path,
        config=config,
        dtype=torch.float64,
        attn_implementation="eager",
        output_loading_info=True,
        **experts,
    )
    model.eval()
    problems = {key: sorted(map(str, value)) for key, value in info.items() if value}
    return model, problems


def float32_drift(path: str, reference, sequences) -> float:
    """How far transformers' own float32 logits are from `reference`'s (float64) on `sequences`."""
    from transformers import AutoModelForCausalLM
    import torch

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    worst = 0.0
    with torch.no_grad():
        for ids in sequences:
            ids = torch.tensor([ids], dtype=torch.long)
            theirs, exact = model(input_ids=ids).logits[0], reference(input_ids=ids).logits[0]
            worst = max(worst, (theirs.double() - exact).abs().max().item())
    return worst


def max_logit_diff(model, sequences, expected) -> float:
    import torch

    worst = 0.0
    with torch.no_grad():
        for ids, ours in zip(sequences, expected):
            logits = model(input_ids=torch.tensor([ids], dtype=torch.long)).logits[0]
            ours = torch.tensor(ours, dtype=torch.float32)
            if ours.shape != logits.shape:
                raise ValueError(f"our logits are {list(ours.shape)}, theirs {list(logits.shape)}")
            worst = max(worst, (logits - ours.double()).abs().max().item())
    return worst


def adapter_loaded(peft_model, adapter_file: str) -> list[str]:
    """Why the adapters in `peft_model` are not exactly the tensors of `adapter_file` (empty when they are)."""
    from safetensors.torch import load_file

    saved = load_file(adapter_file)
    state = peft_model.state_dict()
    # PEFT names the adapter `default` in its modules, not in the file.
    loaded = {
        key.replace(".default.weight", ".weight"): value
        for key, value in state.items()
        if ".lora_A.default." in key or ".lora_B.default." in key
    }
    errors = []
    for key in sorted(set(saved) - set(loaded)):
        errors.append(f"the adapter file has {key}, which PEFT's model has no place for")
    for key in sorted(set(loaded) - set(saved)):
        errors.append(f"PEFT adapted {key}, which the adapter file lacks")
    for key in sorted(set(saved) & set(loaded)):
        if not (saved[key].shape == loaded[key].shape and bool((saved[key] == loaded[key]).all())):
            errors.append(f"{key} differs from the file after loading")
    if not saved:
        errors.append("the adapter file has no tensors")
    return errors


def check(export_dir: str, base_dir: str, logits_file: str, tolerance: float) -> dict:
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    with open(logits_file) as file:
        ours = json.load(file)
    sequences, expected = ours["sequences"], ours["logits"]
    if len(sequences) != len(expected) or not sequences:
        raise ValueError(f"{logits_file}: {len(sequences)} sequences but {len(expected)} logits")
    adapter_dir = os.path.join(export_dir, "adapter")
    lora = os.path.isdir(adapter_dir)
    result = {
        "export": export_dir,
        "lora": lora,
        "sequences": len(sequences),
        "tokens": sum(len(ids) for ids in sequences),
    }
    errors = []

    merged, problems = load_causal_lm(export_dir)
    if problems:
        errors.append(f"loading {export_dir}: {problems}")
    result["class"] = type(merged).__name__
    # Our logits are float32: they may differ from the float64 reference by as much as transformers' own
    # float32 run does, beyond the tolerance (Qwen3.5's delta rule is ill-conditioned in float32 on some
    # sequences; elsewhere that drift is far below the tolerance).
    drift = float32_drift(export_dir, merged, sequences)
    result["transformers_float32_drift"] = drift
    tolerance = tolerance + drift
    result["merged_max_abs_diff"] = max_logit_diff(merged, sequences, expected)
    if not result["merged_max_abs_diff"] <= tolerance:
        errors.append(f"the exported model's logits differ from ours by {result['merged_max_abs_diff']:.3g}")

    theirs = AutoTokenizer.from_pretrained(export_dir)(SAMPLE_TEXT)["input_ids"]
    base_ids = AutoTokenizer.from_pretrained(base_dir)(SAMPLE_TEXT)["input_ids"]
    if theirs != base_ids:
        errors.append(f"the exported tokenizer encodes {SAMPLE_TEXT!r} as {theirs}, the base's as {base_ids}")

    if lora:
        from peft import PeftModel

        base, problems = load_causal_lm(base_dir)
        if problems:
            errors.append(f"loading {base_dir}: {problems}")
        peft_model = PeftModel.from_pretrained(base, adapter_dir)
        peft_model.eval()
        config = peft_model.peft_config["default"]
        result["lora_r"] = config.r
        result["lora_alpha"] = config.lora_alpha
        # A list (PEFT keeps a set), or one string: a regular expression.
        modules = config.target_modules
        result["target_modules"] = modules if isinstance(modules, str) else sorted(modules)
        adapter_file = os.path.join(adapter_dir, "adapter_model.safetensors")
        errors.extend(adapter_loaded(peft_model, adapter_file))
        adapter_names = load_file(adapter_file).keys()
        result["adapter_tensors"] = len(adapter_names)
        result["peft_max_abs_diff"] = max_logit_diff(peft_model, sequences, expected)
        if not result["peft_max_abs_diff"] <= tolerance:
            errors.append(f"PEFT's logits differ from ours by {result['peft_max_abs_diff']:.3g}")

        # An adapted head tied to the embeddings: PEFT's merge writes the head's update into the one
        # shared matrix, the input embeddings included (PEFT warns of it, peft#2777); holo's export gives
        # the head a matrix of its own and keeps the embeddings, which the adapter never changed.
        tied_head = base.config.get_text_config().tie_word_embeddings and any(
            ".lm_head.lora_" in name for name in adapter_names
        )
        embeddings = base.get_input_embeddings().weight.detach().clone()
        peft_merged = peft_model.merge_and_unload().state_dict()
        exported = load_file(os.path.join(export_dir, "model.safetensors"))
        worst = 0.0
        for name, tensor in exported.items():
            merged = as_saved(peft_merged, name)
            if tied_head and name.endswith("embed_tokens.weight"):
                merged = embeddings
            if merged is None:
                errors.append(f"PEFT's merged model has no {name}")
                continue
            worst = max(worst, (merged.float() - tensor.float()).abs().max().item())
        result["peft_merge_weight_max_abs_diff"] = worst
        if not worst <= tolerance:
            errors.append(f"PEFT's merge_and_unload differs from model.safetensors by {worst:.3g}")

    result["ok"] = not errors
    result["errors"] = errors
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("triples", nargs="+", metavar="DIR BASE LOGITS", help="export folder, base folder, our logits")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="largest absolute difference allowed")
    args = parser.parse_args()
    if len(args.triples) % 3:
        parser.print_usage(sys.stderr)
        print("error: give DIR BASE LOGITS.json triples", file=sys.stderr)
        return EXIT_USAGE
    try:
        import peft  # noqa: F401
        import safetensors  # noqa: F401
        import torch
        import transformers  # noqa: F401
    except ImportError as error:
        print(f"export_check: {error}", file=sys.stderr)
        return EXIT_MISSING_PACKAGES
    torch.manual_seed(0)

    status = 0
    for i in range(0, len(args.triples), 3):
        export_dir, base_dir, logits_file = args.triples[i : i + 3]
        try:
            result = check(export_dir, base_dir, logits_file, args.tolerance)
        except Exception as error:  # a folder that does not load is a failed check, reported like the others
            result = {"export": export_dir, "ok": False, "errors": [f"{type(error).__name__}: {error}"]}
        print(json.dumps(result), flush=True)
        if not result["ok"]:
            status = EXIT_MISMATCH
    return status


if __name__ == "__main__":
    sys.exit(main())
