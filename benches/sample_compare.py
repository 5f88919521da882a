#!/usr/bin/env python3
"""Batched sampling throughput and peak memory: holo-runtime's candle model against transformers `generate`.

    ~/.cache/holo-peers/venv/bin/python benches/sample_compare.py [--which tiny|qwen05b|both]
        [--batch 8] [--prompt-len 16] [--new 32] [--repeats 3] [--threads 2] [--dtype f32|bf16]
        [--device cpu|cuda]

Both sides load the same Hugging Face folder, sample the same batch of random prompt ids (seeded) at
temperature 1 with no top-k/top-p, and generate exactly --new tokens per row (transformers:
`min_new_tokens = max_new_tokens`; holo: no end-of-turn token). Each side runs in its own process, one after
the other, with a warm-up run before --repeats timed runs; the script prints the median new tokens per
second of each, the ratio, and each process's peak resident memory (GNU time's maximum RSS). `--dtype bf16`
loads the weights in bf16 on both sides: transformers computes in bf16 (torch's CPU kernels), holo keeps
the matrices in bf16 and computes in f32.

`--device cuda` runs both sides on the first GPU (holo built with `--features cuda`; see docs/cuda.md), at
bf16 both computing in bf16; each timed run ends with `torch.cuda.synchronize()` on the Python side (holo's
sampled tokens come back to the host at every step). Peak GPU memory is the rise of the GPU's used memory
(`nvidia-smi`, polled every 0.1 s) over what it was before the process started, the CUDA context included.

Models (built once under --work-dir, default ~/.cache/holo-peers/bench-models):
- tiny:    `holo init-model --arch qwen2 --preset tiny` (107k parameters, vocab 512);
- qwen05b: Qwen2ForCausalLM with Qwen2.5-0.5B's config (hidden 896, 24 layers, 14 heads / 2 kv heads,
           intermediate 4864, vocab 151936, tied embeddings), random weights from transformers'
           initialisation, saved with save_pretrained (about 2 GB of f32); our offline tokenizer is copied
           in (the prompts are ids, so it only decodes).

Needs the Python peers' venv (bash ../shared/peers/setup.sh), GNU time (/usr/bin/time, Debian package `time`;
`GNU_TIME` names another path) and cargo; builds the Rust side with
`cargo build --release -p holo-runtime --example sample_bench --bin holo`, unless `--holo-bin` and
`--sample-bench-bin` name binaries built beforehand (scripts/gpu-bundle.sh). Each side's figures are printed
as soon as it has run. On 2 cores, timings collapse when anything else runs: run it on an idle machine.
"""
import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GNU_TIME = os.environ.get("GNU_TIME", "/usr/bin/time")

PYTHON_SIDE = textwrap.dedent(
    """
    import json, statistics, sys, time
    import torch
    from transformers import AutoModelForCausalLM, set_seed
    folder, batch, prompt_len, new, repeats, threads, seed, dtype, device = sys.argv[1:10]
    batch, prompt_len, new, repeats, threads, seed = map(int, (batch, prompt_len, new, repeats, threads, seed))
    torch.set_num_threads(threads)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").eval()
    model = model.to(device)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=generator).to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    attention = torch.ones_like(ids)
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
              pad_token_id=0, use_cache=True)
    times = []
    with torch.inference_mode():
        set_seed(seed)
        model.generate(input_ids=ids, attention_mask=attention, **kw)
        for r in range(repeats):
            set_seed(seed + r + 1)
            sync()
            start = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=attention, **kw)
            sync()
            times.append(time.perf_counter() - start)
            assert out.shape[1] - prompt_len == new
    median = statistics.median(times)
    print(json.dumps({"times_s": times, "median_s": median, "new_tokens_per_s": batch * new / median,
                      "best_new_tokens_per_s": batch * new / min(times)}))
    """
)


def run_measured(command, env=None, device="cpu"):
    """Runs a command, returns (stdout, peak RSS in MiB, peak GPU memory in MiB or None).

    The peak is measured by GNU time around the command: `wait4`'s ru_maxrss would include this script's own
    peak (Linux keeps the high-water mark across fork and exec), which building the 0.5B folder inflates.
    On a GPU, also the rise of its used memory (benches/gpu.py).
    """
    gpu_peak = gpu.PeakMemory() if device == "cuda" else contextlib.nullcontext()
    with tempfile.NamedTemporaryFile(mode="r") as peak:
        with gpu_peak:
            completed = subprocess.run(
                [GNU_TIME, "-f", "%M", "-o", peak.name, *command], capture_output=True, env=env
            )
        if completed.returncode != 0:
            sys.exit(f"{' '.join(command)} failed ({completed.returncode}):\n{completed.stderr.decode(errors='replace')}")
        rss_mib = int(peak.read().split()[-1]) / 1024
    return completed.stdout.decode(), rss_mib, (gpu_peak.mib if device == "cuda" else None)


