#!/usr/bin/env python3
"""GRPO training steps on the CPU or a GPU: `holo train` against TRL's `GRPOTrainer`, side by side.

    ~/.cache/holo-peers/venv/bin/python benches/grpo_compare.py [--which tiny|qwen05b|both|none] [--model NAME=DIR]
        [--seeds 0,1,2] [--steps 30] [--batch 32] [--num-generations 8] [--learning-rate 3e-3]
        [--seeds-05b 0,1,2] [--steps-05b 3] [--batch-05b 4] [--num-generations-05b 4]
        [--learning-rate-05b 1e-5] [--max-completion-length 16] [--beta 0.0] [--loss-type dapo]
        [--temperature 1.0] [--gradient-checkpointing true] [--lora-r 16 [--lora-target-modules all-linear]]
        [--threads 2] [--device cpu|cuda] [--json FILE]

Both sides train the same model folder on the same data with the same GRPO settings, one process each,
one after the other (TRL first, then holo, for every seed):

- data: `--n-prompts` (64) arithmetic rows "What is a+b?" (a, b uniform in 0..99, seeded), written once as
  rows.jsonl `{"question": ..., "expected": ...}`; TRL gets them as the conversational prompt
  `[{"role": "user", "content": question}]` with the `expected` column;
- environment: `benches/arith.hol` (a user message with the question, one assistant message sampled to the
  end of its turn, no system message), whose prompt is TRL's `apply_chat_template(...,
  add_generation_prompt=True)` token for token: the script checks every prompt holo trained on against
  the tokenizer's ids for that row (and fails when one differs);
- reward: the sum of two components, mirrored exactly in Python (`exact_answer`, `length_penalty` below):
  `ExactAnswer` (1 when the reply, or the content of its last `<answer>...</answer>`, trimmed, equals
  `expected` once runs of whitespace are collapsed, else 0) and `LengthPenalty max=32` (0 for a reply of at
  most 32 characters, else -(characters - 32) / 32, down to -1). A random model never answers an addition,
  so the length component is the one that carries a learning signal; both are TRL reward functions with
  weight 1 (TRL's `sum_then_normalize`, as holo's default). The script recomputes the Python rule on every
  one of holo's rollouts and fails if it disagrees with the reward holo recorded;
- GRPO: the same `num_generations` (G), `per_device_train_batch_size` (B; one micro-batch per step, one
  generation per step: B/G prompts × G completions), `max_completion_length`, `learning_rate` (linear
  decay to 0, no warm-up, on both), `beta`, `loss_type`, `temperature` (top_p 1, top_k 0),
  `gradient_checkpointing`, `seed`; AdamW, gradient clipping at 1, `scale_rewards=group`, epsilon 0.2 are
  both sides' defaults. TRL: `use_cpu=True`, `bf16=False`, f32 weights, `torch.set_num_threads(--threads)`,
  no vLLM; holo: `RAYON_NUM_THREADS=--threads`. `--lora-r R` trains LoRA adapters instead of every weight:
  PEFT's `LoraConfig(r=R, lora_alpha=2R, lora_dropout=0.05, target_modules=--lora-target-modules)` on
  TRL's side, `--use-peft` with the same figures on holo's.

Measured per run: seconds per optimizer step (TRL: a callback's `on_step_begin` → `on_step_end`; holo:
`step_time` of RUN/metrics.jsonl; both cover generation, scoring, forward, backward and the AdamW update,
and exclude logging and checkpoints), of which the median over the steps after the first is reported, and
the CPU seconds of the same steps (all threads of the process: TRL's `process_time` in the same callback,
holo's from /proc while its metrics.jsonl grows, see `StepCpu`), the figure to compare on a loaded machine;
the process's peak RSS (GNU time's maximum resident set size, model loading and imports included); the mean
reward of the last `--reward-window` steps (5, or all of the steps when fewer) and of step 1. TRL's
generation phase (`_generate_and_score_completions`) is timed as well, to split its step. The figures are
medians over seeds (times) and means over seeds (rewards) for each model.

`--device cuda` runs both sides on the first GPU in bf16 (holo built with `--features cuda`; docs/cuda.md):
TRL loads the weights in bf16 with `bf16=True` (weights, gradients and AdamW's moments in bf16, as holo on
CUDA), holo gets `--device cuda:0`. Peak GPU memory is then reported for both, as the rise of the GPU's used
memory during the process (benches/gpu.py; TRL's `torch.cuda.max_memory_allocated` is recorded too). Use
`--idle-wait 0` there: the CPU-load checks are for the 2-core machines.

Models:
- tiny:    the peers' tiny Qwen2 (`~/.cache/holo-peers/tiny-qwen2`, 2 layers, hidden 64, vocab 512);
- qwen05b: `holo init-model --arch qwen2 --preset small` (Qwen2.5-0.5B's decoder shapes: hidden 896, 24
           layers, 14 / 2 heads, intermediate 4864, tied embeddings, 358 M parameters; with a 512-token
           vocabulary), built once under --work-dir (default ~/.cache/holo-peers/bench-models);
- `--model NAME=DIR` (repeatable; `--which none` for these alone): any model folder holo loads, trained
  with the 0.5B model's settings (`--seeds-05b`, `--steps-05b`, `--batch-05b`, `--num-generations-05b`,
  `--learning-rate-05b`); benches/family_compare.py passes each family's folder this way.

Needs the Python peers' venv (TRL 1.16, bash ../shared/peers/setup.sh), GNU time (/usr/bin/time; `GNU_TIME`
names another path) and cargo; builds `cargo build --release -p holo-runtime --bin holo`, unless `--holo-bin`
names a binary built beforehand (scripts/gpu-bundle.sh). TRL's figures for a seed are printed as soon as its
run ends, before holo's run. On 2 cores, timings collapse when anything else runs, and holo's more than
torch's (its thread pools spin while waiting): before each run the script waits for the machine to go idle
(`--idle-wait`, from /proc/stat), measures the CPU time the rest of the machine used during the run ("other
load", in cores), and runs a side again when that exceeds `--max-other-load` (0.15 cores), at most
`--attempts` (3) times; the table shows the largest other load that was kept.
"""
import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOL = os.path.join(ROOT, "benches", "arith.hol")
GNU_TIME = os.environ.get("GNU_TIME", "/usr/bin/time")
LENGTH_MAX = 32  # `<|LengthPenalty max=32|>` in benches/arith.hol

