#!/usr/bin/env python3
"""Every model family at its real small size: sampling tokens/s against transformers, GRPO steps against TRL.

    ~/.cache/holo-peers/venv/bin/python benches/family_compare.py [--threads 2] \
        [--families qwen2,qwen3,llama,gemma3_text,olmo2] [--batches 1,32] [--dtypes f32,bf16] \
        [--prompt-len 16] [--new 32] [--repeats 1] [--threads 2] \
        [--grpo-families qwen3,gemma3_text] [--grpo-steps 2] [--grpo-batch 8] [--grpo-generations 4] \
        [--grpo-completion 32] [--grpo-lora olmo3,phi3 [--lora-r 16]] [--layers mistral=2,olmo3=2] \
        [--work-dir /tmp/holo-family-bench] [--keep] [--json FILE]

The measurements that issue 36 asks for, one family after another:

- Model: `holo init-model --arch ARCH --preset small` writes the family's real decoder shapes (Qwen2.5-0.5B,
  Qwen3-0.6B, SmolLM2-135M, gemma-3-1b, OLMo-2-1B, SmolLM3-3B, Mistral-7B, Ministral-8B, Olmo-3-7B,
  Phi-4-mini) with a
  512-token vocabulary; this script widens that folder to the real family's vocabulary (FAMILIES below):
  the embedding (and an untied output head) get random rows of the same spread as the first 512, and
  config.json's `vocab_size` is set. The tokenizer gets the new ids as non-special added tokens `zq<id>`
  (tokenizer.json's `added_tokens` for holo, tokenizer_config.json's `added_tokens_decoder` for
  transformers 5, which rebuilds the family's tokenizer class from vocabulary and merges): the chat
  prompts encode to the same ids as before on both sides, and a sampled new id decodes to its name. Both sides then
  load the same folder, the same f32 bytes (bf16: both convert them at load).
- Sampling (a): for every `--dtypes` and `--batches`, transformers' `generate` (sdpa, KV cache, temperature
  1, top-k 0, top-p 1, exactly `--new` tokens per row via `min_new_tokens`) in one process, then holo's
  `sample_bench` example (the scheduler's sampling path, no end-of-turn token) in another, right after,
  on the same seeded random prompt ids of `--prompt-len` tokens (a side that runs past `--side-timeout`
  is reported as failed and the script goes on). Each side does an untimed warm-up
  (transformers: a 4-token generate; holo: a full run) and reports the median of `--repeats` timed runs
  in new tokens per second (batch × new / seconds), the same per CPU second of the process (Python's
  `process_time`, holo's `CLOCK_PROCESS_CPUTIME_ID`: with one thread a side, what the run cost, where wall time
  also counts the waits for cores other work holds), and its peak RSS (GNU time).
- GRPO (b): `benches/grpo_compare.py --model NAME=FOLDER` (TRL's `GRPOTrainer` then `holo train`, same
  folder, data, seed and settings; see its docstring) for each `--grpo-families`, `--grpo-steps` steps
  of `--grpo-batch` completions (`--grpo-generations` per prompt) of `--grpo-completion` tokens, f32,
  gradient checkpointing on both; the step time is the median of the steps after the first, in seconds and in
  CPU seconds of each side's process. Families in `--grpo-lora` train LoRA adapters of rank `--lora-r` on
  every linear projection (grpo_compare.py's `--lora-r`, PEFT on TRL's side) instead of every weight: for
  the models whose f32 weights, gradients and AdamW moments (16 bytes a parameter) would not fit.
- Each row also records the machine's load average when it ended (`os.getloadavg`).

Families (`--families`; the default is the ones whose real size fits a 2-core, 24 GiB CPU box in minutes):

    qwen2 (Qwen2.5-0.5B, vocab 151,936), qwen3 (Qwen3-0.6B, 151,936), llama (SmolLM2-135M, 49,152),
    gemma3_text (gemma-3-1b, 262,144), olmo2 (OLMo-2-1B, 100,278), smollm3 (SmolLM3-3B, 128,256),
    qwen3_5_text (Qwen3.5-0.8B's decoder, 248,320; transformers runs its pure-torch delta rule, as on any
    machine without the fla kernels), qwen3_moe (two of Qwen3-30B-A3B's 48 layers: 128 experts of 768, 8 per
    token; 151,936), gpt_oss (two of gpt-oss-20b's 24 layers: 32 experts of 2,880, 4 per token, sinks, a
    128-position window on the first; 201,088; transformers' eager attention, it has no sdpa path for sinks),
    mistral (Mistral-7B, 32,768), ministral (Ministral-8B, 131,072), olmo3 (Olmo-3-7B,
    100,278), phi3 (Phi-4-mini, 200,064; 3.8 B parameters with its tied embedding).

The 7-8B ones need ~30 GiB in f32, Phi-4-mini 15 GiB, and are refused unless `--allow-big` is given, or
`--layers FAMILY=N` (`holo init-model --layers N`) keeps N of their decoder layers, at the real width and in
the real pattern of windows and RoPE-free layers: each layer then costs per token what the real model's do,
while the embedding and head weigh more in the whole than in the real model (as for the mixtures above).

Disk: each model folder is kept until its family is done (gemma3 3.7 GiB, olmo2 5.6 GiB in f32), and
`holo train` always ends with a checkpoint of the weights and AdamW's moments (about 12 GB at 1 B
parameters in f32) in grpo_compare.py's temporary folder: have that much free in $TMPDIR.
On a machine where other work runs, `--threads 1`: with 2 threads on 2 busy cores both sides' thread
pools collapse (holo's more). Both sides run one after the other on the same cores: on a shared machine the figures are noisy (each
side's "other load", the CPU the rest of the machine used during its run, is printed; compare the pairs,
not rows across runs). Models are built under --work-dir and deleted at the end unless --keep.
Needs the peers' venv (bash ../shared/peers/setup.sh), GNU time and cargo; builds
`cargo build --release -p holo-runtime --example sample_bench --bin holo` unless --holo-bin and
--sample-bench-bin are given.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import textwrap
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import grpo_compare  # noqa: E402  (busy_seconds, run_measured)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# arch: (the real model whose decoder shapes `--preset small` writes, its vocabulary size, fits a CPU run)
FAMILIES = {
    "qwen2": ("Qwen2.5-0.5B", 151_936, True),
    "qwen3": ("Qwen3-0.6B", 151_936, True),
    "llama": ("SmolLM2-135M", 49_152, True),
    "gemma3_text": ("gemma-3-1b", 262_144, True),
    "olmo2": ("OLMo-2-1B", 100_278, True),
    "smollm3": ("SmolLM3-3B", 128_256, True),
    "mistral": ("Mistral-7B", 32_768, False),
    "ministral": ("Ministral-8B", 131_072, False),
    "olmo3": ("Olmo-3-7B", 100_278, False),
    "phi3": ("Phi-4-mini", 200_064, False),
    "qwen3_5_text": ("Qwen3.5-0.8B", 248_320, True),
    "qwen3_moe": ("two of Qwen3-30B-A3B's 48 layers", 151_936, True),
    "gpt_oss": ("two of gpt-oss-20b's 24 layers", 201_088, True),
}

PYTHON_SIDE = textwrap.dedent(
    """
    import json, statistics, sys, time
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, set_seed
    folder, batch, prompt_len, new, repeats, threads, seed, dtype = sys.argv[1:9]
    batch, prompt_len, new, repeats, threads, seed = map(int, (batch, prompt_len, new, repeats, threads, seed))
    torch.set_num_threads(threads)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    start = time.perf_counter()
    # gpt-oss's sinks have no sdpa path in transformers: its eager attention.
    attention = "eager" if AutoConfig.from_pretrained(folder).model_type == "gpt_oss" else "sdpa"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attention).eval()
    load_s = time.perf_counter() - start
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=generator)
    attention = torch.ones_like(ids)
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0, use_cache=True)
    times, cpu_times = [], []
    with torch.inference_mode():
        set_seed(seed)
        model.generate(input_ids=ids, attention_mask=attention, max_new_tokens=4, min_new_tokens=4, **kw)
        for r in range(repeats):
            set_seed(seed + r + 1)
            start, cpu = time.perf_counter(), time.process_time()
            out = model.generate(input_ids=ids, attention_mask=attention, max_new_tokens=new, min_new_tokens=new,
                                 **kw)
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu)
            assert out.shape[1] - prompt_len == new
    median = statistics.median(times)
    print(json.dumps({"times_s": times, "median_s": median, "new_tokens_per_s": batch * new / median,
                      "cpu_times_s": cpu_times, "new_tokens_per_cpu_s": batch * new / statistics.median(cpu_times),
                      "load_s": load_s}))
    """
)


def build_rust():
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "holo-runtime", "--example", "sample_bench", "--bin",
                    "holo"], cwd=ROOT, check=True)
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    return os.path.join(target, "release", "holo"), os.path.join(target, "release", "examples", "sample_bench")


def widen_vocabulary(folder, vocab, seed=0):
    """Widens `holo init-model`'s 512-token folder to `vocab` ids: new embedding (and untied head) rows drawn
    with the spread of the existing ones, `vocab_size` in config.json, and the new ids as tokenizer entries
    that no merge produces (encoding unchanged; each decodes to its own name)."""
    import torch
    from safetensors.torch import load_file, save_file

    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    old = config["vocab_size"]
    if old >= vocab:
        return config
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(seed)
    widened = []
    for name, tensor in list(tensors.items()):
        if name.endswith("embed_tokens.weight") or name.endswith("lm_head.weight"):
            assert tensor.shape[0] == old, (name, tensor.shape)
            extra = torch.randn((vocab - old, tensor.shape[1]), generator=generator, dtype=torch.float32)
            extra = (extra * tensor.float().std()).to(tensor.dtype)
            tensors[name] = torch.cat([tensor, extra]).contiguous()
            widened.append(name)
    assert widened, f"no embedding found in {path}"
    save_file(tensors, path, metadata={"format": "pt"})
    del tensors
    config["vocab_size"] = vocab
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)

    with open(os.path.join(folder, "tokenizer.json")) as f:
        tokenizer = json.load(f)
    taken = set(tokenizer["model"]["vocab"].values()) | {t["id"] for t in tokenizer["added_tokens"]}
    assert taken == set(range(old)), "expected ids 0..vocab_size-1 in the tokenizer"
    for token_id in range(old, vocab):
        tokenizer["added_tokens"].append({"id": token_id, "content": f"zq{token_id}", "single_word": False,
                                          "lstrip": False, "rstrip": False, "normalized": False,
                                          "special": False})
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        json.dump(tokenizer, f, ensure_ascii=False)
    # transformers 5 rebuilds a family's tokenizer class from vocab and merges, then adds the tokens listed here
    # (with ids from len(vocab) on, in order): without them it would know 512 ids.
    with open(os.path.join(folder, "tokenizer_config.json")) as f:
        tokenizer_config = json.load(f)
    for token_id in range(old, vocab):
        tokenizer_config["added_tokens_decoder"][str(token_id)] = {
            "content": f"zq{token_id}", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": False}
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config, f, indent=2, ensure_ascii=False)
    return config


def shapes(arch, layers):
    """What a row's model is: the real model whose shapes it has, and how many of its layers when not all."""
    real = FAMILIES[arch][0]
    return f"{layers.get(arch)} of {real}'s layers" if arch in layers else real