def build_rust(device):
    features = ["--features", "cuda"] if device == "cuda" else []
    subprocess.run(
        ["cargo", "build", "--release", "-q", "-p", "holo-runtime", "--example", "sample_bench", "--bin", "holo",
         *features],
        cwd=ROOT,
        check=True,
    )
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    return os.path.join(target, "release", "holo"), os.path.join(target, "release", "examples", "sample_bench")


def tiny_model(holo, work):
    folder = os.path.join(work, "tiny-qwen2")
    if not os.path.isfile(os.path.join(folder, "model.safetensors")):
        subprocess.run([holo, "init-model", "--arch", "qwen2", "--preset", "tiny", "--force", folder], check=True)
    return folder


def qwen05b_model(holo, work):
    folder = os.path.join(work, "qwen2.5-0.5b-shapes")
    if os.path.isfile(os.path.join(folder, "model.safetensors")):
        return folder
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
        rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645,
    )
    Qwen2ForCausalLM(config).save_pretrained(folder)
    # Our offline tokenizer, for the Rust loader (prompts are ids; it only decodes).
    tokenizer = tiny_model(holo, work)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizer, name), os.path.join(folder, name))
    return folder


def compare(name, folder, bench, args):
    shape = [str(args.batch), str(args.prompt_len), str(args.new), str(args.repeats)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    print(f"{name}: batch {args.batch}, prompt {args.prompt_len}, {args.new} new tokens per row, "
          f"{args.threads} threads, {args.dtype} weights, {args.device}", flush=True)
    theirs_out, theirs_rss, theirs_gpu = run_measured(
        [sys.executable, "-c", PYTHON_SIDE, folder, *shape, str(args.threads), str(args.seed), args.dtype,
         args.device], env, args.device
    )
    theirs = json.loads(theirs_out)
    print(f"  transformers generate: {theirs['new_tokens_per_s']:9.1f} tok/s (median of {args.repeats}), "
          f"peak RSS {theirs_rss:7.0f} MiB" + (f", peak GPU {theirs_gpu:7.0f} MiB" if args.device == "cuda" else ""),
          flush=True)
    ours_out, ours_rss, ours_gpu = run_measured(
        [bench, folder, "--batch", shape[0], "--prompt-len", shape[1], "--new", shape[2], "--repeats", shape[3],
         "--seed", str(args.seed), "--dtype", args.dtype, "--device", args.device],
        dict(env, RAYON_NUM_THREADS=str(args.threads)), args.device
    )
    ours = json.loads(ours_out)
    print(f"  holo-runtime (candle): {ours['new_tokens_per_s']:9.1f} tok/s (median of {args.repeats}), "
          f"peak RSS {ours_rss:7.0f} MiB" + (f", peak GPU {ours_gpu:7.0f} MiB" if args.device == "cuda" else ""),
          flush=True)
    ratio = ours["new_tokens_per_s"] / theirs["new_tokens_per_s"]
    print(f"  holo / transformers:   {ratio:.2f}x tokens/s, {ours_rss / theirs_rss:.2f}x peak memory", flush=True)
    return {"model": name, "dtype": args.dtype, "device": args.device,
            "transformers": dict(theirs, peak_rss_mib=theirs_rss, peak_gpu_mib=theirs_gpu),
            "holo": dict(ours, peak_rss_mib=ours_rss, peak_gpu_mib=ours_gpu), "ratio": ratio}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--which", default="both", choices=["tiny", "qwen05b", "both"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="f32", choices=["f32", "bf16"],
                        help="weight precision on both sides (holo bf16: bf16 matrices, f32 arithmetic)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where both sides run (cuda: the first GPU; holo built with --features cuda)")
    parser.add_argument("--work-dir", default=os.path.expanduser("~/.cache/holo-peers/bench-models"))
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--holo-bin", help="a holo binary built beforehand (with --sample-bench-bin: no cargo build)")
    parser.add_argument("--sample-bench-bin", help="a sample_bench binary built beforehand (with --holo-bin)")
    args = parser.parse_args()
    if (args.holo_bin is None) != (args.sample_bench_bin is None):
        parser.error("--holo-bin and --sample-bench-bin go together")
    os.makedirs(args.work_dir, exist_ok=True)
    holo, bench = (args.holo_bin, args.sample_bench_bin) if args.holo_bin else build_rust(args.device)
    results = []
    if args.which in ("tiny", "both"):
        results.append(compare("tiny", tiny_model(holo, args.work_dir), bench, args))
    if args.which in ("qwen05b", "both"):
        results.append(compare("qwen2.5-0.5b shapes", qwen05b_model(holo, args.work_dir), bench, args))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)


if __name__ == "__main__":
    main()
