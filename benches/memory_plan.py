#!/usr/bin/env python3
"""The memory plan of `holo train` against measured peaks: a grid of GRPO runs on random models, each run's
predicted peak (RUN/memory_plan.json, written before the weights are loaded) beside its peak RSS
(`/usr/bin/time -v`'s maximum resident set size), and the error.

Usage: benches/memory_plan.py [--holo PATH] [--work DIR] [--only NAME,...] [--held-out] [--big]

- models: random folders from `holo init-model` (qwen2, qwen3, qwen3_5_text and qwen3_5_moe_text `tiny`,
  llama `small`: SmolLM2-135M's decoder), at the offline tokenizer's 512 ids or padded to a real vocabulary (`--vocab`); `--big` adds
  Qwen2.5-0.5B's shapes with its 151,936-token vocabulary (494M parameters, several minutes a run) and
  Qwen3.5-0.8B's decoder (`qwen3_5_text` `small`, 24 layers of 1,024, 512 ids);
- runs: `benches/arith.hol` on arithmetic rows, 2 optimizer steps (the second holds AdamW's state through
  generation and training, the steady state the plan predicts), no checkpoint, f32 on the CPU (bf16
  training is CUDA's), full fine-tuning or LoRA, micro-batches of 4 to 16 completions of 32 to 128
  tokens, recomputation on and off, a reference model (`--beta`), gradient accumulation, LoRA on the output
  head (`lm_head`);
- `--held-out` adds three runs outside that grid, which the terms were not adjusted to: SmolLM2-135M's
  decoder at 32,000 tokens, micro-batches of 12 and 16, completions of 96 tokens;
- the plan counts every completion at `max_completion_length`; a random model sometimes ends a completion
  early, so the table shows the mean length sampled.

The error is (predicted − measured) / measured; the target is within ±10% on every row.
"""

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOL = os.path.join(ROOT, "benches", "arith.hol")

MODELS = {
    "qwen2-tiny": ("qwen2", "tiny", None),
    "qwen2-tiny-152k": ("qwen2", "tiny", 151936),
    "qwen3-tiny-32k": ("qwen3", "tiny", 32000),
    "llama-135m": ("llama", "small", None),
    "llama-135m-49k": ("llama", "small", 49152),
    "llama-135m-32k": ("llama", "small", 32000),
    "qwen2-0.5b-152k": ("qwen2", "small", 151936),
    "qwen3_5-tiny": ("qwen3_5_text", "tiny", None),
    "qwen3_5_moe-tiny": ("qwen3_5_moe_text", "tiny", None),
    "qwen3_5-small": ("qwen3_5_text", "small", None),
}

LORA = ["--use-peft", "--lora-r", "16"]
ALL_LINEAR = ["--use-peft", "--lora-r", "8", "--lora-target-modules",
              '["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"]']
HEAD_LORA = LORA + ["--lora-target-modules", '["q_proj","v_proj","lm_head"]']
KEEP_GRAPH = ["--gradient-checkpointing", "false"]
# Qwen3.5: every projection of both layer kinds (Gated DeltaNet's and attention's), the dense MLP's or the
# shared expert's and its gate.
QWEN3_5_LORA = ["--use-peft", "--lora-r", "16", "--lora-target-modules", "all-linear"]

