#!/usr/bin/env python3
"""Decoding from a GGUF file's quantized blocks, llama.cpp's against holo's, on the same files, one thread each.

    PYTHONPATH=~/.cache/holo-peers/llama-cpp-python-0.3.36-site ~/.cache/holo-peers/venv/bin/python \
        benches/llama_cpp_compare.py FILE.gguf [FILE.gguf ...] [--batch 1,8] [--new 32] [--prompt-len 16]
        [--repeats 3] [--sample-bench PATH] [--holo PATH] [--greedy 16]
    ... benches/llama_cpp_compare.py --q4-k-m-from Q8_0.gguf OUT.gguf

llama.cpp is llama-cpp-python's C library (`scripts/gguf_converted.py` says which build), driven through its
low-level API as a server's continuous batch drives it: the B sequences' random prompts (seeded ids) in one
`llama_decode`, then one token per sequence per `llama_decode`, each drawn at temperature 1 from that row's
logits (numpy, inverse CDF), `--new` tokens per sequence, no end-of-turn. The context is llama.cpp's default
(f16 keys and values, flash attention as llama.cpp picks it), `n_threads` and `n_threads_batch` 1. Each
measurement is one untimed warm-up run then `--repeats` timed ones, the cache cleared before each, timed in
wall and CPU seconds (`time.process_time`, the whole process: llama.cpp runs on the calling thread with one
thread): the prefill and the decoding steps apart. holo is `sample_bench FILE --quantized` with the same
batch, lengths and repeats under `RAYON_NUM_THREADS=1`, whose `new_tokens_per_s` and `new_tokens_per_cpu_s`
are B × `--new` tokens over the median of its runs of `generate`, the prefill included; the ratios compare
them with llama.cpp's prefill + decoding counted the same way (median of the runs). llama.cpp's decoding steps
alone (B × (`--new` − 1) tokens) and both prefills (holo's a separate pass) are printed beside.

With `--holo PATH` (a built `holo`), a check that both sides decode the same model first: for each file, the
same few prompts' greedy continuations of `--greedy` tokens, from llama.cpp here and from `holo serve FILE
--quantized` (temperature 0), compared token by token (holo's text re-tokenized by llama.cpp).

`--q4-k-m-from` writes a Q4_K_M file from another GGUF file with `llama_model_quantize` (`allow_requantize`, as
`llama-quantize --allow-requantize` does) and prints the type of each of its tensors by count.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

import llama_cpp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_compare import free_port, start_holo, wait_ready  # noqa: E402

VENDORED = Path.home() / ".cache/holo-peers/llama-cpp-python-0.3.36/vendor/llama.cpp"
GREEDY_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "Question: What is 12 times 7?\nAnswer:",
    "In 1969, the first humans",
]

# llama.cpp's log, silenced; kept alive here, since llama.cpp calls it for as long as the process runs.
QUIET = llama_cpp.llama_log_callback(lambda level, text, data: None)


class Llama:
    """One model and one context of llama.cpp with room for `sequences` sequences of `length` tokens."""

    def __init__(self, path: Path, sequences: int, length: int):
        model_params = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), model_params)
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {path}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        params = llama_cpp.llama_context_default_params()
        # Each sequence gets n_ctx / n_seq_max cells of the cache; llama.cpp pads n_ctx to 256.
        params.n_ctx = max(256, sequences * length)
        params.n_batch = params.n_ubatch = max(sequences * length, 512)
        params.n_seq_max = sequences
        params.n_threads = params.n_threads_batch = 1
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise SystemExit(f"llama.cpp could not make a context for {path}")
        self.batch = llama_cpp.llama_batch_init(params.n_batch, 0, sequences)

    def close(self):
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)

    def clear(self):
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One `llama_decode` of (token, position, sequence, wants logits) entries."""
        for i, (token, position, sequence, logits) in enumerate(entries):
            self.batch.token[i] = token
            self.batch.pos[i] = position
            self.batch.n_seq_id[i] = 1
            self.batch.seq_id[i][0] = sequence
            self.batch.logits[i] = logits
        self.batch.n_tokens = len(entries)
        status = llama_cpp.llama_decode(self.ctx, self.batch)
        if status != 0:
            raise SystemExit(f"llama_decode returned {status}")

    def logits(self, i: int) -> np.ndarray:
        """The logits of the i-th entry that wanted them in the last `decode` (-1: the last one)."""
        pointer = llama_cpp.llama_get_logits_ith(self.ctx, i)
        return np.ctypeslib.as_array(pointer, shape=(self.n_vocab,))

    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        out = (llama_cpp.llama_token * (len(data) + 8))()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), out, len(out), True, False)
        return list(out[:n])

    def piece(self, token: int) -> bytes:
        out = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self.vocab, token, out, len(out), 0, False)
        return out.raw[:n]


