#!/usr/bin/env python3
"""SFT parity fixtures for `holo sft` (holo-runtime/holo-train/src/sft/), every number computed by TRL's own code.

Regenerate (from the repository root, offline; needs the Python peers' venv, `bash ../shared/peers/setup.sh`):

    ~/.cache/holo-peers/venv/bin/python scripts/sft_fixtures.py

It writes `holo-runtime/tests/fixtures/sft/cases.json` and nothing else; `holo-runtime/tests/sft_parity.rs` compares.

For each case the script builds a real `trl.SFTTrainer` (CPU, f32, eager attention, `bf16=False`) on the committed
tiny model `holo-runtime/tests/fixtures/models/qwen2` with the case's rows (`datasets.Dataset.from_list`), then:

1. Tokenization: TRL's `_prepare_dataset` (the trainer's `train_dataset`): each example's `input_ids` and `labels`
   are recorded. For `assistant_only_loss` the tokenizer's chat template is replaced by `CHAT_TEMPLATE` (the model's
   ChatML with a `{% generation %}` block around each assistant turn, `<|im_end|>` included), which TRL then uses
   as it is (it only swaps in its own training template when the model's has no such block).
2. Loss: the examples, in file order, are split into micro-batches of `per_device_train_batch_size`, each padded
   by TRL's collator (`trainer.data_collator`); `num_items_in_batch` is transformers' count over all of the step's
   micro-batches (`labels[..., 1:] != -100`); each micro-batch goes through `trainer.compute_loss(model, batch,
   num_items_in_batch=...)` and `loss.backward()`, gradients accumulating, as `Trainer.training_step` does (the loss
   is not divided by the accumulation steps again: SFTTrainer's model takes loss kwargs). The losses, TRL's logged
   `entropy` and `mean_token_accuracy` of each micro-batch (the `tokens_greedy` case's rows are pre-tokenized and
   partly the model's own greedy choices, so that its accuracy is neither 0 nor 1), and the accumulated gradients of `GRAD_PARAMS`
   (shape, L2 norm, sum, first `GRAD_HEAD` entries) are recorded.

The output is deterministic (no random draw: the model is in train mode, but its dropout is 0).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import importlib.metadata as md
import json
import platform
import tempfile
from pathlib import Path

import datasets
import torch
from fixture_gradients import grad_sample
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "holo-runtime" / "tests" / "fixtures" / "models" / "qwen2"
OUT = ROOT / "holo-runtime" / "tests" / "fixtures" / "sft" / "cases.json"

GRAD_PARAMS = [
    "model.embed_tokens.weight",  # tied with lm_head: gets both the input-embedding and the LM-head gradient
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.q_proj.bias",
    "model.layers.1.mlp.down_proj.weight",
    "model.norm.weight",
]
GRAD_HEAD = 64

# The tiny model's ChatML, with the assistant's turns (their end of turn included) in generation blocks.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- message['content'] + '<|im_end|>' + '\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


MESSAGES = [
    {"messages": [{"role": "system", "content": "Answer briefly."}, user("What is 12+7?"), assistant("<answer>19</answer>")]},
    {"messages": [user("Name a colour."), assistant("Blue."), user("Another?"), assistant("Green, or red.")]},
    {"messages": [user("Add 3 and 4"), assistant("7")]},
    {"messages": [user("Say hello in French"), assistant("Bonjour !"), user("And in German?"), assistant("Hallo.")]},
]

PROMPT_COMPLETION = [
    {"prompt": [user("What is 47+8?")], "completion": [assistant("<answer>55</answer>")]},
    {"prompt": [{"role": "system", "content": "Be terse."}, user("Spell cat")], "completion": [assistant("c-a-t")]},
    {"prompt": [user("Capital of France?")], "completion": [assistant("Paris, on the Seine.")]},
    {"prompt": [user("2*3?")], "completion": [assistant("6")]},
]

CASES = [
    # name, rows (None: greedy_rows()), SFTConfig keywords, marked chat template
    ("messages_assistant_only", MESSAGES, {"assistant_only_loss": True, "per_device_train_batch_size": 4}, True),
    ("prompt_completion_only", PROMPT_COMPLETION, {"per_device_train_batch_size": 4}, False),
    ("prompt_completion_full", PROMPT_COMPLETION, {"completion_only_loss": False, "per_device_train_batch_size": 4}, False),
    (
        "prompt_completion_grad_accum",
        PROMPT_COMPLETION,
        {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2},
        False,
    ),
    ("messages_dft", MESSAGES, {"loss_type": "dft", "per_device_train_batch_size": 4}, False),
    ("tokens_greedy", None, {"per_device_train_batch_size": 2}, False),
]


def greedy_rows() -> list:
    """Pre-tokenized rows (`input_ids` + `assistant_masks`, as `holo export-data --tokens` writes them) whose
    trained tokens are partly the model's own greedy choices, so that `mean_token_accuracy` is neither 0 nor 1."""
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32, attn_implementation="eager")
    rows = []
    for question, tail in [("What is 1+1?", "<answer>2</answer>"), ("Name a fruit.", "Apple.")]:
        prompt = tokenizer.apply_chat_template([user(question)], add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False)
        greedy = out[0, len(prompt) :].tolist()
        rest = tokenizer(tail + "<|im_end|>", add_special_tokens=False)["input_ids"]
        ids = prompt + greedy + rest
        rows.append({"input_ids": ids, "assistant_masks": [0] * len(prompt) + [1] * (len(greedy) + len(rest))})
    return rows


