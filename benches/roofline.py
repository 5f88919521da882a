#!/usr/bin/env python3
"""The issue's two rates as ratios of this machine's measured peaks (issue 39).

    ~/.cache/holo-peers/venv/bin/python benches/roofline.py [--holo-bin BIN] [--peaks-bin BIN]
        [--sample-bin BIN] [--work-dir DIR] [--only peaks|train|sample] [--vocab 512|151936|both]
        [--train-threads 1|2] [--steps 2] [--repeats 5] [--new 64] [--peaks-json FILE] [--json FILE]

- The peaks: `holo-model`'s `machine_peaks` example (the f32 FMA peak and the read bandwidth from memory on
  one core and two, each the best of several runs by wall and by thread CPU time; decoding's product on
  weights larger than the caches at 1 and 2 threads), numpy's `sum` and torch's `mv` over the same sizes.
- Training: `holo train` as `benches/grpo_compare.py` runs it (recomputation on, `--save-strategy no`),
  `--steps` GRPO steps of 2 prompts x 8 completions of up to 128 tokens, on `holo init-model --arch qwen2
  --preset small` (Qwen2.5-0.5B's decoder) with its 512-token vocabulary and with the real 151,936
  (`--vocab`; the real one waits, at most 20 minutes, for 12 GiB of available memory). The rate is
  6 * parameters * trained tokens over each step's forward and backward (`time/backward` in metrics.jsonl,
  and the process's CPU seconds over that span), against the FMA peak of as many cores as threads
  (`--train-threads`, 2 by default); 8 * P * T (recomputation's second forward) and the head's share
  beside it.
- Sampling: `sample_bench` (f32) at B = 1 and 8 on SmolLM2-135M's and Qwen3-0.6B's shapes at their real
  vocabularies (`holo init-model --arch llama|qwen3 --preset small --vocab ...`): the bytes of weights one
  decoding step reads (every projection and the head, once) times decoding steps per second (the prefill
  taken out), at one thread against one core's read bandwidth and at two against two cores'.

The binaries default to the dev profile's in CARGO_TARGET_DIR (holo-model and holo-train are built at
opt-level 3 there, the dependencies too), built by `cargo build` unless given.
"""
import argparse
import json
import os
import struct
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOL = os.path.join(ROOT, "benches", "arith.hol")
TARGET = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
QWEN25_VOCAB, SMOLLM2_VOCAB, QWEN3_VOCAB = 151_936, 49_152, 151_936
# Each cargo target and the file it builds.
BINARIES = {"holo": (["--bin", "holo"], "holo"),
            "peaks": (["-p", "holo-model", "--example", "machine_peaks"], "examples/machine_peaks"),
            "sample": (["--example", "sample_bench"], "examples/sample_bench")}


def binary(name, given):
    if given:
        return given
    selector, path = BINARIES[name]
    package = [] if "-p" in selector else ["-p", "holo-runtime"]
    subprocess.run(["cargo", "build", "-q", *package, *selector], cwd=ROOT, check=True)
    return os.path.join(TARGET, "debug", path)


def load_average():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def run_json(command, threads, lines=False):
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    parsed = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return parsed if lines else parsed[-1]


def best(section, threads, clock):
    """The best rate among a section's variants at a thread count, and the variant that gave it."""
    name, rates = max(((name, v[f"threads_{threads}"][clock]) for name, v in section.items() if name != "buffer_gb"),
                      key=lambda pair: pair[1])
    return rates, name