# Rust's `char::is_whitespace` (Unicode White_Space), which `str::trim` and `split_whitespace` use; Python's
# `str.isspace` also counts U+001C..U+001F, which a random model can sample.
RUST_WHITESPACE = frozenset(
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
    "\u2028\u2029\u202f\u205f\u3000"
)

REWARDS = textwrap.dedent(
    '''
    RUST_WHITESPACE = frozenset(%r)


    def _trim(text):
        start, end = 0, len(text)
        while start < end and text[start] in RUST_WHITESPACE:
            start += 1
        while end > start and text[end - 1] in RUST_WHITESPACE:
            end -= 1
        return text[start:end]


    def _words(text):
        words, word = [], []
        for char in text:
            if char in RUST_WHITESPACE:
                if word:
                    words.append("".join(word))
                    word = []
            else:
                word.append(char)
        if word:
            words.append("".join(word))
        return words


    def answer_text(text, tag="answer"):
        """holo's `answer_text`: the content of the last <tag>...</tag> (an unclosed one runs to the end),
        or the whole text, trimmed."""
        opening, closing = "<%%s>" %% tag, "</%%s>" %% tag
        at = text.rfind(opening)
        if at >= 0:
            start = at + len(opening)
            end = text.find(closing, start)
            text = text[start:] if end < 0 else text[start:end]
        return _trim(text)


    def exact_answer_value(text, expected):
        """`ExactAnswer`: 1 when the answer equals `expected` up to runs of whitespace, else 0."""
        return 1.0 if _words(answer_text(text)) == _words(expected) else 0.0


    def length_penalty_value(text, limit=%d):
        """`LengthPenalty max=limit`: 0 up to `limit` characters, then -(excess / limit), down to -1."""
        return -min(max(len(text) - limit, 0) / limit, 1.0)
    '''
) % ("".join(sorted(RUST_WHITESPACE)), LENGTH_MAX)

exec(REWARDS)  # the same functions in this process, to check holo's recorded rewards