# (name, model, per-device batch, num_generations, max_completion_length, extra flags)
GRID = [
    ("tiny", "qwen2-tiny", 4, 4, 32, []),
    ("tiny 152k", "qwen2-tiny-152k", 4, 4, 32, []),
    ("tiny 152k B8 C128", "qwen2-tiny-152k", 8, 8, 128, []),
    ("tiny 152k B8 C128 graph", "qwen2-tiny-152k", 8, 8, 128, KEEP_GRAPH),
    ("tiny 152k B8 C128 LoRA", "qwen2-tiny-152k", 8, 8, 128, LORA),
    ("tiny 152k B8 C128 LoRA head", "qwen2-tiny-152k", 8, 8, 128, HEAD_LORA),
    ("tiny 152k beta", "qwen2-tiny-152k", 4, 4, 32, ["--beta", "0.04"]),
    ("qwen3 tiny 32k B8 C64", "qwen3-tiny-32k", 8, 8, 64, []),
    ("qwen3 tiny 32k B8 C64 LoRA", "qwen3-tiny-32k", 8, 8, 64, LORA),
    ("135m B4 C32", "llama-135m", 4, 4, 32, []),
    ("135m B8 C64", "llama-135m", 8, 8, 64, []),
    ("135m B8 C64 graph", "llama-135m", 8, 8, 64, KEEP_GRAPH),
    ("135m B8 C64 LoRA", "llama-135m", 8, 8, 64, LORA),
    ("135m B8 C64 LoRA all", "llama-135m", 8, 8, 64, ALL_LINEAR),
    ("135m B16 C64", "llama-135m", 16, 8, 64, []),
    ("135m B16 C64 graph", "llama-135m", 16, 8, 64, KEEP_GRAPH),
    ("135m B4 C32 beta", "llama-135m", 4, 4, 32, ["--beta", "0.04"]),
    ("135m B4 C32 accumulate 2", "llama-135m", 4, 4, 32, ["--gradient-accumulation-steps", "2"]),
    ("135m 49k B4 C32", "llama-135m-49k", 4, 4, 32, []),
    ("135m 49k B8 C128", "llama-135m-49k", 8, 8, 128, []),
    ("135m 49k B8 C128 LoRA", "llama-135m-49k", 8, 8, 128, LORA),
    ("135m 49k B8 C128 LoRA head", "llama-135m-49k", 8, 8, 128, HEAD_LORA),
    ("135m 49k B8 C128 graph", "llama-135m-49k", 8, 8, 128, KEEP_GRAPH),
    ("135m 49k B16 C128", "llama-135m-49k", 16, 8, 128, []),
    ("qwen3.5 tiny B8 C128", "qwen3_5-tiny", 8, 8, 128, []),
    ("qwen3.5 tiny B8 C128 graph", "qwen3_5-tiny", 8, 8, 128, KEEP_GRAPH),
    ("qwen3.5 tiny B8 C128 LoRA", "qwen3_5-tiny", 8, 8, 128, QWEN3_5_LORA),
    ("qwen3.5 tiny B8 C128 LoRA graph", "qwen3_5-tiny", 8, 8, 128, QWEN3_5_LORA + KEEP_GRAPH),
    ("qwen3.5 moe tiny B8 C128", "qwen3_5_moe-tiny", 8, 8, 128, []),
    ("qwen3.5 moe tiny B8 C128 graph", "qwen3_5_moe-tiny", 8, 8, 128, KEEP_GRAPH),
    ("qwen3.5 moe tiny B8 C128 LoRA", "qwen3_5_moe-tiny", 8, 8, 128, QWEN3_5_LORA),
    ("qwen3.5 moe tiny B8 C128 LoRA graph", "qwen3_5_moe-tiny", 8, 8, 128, QWEN3_5_LORA + KEEP_GRAPH),
]

# Runs outside the grid the plan was checked on (another vocabulary, micro-batch and length): the
# terms were not adjusted to them (`--held-out` adds them).
HELD_OUT = [
    ("135m 32k B8 C96 LoRA", "llama-135m-32k", 8, 8, 96, LORA),
    ("135m 32k B12 C96", "llama-135m-32k", 12, 12, 96, []),
    ("qwen3 tiny 32k B16 C96 LoRA head", "qwen3-tiny-32k", 16, 8, 96, HEAD_LORA),
]

BIG = [("0.5B 152k B16 C128", "qwen2-0.5b-152k", 16, 8, 128, []),
       ("qwen3.5 small B4 C32 LoRA", "qwen3_5-small", 4, 4, 32, QWEN3_5_LORA),
       ("qwen3.5 small B4 C32 LoRA graph", "qwen3_5-small", 4, 4, 32, QWEN3_5_LORA + KEEP_GRAPH),
       ("qwen3.5 small B4 C32", "qwen3_5-small", 4, 4, 32, [])]


def model_folder(holo, work, name):
    arch, preset, vocab = MODELS[name]
    folder = os.path.join(work, name)
    if not os.path.exists(os.path.join(folder, "config.json")):
        command = [holo, "init-model", "--arch", arch, "--preset", preset, folder]
        if vocab:
            command[2:2] = ["--vocab", str(vocab)]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return folder