def build_model(holo, arch, work, layers):
    real, vocab, _ = FAMILIES[arch]
    kept = [] if arch not in layers else ["--layers", str(layers[arch])]
    folder = os.path.join(work, f"{arch}-{real}-v{vocab}" + (f"-l{layers[arch]}" if kept else ""))
    marker = os.path.join(folder, ".widened")
    if not os.path.exists(marker):
        subprocess.run([holo, "init-model", "--arch", arch, "--preset", "small", *kept, "--force", folder],
                       check=True, stdout=subprocess.DEVNULL)
        widen_vocabulary(folder, vocab)
        open(marker, "w").close()
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    size = os.path.getsize(os.path.join(folder, "model.safetensors"))
    return folder, config, size


def sample_pair(arch, folder, bench, dtype, batch, args):
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), RAYON_NUM_THREADS=str(args.threads),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONWARNINGS="ignore")
    shape = [str(batch), str(args.prompt_len), str(args.new), str(args.repeats)]
    limit = ["timeout", str(args.side_timeout)] if args.side_timeout else []
    out, t_rss, t_wall, t_other, _ = grpo_compare.run_measured(
        [*limit, sys.executable, "-c", PYTHON_SIDE, folder, *shape, str(args.threads), str(args.seed), dtype], env)
    theirs = json.loads(out.strip().splitlines()[-1])
    out, h_rss, h_wall, h_other, _ = grpo_compare.run_measured(
        [*limit, bench, folder, "--batch", shape[0], "--prompt-len", shape[1], "--new", shape[2], "--repeats", shape[3],
         "--seed", str(args.seed), "--dtype", dtype], env)
    ours = json.loads(out.strip().splitlines()[-1])
    ratio = ours["new_tokens_per_s"] / theirs["new_tokens_per_s"]
    cpu_ratio = ours["new_tokens_per_cpu_s"] / theirs["new_tokens_per_cpu_s"]
    row = {"arch": arch, "dtype": dtype, "batch": batch,
           "transformers": dict(theirs, peak_rss_mib=t_rss, wall_s=t_wall, other_load_cores=t_other),
           "holo": dict(ours, peak_rss_mib=h_rss, wall_s=h_wall, other_load_cores=h_other), "ratio": ratio,
           "cpu_ratio": cpu_ratio, "load_average": os.getloadavg()}
    print(f"  {dtype} B={batch}: transformers {theirs['new_tokens_per_s']:8.1f} tok/s ({t_rss:,.0f} MiB, other load "
          f"{t_other:.2f}), holo {ours['new_tokens_per_s']:8.1f} tok/s ({h_rss:,.0f} MiB, other load {h_other:.2f}): "
          f"{ratio:.2f}x; per CPU second {theirs['new_tokens_per_cpu_s']:.1f} / {ours['new_tokens_per_cpu_s']:.1f}: "
          f"{cpu_ratio:.2f}x; load average {row['load_average'][0]:.1f}", flush=True)
    return row


