#!/usr/bin/env python3
"""Asynchronous GRPO (`max_off_policy_steps = k`) against the synchronous loop: steps per hour, the reward
curve, the sampler-trainer mismatch, and whether drawing ahead biases which rollouts are trained.

Usage: benches/async_grpo.py [--holo PATH] [--work DIR] [--ks 0,1,2] [--seeds 3] [--steps 12]
                             [--mode inproc|server] [--arch qwen2] [--preset tiny]
                             [--hol benches/arith.hol] [--correction on|off] [--learning-rate 5e-4]
                             [--max-completion-length 96] [--loss-type dapo]
                             [--servers 1] [--slow-delay 0] [--server-concurrency 64]

- model: a random folder from `holo init-model --arch ARCH --preset PRESET`;
- runs: `benches/arith.hol` (or `--hol`: `benches/spread.hol` ends each reply at a punctuation token, so a
  random model's reply lengths spread from 1 token to the limit) on arithmetic rows, `--steps` optimizer
  steps, 2 prompts × 8 completions of up to `--max-completion-length` (96) tokens per step, full
  fine-tuning, TRL's importance-sampling correction (`--correction off` leaves it out);
- `--mode inproc`: the trainer samples in process (k > 0: snapshots of the weights on a thread of their
  own); `--mode server`: the trainer on core 0 (`taskset -c 0`) samples on a `holo serve` on core 1
  (`taskset -c 1`), pushing its weights after every step; `--servers 2` starts two, both on core 1, each
  behind a counting proxy, the last one's proxy answering its rollouts one at a time, each `--slow-delay`
  seconds after the server did (a server that samples one rollout per `--slow-delay` seconds); `--server-concurrency` is the trainer's
  `--vllm-server-concurrency` (requests a server runs at once; the others wait at the trainer for the
  first server done with one), and each run reports how many rollout requests each server took;
- per run: seconds per step after the first (the first loads and compiles nothing, but starts the
  pipeline), the mean reward of the last third of the steps, the mean of `sampling/mismatch_kl`, the
  largest importance ratio, the share of ratios corrected, the mean `async/staleness`;
- per k > 0 and seed: the Kolmogorov-Smirnov distance between the completion lengths trained by that run
  and by the synchronous run of the same seed (every generated rollout is trained: a distance near 0
  says that drawing ahead does not favour short rollouts), and per run the spread of the lengths (5th
  and 95th percentiles).

Wall-clock figures on a shared machine move with its load: compare the rows of one invocation only.
"""

import argparse
import http.server
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOL = os.path.join(ROOT, "benches", "arith.hol")


def write_rows(path, count=64):
    rng = random.Random(0)
    with open(path, "w") as out:
        for _ in range(count):
            a, b = rng.randint(1, 99), rng.randint(1, 99)
            out.write(json.dumps({"question": f"What is {a}+{b}?", "expected": str(a + b)}) + "\n")


def model_folder(holo, work, arch, preset):
    folder = os.path.join(work, f"{arch}-{preset}")
    if not os.path.exists(os.path.join(folder, "config.json")):
        subprocess.run([holo, "init-model", "--arch", arch, "--preset", preset, folder], check=True,
                       stdout=subprocess.DEVNULL)
    return folder


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(holo, model, work):
    port = free_port()
    log = open(os.path.join(work, f"serve-{port}.log"), "w")
    process = subprocess.Popen(["taskset", "-c", "1", holo, "serve", model, "--port", str(port),
                                "--no-access-log"], stdout=log, stderr=log)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            urllib.request.urlopen(base + "/health", timeout=2)
            return process, base
        except OSError:
            time.sleep(0.5)
    process.kill()
    sys.exit(f"holo serve did not answer {base}/health within 120 s (see {log.name})")