def write_rows(path):
    rng = random.Random(0)
    with open(path, "w") as out:
        for _ in range(64):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            out.write(json.dumps({"question": f"What is {a}+{b}?", "expected": str(a + b)}) + "\n")


def train_command(holo, work, rows, row, run):
    _, model, batch, generations, completion, extra = row
    return [holo, "train", HOL, "--model", model_folder(holo, work, model), "--data", rows, "--out", run,
            "--max-steps", "2", "--num-generations", str(generations), "--per-device-train-batch-size", str(batch),
            "--max-completion-length", str(completion), "--save-strategy", "no", *extra]


def predict(holo, work, rows, row):
    """The plan alone: the run refused at once under a limit nothing fits."""
    run = os.path.join(work, "plan")
    shutil.rmtree(run, ignore_errors=True)
    command = train_command(holo, work, rows, row, run) + ["--memory-limit", "0.000001"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 2 or "memory plan:" not in done.stderr:
        sys.exit(f"{row[0]}: expected the plan's refusal:\n{done.stderr[-3000:]}")
    with open(os.path.join(run, "memory_plan.json")) as file:
        return json.load(file)


def measure(holo, work, rows, row):
    name, completion = row[0], row[4]
    run = os.path.join(work, "run")
    shutil.rmtree(run, ignore_errors=True)
    command = ["/usr/bin/time", "-v"] + train_command(holo, work, rows, row, run) + ["--memory-check", "warn"]
    started = time.time()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{name}: holo train failed:\n{done.stderr[-3000:]}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr).group(1)) * 1024
    with open(os.path.join(run, "memory_plan.json")) as file:
        plan = json.load(file)
    with open(os.path.join(run, "metrics.jsonl")) as file:
        lengths = [json.loads(line)["completions/mean_length"] for line in file if line.strip()]
    return {"name": name, "predicted": plan["peak"]["bytes"], "phase": plan["peak"]["phase"], "measured": rss,
            "mean_length": sum(lengths) / len(lengths), "completion": completion,
            "seconds": time.time() - started}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--holo", default=os.path.join(ROOT, "target", "release", "holo"))
    parser.add_argument("--work", default="/tmp/holo-memory-plan")
    parser.add_argument("--only", help="comma-separated row names")
    parser.add_argument("--big", action="store_true", help="also Qwen2.5-0.5B's shapes at its real vocabulary")
    parser.add_argument("--held-out", action="store_true", help="also the runs outside the grid")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--reuse", help="take the measured peaks of the rows of this --json file, and only plan")
    args = parser.parse_args()
    os.makedirs(args.work, exist_ok=True)
    rows = os.path.join(args.work, "rows.jsonl")
    write_rows(rows)
    grid = GRID + (HELD_OUT if args.held_out else []) + (BIG if args.big else [])
    if args.only:
        wanted = set(args.only.split(","))
        grid = [row for row in grid if row[0] in wanted]
    mib = 1 << 20
    print(f"{'run':<32}{'predicted':>11}{'measured':>11}{'error':>8}  {'phase':<11}{'length':>9}{'s':>6}", flush=True)
    results = []
    reused = {}
    if args.reuse:
        with open(args.reuse) as file:
            reused = {result["name"]: result for result in json.load(file)}
    for row in grid:
        if row[0] in reused:
            plan = predict(args.holo, args.work, rows, row)
            result = dict(reused[row[0]], predicted=plan["peak"]["bytes"], phase=plan["peak"]["phase"])
        else:
            result = measure(args.holo, args.work, rows, row)
        result["error"] = (result["predicted"] - result["measured"]) / result["measured"]
        results.append(result)
        print(f"{result['name']:<32}{result['predicted'] / mib:>9.0f}Mi{result['measured'] / mib:>9.0f}Mi"
              f"{result['error'] * 100:>7.1f}%  {result['phase']:<11}"
              f"{result['mean_length']:>5.1f}/{result['completion']:<3}{result['seconds']:>6.0f}", flush=True)
    worst = max(results, key=lambda result: abs(result["error"]))
    print(f"worst error: {worst['error'] * 100:+.1f}% ({worst['name']}); "
          f"mean |error| {sum(abs(r['error']) for r in results) / len(results) * 100:.1f}% over {len(results)} runs")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()