TRL_SIDE = REWARDS + textwrap.dedent(
    """
    import json, statistics, sys, time
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback, set_seed
    from trl import GRPOConfig, GRPOTrainer

    config = json.loads(sys.argv[1])
    torch.set_num_threads(config["threads"])
    on_gpu = config["device"] == "cuda"
    set_seed(config["seed"])


    def _text(completion):  # conversational: [{"role": "assistant", "content": ...}]
        return completion[0]["content"] if isinstance(completion, list) else completion


    def exact_answer(completions, expected, **kw):
        return [exact_answer_value(_text(c), e) for c, e in zip(completions, expected)]


    def length_penalty(completions, **kw):
        return [length_penalty_value(_text(c)) for c in completions]


    class StepTimer(TrainerCallback):
        def __init__(self):
            self.start, self.times, self.cpu_start, self.cpu_times = None, [], None, []

        def on_step_begin(self, args, state, control, **kw):
            self.start, self.cpu_start = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.start)
            self.cpu_times.append(time.process_time() - self.cpu_start)


    with open(config["data"]) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    tokenizer = AutoTokenizer.from_pretrained(config["model"])
    tokenizer.padding_side = "left"
    prompt_ids = {
        row["question"]: tokenizer.apply_chat_template(
            [{"role": "user", "content": row["question"]}], add_generation_prompt=True, tokenize=True,
            return_dict=False)
        for row in rows
    }
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": row["question"]}], "expected": row["expected"]} for row in rows])
    model = AutoModelForCausalLM.from_pretrained(config["model"], dtype=torch.bfloat16 if on_gpu else torch.float32)
    peft_config = None
    if config["lora"]:
        from peft import LoraConfig

        peft_config = LoraConfig(task_type="CAUSAL_LM", **config["lora"])
    args = GRPOConfig(
        output_dir=config["out"], max_steps=config["steps"], per_device_train_batch_size=config["batch"],
        gradient_accumulation_steps=1, num_generations=config["num_generations"],
        max_completion_length=config["max_completion_length"], learning_rate=config["learning_rate"],
        lr_scheduler_type="linear", warmup_steps=0, beta=config["beta"], loss_type=config["loss_type"],
        temperature=config["temperature"], top_p=1.0, top_k=0,
        gradient_checkpointing=config["gradient_checkpointing"], use_vllm=False, use_cpu=not on_gpu, bf16=on_gpu,
        fp16=False, report_to="none", logging_steps=1, save_strategy="no", seed=config["seed"],
        data_seed=config["seed"], dataloader_num_workers=0, disable_tqdm=True,
    )
    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=[exact_answer, length_penalty], args=args,
                          train_dataset=dataset, processing_class=tokenizer, callbacks=[timer],
                          peft_config=peft_config)
    generation_times = []
    generate = trainer._generate_and_score_completions


    def timed_generate(*a, **kw):
        start = time.perf_counter()
        out = generate(*a, **kw)
        generation_times.append(time.perf_counter() - start)
        return out


    trainer._generate_and_score_completions = timed_generate
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    print(json.dumps({
        "step_time": timer.times,
        "step_cpu_time": timer.cpu_times,
        "generation_time": generation_times,
        "reward": [h["reward"] for h in logs],
        "exact_answer": [h.get("rewards/exact_answer/mean") for h in logs],
        "length_penalty": [h.get("rewards/length_penalty/mean") for h in logs],
        "mean_length": [h.get("completions/mean_length") for h in logs],
        "prompt_ids": prompt_ids,
        "versions": {"torch": torch.__version__, "threads": torch.get_num_threads()},
        "max_memory_allocated_mib": torch.cuda.max_memory_allocated() / 2**20 if on_gpu else None,
    }))
    """
)


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def busy_seconds():
    """CPU seconds spent so far by every process on the machine (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / CLOCK_TICKS


def wait_idle(limit_s, threshold=0.1):
    """Waits (at most `limit_s`) until the machine's CPU use stays below `threshold` cores for three 2-s
    windows in a row; returns whether it did."""
    quiet, waited = 0, 0.0
    while waited < limit_s:
        start = busy_seconds()
        time.sleep(2)
        waited += 2
        quiet = quiet + 1 if (busy_seconds() - start) / 2 < threshold else 0
        if quiet >= 3:
            return True
    return False


def run_measured(command, env, device="cpu"):
    """Runs a command; returns (stdout, peak RSS in MiB, wall seconds, other load in cores, peak GPU memory in
    MiB or None): run_timed's figures as a tuple."""
    figures = run_timed(command, env, device)
    return figures["stdout"], figures["rss_mib"], figures["wall_s"], figures["other_cores"], figures["gpu_mib"]