def peaks(args):
    bin_ = binary("peaks", args.peaks_bin)
    print(f"peaks: load average {load_average()}", flush=True)
    full = run_json([bin_, "--repeats", str(args.repeats), "--gb", str(args.gb)], 2)
    one = run_json([bin_, "--repeats", str(args.repeats), "--only", "products"], 1)
    import numpy as np
    import torch

    def timed(work, nbytes, cpu_clock):
        """GB/s of `work` reading `nbytes`, best of the repeats, per wall second and per CPU second."""
        wall, cpu = 0.0, 0.0
        for _ in range(args.repeats):
            started, cpu_started = time.perf_counter(), cpu_clock()
            work()
            wall = max(wall, nbytes / (time.perf_counter() - started) / 1e9)
            cpu = max(cpu, nbytes / max(cpu_clock() - cpu_started, 1e-9) / 1e9)
        return {"per_wall_s": wall, "per_cpu_s": cpu}

    values = np.ones(int(args.gb * 1e9 / 4), dtype=np.float32)
    # numpy's sum runs on the calling thread.
    numpy_rates = timed(values.sum, values.nbytes, time.thread_time)
    del values
    # As many rows of Qwen2.5's hidden size as `--gb` holds, as the head's product reads them.
    weight = torch.randn(int(args.gb * 1e9 / 4 / 896), 896)
    x = torch.randn(896)
    torch_rates = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        # All the process's threads: torch's pool with 2 (the process's other threads sleep).
        torch_rates[threads] = timed(lambda: torch.mv(weight, x), weight.numel() * 4, time.process_time)
    del weight
    fma1, fma1_name = best(full["fma"], 1, "per_cpu_s")
    fma2, fma2_name = best(full["fma"], 2, "per_cpu_s")
    read1, read1_name = best(full["read"], 1, "per_cpu_s")
    # Per thread-CPU second, summed over the two threads: on a shared machine the wall rate counts other
    # processes' turns. It assumes the two threads' reads overlapped: the best wall rate (printed above)
    # is the figure to trust when the machine was quiet.
    read2, read2_name = best(full["read"], 2, "per_cpu_s")
    summary = {"fma_gflops_1": fma1, "fma_gflops_2": fma2, "fma_variant_1": fma1_name, "fma_variant_2": fma2_name,
               # Two FMA ports, 16 lanes, two FLOP each: 64 FLOP a cycle.
               "clock_ghz_implied": fma1 / 64,
               "read_gbs_1": read1, "read_gbs_2": read2, "read_variant_1": read1_name, "read_variant_2": read2_name,
               "numpy_sum_gbs": numpy_rates, "torch_mv_gbs_1": torch_rates[1], "torch_mv_gbs_2": torch_rates[2],
               "skinny_1row_gbs_1": one["products"]["rows_1"], "skinny_1row_gbs_2": full["products"]["rows_1"],
               "skinny_8row_gbs_1": one["products"]["rows_8"], "skinny_8row_gbs_2": full["products"]["rows_8"],
               "load_average_after": load_average()}
    print("  FMA, GFLOP/s (best of runs; per wall s / per thread-CPU s; 1 thread | 2 threads):")
    for name, v in full["fma"].items():
        print(f"    {name:<12} {v['threads_1']['per_wall_s']:7.1f} / {v['threads_1']['per_cpu_s']:7.1f} | "
              f"{v['threads_2']['per_wall_s']:7.1f} / {v['threads_2']['per_cpu_s']:7.1f}")
    print(f"  reads over {full['read']['buffer_gb']:.2f} GB, GB/s (per wall s / per thread-CPU s, waited s of the "
          "best wall run; 1 thread | 2 threads):")
    for name, v in full["read"].items():
        if name == "buffer_gb":
            continue
        a, b = v["threads_1"], v["threads_2"]
        print(f"    {name:<18} {a['per_wall_s']:6.2f} / {a['per_cpu_s']:6.2f} ({a['waited_s']:.2f}) | "
              f"{b['per_wall_s']:6.2f} / {b['per_cpu_s']:6.2f} ({b['waited_s']:.2f})")
    print(f"  numpy sum {numpy_rates['per_wall_s']:.2f} / {numpy_rates['per_cpu_s']:.2f} GB/s; torch mv "
          f"{torch_rates[1]['per_wall_s']:.2f} / {torch_rates[1]['per_cpu_s']:.2f} (1 thread), "
          f"{torch_rates[2]['per_wall_s']:.2f} / {2 * torch_rates[2]['per_cpu_s']:.2f} (2; per CPU s x 2)")
    for rows in (1, 8):
        a, b = one["products"][f"rows_{rows}"], full["products"][f"rows_{rows}"]
        print(f"  skinny product, {rows} row(s): {a['gb_per_wall_s']:.2f} / {a['gb_per_cpu_s']:.2f} GB/s (1 thread), "
              f"{b['gb_per_wall_s']:.2f} / {2 * b['gb_per_cpu_s']:.2f} (2; per CPU s x 2: the rate of two cores "
              "of its own, as the read peaks' two-thread figure)")
    print(f"  peaks: FMA {fma1:.1f} GFLOP/s per core ({fma1_name}, {summary['clock_ghz_implied']:.2f} GHz implied), "
          f"{fma2:.1f} on two ({fma2_name}); read {read1:.2f} GB/s on one core ({read1_name}, per CPU s), "
          f"{read2:.2f} on two ({read2_name}, per CPU s); load average {load_average()}", flush=True)
    return {"machine_peaks": full, "machine_peaks_one_thread_products": one, "numpy_sum_gbs": numpy_rates,
            "torch_mv_gbs": torch_rates, "summary": summary}