def draw(logits: np.ndarray, rng: np.random.Generator) -> int:
    """A token drawn from softmax(logits) at temperature 1."""
    weights = np.exp(logits - logits.max())
    cumulative = np.cumsum(weights)
    return int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))


def llama_run(llama: Llama, batch: int, prompt_len: int, new: int, rng: np.random.Generator) -> dict:
    """One run: the prompts' prefill, then `new` steps of one token per sequence; wall and CPU seconds of each."""
    llama.clear()
    prompts = rng.integers(0, llama.n_vocab, size=(batch, prompt_len))
    wall, cpu = time.perf_counter(), time.process_time()
    llama.decode([(int(prompts[s, p]), p, s, p == prompt_len - 1) for s in range(batch) for p in range(prompt_len)])
    tokens = [draw(llama.logits(s * prompt_len + prompt_len - 1), rng) for s in range(batch)]
    prefill_wall, prefill_cpu = time.perf_counter() - wall, time.process_time() - cpu
    wall, cpu = time.perf_counter(), time.process_time()
    for step in range(new - 1):
        llama.decode([(tokens[s], prompt_len + step, s, True) for s in range(batch)])
        tokens = [draw(llama.logits(s), rng) for s in range(batch)]
    # The first new token came from the prefill's logits: `new` tokens per sequence in all.
    return {"prefill_s": prefill_wall, "prefill_cpu_s": prefill_cpu,
            "decode_s": time.perf_counter() - wall, "decode_cpu_s": time.process_time() - cpu}


def llama_bench(path: Path, batch: int, prompt_len: int, new: int, repeats: int, seed: int) -> dict:
    llama = Llama(path, batch, prompt_len + new)
    rng = np.random.default_rng(seed)
    try:
        llama_run(llama, batch, prompt_len, new, rng)
        runs = [llama_run(llama, batch, prompt_len, new, rng) for _ in range(repeats)]
    finally:
        llama.close()
    # sample_bench times the whole `generate` (the prefill included) and counts every new token.
    whole = [r["prefill_s"] + r["decode_s"] for r in runs]
    whole_cpu = [r["prefill_cpu_s"] + r["decode_cpu_s"] for r in runs]
    return {"new_tokens_per_s": batch * new / statistics.median(whole),
            "new_tokens_per_cpu_s": batch * new / statistics.median(whole_cpu),
            # The decoding steps alone: the tokens after the prefill's first.
            "decode_tokens_per_s": batch * (new - 1) / statistics.median(r["decode_s"] for r in runs),
            "decode_tokens_per_cpu_s": batch * (new - 1) / statistics.median(r["decode_cpu_s"] for r in runs),
            "prefill_s": statistics.median(r["prefill_s"] for r in runs)}


def holo_bench(sample_bench: str, path: Path, batch: int, prompt_len: int, new: int, repeats: int) -> dict:
    command = [sample_bench, str(path), "--batch", str(batch), "--new", str(new), "--prompt-len", str(prompt_len),
               "--repeats", str(repeats), "--quantized"]
    run = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "RAYON_NUM_THREADS": "1"})
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{run.stderr}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def llama_greedy(path: Path, prompts: list[str], new: int) -> list[list[int]]:
    out = []
    for prompt in prompts:
        llama = Llama(path, 1, 256)
        try:
            ids = llama.tokenize(prompt)
            llama.decode([(t, p, 0, p == len(ids) - 1) for p, t in enumerate(ids)])
            continuation = [int(np.argmax(llama.logits(-1)))]
            for step in range(new - 1):
                llama.decode([(continuation[-1], len(ids) + step, 0, True)])
                continuation.append(int(np.argmax(llama.logits(-1))))
        finally:
            llama.close()
        out.append(continuation)
    return out


def holo_greedy(holo: str, path: Path, prompts: list[str], new: int) -> list[str]:
    port = free_port()
    process, name = start_holo(holo, str(path), port, 1, ["--quantized"])
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", process)
        texts = []
        for prompt in prompts:
            body = json.dumps({"model": name, "prompt": prompt, "max_tokens": new, "temperature": 0}).encode()
            request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=300) as response:
                texts.append(json.load(response)["choices"][0]["text"])
    finally:
        process.terminate()
        process.wait()
    return texts