def run_timed(command, env, device="cpu", steps=None):
    """Runs a command; returns its stdout, peak RSS (MiB), wall and CPU seconds (user + system, all threads),
    other load (cores), peak GPU memory (MiB or None) and, given `steps` (a StepCpu), the CPU seconds of each
    of its steps.

    Peak RSS and times are GNU time's, measured around the child: `wait4`'s ru_maxrss would fold in this
    script's own high-water mark. The other load is the CPU time that the rest of the machine used during
    the run (all CPU time from /proc/stat less the child's user and system time) per second of wall time:
    above 0 the run shared its cores; on a loaded machine the CPU seconds are the figures to compare. On a
    GPU, also the rise of its used memory (benches/gpu.py).
    """
    gpu_peak = gpu.PeakMemory() if device == "cuda" else contextlib.nullcontext()
    with tempfile.NamedTemporaryFile(mode="r") as peak:
        before = busy_seconds()
        with gpu_peak:
            child = subprocess.Popen([GNU_TIME, "-f", "%M %e %U %S", "-o", peak.name, *command],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
            with steps.watching(child.pid) if steps else contextlib.nullcontext():
                stdout, stderr = child.communicate()
        busy = busy_seconds() - before
        if child.returncode != 0:
            sys.exit(f"{' '.join(command)} failed ({child.returncode}):\n"
                     f"{stderr.decode(errors='replace')[-4000:]}")
        rss_kib, wall, user, system = peak.read().split()[-4:]
        wall, cpu = float(wall), float(user) + float(system)
        return {"stdout": stdout.decode(), "rss_mib": int(rss_kib) / 1024, "wall_s": wall, "cpu_s": cpu,
                "other_cores": max(0.0, busy - cpu) / max(wall, 1e-3),
                "gpu_mib": gpu_peak.mib if device == "cuda" else None,
                "step_cpu_s": steps.per_step() if steps else None}


class StepCpu:
    """The CPU seconds of each of `holo train`'s steps, which it does not log: a thread polls the process's
    CPU time (/proc/PID/stat, all its threads) and RUN/metrics.jsonl, which gets one line at the end of each
    step; a step's CPU time is the process's between the line that ends it and the one before (the first
    step's from the process's start: loading included). It includes the writing of the step's metrics and
    rollouts, which TRL's figure (the process's CPU time from `on_step_begin` to `on_step_end`) does not; the
    poll period (0.1 s) bounds the error of each boundary."""

    PERIOD_S = 0.1

    def __init__(self, metrics_path):
        self.metrics_path = metrics_path
        self.marks = []  # the process's CPU seconds when metrics.jsonl reached 1, 2, ... lines

    @contextlib.contextmanager
    def watching(self, time_pid):
        done = threading.Event()
        thread = threading.Thread(target=self._poll, args=(time_pid, done), daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def _poll(self, time_pid, done):
        pid, cpu = None, 0.0
        finished = False
        while not finished:  # one last pass once the process is done: its last step's line
            finished = done.wait(self.PERIOD_S)
            if pid is None:  # the command GNU time started
                try:
                    with open(f"/proc/{time_pid}/task/{time_pid}/children") as children:
                        pid = int(children.read().split()[0])
                except (OSError, IndexError, ValueError):
                    continue
            try:
                with open(f"/proc/{pid}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
                cpu = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime
            except (OSError, IndexError, ValueError):
                pass  # exited: its last reading stands
            try:
                with open(self.metrics_path) as metrics:
                    lines = sum(1 for line in metrics if line.strip())
            except OSError:
                lines = 0
            self.marks.extend([cpu] * (lines - len(self.marks)))

    def per_step(self):
        return [b - a for a, b in zip([0.0] + self.marks, self.marks)]


def build_rust(device):
    features = ["--features", "cuda"] if device == "cuda" else []
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "holo-runtime", "--bin", "holo", *features], cwd=ROOT,
                   check=True)
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    return os.path.join(target, "release", "holo")


def qwen05b_model(holo, work):
    folder = os.path.join(work, "qwen2.5-0.5b-shapes-v512")
    if not os.path.isfile(os.path.join(folder, "model.safetensors")):
        subprocess.run([holo, "init-model", "--arch", "qwen2", "--preset", "small", "--force", folder], check=True)
    return folder


def write_rows(path, count, seed):
    rng = random.Random(seed)
    with open(path, "w") as out:
        for _ in range(count):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            out.write(json.dumps({"question": f"What is {a}+{b}?", "expected": str(a + b)}) + "\n")


def sampled_text(record):
    return "".join(part["text"] for context in record["contexts"] for message in context["messages"]
                   for part in message["parts"] if part["sampled"])


def check_holo_run(run, prompt_ids):
    """Every prompt holo trained on is TRL's chat-templated prompt, and the Python reward rule gives the
    rewards holo recorded. Returns the number of rollouts checked."""
    checked = 0
    with open(os.path.join(run, "rollouts.jsonl")) as records:
        for line in records:
            record = json.loads(line)
            (context,) = record["contexts"]
            ids, mask = context["tokens"]["ids"], context["tokens"]["loss_mask"]
            prompt = ids[:mask.index(1)] if 1 in mask else ids
            question = record["row"]["question"]
            if prompt != prompt_ids[question]:
                sys.exit(f"holo's prompt for {question!r} differs from TRL's:\n  holo {prompt}\n"
                         f"  TRL  {prompt_ids[question]}")
            text = sampled_text(record)
            ours = {"exact_answer": exact_answer_value(text, record["row"]["expected"]),
                    "length_penalty": length_penalty_value(text)}
            for name, value in ours.items():
                if abs(record["rewards"][name] - value) > 1e-9:
                    sys.exit(f"the Python rule gives {name} = {value} for {text!r}, holo recorded "
                             f"{record['rewards'][name]}")
            checked += 1
    return checked


def measured(label, command, env, args, before=None, steps=None):
    """Runs one side on a quiet machine: waits for idle (`--idle-wait`), runs, and runs again (at most
    `--attempts` times in all) while the rest of the machine used more than `--max-other-load` cores
    meanwhile. Returns run_timed's figures of the last attempt and the attempts made."""
    for attempt in range(1, args.attempts + 1):
        if args.idle_wait > 0 and not wait_idle(args.idle_wait):
            print(f"    ({label}: the machine did not go idle within {args.idle_wait} s; measuring anyway)",
                  flush=True)
        if before:
            before()
        figures = run_timed(command, env, args.device, steps() if steps else None)
        other = figures["other_cores"]
        if other <= args.max_other_load or attempt == args.attempts:
            if other > args.max_other_load:
                print(f"    ({label}: other processes used {other:.2f} cores; kept after {attempt} attempts)",
                      flush=True)
            return figures, attempt
        print(f"    ({label}: other processes used {other:.2f} cores during the run; measuring again)",
              flush=True)


def lora_settings(args):
    """PEFT's LoraConfig arguments for `--lora-r` (None: full fine-tuning); holo gets the same."""
    if not args.lora_r:
        return None
    return {"r": args.lora_r, "lora_alpha": 2 * args.lora_r, "lora_dropout": 0.05,
            "target_modules": args.lora_target_modules}


def train_pair(name, folder, holo, rows, seed, settings, args, work):
    steps, batch = settings["steps"], settings["batch"]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), RAYON_NUM_THREADS=str(args.threads),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", PYTHONWARNINGS="ignore")
    trl_out = os.path.join(work, f"trl-{name}-{seed}")
    config = dict(model=folder, data=rows, out=trl_out, seed=seed, steps=steps, batch=batch,
                  num_generations=settings["num_generations"], max_completion_length=args.max_completion_length,
                  learning_rate=settings["learning_rate"], beta=args.beta, loss_type=args.loss_type,
                  temperature=args.temperature, gradient_checkpointing=args.gradient_checkpointing,
                  threads=args.threads, device=args.device, lora=lora_settings(args))
    trl_figures, trl_attempts = measured("TRL", [sys.executable, "-c", TRL_SIDE, json.dumps(config)], env, args)
    trl = json.loads(trl_figures["stdout"].strip().splitlines()[-1])
    print(f"  seed {seed}: TRL steps {', '.join(f'{t:.3f}' for t in trl['step_time'])} s "
          f"({', '.join(f'{t:.3f}' for t in trl['step_cpu_time'])} CPU s), "
          f"rewards {', '.join(f'{r:+.3f}' for r in trl['reward'])}, {trl_figures['rss_mib']:.0f} MiB"
          + (f", peak GPU {trl_figures['gpu_mib']:.0f} MiB" if args.device == "cuda" else ""), flush=True)

    run = os.path.join(work, f"holo-{name}-{seed}")
    command = [holo, "train", HOL, "--model", folder, "--data", rows, "--out", run, "--max-steps", str(steps),
               "--num-generations", str(settings["num_generations"]), "--per-device-train-batch-size", str(batch),
               "--max-completion-length", str(args.max_completion_length),
               "--learning-rate", repr(settings["learning_rate"]), "--seed", str(seed), "--beta", repr(args.beta),
               "--loss-type", args.loss_type, "--temperature", repr(args.temperature),
               "--gradient-checkpointing", str(args.gradient_checkpointing).lower(),
               "--lr-scheduler-type", "linear", "--top-p", "1.0", "--top-k", "0",
               # No checkpoints, as TRL's side (`save_strategy="no"`): at 0.5B shapes the last step's
               # checkpoint (weights and AdamW's moments, 6 GB) filled a shared disk.
               "--save-strategy", "no",
               "--device", "cuda:0" if args.device == "cuda" else "cpu"]
    if args.lora_r:
        lora = lora_settings(args)
        command += ["--use-peft", "--lora-r", str(lora["r"]), "--lora-alpha", repr(float(lora["lora_alpha"])),
                    "--lora-dropout", repr(lora["lora_dropout"]), "--lora-target-modules", lora["target_modules"]]
    holo_figures, holo_attempts = measured(
        "holo", command, env, args, before=lambda: shutil.rmtree(run, ignore_errors=True),
        steps=lambda: StepCpu(os.path.join(run, "metrics.jsonl")))
    with open(os.path.join(run, "metrics.jsonl")) as lines:
        metrics = [json.loads(line) for line in lines if line.strip()]
    checked = check_holo_run(run, trl["prompt_ids"])
    ours = {"step_time": [m["step_time"] for m in metrics], "step_cpu_time": holo_figures["step_cpu_s"],
            "reward": [m["reward"] for m in metrics],
            "exact_answer": [m.get("rewards/exact_answer/mean") for m in metrics],
            "length_penalty": [m.get("rewards/length_penalty/mean") for m in metrics],
            "mean_length": [m.get("completions/mean_length") for m in metrics]}
    del trl["prompt_ids"]
    if len(trl["step_time"]) != steps or len(ours["step_time"]) != steps:
        sys.exit(f"expected {steps} steps, TRL logged {len(trl['step_time'])}, holo {len(ours['step_time'])}")
    window = min(args.reward_window, steps)

    def summary(side, figures, attempts):
        later = side["step_time"][1:] or side["step_time"]
        later_cpu = side["step_cpu_time"][1:] or side["step_cpu_time"]
        return dict(side, median_step_s=statistics.median(later), median_step_cpu_s=statistics.median(later_cpu),
                    peak_rss_mib=figures["rss_mib"], peak_gpu_mib=figures["gpu_mib"], wall_s=figures["wall_s"],
                    cpu_s=figures["cpu_s"], other_load_cores=figures["other_cores"], attempts=attempts,
                    load_average=os.getloadavg(), last_reward=statistics.fmean(side["reward"][-window:]),
                    first_reward=side["reward"][0])

    result = {"seed": seed, "trl": summary(trl, trl_figures, trl_attempts),
              "holo": summary(ours, holo_figures, holo_attempts), "rollouts_checked": checked}
    t, h = result["trl"], result["holo"]
    generation = statistics.median(t["generation_time"][1:] or t["generation_time"])
    print(f"  seed {seed}: TRL {t['median_step_s']:.3f} s/step, {t['median_step_cpu_s']:.3f} CPU s/step "
          f"(generation {generation:.3f} s), {t['peak_rss_mib']:.0f} MiB, reward {t['first_reward']:+.3f} -> "
          f"{t['last_reward']:+.3f}, other load {t['other_load_cores']:.2f}; holo {h['median_step_s']:.3f} s/step, "
          f"{h['median_step_cpu_s']:.3f} CPU s/step, {h['peak_rss_mib']:.0f} MiB, reward {h['first_reward']:+.3f} "
          f"-> {h['last_reward']:+.3f}, other load {h['other_load_cores']:.2f} ({checked} rollouts checked)",
          flush=True)
    if args.device == "cuda":
        print(f"    peak GPU memory: TRL {t['peak_gpu_mib']:.0f} MiB (torch allocated "
              f"{trl['max_memory_allocated_mib']:.0f}), holo {h['peak_gpu_mib']:.0f} MiB", flush=True)
    return result