class Proxy:
    """A proxy in front of `base` on its own threads that counts the rollout requests (completions asking
    for tokens) it forwards; with a `delay`, it answers them one at a time, each `delay` seconds after
    the server did: a server that samples one rollout per `delay` seconds, whatever it is sent."""

    def __init__(self, base, delay):
        self.rollouts = 0
        self.lock = threading.Lock()
        self.one_at_a_time = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *_):
                pass

            def forward(self):
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else None
                rollout = False
                if self.path.endswith("/completions") and body:
                    rollout = json.loads(body).get("max_tokens") != 0
                request = urllib.request.Request(base + self.path, data=body, method=self.command,
                                                 headers={"content-type": "application/json"})
                if rollout:
                    with proxy.lock:
                        proxy.rollouts += 1
                slow = rollout and delay > 0
                if slow:
                    proxy.one_at_a_time.acquire()
                try:
                    with urllib.request.urlopen(request, timeout=600) as answer:
                        status, headers, data = answer.status, answer.headers, answer.read()
                except urllib.error.HTTPError as error:
                    status, headers, data = error.code, error.headers, error.read()
                if slow:
                    time.sleep(delay)
                    proxy.one_at_a_time.release()
                self.send_response(status)
                for name in ("content-type", "x-holo-weight-version"):
                    if headers.get(name):
                        self.send_header(name, headers[name])
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