def greedy_check(holo: str, path: Path, new: int) -> tuple[int, int]:
    """How many of the prompts' first `new` greedy tokens llama.cpp and holo agree on (up to the first
    difference in each), of how many."""
    ours = llama_greedy(path, GREEDY_PROMPTS, new)
    theirs = holo_greedy(holo, path, GREEDY_PROMPTS, new)
    llama = Llama(path, 1, 256)
    agreed = 0
    try:
        for ids, text in zip(ours, theirs):
            ours_text = b"".join(llama.piece(t) for t in ids).decode(errors="replace")
            common = 0
            for a, b in zip(ours_text, text):
                if a != b:
                    break
                common += 1
            # Tokens of llama.cpp's continuation whose text holo's continuation also begins with.
            length, tokens = 0, 0
            for t in ids:
                length += len(llama.piece(t).decode(errors="replace"))
                if length > common:
                    break
                tokens += 1
            agreed += tokens
            print(f"  {tokens:2d}/{new} tokens agree: llama.cpp {ours_text!r} | holo {text!r}", flush=True)
    finally:
        llama.close()
    return agreed, new * len(GREEDY_PROMPTS)


def types_by_tensor(path: Path) -> dict[str, str]:
    """Each tensor's GGML type, read by the vendored llama.cpp's `gguf-py`."""
    sys.path.insert(0, str(VENDORED / "gguf-py"))
    import gguf

    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def quantize_q4_k_m(source: Path, out: Path) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.allow_requantize = True
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params))
    if status != 0:
        raise SystemExit(f"llama_model_quantize returned {status}")
    kinds = collections.defaultdict(collections.Counter)
    for name, kind in types_by_tensor(out).items():
        # blk.N.attn_q.weight -> attn_q.weight
        kinds[name.split(".", 2)[-1] if name.startswith("blk.") else name][kind] += 1
    for name, counts in sorted(kinds.items()):
        print(f"{name}: {dict(counts)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", type=Path)
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample-bench", default=os.path.join(os.environ.get("CARGO_TARGET_DIR", "target"),
                                                               "debug/examples/sample_bench"))
    parser.add_argument("--holo", help="a built holo, for the greedy check")
    parser.add_argument("--greedy", type=int, default=16, help="tokens per prompt in the greedy check")
    parser.add_argument("--q4-k-m-from", nargs=2, type=Path, metavar=("SOURCE", "OUT"))
    args = parser.parse_args()
    llama_cpp.llama_backend_init()
    llama_cpp.llama_log_set(QUIET, ctypes.c_void_p(0))
    if args.q4_k_m_from:
        quantize_q4_k_m(*args.q4_k_m_from)
        return
    rows = []
    for path in args.files:
        print(f"{path.name}: {dict(collections.Counter(types_by_tensor(path).values()))}", flush=True)
        if args.holo:
            agreed, total = greedy_check(args.holo, path, args.greedy)
            print(f"  greedy: {agreed} of {total} tokens agree", flush=True)
        for batch in map(int, args.batch.split(",")):
            llama = llama_bench(path, batch, args.prompt_len, args.new, args.repeats, args.seed)
            holo = holo_bench(args.sample_bench, path, batch, args.prompt_len, args.new, args.repeats)
            rows.append((path.name, batch, llama, holo))
            print(json.dumps({"file": path.name, "batch": batch, "llama_cpp": llama,
                              "holo": {k: holo[k] for k in ("new_tokens_per_s", "new_tokens_per_cpu_s",
                                                            "prefill_s")}}), flush=True)
    print("\n| file | B | llama.cpp tokens/s | holo tokens/s | holo / llama.cpp | llama.cpp tokens/CPU s "
          "| holo tokens/CPU s | holo / llama.cpp (CPU) | llama.cpp decoding alone: tokens/s, /CPU s "
          "| prefill s: llama.cpp, holo |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, batch, llama, holo in rows:
        print(f"| {name} | {batch} | {llama['new_tokens_per_s']:.1f} | {holo['new_tokens_per_s']:.1f} "
              f"| {holo['new_tokens_per_s'] / llama['new_tokens_per_s']:.2f} "
              f"| {llama['new_tokens_per_cpu_s']:.1f} | {holo['new_tokens_per_cpu_s']:.1f} "
              f"| {holo['new_tokens_per_cpu_s'] / llama['new_tokens_per_cpu_s']:.2f} "
              f"| {llama['decode_tokens_per_s']:.1f}, {llama['decode_tokens_per_cpu_s']:.1f} "
              f"| {llama['prefill_s']:.3f}, {holo['prefill_s']:.3f} |")

if __name__ == "__main__":
    main()