def compare(name, folder, holo, settings, args, work):
    seeds, steps, batch = settings["seeds"], settings["steps"], settings["batch"]
    rows = os.path.join(work, "rows.jsonl")
    write_rows(rows, args.n_prompts, args.data_seed)
    print(f"{name}: {folder}\n  G {settings['num_generations']}, batch {batch} "
          f"({batch // settings['num_generations']} prompts per step), {args.max_completion_length} completion "
          f"tokens, lr {settings['learning_rate']}, beta {args.beta}, "
          f"{args.loss_type}, temperature {args.temperature}, gradient checkpointing "
          f"{args.gradient_checkpointing}, {steps} steps, seeds {seeds}, {args.threads} threads", flush=True)
    runs = [train_pair(name, folder, holo, rows, seed, settings, args, work) for seed in seeds]

    def over_seeds(side, key, reduce):
        return reduce([run[side][key] for run in runs])

    row = {"model": name, "settings": settings, "steps": steps, "seeds": seeds, "runs": runs,
           "reward_window": min(args.reward_window, steps)}
    for side in ("trl", "holo"):
        row[side] = {
            "median_step_s": over_seeds(side, "median_step_s", statistics.median),
            "median_step_cpu_s": over_seeds(side, "median_step_cpu_s", statistics.median),
            "peak_rss_mib": over_seeds(side, "peak_rss_mib", max),
            "peak_gpu_mib": over_seeds(side, "peak_gpu_mib", max) if args.device == "cuda" else None,
            "last_reward": over_seeds(side, "last_reward", statistics.fmean),
            "first_reward": over_seeds(side, "first_reward", statistics.fmean),
            "wall_s": over_seeds(side, "wall_s", statistics.median),
            "other_load_cores": over_seeds(side, "other_load_cores", max),
        }
    row["trl"]["generation_s"] = statistics.median(
        statistics.median(run["trl"]["generation_time"][1:] or run["trl"]["generation_time"]) for run in runs)
    row["speedup"] = row["trl"]["median_step_s"] / row["holo"]["median_step_s"]
    row["cpu_speedup"] = row["trl"]["median_step_cpu_s"] / row["holo"]["median_step_cpu_s"]
    row["rss_ratio"] = row["holo"]["peak_rss_mib"] / row["trl"]["peak_rss_mib"]
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--which", default="both", choices=["tiny", "qwen05b", "both", "none"])
    parser.add_argument("--model", action="append", default=[], metavar="NAME=DIR",
                        help="also train this model folder (any family holo loads), with the 0.5B model's settings "
                             "(--seeds-05b, --steps-05b, --batch-05b, ...); repeatable")
    parser.add_argument("--seeds", default="0,1,2", help="seeds of the tiny model's runs")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps, tiny model")
    parser.add_argument("--batch", type=int, default=32, help="per_device_train_batch_size, tiny model")
    parser.add_argument("--num-generations", type=int, default=8, help="G, tiny model")
    parser.add_argument("--learning-rate", type=float, default=3e-3, help="tiny model")
    parser.add_argument("--seeds-05b", default="0,1,2", help="seeds of the 0.5B-shaped model's runs")
    parser.add_argument("--steps-05b", type=int, default=3)
    parser.add_argument("--batch-05b", type=int, default=4)
    parser.add_argument("--num-generations-05b", type=int, default=4)
    parser.add_argument("--learning-rate-05b", type=float, default=1e-5)
    parser.add_argument("--max-completion-length", type=int, default=16)
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--loss-type", default="dapo")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--gradient-checkpointing", default="true", choices=["true", "false"])
    parser.add_argument("--lora-r", type=int, default=0,
                        help="train LoRA adapters of this rank (alpha twice it, dropout 0.05) on both sides, "
                             "PEFT's on TRL's, instead of every weight (0, the default)")
    parser.add_argument("--lora-target-modules", default="all-linear", help="the adapted projections, with --lora-r")
    parser.add_argument("--reward-window", type=int, default=5, help="reward: mean of this many last steps")
    parser.add_argument("--n-prompts", type=int, default=64)
    parser.add_argument("--data-seed", type=int, default=0, help="seeds the arithmetic rows")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tiny-model", default=os.path.expanduser("~/.cache/holo-peers/tiny-qwen2"))
    parser.add_argument("--work-dir", default=os.path.expanduser("~/.cache/holo-peers/bench-models"))
    parser.add_argument("--idle-wait", type=float, default=600,
                        help="before each run, wait at most this many seconds for the machine to go idle (0: no wait)")
    parser.add_argument("--max-other-load", type=float, default=0.15,
                        help="run a side again when the rest of the machine used more cores than this during it")
    parser.add_argument("--attempts", type=int, default=3, help="runs of a side at most (see --max-other-load)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where both sides train (cuda: the first GPU, bf16; holo built with --features cuda)")
    parser.add_argument("--json", help="also write every figure here")
    parser.add_argument("--holo-bin", help="a holo binary built beforehand (no cargo build)")
    args = parser.parse_args()
    args.gradient_checkpointing = args.gradient_checkpointing == "true"
    os.makedirs(args.work_dir, exist_ok=True)
    holo = args.holo_bin or build_rust(args.device)
    results = []
    with tempfile.TemporaryDirectory(prefix="grpo-compare-") as work:
        if args.which in ("tiny", "both"):
            os.makedirs(os.path.join(work, "tiny"))
            settings = dict(seeds=[int(s) for s in args.seeds.split(",")], steps=args.steps, batch=args.batch,
                            num_generations=args.num_generations, learning_rate=args.learning_rate)
            results.append(compare("tiny", args.tiny_model, holo, settings, args, os.path.join(work, "tiny")))
        if args.which in ("qwen05b", "both"):
            os.makedirs(os.path.join(work, "qwen05b"))
            settings = dict(seeds=[int(s) for s in args.seeds_05b.split(",")], steps=args.steps_05b,
                            batch=args.batch_05b, num_generations=args.num_generations_05b,
                            learning_rate=args.learning_rate_05b)
            results.append(compare("qwen2.5-0.5b shapes", qwen05b_model(holo, args.work_dir), holo, settings, args,
                                   os.path.join(work, "qwen05b")))
        for index, named in enumerate(args.model):
            name, _, folder = named.partition("=")
            if not folder:
                parser.error(f"--model takes NAME=DIR, not {named!r}")
            os.makedirs(os.path.join(work, f"model{index}"))
            settings = dict(seeds=[int(s) for s in args.seeds_05b.split(",")], steps=args.steps_05b,
                            batch=args.batch_05b, num_generations=args.num_generations_05b,
                            learning_rate=args.learning_rate_05b)
            results.append(compare(name, folder, holo, settings, args, os.path.join(work, f"model{index}")))

    print()
    print("| model | steps × seeds | TRL s/step | holo s/step | speedup | CPU s/step TRL / holo | speedup per CPU s "
          "| peak RSS TRL / holo (MiB) | RSS ratio | reward step 1 TRL / holo | reward last steps TRL / holo "
          "| other load TRL / holo |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in results:
        t, h = row["trl"], row["holo"]
        print(f"| {row['model']} | {row['steps']} × {len(row['seeds'])} | {t['median_step_s']:.3f} | "
              f"{h['median_step_s']:.3f} | {row['speedup']:.1f}× | {t['median_step_cpu_s']:.2f} / "
              f"{h['median_step_cpu_s']:.2f} | {row['cpu_speedup']:.2f}× | "
              f"{t['peak_rss_mib']:,.0f} / {h['peak_rss_mib']:,.0f} | "
              f"{row['rss_ratio']:.2f} | {t['first_reward']:+.3f} / {h['first_reward']:+.3f} | "
              f"{t['last_reward']:+.3f} / {h['last_reward']:+.3f} (last {row['reward_window']}) | "
              f"{t['other_load_cores']:.2f} / {h['other_load_cores']:.2f} |")
    summary = {row["model"]: {"trl_s_per_step": row["trl"]["median_step_s"],
                              "holo_s_per_step": row["holo"]["median_step_s"], "speedup": row["speedup"],
                              "trl_cpu_s_per_step": row["trl"]["median_step_cpu_s"],
                              "holo_cpu_s_per_step": row["holo"]["median_step_cpu_s"],
                              "cpu_speedup": row["cpu_speedup"],
                              "trl_peak_rss_mib": row["trl"]["peak_rss_mib"],
                              "holo_peak_rss_mib": row["holo"]["peak_rss_mib"], "rss_ratio": row["rss_ratio"],
                              "trl_peak_gpu_mib": row["trl"]["peak_gpu_mib"],
                              "holo_peak_gpu_mib": row["holo"]["peak_gpu_mib"],
                              "trl_reward": row["trl"]["last_reward"], "holo_reward": row["holo"]["last_reward"],
                              "speedup_at_least_3": row["speedup"] >= 3, "rss_not_above_trl": row["rss_ratio"] <= 1,
                              "reward_not_below_trl": row["holo"]["last_reward"] >= row["trl"]["last_reward"]}
               for row in results}
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"args": vars(args), "results": results}, out, indent=2)


if __name__ == "__main__":
    main()