def init_model(holo, folder, arch, vocab):
    if not os.path.isfile(os.path.join(folder, "model.safetensors")):
        command = [holo, "init-model", "--arch", arch, "--preset", "small", "--force", folder]
        subprocess.run(command + (["--vocab", str(vocab)] if vocab else []), check=True)
    return folder


def tensor_shapes(folder):
    """Each tensor's shape in the folder's model.safetensors (its JSON header)."""
    with open(os.path.join(folder, "model.safetensors"), "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return {name: entry["shape"] for name, entry in header.items() if name != "__metadata__"}


def numel(shape):
    count = 1
    for dim in shape:
        count *= dim
    return count


def process_cpu(pid):
    """A process's CPU seconds so far, all its threads (`schedstat`, nanoseconds); None once it has gone."""
    total = 0
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
    except (FileNotFoundError, ProcessLookupError):
        return None
    return total / 1e9


def watched(command, env, metrics):
    """Runs `command`, sampling its CPU seconds every 50 ms and noting when each line of `metrics` appears.
    Returns the samples `(wall, cpu)` and each line's time."""
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)
    clock, logged = [], []
    while process.poll() is None:
        cpu = process_cpu(process.pid)
        if cpu is not None:
            clock.append((time.monotonic(), cpu))
        if os.path.exists(metrics):
            with open(metrics) as f:
                lines = sum(1 for line in f if line.strip())
            logged += [time.monotonic()] * (lines - len(logged))
        time.sleep(0.05)
    if process.returncode:
        sys.exit(f"{' '.join(command)} failed ({process.returncode})")
    with open(metrics) as f:
        lines = sum(1 for line in f if line.strip())
    # A line written in the last 50 ms before the exit.
    logged += [time.monotonic()] * (lines - len(logged))
    return clock, logged


def cpu_at(clock, instant):
    """The CPU seconds at `instant`, interpolated between the samples around it."""
    for (t0, c0), (t1, c1) in zip(clock, clock[1:]):
        if t0 <= instant <= t1:
            return c0 + (c1 - c0) * (instant - t0) / max(t1 - t0, 1e-9)
    return clock[-1][1] if instant > clock[-1][0] else clock[0][1]


def wait_for_memory(gib, deadline_s):
    """Waits (at most `deadline_s`) until the kernel says `gib` GiB are available: the real vocabulary's
    step peaks near 9 GB, and the machine is shared."""
    waited = 0
    while True:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable")) / 2**20
        if available >= gib or waited >= deadline_s:
            return available
        time.sleep(10)
        waited += 10


