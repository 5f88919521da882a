#!/usr/bin/env python3
"""Concurrent clients against `holo serve` (and llama.cpp's `llama-server`, when given), side by side.

    python3 benches/serve_compare.py --model MODEL [--holo target/release/holo] [--llama-server PATH]
        [--clients 1,4,16,64] [--requests-per-client 3] [--seed 0] [--holo-arg=--batch-invariant ...]

MODEL is a model folder or a `.gguf` file (llama-server needs a `.gguf`). For each number of clients B,
each server gets the same requests: B threads, each sending `--requests-per-client` completions one after
the other, with mixed prompt lengths (16 to 512 words) and mixed `max_tokens` (16 to 256), temperature 1
and a fixed seed per request. Printed per server and B: completion tokens per second over the whole run,
p50 / p99 request latency, and when both servers ran, the ratios (holo / llama.cpp). Standard library
only; nothing is downloaded.
"""

import argparse
import json
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request

WORDS = ("the cat sat on a mat while seven birds sang about numbers rivers mountains and the sea "
         "when one plus two makes three each answer comes after careful thought").split()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url, process, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode} before answering {url}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} did not answer within {timeout} s")


def requests_for(clients, per_client, seed):
    rng = random.Random(seed)
    work = []
    for _ in range(clients):
        mine = []
        for _ in range(per_client):
            words = rng.randint(16, 512)
            prompt = " ".join(rng.choice(WORDS) for _ in range(words))
            mine.append({"prompt": prompt, "max_tokens": rng.randint(16, 256), "temperature": 1.0,
                         "seed": rng.randrange(1 << 31)})
        work.append(mine)
    return work


def post(url, body):
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=3600) as response:
        return json.loads(response.read())


def load(base, model_name, work):
    """Runs every client's requests; returns (completion tokens, wall seconds, latencies)."""
    latencies, tokens, errors = [], [0], []
    lock = threading.Lock()

    def client(mine):
        for body in mine:
            started = time.perf_counter()
            try:
                answer = post(base + "/v1/completions", dict(body, model=model_name))
            except Exception as error:  # noqa: BLE001 - reported below
                with lock:
                    errors.append(str(error))
                continue
            elapsed = time.perf_counter() - started
            with lock:
                latencies.append(elapsed)
                tokens[0] += answer["usage"]["completion_tokens"]

    threads = [threading.Thread(target=client, args=(mine,)) for mine in work]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    if errors:
        raise SystemExit(f"{len(errors)} requests failed, first: {errors[0]}")
    return tokens[0], wall, sorted(latencies)


def percentile(sorted_values, q):
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


def start_holo(holo, model, port, max_seqs, extra):
    command = [holo, "serve", model, "--port", str(port), "--served-model-name", "bench",
               "--max-num-seqs", str(max_seqs), *extra]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), "bench"


def start_llama(server, model, port, slots):
    command = [server, "-m", model, "--port", str(port), "--host", "127.0.0.1", "--parallel", str(slots),
               "--cont-batching", "-c", str(2048 * slots), "--threads", str(os.cpu_count() or 1)]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), "bench"


def measure(name, start, args, clients_list):
    results = {}
    for clients in clients_list:
        port = free_port()
        process, model_name = start(port, max(clients, 1))
        try:
            wait_ready(f"http://127.0.0.1:{port}/health", process)
            work = requests_for(clients, args.requests_per_client, args.seed + clients)
            tokens, wall, latencies = load(f"http://127.0.0.1:{port}", model_name, work)
        finally:
            process.terminate()
            process.wait()
        results[clients] = (tokens / wall, percentile(latencies, 0.5), percentile(latencies, 0.99))
        rate, p50, p99 = results[clients]
        print(f"{name:>10} B={clients:<3} {rate:8.1f} tokens/s  p50 {p50:7.2f} s  p99 {p99:7.2f} s  "
              f"({tokens} tokens in {wall:.1f} s)", flush=True)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--holo", default="target/release/holo")
    parser.add_argument("--holo-arg", action="append", default=[],
                        help="one more argument for holo serve (repeatable), e.g. --holo-arg=--batch-invariant")
    parser.add_argument("--llama-server")
    parser.add_argument("--clients", default="1,4,16,64")
    parser.add_argument("--requests-per-client", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    clients_list = [int(c) for c in re.split(r"[, ]+", args.clients) if c]
    holo = measure("holo", lambda port, n: start_holo(args.holo, args.model, port, n, args.holo_arg), args, clients_list)
    if not args.llama_server:
        print("llama.cpp: skipped (no --llama-server)")
        return
    llama = measure("llama.cpp", lambda port, n: start_llama(args.llama_server, args.model, port, n), args,
                    clients_list)
    for clients in clients_list:
        (rate, _, p99), (llama_rate, _, llama_p99) = holo[clients], llama[clients]
        print(f"B={clients:<3} throughput holo/llama.cpp = {rate / llama_rate:.2f}x, "
              f"p99 holo/llama.cpp = {p99 / llama_p99:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
