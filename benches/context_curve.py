#!/usr/bin/env python3
"""The cost of one decoding step over the context length, holo against transformers: Qwen3.5 against Qwen3.

    ~/.cache/holo-peers/venv/bin/python benches/context_curve.py [--families qwen3_5_text,qwen3] \
        [--contexts 512,1024,2048,4096,8192] [--new 32] [--batch 1] [--threads 1] [--seed 0] \
        [--filled] [--work-dir /tmp/holo-context-curve] [--keep] [--json FILE] [--holo-bin B --sample-bench-bin S]

What a generation of N tokens costs is the sum of its steps' costs at contexts 1 … N; this measures the step at
chosen contexts L instead of generating 8k tokens (an hour per side at a few tokens per second on a small CPU).
Qwen3.5's Gated DeltaNet layers (18 of its 24) keep a state of fixed size, so only its 6 attention layers'
steps grow with L; every one of Qwen3's 28 layers reads all L cached keys and values.

For every family, one process per side over all the contexts, one side after the other: one sequence of seeded
random prompt tokens runs through the side's KV cache `--chunk` tokens a pass until the cache holds the first
context L (timed: the prefill), then one untimed step and `--new` timed one-token steps, each a greedy pick of the
last logits; the prompt then goes on to the next context (the steps' tokens count as context), and so on. A
sequence is prefilled once to the largest context, not once per context.

With `--filled`, no prefill: each context's cache is filled instead, on both sides alike, with `L` columns of
standard normal keys and values in every attention layer and, in Qwen3.5's linear layers, the states after the
prompt's first token. A step reads a cache the same way whatever it holds, so this measures the step at
contexts whose prefill would take too long on a small machine (compare a few contexts both ways to check).

- transformers (sdpa): `model(…, past_key_values=cache, logits_to_keep=1)`, the cache its own (Qwen3.5's
  holds the linear layers' states and continues them across chunks).
- holo: `sample_bench --steps L,L,..` (the same through `Model::forward_hidden` and a `KvCache`).

Prints per context: prefill wall and CPU seconds (from the previous context), decoding tokens/s and ms per step,
the side's peak RSS so far (its process's high-water mark), holo's cache bytes, holo / transformers in tokens/s,
and holo / transformers in prefill CPU seconds (above 1, holo's prefill cost more); per side the whole run's peak
RSS (GNU time), the load the rest of the machine put on the cores during it, and the load average before and
after. The models are family_compare.py's: `holo init-model --arch ARCH --preset small`
widened to the real vocabulary (f32).
"""
import argparse
import json
import os
import shutil
import sys
import textwrap
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import family_compare  # noqa: E402  (FAMILIES, build_model, build_rust)
import grpo_compare  # noqa: E402  (run_measured)

PYTHON_SIDE = textwrap.dedent(
    """
    import json, resource, sys, time
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.cache_utils import DynamicLayer
    folder, batch, contexts, new, threads, seed, chunk, filled = sys.argv[1:9]
    batch, new, threads, seed, chunk, filled = map(int, (batch, new, threads, seed, chunk, filled))
    contexts = [int(c) for c in contexts.split(",")]
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, max(contexts)), generator=generator)
    past, cached, taken = None, 0, 0

    def step(tokens):
        global past
        out = model(input_ids=tokens, past_key_values=past, use_cache=True, logits_to_keep=1)
        past = out.past_key_values
        return out.logits[:, -1].argmax(-1, keepdim=True)

    with torch.inference_mode():
        for context in contexts:
            start, cpu = time.perf_counter(), time.process_time()
            if filled:
                # The first prompt token alone gives the linear layers' states; the attention layers get
                # `context` columns of standard normal keys and values.
                past = None
                picked = step(ids[:, :1])
                for layer in past.layers:
                    if isinstance(layer, DynamicLayer) and layer.get_seq_length() > 0:
                        shape = (batch, layer.keys.shape[1], context, layer.keys.shape[3])
                        layer.keys, layer.values = torch.randn(shape), torch.randn(shape)
                cached = context
            while cached < context:
                width = min(chunk, context - cached)
                picked = step(ids[:, taken:taken + width])
                cached, taken = cached + width, taken + width
            prefill, prefill_cpu = time.perf_counter() - start, time.process_time() - cpu
            picked = step(picked)
            start = time.perf_counter()
            for _ in range(new):
                picked = step(picked)
            decode = time.perf_counter() - start
            cached += 1 + new
            assert past.get_seq_length() == cached, (past.get_seq_length(), cached)
            print(json.dumps({"context": context, "filled": bool(filled), "prefill_s": None if filled else prefill,
                              "prefill_cpu_s": None if filled else prefill_cpu,
                              "decode_s": decode, "per_token_ms": decode / new * 1e3,
                              "decode_tokens_per_s": batch * new / decode,
                              "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}),
                  flush=True)
    """
)