def train(args, holo, peak):
    results = []
    for vocab in {"512": (None,), "151936": (QWEN25_VOCAB,), "both": (None, QWEN25_VOCAB)}[args.vocab]:
        available = wait_for_memory(12 if vocab else 8, 1200)
        print(f"train, vocab {vocab or 512}: {available:.1f} GiB available", flush=True)
        folder = init_model(holo, os.path.join(args.work_dir, f"qwen2.5-0.5b-shapes-v{vocab or 512}"), "qwen2", vocab)
        shapes = tensor_shapes(folder)
        parameters = sum(numel(shape) for shape in shapes.values())
        head = shapes.get("lm_head.weight", shapes["model.embed_tokens.weight"])
        rows = os.path.join(args.work_dir, "roofline-rows.jsonl")
        with open(rows, "w") as out:
            for a, b in ((12, 34), (56, 7), (23, 45), (8, 91)):
                out.write(json.dumps({"question": f"What is {a}+{b}?", "expected": str(a + b)}) + "\n")
        run = os.path.join(args.work_dir, f"roofline-run-v{vocab or 512}")
        subprocess.run(["rm", "-rf", run], check=True)
        command = [holo, "train", HOL, "--model", folder, "--data", rows, "--out", run, "--max-steps", str(args.steps),
                   "--num-generations", "8", "--per-device-train-batch-size", "16", "--max-completion-length", "128",
                   "--learning-rate", "1e-05", "--seed", "0", "--beta", "0.0", "--loss-type", "dapo",
                   "--temperature", "1.0", "--gradient-checkpointing", "true", "--lr-scheduler-type", "linear",
                   "--top-p", "1.0", "--top-k", "0", "--save-strategy", "no", "--device", "cpu"]
        load_before = load_average()
        threads = str(args.train_threads)
        env = dict(os.environ, RAYON_NUM_THREADS=threads, OMP_NUM_THREADS=threads)
        clock, logged = watched(command, env, os.path.join(run, "metrics.jsonl"))
        with open(os.path.join(run, "metrics.jsonl")) as lines:
            metrics = [json.loads(line) for line in lines if line.strip()]
        # Tokens per step: the completions' (trained) tokens, and the tokens the pass reads when each
        # group's prompt is computed once (shared prefixes).
        trained, read = [0] * len(metrics), [0] * len(metrics)
        with open(os.path.join(run, "rollouts.jsonl")) as records:
            prompts = {}
            for line in records:
                record = json.loads(line)
                step = record.get("step", 1) - 1
                (context,) = record["contexts"]
                mask = context["tokens"]["loss_mask"]
                trained[step] += sum(mask)
                prompt = tuple(context["tokens"]["ids"][:mask.index(1)] if 1 in mask else context["tokens"]["ids"])
                read[step] += sum(mask) + (0 if (step, prompt) in prompts else len(prompt))
                prompts[(step, prompt)] = True
        steps = []
        for index, m in enumerate(metrics):
            seconds = m["time/backward"]
            # The step's phases run generation, forward and backward, update, then its line is logged:
            # the backward's CPU seconds are the process's between those instants.
            ended = logged[index] - m["time/optimizer"]
            cpu = cpu_at(clock, ended) - cpu_at(clock, ended - seconds)
            flop6, flop8 = 6 * parameters * trained[index], 8 * parameters * trained[index]
            steps.append({"step": index + 1, "backward_s": seconds, "backward_cpu_s": cpu,
                          "generation_s": m.get("time/generation"), "optimizer_s": m.get("time/optimizer"),
                          "step_s": m.get("step_time"), "trained_tokens": trained[index], "pass_tokens": read[index],
                          "gflops_6pt": flop6 / seconds / 1e9, "gflops_8pt": flop8 / seconds / 1e9,
                          "ratio_6pt": flop6 / seconds / 1e9 / peak, "ratio_8pt": flop8 / seconds / 1e9 / peak,
                          # Per CPU second, times the threads: the rate on cores of its own.
                          "cpu_ratio_6pt": args.train_threads * flop6 / cpu / 1e9 / peak,
                          "cpu_ratio_8pt": args.train_threads * flop8 / cpu / 1e9 / peak})
        fastest = max(steps, key=lambda s: s["gflops_6pt"])
        result = {"vocab": vocab or 512, "parameters": parameters, "head_parameters": numel(head),
                  "head_share": numel(head) / parameters, "steps": steps, "best": fastest,
                  "load_average_before": load_before, "load_average_after": load_average()}
        print(f"train, vocab {vocab or 512}: P = {parameters:,} (head {numel(head) / parameters:.1%}); per step "
              + "; ".join(f"T = {s['trained_tokens']} ({s['pass_tokens']} through the pass), forward+backward "
                          f"{s['backward_s']:.2f} s ({s['backward_cpu_s']:.2f} CPU s): 6PT {s['gflops_6pt']:.0f} "
                          f"GFLOP/s = {s['ratio_6pt']:.1%} of {peak:.0f} ({s['cpu_ratio_6pt']:.1%} per CPU s), "
                          f"8PT {s['gflops_8pt']:.0f} = {s['ratio_8pt']:.1%} ({s['cpu_ratio_8pt']:.1%})" for s in steps)
              + f"; load average {load_before} -> {result['load_average_after']}", flush=True)
        results.append(result)
    return results


