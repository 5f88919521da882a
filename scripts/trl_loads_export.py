#!/usr/bin/env python3
"""Checks that files written by `holo export-data` train in TRL unchanged.

    ~/.cache/holo-peers/venv/bin/python scripts/trl_loads_export.py --model DIR [--sft FILE]... [--dpo FILE]...

(offline, on the CPU; `holo-runtime/tests/cli/export_data_cli.rs` runs it on files exported from fresh rollouts of the
tiny Qwen2 at `holo-runtime/tests/fixtures/models/qwen2`). Each file is loaded with `datasets.load_dataset("json")`
as it is, given to `SFTTrainer` (`--sft`) or `DPOTrainer` (`--dpo`) with the model folder, and trained one
optimizer step (`max_steps=1`, `report_to="none"`, output in a temporary folder). The step's loss must be finite.

For an SFT file with `input_ids` (`--tokens`), TRL must have kept the ids as written and built its labels from
`assistant_masks`: -100 exactly where the mask is 0. TRL 1.16's DPOTrainer always tokenizes the
messages itself; for a DPO file with `prompt_ids` (`--tokens`), TRL's collator batches holo's recorded ids and
TRL's DPO loss on that batch must be finite (`holo_ids_loss`). `examples_tokenized_as_trl_does` counts the
pairs whose ids TRL's own tokenization reproduces (a model may sample a token sequence the tokenizer would not
produce, so this is reported, not required).

Prints one JSON line per file (`file`, `trainer`, `loss`, `rows`, `errors`). Exit status: 0 when every file
trained and passed its checks, 1 when one did not, 2 on bad arguments, 3 when torch, transformers, datasets or
trl cannot be imported (a caller may treat that as a skip).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")

try:
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer
except ImportError as error:  # the test checked these imports first; this names the one that failed
    print(f"cannot import: {error}", file=sys.stderr)
    sys.exit(3)


def common_args(output_dir: str) -> dict:
    """One optimizer step of two examples on the CPU, nothing saved or reported."""
    return dict(
        output_dir=output_dir,
        max_steps=1,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        learning_rate=1e-4,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=0,
        dataset_num_proc=None,
        disable_tqdm=True,
    )


def trained_loss(trainer) -> float:
    result = trainer.train()
    return float(result.training_loss)


def check_sft(path: str, model_dir: str) -> dict:
    errors = []
    raw = load_dataset("json", data_files=path, split="train")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as out:
        trainer = SFTTrainer(
            model=model,
            args=SFTConfig(**common_args(out)),
            train_dataset=raw,
            processing_class=tokenizer,
        )
        prepared = trainer.train_dataset
        if "input_ids" in raw.column_names:
            # TRL drops rows it cannot train on; then the zip below would compare the wrong rows.
            if len(prepared) != len(raw):
                errors.append(f"TRL kept {len(prepared)} of {len(raw)} examples")
            for index, (written, seen) in enumerate(zip(raw, prepared)):
                if seen["input_ids"] != written["input_ids"]:
                    errors.append(f"example {index}: TRL changed input_ids")
                expected = [
                    token if bit else -100 for token, bit in zip(written["input_ids"], written["assistant_masks"])
                ]
                if seen["labels"] != expected:
                    errors.append(f"example {index}: labels are not input_ids masked by assistant_masks")
        loss = trained_loss(trainer)
    if not math.isfinite(loss):
        errors.append(f"loss {loss} is not finite")
    return {"file": path, "trainer": "SFTTrainer", "loss": loss, "rows": len(raw), "errors": errors}


def check_dpo(path: str, model_dir: str) -> dict:
    errors = []
    extra = {}
    raw = load_dataset("json", data_files=path, split="train")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as out:
        trainer = DPOTrainer(
            model=model,
            args=DPOConfig(**common_args(out), max_length=None),
            train_dataset=raw,
            processing_class=tokenizer,
        )
        if "prompt_ids" in raw.column_names:
            # TRL 1.16's DPOTrainer always tokenizes the messages itself, so holo's ids reach it only
            # through its collator: TRL's DPO loss on a batch of them must be finite.
            columns = ("prompt_ids", "chosen_ids", "rejected_ids")
            batch = trainer.data_collator([{column: example[column] for column in columns} for example in raw])
            with torch.no_grad():
                holo_ids_loss = float(trainer.compute_loss(trainer.model, batch))
            if not math.isfinite(holo_ids_loss):
                errors.append(f"DPO loss on holo's token ids {holo_ids_loss} is not finite")
            same = [all(seen[c] == written[c] for c in columns) for written, seen in zip(raw, trainer.train_dataset)]
            extra["holo_ids_loss"] = holo_ids_loss
            extra["examples_tokenized_as_trl_does"] = sum(same)
        loss = trained_loss(trainer)
    if not math.isfinite(loss):
        errors.append(f"loss {loss} is not finite")
    return {"file": path, "trainer": "DPOTrainer", "loss": loss, "rows": len(raw), **extra, "errors": errors}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model folder with a chat template")
    parser.add_argument("--sft", action="append", default=[], help="an SFT file of `holo export-data`")
    parser.add_argument("--dpo", action="append", default=[], help="a DPO file of `holo export-data`")
    args = parser.parse_args()
    if not args.sft and not args.dpo:
        parser.error("give at least one --sft or --dpo file")
    torch.manual_seed(0)
    ok = True
    checks = [(check_sft, path) for path in args.sft] + [(check_dpo, path) for path in args.dpo]
    for check, path in checks:
        try:
            result = check(path, args.model)
        except Exception as error:  # one file's failure is reported, the others still run
            result = {"file": path, "errors": [f"{type(error).__name__}: {error}"]}
        ok = ok and not result["errors"]
        print(json.dumps(result), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
