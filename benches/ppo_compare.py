#!/usr/bin/env python3
"""PPO updates on the CPU: `holo train --algorithm ppo` against TRL's `PPOTrainer`, side by side.

    ~/.cache/holo-peers/venv/bin/python benches/ppo_compare.py [--seeds 0,1,2] [--steps 20] [--batch 8]
        [--gradient-accumulation-steps 1] [--num-ppo-epochs 4] [--response-length 16] [--learning-rate 1e-3]
        [--kl-coef 0.05] [--temperature 0.7] [--gradient-checkpointing true] [--threads 2] [--json FILE]

TRL's `PPOTrainer` left TRL after 1.12.0 (`trl.experimental.ppo`); the peer venv has TRL 1.16. The script
installs TRL 1.12.0 without dependencies into `~/.cache/holo-peers/trl-1.12.0/site` once and runs the TRL side
with that folder first on `PYTHONPATH` (torch, transformers, accelerate and datasets are the venv's).

Both sides train the peers' tiny Qwen2 (`~/.cache/holo-peers/tiny-qwen2`) from the same arithmetic rows
(`benches/grpo_compare.py`'s, chat-templated as TRL's conversational prompt), one process each, one after the
other per seed, with the same PPO settings: rollouts per update (`per_device_train_batch_size` ×
`gradient_accumulation_steps`; one mini-batch, which both define alike), `num_ppo_epochs`, response length
(TRL's `response_length`, stopping at the end-of-turn token; holo's `max_completion_length`), temperature
(top-k and top-p off), `kl_coef` (k1), clip ranges and `vf_coef` (TRL's defaults, which holo's repeat),
learning rate (linear decay), gradient checkpointing, seed; f32, 2 threads each.

What each side computes per update: generation, the reference's and the value model's forward (TRL also runs
its reward model's: a sequence classifier, since TRL's PPO takes no reward function; holo instead runs the
policy's forward for the sampling log-probabilities, which TRL takes from generation), then
`num_ppo_epochs` × (forward and backward of policy and value model, one AdamW step over both). The rewards
differ (TRL's random-headed reward model, holo's `benches/arith.hol`), so only times and memory are compared.

Measured per run: seconds per update (TRL: between consecutive `on_step_end` callbacks, the first from
`on_train_begin`; holo: `step_time` in metrics.jsonl), the median over the updates after the first; the
process's peak RSS (GNU time). Medians over seeds. The same idle-machine rules as grpo_compare.py (`--idle-wait`,
`--max-other-load`, `--attempts`).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import textwrap

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import grpo_compare as shared  # noqa: E402  (the machine-load and build helpers)

TRL_VERSION = "1.12.0"
TRL_SITE = os.path.expanduser(f"~/.cache/holo-peers/trl-{TRL_VERSION}/site")
TINY = os.path.expanduser("~/.cache/holo-peers/tiny-qwen2")

TRL_SIDE = textwrap.dedent(
    """
    import json, sys, time
    import torch
    from datasets import Dataset
    from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                              TrainerCallback, set_seed)
    import trl
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    config = json.loads(sys.argv[1])
    torch.set_num_threads(config["threads"])
    set_seed(config["seed"])


    class UpdateTimer(TrainerCallback):
        def __init__(self):
            self.last, self.times = None, []

        def on_train_begin(self, args, state, control, **kw):
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            self.times.append(now - self.last)
            self.last = now


    with open(config["data"]) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    tokenizer = AutoTokenizer.from_pretrained(config["model"])
    tokenizer.padding_side = "left"
    dataset = Dataset.from_list([
        {"input_ids": tokenizer.apply_chat_template([{"role": "user", "content": row["question"]}],
                                                   add_generation_prompt=True, tokenize=True, return_dict=False)}
        for row in rows
    ])
    load = lambda: AutoModelForCausalLM.from_pretrained(config["model"], dtype=torch.float32)
    classifier = lambda: AutoModelForSequenceClassification.from_pretrained(
        config["model"], num_labels=1, dtype=torch.float32)
    batch = config["batch"] * config["gradient_accumulation_steps"]
    args = PPOConfig(
        output_dir=config["out"], per_device_train_batch_size=config["batch"],
        gradient_accumulation_steps=config["gradient_accumulation_steps"], num_mini_batches=1,
        num_ppo_epochs=config["num_ppo_epochs"], total_episodes=config["steps"] * batch,
        response_length=config["response_length"], stop_token="eos", temperature=config["temperature"],
        kl_coef=config["kl_coef"], learning_rate=config["learning_rate"], lr_scheduler_type="linear",
        gradient_checkpointing=config["gradient_checkpointing"], local_rollout_forward_batch_size=batch,
        num_sample_generations=0, use_cpu=True, bf16=False, fp16=False, report_to="none", logging_steps=1,
        save_strategy="no", seed=config["seed"], dataloader_num_workers=0, disable_tqdm=True,
    )
    timer = UpdateTimer()
    trainer = PPOTrainer(args=args, processing_class=tokenizer, model=load(), ref_model=load(),
                         reward_model=classifier(), value_model=classifier(), train_dataset=dataset,
                         callbacks=[timer])
    trainer.train()
    print(json.dumps({"step_time": timer.times, "trl": trl.__version__,
                      "versions": {"torch": torch.__version__, "threads": torch.get_num_threads()}}))
    """
)


def trl_site():
    if not os.path.isdir(os.path.join(TRL_SITE, "trl", "experimental", "ppo")):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", TRL_SITE,
                        f"trl=={TRL_VERSION}"], check=True)
    return TRL_SITE


def run_pair(holo, rows, seed, args, work):
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), RAYON_NUM_THREADS=str(args.threads),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", PYTHONWARNINGS="ignore", TRL_EXPERIMENTAL_SILENCE="1")
    trl_env = dict(env, PYTHONPATH=os.pathsep.join(filter(None, [trl_site(), env.get("PYTHONPATH")])))
    config = dict(model=TINY, data=rows, out=os.path.join(work, f"trl-ppo-{seed}"), seed=seed, steps=args.steps,
                  batch=args.batch, gradient_accumulation_steps=args.gradient_accumulation_steps,
                  num_ppo_epochs=args.num_ppo_epochs, response_length=args.response_length,
                  temperature=args.temperature, kl_coef=args.kl_coef, learning_rate=args.learning_rate,
                  gradient_checkpointing=args.gradient_checkpointing, threads=args.threads)
    trl_figures, _ = shared.measured(
        "TRL", [sys.executable, "-c", TRL_SIDE, json.dumps(config)], trl_env, args)
    trl_rss, trl_other = trl_figures["rss_mib"], trl_figures["other_cores"]
    trl = json.loads(trl_figures["stdout"].strip().splitlines()[-1])
    if trl["trl"] != TRL_VERSION:
        sys.exit(f"the TRL side imported TRL {trl['trl']}, not {TRL_VERSION}")

    run = os.path.join(work, f"holo-ppo-{seed}")
    command = [holo, "train", shared.HOL, "--model", TINY, "--data", rows, "--out", run,
               "--algorithm", "ppo", "--max-steps", str(args.steps), "--num-generations", "1",
               "--per-device-train-batch-size", str(args.batch),
               "--gradient-accumulation-steps", str(args.gradient_accumulation_steps),
               "--num-mini-batches", "1", "--num-ppo-epochs", str(args.num_ppo_epochs),
               "--max-completion-length", str(args.response_length), "--temperature", repr(args.temperature),
               "--top-p", "1.0", "--top-k", "0", "--kl-coef", repr(args.kl_coef),
               "--learning-rate", repr(args.learning_rate), "--lr-scheduler-type", "linear",
               "--gradient-checkpointing", str(args.gradient_checkpointing).lower(), "--seed", str(seed),
               "--save-steps", str(args.steps + 1)]
    holo_figures, _ = shared.measured(
        "holo", command, env, args, before=lambda: shutil.rmtree(run, ignore_errors=True))
    holo_rss, holo_other = holo_figures["rss_mib"], holo_figures["other_cores"]
    with open(os.path.join(run, "metrics.jsonl")) as lines:
        holo_times = [json.loads(line)["step_time"] for line in lines if line.strip()]
    if len(trl["step_time"]) != args.steps or len(holo_times) != args.steps:
        sys.exit(f"expected {args.steps} updates, TRL logged {len(trl['step_time'])}, holo {len(holo_times)}")
    result = {
        "seed": seed,
        "trl": {"median_step_s": statistics.median(trl["step_time"][1:]), "peak_rss_mib": trl_rss,
                "other_load_cores": trl_other, "step_time": trl["step_time"]},
        "holo": {"median_step_s": statistics.median(holo_times[1:]), "peak_rss_mib": holo_rss,
                 "other_load_cores": holo_other, "step_time": holo_times},
    }
    t, h = result["trl"], result["holo"]
    print(f"  seed {seed}: TRL {t['median_step_s']:.3f} s/update, {t['peak_rss_mib']:.0f} MiB, other load "
          f"{trl_other:.2f}; holo {h['median_step_s']:.3f} s/update, {h['peak_rss_mib']:.0f} MiB, other load "
          f"{holo_other:.2f}", flush=True)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1)
    parser.add_argument("--num-ppo-epochs", type=int, default=4)
    parser.add_argument("--response-length", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--kl-coef", type=float, default=0.05)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--gradient-checkpointing", type=lambda v: v.lower() == "true", default=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-prompts", type=int, default=64)
    parser.add_argument("--data-seed", type=int, default=1234)
    parser.add_argument("--idle-wait", type=float, default=60.0)
    parser.add_argument("--max-other-load", type=float, default=0.15)
    parser.add_argument("--attempts", type=int, default=3)
    parser.add_argument("--work-dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "holo-ppo-compare"))
    parser.add_argument("--json")
    parser.add_argument("--holo-bin", help="a holo binary built beforehand (no cargo build)")
    # grpo_compare.py's measuring reads the device from the arguments; PPO is compared on the CPU only.
    parser.set_defaults(device="cpu")
    args = parser.parse_args()
    if not os.path.isdir(TINY):
        sys.exit(f"{TINY} is missing: run bash ../shared/peers/setup.sh")
    os.makedirs(args.work_dir, exist_ok=True)
    holo = args.holo_bin or shared.build_rust(args.device)
    rows = os.path.join(args.work_dir, "rows.jsonl")
    shared.write_rows(rows, args.n_prompts, args.data_seed)
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"tiny Qwen2: {args.batch * args.gradient_accumulation_steps} rollouts per update, "
          f"{args.num_ppo_epochs} epochs, {args.response_length} response tokens, {args.steps} updates, "
          f"seeds {seeds}, {args.threads} threads", flush=True)
    runs = [run_pair(holo, rows, seed, args, args.work_dir) for seed in seeds]
    summary = {side: {"median_step_s": statistics.median(r[side]["median_step_s"] for r in runs),
                      "peak_rss_mib": max(r[side]["peak_rss_mib"] for r in runs)} for side in ("trl", "holo")}
    speedup = summary["trl"]["median_step_s"] / summary["holo"]["median_step_s"]
    print(f"\nTRL {TRL_VERSION} PPOTrainer {summary['trl']['median_step_s']:.3f} s/update, "
          f"{summary['trl']['peak_rss_mib']:.0f} MiB; holo {summary['holo']['median_step_s']:.3f} s/update, "
          f"{summary['holo']['peak_rss_mib']:.0f} MiB; holo is {speedup:.2f}× TRL's speed, "
          f"{summary['holo']['peak_rss_mib'] / summary['trl']['peak_rss_mib']:.2f}× its memory")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"runs": runs, "summary": summary, "speedup": speedup, "settings": vars(args)}, out, indent=1)


if __name__ == "__main__":
    main()