def grpo(arch, folder, holo, args, work):
    out_json = os.path.join(work, f"grpo-{arch}.json")
    command = [sys.executable, os.path.join(ROOT, "benches", "grpo_compare.py"), "--which", "none",
               "--model", f"{arch}={folder}", "--holo-bin", holo, "--seeds-05b", str(args.seed),
               "--steps-05b", str(args.grpo_steps), "--batch-05b", str(args.grpo_batch),
               "--num-generations-05b", str(args.grpo_generations), "--learning-rate-05b", "1e-5",
               "--max-completion-length", str(args.grpo_completion), "--threads", str(args.threads),
               "--idle-wait", str(args.idle_wait), "--attempts", "1", "--work-dir", work, "--json", out_json]
    if arch in args.grpo_lora.split(","):
        command += ["--lora-r", str(args.lora_r)]
    print("  " + " ".join(command[1:]), flush=True)
    completed = subprocess.run(command, cwd=ROOT)
    if completed.returncode != 0:
        print(f"  GRPO comparison for {arch} failed ({completed.returncode})", flush=True)
        return {"arch": arch, "failed": completed.returncode}
    with open(out_json) as f:
        (result,) = json.load(f)["results"]
    return {"arch": arch, "lora_r": args.lora_r if arch in args.grpo_lora.split(",") else None,
            "trl_s_per_step": result["trl"]["median_step_s"],
            "holo_s_per_step": result["holo"]["median_step_s"], "speedup": result["speedup"],
            "trl_cpu_s_per_step": result["trl"]["median_step_cpu_s"],
            "holo_cpu_s_per_step": result["holo"]["median_step_cpu_s"], "cpu_speedup": result["cpu_speedup"],
            "load_average": os.getloadavg(),
            "trl_peak_rss_mib": result["trl"]["peak_rss_mib"], "holo_peak_rss_mib": result["holo"]["peak_rss_mib"],
            "trl_generation_s": result["trl"]["generation_s"],
            "other_load": [result["trl"]["other_load_cores"], result["holo"]["other_load_cores"]],
            "step_times": {side: result["runs"][0][side]["step_time"] for side in ("trl", "holo")},
            "step_cpu_times": {side: result["runs"][0][side]["step_cpu_time"] for side in ("trl", "holo")}}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="qwen2,qwen3,llama,gemma3_text,olmo2")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--dtypes", default="f32,bf16")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--side-timeout", type=int, default=600,
                        help="seconds one side of a sampling cell may take, load included (0: no limit); "
                             "a side past it is reported as failed")
    parser.add_argument("--grpo-families", default="qwen3,gemma3_text",
                        help="families (among --families) to run a GRPO comparison on; empty: none")
    parser.add_argument("--grpo-steps", type=int, default=2)
    parser.add_argument("--grpo-batch", type=int, default=8)
    parser.add_argument("--grpo-generations", type=int, default=4)
    parser.add_argument("--grpo-completion", type=int, default=32)
    parser.add_argument("--grpo-lora", default="",
                        help="families (among --grpo-families) that train LoRA adapters instead of every weight")
    parser.add_argument("--lora-r", type=int, default=16, help="the adapters' rank, with --grpo-lora")
    parser.add_argument("--idle-wait", type=float, default=0, help="grpo_compare.py's --idle-wait")
    parser.add_argument("--allow-big", action="store_true",
                        help="also the 7-8B families (about 30 GiB in f32) and Phi-4-mini (15 GiB)")
    parser.add_argument("--layers", default="",
                        help="FAMILY=N,...: N of the family's decoder layers (holo init-model --layers), not all")
    parser.add_argument("--work-dir", default="/tmp/holo-family-bench")
    parser.add_argument("--keep", action="store_true", help="keep the model folders")
    parser.add_argument("--json", help="also write every figure here")
    parser.add_argument("--holo-bin")
    parser.add_argument("--sample-bench-bin")
    args = parser.parse_args()
    families = [f for f in args.families.split(",") if f]
    layers = {}
    for item in filter(None, args.layers.split(",")):
        arch, _, count = item.partition("=")
        if arch not in FAMILIES or not count.isdigit() or int(count) < 1:
            parser.error(f"--layers: expected FAMILY=N with a known family and N >= 1, got {item!r}")
        layers[arch] = int(count)
    for arch in families:
        if arch not in FAMILIES:
            parser.error(f"unknown family {arch!r}; known: {', '.join(FAMILIES)}")
        if not FAMILIES[arch][2] and not args.allow_big and arch not in layers:
            parser.error(f"{arch} ({FAMILIES[arch][0]}) is too big for a CPU run; pass --allow-big, or "
                         f"--layers {arch}=2 for two of its layers")
    grpo_families = [f for f in args.grpo_families.split(",") if f]
    batches = [int(b) for b in args.batches.split(",") if b]
    dtypes = [d for d in args.dtypes.split(",") if d]
    holo, bench = (args.holo_bin, args.sample_bench_bin) if args.holo_bin else build_rust()
    os.makedirs(args.work_dir, exist_ok=True)
    sampling, training = [], []
    started = time.time()
    try:
        for arch in families + [f for f in grpo_families if f not in families]:
            real = shapes(arch, layers)
            start = time.time()
            folder, config, size = build_model(holo, arch, args.work_dir, layers)
            print(f"{arch} ({real} shapes: hidden {config['hidden_size']}, {config['num_hidden_layers']} layers, "
                  f"vocab {config['vocab_size']:,}, {size / 2**30:.2f} GiB f32), built in {time.time() - start:.0f} s",
                  flush=True)
            if arch in families:
                for dtype in dtypes:
                    for batch in batches:
                        try:
                            sampling.append(sample_pair(arch, folder, bench, dtype, batch, args))
                        except SystemExit as failure:  # run_measured's exit on a failed side: go on
                            print(f"  {dtype} B={batch}: FAILED: {failure}", flush=True)
                            sampling.append({"arch": arch, "dtype": dtype, "batch": batch, "failed": str(failure)})
            if arch in grpo_families:
                training.append(grpo(arch, folder, holo, args, args.work_dir))
            if not args.keep:
                shutil.rmtree(folder, ignore_errors=True)
    finally:
        if not args.keep:
            shutil.rmtree(args.work_dir, ignore_errors=True)
    print(f"\n(total {time.time() - started:.0f} s; {args.prompt_len}-token prompts, {args.new} new tokens per row, "
          f"temperature 1, median of {args.repeats} after a warm-up, {args.threads} threads)\n")
    print("| family (shapes) | vocab | dtype | B | transformers tok/s | holo tok/s | holo / transformers "
          "| tokens per CPU s, transformers / holo | holo / transformers per CPU s "
          "| peak RSS transformers / holo (MiB) | load average |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in sampling:
        real, vocab = shapes(row["arch"], layers), FAMILIES[row["arch"]][1]
        if "failed" in row:
            print(f"| {row['arch']} ({real}) | {vocab:,} | {row['dtype']} | {row['batch']} | failed | | | | | | |")
            continue
        t, h = row["transformers"], row["holo"]
        print(f"| {row['arch']} ({real}) | {vocab:,} | {row['dtype']} | {row['batch']} | {t['new_tokens_per_s']:,.1f} "
              f"| {h['new_tokens_per_s']:,.1f} | {row['ratio']:.2f}× | {t['new_tokens_per_cpu_s']:,.1f} / "
              f"{h['new_tokens_per_cpu_s']:,.1f} | {row['cpu_ratio']:.2f}× | {t['peak_rss_mib']:,.0f} / "
              f"{h['peak_rss_mib']:,.0f} | {row['load_average'][0]:.1f} |")
    if training:
        print(f"\nGRPO: {args.grpo_batch} completions ({args.grpo_batch // args.grpo_generations} prompts × "
              f"{args.grpo_generations}) of {args.grpo_completion} tokens, f32, gradient checkpointing, "
              f"{args.grpo_steps} steps (median after the first)\n")
        print("| family (shapes) | trained | TRL s/step | holo s/step | speedup | CPU s/step TRL / holo "
              "| speedup per CPU s | peak RSS TRL / holo (MiB) | other load TRL / holo (cores) | load average |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for row in training:
            real = shapes(row["arch"], layers)
            if "failed" in row:
                print(f"| {row['arch']} ({real}) | failed | | | | | | | | |")
                continue
            trained = f"LoRA r {row['lora_r']}, all linear" if row["lora_r"] else "every weight"
            print(f"| {row['arch']} ({real}) | {trained} | {row['trl_s_per_step']:.2f} | "
                  f"{row['holo_s_per_step']:.2f} | {row['speedup']:.2f}× | {row['trl_cpu_s_per_step']:.2f} / {row['holo_cpu_s_per_step']:.2f} | "
                  f"{row['cpu_speedup']:.2f}× | {row['trl_peak_rss_mib']:,.0f} / {row['holo_peak_rss_mib']:,.0f} | "
                  f"{row['other_load'][0]:.2f} / {row['other_load'][1]:.2f} | {row['load_average'][0]:.1f} |")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"args": vars(args), "sampling": sampling, "grpo": training}, out, indent=2)


if __name__ == "__main__":
    main()