def grad_record(param: torch.Tensor) -> dict:
    g = param.grad.detach().flatten()
    return {"shape": list(param.shape), "l2_norm": g.norm().item(), "sum": g.sum().item(), "head": g[:GRAD_HEAD].tolist(), "sample": grad_sample(g)}


def run_case(name, rows, settings, marked, output_dir) -> dict:
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    if marked:
        tokenizer.chat_template = CHAT_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32, attn_implementation="eager")
    args = SFTConfig(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        dataset_num_proc=None,
        **settings,
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    prepared = [{"input_ids": ex["input_ids"], "labels": ex["labels"]} for ex in trainer.train_dataset]
    assert len(prepared) == len(rows), "TRL dropped an example"
    size = args.per_device_train_batch_size
    batches = [trainer.data_collator(prepared[i : i + size]) for i in range(0, len(prepared), size)]
    num_items = sum(int((batch["labels"][..., 1:] != -100).sum()) for batch in batches)
    model = trainer.model
    model.train()
    model.zero_grad()
    micro = []
    for index, batch in enumerate(batches):
        trainer._metrics["train"].clear()
        loss = trainer.compute_loss(model, batch, num_items_in_batch=torch.tensor(num_items))
        loss.backward()
        metrics = {key: values[-1] for key, values in trainer._metrics["train"].items() if key != "num_tokens"}
        micro.append(
            {"examples": list(range(index * size, min((index + 1) * size, len(prepared)))), "loss": loss.item(), "metrics": metrics}
        )
    params = dict(model.named_parameters())
    return {
        "name": name,
        "config": {
            "assistant_only_loss": args.assistant_only_loss,
            "completion_only_loss": trainer.completion_only_loss,
            "loss_type": args.loss_type,
            "per_device_train_batch_size": size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "max_length": args.max_length,
        },
        "chat_template": CHAT_TEMPLATE if marked else None,
        "rows": rows,
        "prepared": prepared,
        "num_items_in_batch": num_items,
        "micro_batches": micro,
        "gradients": {name: grad_record(params[name]) for name in GRAD_PARAMS},
    }


def main() -> None:
    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory() as output_dir:
        records = [
            run_case(name, greedy_rows() if rows is None else rows, settings, marked, output_dir)
            for name, rows, settings, marked in CASES
        ]
    for record in records:
        print(f"{record['name']:32s} loss {[m['loss'] for m in record['micro_batches']]}")
    versions = {"python": platform.python_version()}
    versions.update({pkg: md.version(pkg) for pkg in ("torch", "transformers", "trl")})
    doc = {
        "versions": versions,
        "model": str(MODEL_DIR.relative_to(ROOT)),
        "gradient_params": GRAD_PARAMS,
        "gradient_head": GRAD_HEAD,
    }
    head = json.dumps(doc, indent=1)
    lines = [json.dumps(r, separators=(",", ":"), ensure_ascii=False) for r in records]
    text = head[:-2] + ',\n "cases": [\n' + ",\n".join(lines) + "\n ]\n}\n"
    json.loads(text)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)} ({OUT.stat().st_size} bytes, {len(records)} cases)")


if __name__ == "__main__":
    main()