def sample(args, holo, bench, read1, read2):
    results = []
    for name, arch, vocab in (("smollm2-135m", "llama", SMOLLM2_VOCAB), ("qwen3-0.6b", "qwen3", QWEN3_VOCAB)):
        folder = init_model(holo, os.path.join(args.work_dir, f"{name}-shapes-v{vocab}"), arch, vocab)
        for threads, bandwidth in ((1, read1), (2, read2)):
            for batch in (1, 8):
                load_before = load_average()
                out = run_json([bench, folder, "--batch", str(batch), "--prompt-len", "16", "--new", str(args.new),
                                "--repeats", str(args.repeats)], threads)
                # Decoding steps per second of the fastest run, its prefill taken out.
                decode_s = min(out["times_s"]) - out["prefill_s"]
                steps_per_s = args.new / decode_s
                gbs = out["weight_bytes_per_token"] * steps_per_s / 1e9
                # The CPU seconds of decoding: the fastest run's, in the share its decoding had of its wall time.
                cpu_s = min(out["cpu_times_s"]) * decode_s / min(out["times_s"])
                cpu_gbs = out["weight_bytes_per_token"] * args.new / cpu_s * threads / 1e9
                row = {"model": name, "threads": threads, "batch": batch, "bytes_per_step": out["weight_bytes_per_token"],
                       "tokens_per_s": out["best_new_tokens_per_s"], "steps_per_s": steps_per_s, "gbs": gbs,
                       "ratio": gbs / bandwidth, "gbs_per_cpu_s_times_threads": cpu_gbs, "cpu_ratio": cpu_gbs / bandwidth,
                       "load_average_before": load_before, "load_average_after": load_average(), "raw": out}
                print(f"sample {name}, {threads} thread(s), B = {batch}: {out['weight_bytes_per_token'] / 1e9:.3f} GB "
                      f"a step x {steps_per_s:.1f} steps/s = {gbs:.2f} GB/s = {row['ratio']:.1%} of {bandwidth:.2f} "
                      f"(per CPU s x threads {cpu_gbs:.2f} = {row['cpu_ratio']:.1%}) "
                      f"({out['best_new_tokens_per_s']:.1f} tokens/s with prefill); load average {load_before} -> "
                      f"{row['load_average_after']}", flush=True)
                results.append(row)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--holo-bin")
    parser.add_argument("--peaks-bin")
    parser.add_argument("--sample-bin")
    parser.add_argument("--work-dir", default=os.path.expanduser("~/.cache/holo-peers/bench-models"))
    parser.add_argument("--only", choices=["peaks", "train", "sample"])
    parser.add_argument("--peaks-json", help="the peaks of an earlier --json instead of measuring them again")
    parser.add_argument("--vocab", choices=["512", "151936", "both"], default="both", help="training's vocabularies")
    parser.add_argument("--gb", type=float, default=1.5, help="the read peaks' buffer, GB")
    parser.add_argument("--steps", type=int, default=2, help="GRPO steps per training run")
    parser.add_argument("--train-threads", type=int, choices=[1, 2], default=2,
                        help="training's threads (1: against one core's peak, where no thread waits on another)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new", type=int, default=64, help="tokens sampled per row")
    parser.add_argument("--json")
    args = parser.parse_args()
    os.makedirs(args.work_dir, exist_ok=True)
    report = {}

    def save():
        if args.json:
            with open(args.json, "w") as out:
                json.dump(report, out, indent=1)

    if args.peaks_json:
        with open(args.peaks_json) as f:
            report["peaks"] = json.load(f)["peaks"]
    elif args.only in (None, "peaks"):
        report["peaks"] = peaks(args)
        save()
    if args.only in (None, "train", "sample"):
        if "peaks" not in report:
            sys.exit("training and sampling need the peaks: measure them (no --only) or pass --peaks-json")
        summary = report["peaks"]["summary"]
        holo = binary("holo", args.holo_bin)
        if args.only in (None, "train"):
            peak = summary["fma_gflops_1"] if args.train_threads == 1 else summary["fma_gflops_2"]
            report["train"] = train(args, holo, peak)
            save()
        if args.only in (None, "sample"):
            report["sample"] = sample(args, holo, binary("sample", args.sample_bin), summary["read_gbs_1"],
                                      summary["read_gbs_2"])
            save()


if __name__ == "__main__":
    main()