def run(args, model, rows, k, seed):
    tag = os.path.splitext(os.path.basename(args.hol))[0]
    out = os.path.join(args.work, f"{args.mode}{args.servers}-{tag}-{args.correction}-k{k}-seed{seed}")
    shutil.rmtree(out, ignore_errors=True)
    command = [args.holo, "train", args.hol, "--model", model, "--data", rows, "--out", out,
               "--max-steps", str(args.steps), "--num-generations", "8",
               "--per-device-train-batch-size", "8", "--gradient-accumulation-steps", "2",
               "--max-completion-length", str(args.max_completion_length),
               "--learning-rate", str(args.learning_rate), "--temperature", "1.0",
               "--seed", str(seed), "--max-off-policy-steps", str(k), "--save-strategy", "no",
               "--loss-type", args.loss_type]
    if args.correction == "off" and args.loss_type != "dppo":
        command += ["--vllm-importance-sampling-correction", "false"]
    servers, proxies = [], []
    if args.mode == "server":
        command = ["taskset", "-c", "0"] + command
        for index in range(args.servers):
            server, base = start_server(args.holo, model, args.work)
            servers.append(server)
            if args.servers > 1:
                slow = index == args.servers - 1
                proxies.append(Proxy(base, args.slow_delay if slow else 0.0))
                base = proxies[-1].base
            command += ["--vllm-server-base-url", base]
        command += ["--vllm-server-concurrency", str(args.server_concurrency)]
    try:
        done = subprocess.run(command, capture_output=True, text=True)
    finally:
        for server in servers:
            server.kill()
            server.wait()
        for proxy in proxies:
            proxy.close()
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)}\n{done.stderr[-3000:]}")
    metrics = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    steps = [m for m in metrics if "loss" in m]
    lengths = []
    for line in open(os.path.join(out, "rollouts.jsonl")):
        record = json.loads(line)
        lengths.append(sum(sum(c["tokens"]["loss_mask"]) for c in record["contexts"] if "tokens" in c))
    last = steps[-max(1, len(steps) // 3):]
    ordered = sorted(lengths)
    percentile = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0
    mean = lambda values: sum(values) / len(values) if values else float("nan")
    return {
        "k": k,
        "seed": seed,
        "seconds_per_step": mean([m["step_time"] for m in steps[1:]]),
        "reward_last_third": mean([m["reward"] for m in last]),
        "mismatch_kl": mean([m.get("sampling/mismatch_kl", 0.0) for m in steps]),
        "max_ratio": max((m.get("sampling/importance_sampling_ratio/max", 1.0) for m in steps), default=1.0),
        "corrected": mean([m.get("sampling/importance_sampling_ratio/corrected_fraction", 0.0) for m in steps]),
        "staleness": mean([m.get("async/staleness", 0.0) for m in steps]),
        "rollouts": len(lengths),
        "p5": percentile(0.05),
        "p95": percentile(0.95),
        "lengths": lengths,
        "rollouts_per_server": [proxy.rollouts for proxy in proxies],
    }


def ks_distance(a, b):
    """The largest gap between the empirical distribution functions of `a` and `b`."""
    a, b = sorted(a), sorted(b)
    values = sorted(set(a) | set(b))
    gap, i, j = 0.0, 0, 0
    for value in values:
        while i < len(a) and a[i] <= value:
            i += 1
        while j < len(b) and b[j] <= value:
            j += 1
        gap = max(gap, abs(i / len(a) - j / len(b)))
    return gap


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--holo", default=os.path.join(ROOT, "target", "release", "holo"))
    parser.add_argument("--work", default="/tmp/holo-async-bench")
    parser.add_argument("--ks", default="0,1,2")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--mode", choices=["inproc", "server"], default="inproc")
    parser.add_argument("--arch", default="qwen2")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--hol", default=HOL)
    parser.add_argument("--correction", choices=["on", "off"], default="on")
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--max-completion-length", type=int, default=96)
    parser.add_argument("--loss-type", default="dapo")
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--slow-delay", type=float, default=0.0)
    parser.add_argument("--server-concurrency", type=int, default=64)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    os.makedirs(args.work, exist_ok=True)
    rows = os.path.join(args.work, "rows.jsonl")
    write_rows(rows)
    model = model_folder(args.holo, args.work, args.arch, args.preset)
    ks = [int(k) for k in args.ks.split(",")]
    results = []
    for seed in range(1, args.seeds + 1):
        for k in ks:
            results.append(run(args, model, rows, k, seed))
            r = results[-1]
            print(f"{args.mode} k={k} seed={seed}: {r['seconds_per_step']:.3f} s/step, reward "
                  f"{r['reward_last_third']:.3f}, mismatch_kl {r['mismatch_kl']:.2e}, max ratio "
                  f"{r['max_ratio']:.3f}, corrected {r['corrected']:.3f}, staleness {r['staleness']:.2f}, "
                  f"{r['rollouts']} rollouts, lengths p5 {r['p5']} "
                  f"p95 {r['p95']}"
                  + (f", rollout requests per server {r['rollouts_per_server']}"
                     if r["rollouts_per_server"] else ""), flush=True)
    print(f"\n| mode | k | s/step (mean of {args.seeds} seeds) | × synchronous | reward, last third "
          f"(min–max) | mismatch KL | max ratio | corrected | KS vs k=0 (max) |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = {r["seed"]: r for r in results if r["k"] == 0}
    sync_speed = None
    for k in ks:
        rows_k = [r for r in results if r["k"] == k]
        speed = sum(r["seconds_per_step"] for r in rows_k) / len(rows_k)
        if k == 0:
            sync_speed = speed
        rewards = [r["reward_last_third"] for r in rows_k]
        ks_max = max((ks_distance(r["lengths"], base[r["seed"]]["lengths"]) for r in rows_k
                      if r["seed"] in base), default=float("nan"))
        ratio = f"{sync_speed / speed:.2f}×" if sync_speed else "-"
        print(f"| {args.mode} | {k} | {speed:.3f} | {ratio} | {sum(rewards) / len(rewards):.3f} "
              f"({min(rewards):.3f}–{max(rewards):.3f}) | "
              f"{sum(r['mismatch_kl'] for r in rows_k) / len(rows_k):.2e} | "
              f"{max(r['max_ratio'] for r in rows_k):.3f} | "
              f"{sum(r['corrected'] for r in rows_k) / len(rows_k):.3f} | {ks_max:.3f} |")
    if args.json:
        with open(args.json, "w") as out:
            json.dump([{k: v for k, v in r.items() if k != "lengths"} for r in results], out, indent=1)


if __name__ == "__main__":
    main()