def curve(arch, folder, bench, contexts, args):
    """Both sides' rows for one family: each side one process over every context, one after the other."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), RAYON_NUM_THREADS=str(args.threads),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONWARNINGS="ignore")
    limit = ["timeout", str(args.side_timeout)] if args.side_timeout else []
    listed = ",".join(map(str, contexts))
    sides = {}
    for side, command in (
            ("transformers", [sys.executable, "-c", PYTHON_SIDE, folder, str(args.batch), listed, str(args.new),
                              str(args.threads), str(args.seed), str(args.chunk), str(int(args.filled))]),
            ("holo", [bench, folder, "--steps", listed, "--batch", str(args.batch), "--new", str(args.new), "--seed",
                      str(args.seed), *(["--filled"] if args.filled else [])])):
        load = os.getloadavg()[0]
        try:
            out, rss, wall, other, _ = grpo_compare.run_measured([*limit, *command], env)
        except SystemExit as failure:  # run_measured's exit on a failed side: go on
            print(f"  {side}: FAILED: {failure}", flush=True)
            sides[side] = {"failed": str(failure)}
            continue
        figures = [json.loads(row) for row in out.strip().splitlines() if row.startswith("{")]
        sides[side] = {"by_context": {f["context"]: f for f in figures}, "peak_rss_mib": rss, "wall_s": wall,
                       "other_load_cores": other, "load_average": [load, os.getloadavg()[0]]}
        print(f"  {side}: {wall:.0f} s, peak RSS {rss:,.0f} MiB, other load {other:.2f} cores, load average "
              f"{load:.1f} → {os.getloadavg()[0]:.1f}", flush=True)
    rows = []
    for context in contexts:
        row = {"arch": arch, "context": context}
        for side in ("transformers", "holo"):
            figures = sides[side].get("by_context", {}).get(context)
            row[side] = figures or {"failed": sides[side].get("failed", "no figures")}
        if "failed" not in row["transformers"] and "failed" not in row["holo"]:
            row["ratio"] = row["holo"]["decode_tokens_per_s"] / row["transformers"]["decode_tokens_per_s"]
            if row["holo"].get("prefill_cpu_s") and row["transformers"].get("prefill_cpu_s"):
                row["prefill_cpu_ratio"] = row["holo"]["prefill_cpu_s"] / row["transformers"]["prefill_cpu_s"]
        print("  " + line(row), flush=True)
        rows.append(row)
    return rows, {side: {k: v for k, v in figures.items() if k != "by_context"} for side, figures in sides.items()}


def line(row):
    """One Markdown table row: family, L, then per side prefill s, tokens/s, ms/step and peak RSS so far."""
    cells = [f"{row['arch']} ({family_compare.FAMILIES[row['arch']][0]})", f"{row['context']:,}"]
    for side in ("transformers", "holo"):
        figures = row[side]
        if "failed" in figures:
            cells += ["failed", "", "", ""]
            continue
        prefill = "filled" if figures["prefill_s"] is None else f"{figures['prefill_s']:.1f}"
        if figures.get("prefill_cpu_s") is not None:
            prefill += f" ({figures['prefill_cpu_s']:.1f})"
        cells += [prefill, f"{figures['decode_tokens_per_s']:.2f}",
                  f"{figures['per_token_ms']:.0f}", f"{figures['peak_rss_mib']:,.0f}"]
    holo = row["holo"]
    cells.append(f"{holo['cache_bytes'] / 2**20:,.1f}" if "cache_bytes" in holo else "")
    cells.append(f"**{row['ratio']:.2f}×**" if "ratio" in row else "")
    cells.append(f"{row['prefill_cpu_ratio']:.2f}×" if "prefill_cpu_ratio" in row else "")
    return "| " + " | ".join(cells) + " |"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="qwen3_5_text,qwen3")
    parser.add_argument("--contexts", default="512,1024,2048,4096,8192")
    parser.add_argument("--new", type=int, default=32, help="timed decoding steps per context")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=1024, help="prompt tokens per transformers prefill pass")
    parser.add_argument("--filled", action="store_true",
                        help="fill each context's cache with random keys and values instead of prefilling it")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--side-timeout", type=int, default=1800,
                        help="seconds one side of a row may take, load included (0: no limit)")
    parser.add_argument("--work-dir", default="/tmp/holo-context-curve")
    parser.add_argument("--keep", action="store_true", help="keep the model folders")
    parser.add_argument("--json", help="also write every figure here")
    parser.add_argument("--holo-bin")
    parser.add_argument("--sample-bench-bin")
    args = parser.parse_args()
    families = [f for f in args.families.split(",") if f]
    for arch in families:
        if arch not in family_compare.FAMILIES:
            parser.error(f"unknown family {arch!r}; known: {', '.join(family_compare.FAMILIES)}")
    contexts = [int(c) for c in args.contexts.split(",") if c]
    holo, bench = (args.holo_bin, args.sample_bench_bin) if args.holo_bin else family_compare.build_rust()
    os.makedirs(args.work_dir, exist_ok=True)
    rows, runs, started = [], {}, time.time()
    try:
        for arch in families:
            folder, config, size = family_compare.build_model(holo, arch, args.work_dir, {})
            print(f"{arch} ({family_compare.FAMILIES[arch][0]} shapes: hidden {config['hidden_size']}, "
                  f"{config['num_hidden_layers']} layers, vocab {config['vocab_size']:,}, "
                  f"{size / 2**30:.2f} GiB f32)", flush=True)
            family_rows, runs[arch] = curve(arch, folder, bench, contexts, args)
            rows += family_rows
            if not args.keep:
                shutil.rmtree(folder, ignore_errors=True)
    finally:
        if not args.keep:
            shutil.rmtree(args.work_dir, ignore_errors=True)
    print(f"\n(total {time.time() - started:.0f} s; B = {args.batch}, {args.new} timed greedy steps after one untimed "
          f"at each context, f32, {args.threads} thread(s) per side; peak RSS: the side's process so far)\n")
    print("| family (shapes) | L | transformers prefill s (CPU s) | tok/s | ms/step | peak RSS MiB "
          "| holo prefill s (CPU s) | tok/s | ms/step | peak RSS MiB | holo cache MiB | holo / transformers "
          "| prefill CPU s holo / transformers |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(line(row))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"args": vars(args), "rows": rows, "runs": runs}, out, indent=2)


if __name__ == "__main__":
    main()
