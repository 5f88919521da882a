#!/usr/bin/env python3
"""`holo view` on a large run: the page written, then opened in headless Chromium, with the times printed.

    python3 benches/view_large.py [--holo PATH] [--size-mb 50] [--out DIR] [--model DIR] [--chromium PATH]

1. Builds a run folder of about `--size-mb` MB under `--out` (default `$TMPDIR/holo-view-large`), shaped
   like a GRPO run of `holo train` in token space (the records of `holo_core::loom::record`):
   `rollouts.jsonl` with `--rows` rows × `--group` rollouts per step for as many steps as the size needs
   (each rollout 200 to 2000 tokens: a ChatML system and user prompt, a sampled answer, a third of them
   with a tool call and a second assistant turn; token ids, loss masks and f32 log-probs aligned; reward
   components with weights and feedback; some truncated, some failed; timings), an `eval_rollouts.jsonl`
   every 20 steps, and `metrics.jsonl` with a line of GRPO metrics per step. The same arguments give the
   same bytes; a folder already built with them is reused.
   Token ids are one per word. With `--model DIR` (a model folder with a byte-level BPE `tokenizer.json`,
   e.g. SmolLM2's) the words are tokens of that vocabulary and `holo view --model DIR` decodes them, as a
   run folder's own model would; without it the ids are drawn from a Qwen2-sized vocabulary and the
   page shows ids.
2. (a) `holo view RUN --out RUN.html`: wall time, peak memory, page size.
   (b) Chromium (`--headless --dump-dom --virtual-time-budget`) on the page, as a file: the rollout list
   (no fragment), the first rollout selected and drawn token by token (`#sel=0`), a text search over every
   rollout (`#q=WORD`), and the completions of one step (`#tab=steps`). Each is checked in the DOM: the
   list's `#count` reads "N of N rollouts" (or the number of matches) and `#list-items` holds its first
   screenful, items 0, 1, … in order; the selected rollout shows one `tok trained` span per trained token;
   the step's table has one row per rollout of that step.
   (c) `holo view RUN --serve`: the time until it prints its address (reading and rendering), then
   Chromium on `http://127.0.0.1:PORT/` over loopback. (`--serve` sends the same page in one response;
   it neither streams nor paginates.)
   The timed copy of the file has one more small script after the page's own: it records, in the DOM,
   `performance.now()` when the page's script has run (the list drawn; "page JS ms"), the JS heap
   (`performance.memory`), the navigation's `responseEnd` and `domInteractive` and the time of the next
   frame (in `--json`); then it removes the data element, so that `--dump-dom` does not print 50 MB
   back. The served page has no such script, and `--dump-dom` of it prints the whole data element (slow
   in itself: Chromium serializing 50 MB), so its load is timed with `--screenshot` (as is the file's,
   to compare) and its DOM checked, as the list, in a second run. Chromium's wall time includes its
   start: a tiny page's, measured first, is printed as the baseline.
3. Prints a table (times, the page's size, the peak memory of Chromium's processes together: their PSS
   summed, sampled every 50 ms; the machine from `lscpu`), and exits 1 when `holo view` failed or
   Chromium did not render a page (an error exit, out of memory, `--timeout`, no list, a wrong count),
   2 for bad arguments or a missing tool.

Standard library only. `--json FILE` also writes every figure as JSON.
"""

import argparse
import json
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GENERATOR_VERSION = 4
QWEN_VOCAB = 151_936
EVAL_EVERY = 20
# A word that appears in the answers of every SEARCH_EVERY-th training rollout, for the search scenario.
SEARCH_WORD = "quokkaberry"
SEARCH_EVERY = 97

WORDS = """
the a of to and in is that it for on with as by this be are from at or an was which have not but all
we can has one if more when will there so each first two three four five six seven eight nine ten
number numbers sum total answer result step steps add subtract multiply divide equal equals value
values left right side both then now next since because therefore thus let check again compute
find given question problem need means gives get know per remaining every whole half twice times
minus plus over under between after before apples oranges books pages hours minutes price dollars
cents train miles speed distance rate time work together each day week month year people students
class teacher bought sold costs spent saved shares split equally groups boxes rows columns area
perimeter length width height triangle square circle radius angle degrees percent fraction ratio
odd even prime factor multiple divisible remainder quotient product difference smaller larger
largest smallest first second last final careful verify substitute solve equation variable unknown
""".split()

SYSTEM = ("You are a careful assistant. Think step by step inside <think> tags, then give the final "
          "answer inside <answer> tags. Use the calculator tool when a computation is long.")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    default_holo = os.path.join(REPO, "target/release/holo")
    if not os.path.exists(default_holo):
        default_holo = os.path.join(REPO, "target/debug/holo")
    parser.add_argument("--holo", default=default_holo,
                        help="the holo binary [default: target/release/holo if present, else target/debug/holo]")
    parser.add_argument("--size-mb", type=float, default=50.0, help="the run's size in MB (10^6 bytes) [50]")
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "holo-view-large"),
                        help="where the run, the page and Chromium's profile go [$TMPDIR/holo-view-large]")
    parser.add_argument("--model", help="a model folder whose tokenizer.json the token ids come from (and "
                                        "`holo view --model` decodes)")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    parser.add_argument("--rows", type=int, default=4, help="data rows per training step [4]")
    parser.add_argument("--group", type=int, default=8, help="rollouts per row (G) [8]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-ms", type=int, default=10_000,
                        help="Chromium's --virtual-time-budget [10000]")
    parser.add_argument("--timeout", type=int, default=300, help="seconds before a Chromium run is killed [300]")
    parser.add_argument("--skip-serve", action="store_true", help="leave out (c)")
    parser.add_argument("--json", help="also write every figure to this file")
    args = parser.parse_args()
    if not os.path.isfile(args.holo):
        parser.error(f"no holo binary at {args.holo} (cargo build --release --bin holo)")
    if not os.path.isfile(args.chromium):
        parser.error(f"no chromium at {args.chromium} (sh scripts/install_chromium.sh)")
    if args.size_mb <= 0 or args.rows < 1 or args.group < 1:
        parser.error("--size-mb, --rows and --group must be positive")
    if args.model and not os.path.isfile(os.path.join(args.model, "tokenizer.json")):
        parser.error(f"--model: no tokenizer.json in {args.model}")
    return args


# ---- the run ----

class Vocab:
    """Words and their token ids: a model's byte-level BPE vocabulary, or made-up ids in a Qwen2-sized one."""

    def __init__(self, model, rng):
        self.frames = {"im_start": 151644, "im_end": 151645, "nl": 198}
        if model is None:
            ids = rng.sample(range(1000, QWEN_VOCAB - 400), len(WORDS) * 2 + 16)
            self.words = [(" " + w, ids[2 * i]) for i, w in enumerate(WORDS)]
            self.words += [(w, ids[2 * i + 1]) for i, w in enumerate(WORDS)]
            self.vocab = None
            self.name = f"made-up ids < {QWEN_VOCAB}"
        else:
            with open(os.path.join(model, "tokenizer.json"), encoding="utf-8") as f:
                tokenizer = json.load(f)
            vocab = tokenizer["model"]["vocab"]
            added = {t["content"]: t["id"] for t in tokenizer.get("added_tokens", [])}
            for name, text in (("im_start", "<|im_start|>"), ("im_end", "<|im_end|>")):
                if text not in added:
                    print(f"error: --model: {text} is not a token of {model}", file=sys.stderr)
                    sys.exit(2)
                self.frames[name] = added[text]
            self.frames["nl"] = vocab.get("\u010a", self.frames["nl"])
            words = sorted((t, i) for t, i in vocab.items()
                           if t.startswith("\u0120") and t[1:].isalpha() and t[1:].isascii() and len(t) > 2)
            if len(words) < 100:
                print(f"error: --model: {model}'s tokenizer.json is not a byte-level BPE vocabulary", file=sys.stderr)
                sys.exit(2)
            self.words = [(" " + t[1:], i) for t, i in words]
            self.vocab = vocab
            self.name = f"{model}'s tokenizer.json"
        self.encoded = {}

    def encode(self, text):
        """The ids of `text`: with a model's vocabulary, its longest tokens first (byte-level: a space is
        `Ġ`, a newline `Ċ`), near enough to what its tokenizer gives; else one made-up id per word."""
        if text in self.encoded:
            return self.encoded[text]
        if self.vocab is None:
            ids = [1000 + zlib.crc32(word.encode()) % (QWEN_VOCAB - 2000) for word in text.split()]
        else:
            symbols = text.replace(" ", "\u0120").replace("\n", "\u010a")
            ids, at = [], 0
            while at < len(symbols):
                for end in range(min(len(symbols), at + 24), at, -1):
                    if symbols[at:end] in self.vocab:
                        ids.append(self.vocab[symbols[at:end]])
                        at = end
                        break
                else:
                    at += 1
        self.encoded[text] = ids
        return ids

    def text(self, rng, n):
        """`n` tokens of words: the text and its ids."""
        pieces = rng.choices(self.words[: len(self.words) // 2] if len(self.words) > 400 else self.words, k=n)
        text = "".join(p if p.startswith(" ") or k == 0 else " " + p for k, (p, _) in enumerate(pieces))
        return text, [i for _, i in pieces]



def f32(x):
    """`x` rounded to an f32, written as serde writes one (the shortest text that reads back the same)."""
    bits = struct.unpack("<f", struct.pack("<f", x))[0]
    for precision in range(6, 10):
        text = f"{bits:.{precision}g}"
        if struct.unpack("<f", struct.pack("<f", float(text)))[0] == bits:
            return float(text)
    return bits


def message(vocab, role, parts):
    """A message record and its ChatML ids, loss mask and log-probs; `parts` are (text, ids, sampled, logprobs)."""
    ids = [vocab.frames["im_start"]] + vocab.encode(role) + [vocab.frames["nl"]]
    mask = [0] * len(ids)
    logprobs = [0.0] * len(ids)
    records = []
    for text, part_ids, sampled, part_logprobs in parts:
        records.append({"text": text, "sampled": sampled})
        ids += part_ids
        mask += [1 if sampled else 0] * len(part_ids)
        logprobs += part_logprobs if sampled else [0.0] * len(part_ids)
    ids += [vocab.frames["im_end"], vocab.frames["nl"]]
    mask += [0, 0]
    logprobs += [0.0, 0.0]
    return {"role": role, "parts": records}, (ids, mask, logprobs)


def sampled_logprobs(rng, n):
    return [f32(-rng.expovariate(1.6)) for _ in range(n)]


def completion_length(rng):
    """Completion tokens: most a few hundred, a tail to the 1536-token cap (then truncated)."""
    n = int(rng.lognormvariate(6.0, 0.6))
    return max(100, min(n, 1536))


def rollout(vocab, rng, question, step, row_index, rollout_index, marker):
    """One rollout record, as `holo train` writes it."""
    expected = question["expected"]
    answer_tokens = completion_length(rng)
    truncated = answer_tokens >= 1536
    failed = rng.random() < 0.01
    tool = not truncated and rng.random() < 0.33
    think, think_ids = vocab.text(rng, max(8, answer_tokens - 12))
    if marker:
        think += " " + SEARCH_WORD
        think_ids = think_ids + [vocab.words[0][1]]
    correct = rng.random() < 0.45
    value = expected if correct else expected + rng.choice([-10, -1, 1, 2, 7])
    if truncated:
        sampled_text, sampled_ids = "<think>" + think, vocab.encode("<think>") + think_ids
    else:
        closing = f"</think><answer>{value}</answer>"
        sampled_text = f"<think>{think}{closing}"
        sampled_ids = vocab.encode("<think>") + think_ids + vocab.encode(closing)
    system, system_ids = SYSTEM, vocab.encode(SYSTEM)
    contexts_messages = []
    streams = []
    for role, parts in (("system", [(system, system_ids, False, None)]),
                        ("user", [(question["text"], question["ids"], False, None)])):
        record, stream = message(vocab, role, parts)
        contexts_messages.append(record)
        streams.append(stream)
    if tool:
        call_text, call_ids = vocab.text(rng, rng.randint(30, 120))
        closing = f"</think><tool>calculator({expected} * 3)</tool>"
        call = f"<think>{call_text}{closing}"
        call_ids = vocab.encode("<think>") + call_ids + vocab.encode(closing)
        record, stream = message(vocab, "assistant", [(call, call_ids, True, sampled_logprobs(rng, len(call_ids)))])
        contexts_messages.append(record)
        streams.append(stream)
        # The tool's result comes back as the user's message (hol/tool.hol).
        result = f"<result>{expected * 3}</result>"
        record, stream = message(vocab, "user", [(result, vocab.encode(result), False, None)])
        contexts_messages.append(record)
        streams.append(stream)
    record, stream = message(vocab, "assistant",
                             [(sampled_text, sampled_ids, True, sampled_logprobs(rng, len(sampled_ids)))])
    if truncated:
        # A sample cut at max_tokens has no end-of-message frame.
        stream = tuple(part[:-2] for part in stream)
    contexts_messages.append(record)
    streams.append(stream)
    ids, mask, logprobs = [], [], []
    for s_ids, s_mask, s_logprobs in streams:
        ids += s_ids
        mask += s_mask
        logprobs += s_logprobs
    contexts = [{"trained": True, "messages": contexts_messages,
                 "tokens": {"ids": ids, "loss_mask": mask, "logprobs": logprobs}}]
    if tool and rng.random() < 0.5:
        # A second, untrained context: a summary the holoware asked for from a fresh prompt.
        summary_text, summary_ids = vocab.text(rng, rng.randint(40, 160))
        ask = "Summarize the solution in one sentence."
        user, u_stream = message(vocab, "user", [(ask, vocab.encode(ask), False, None)])
        reply, r_stream = message(vocab, "assistant", [(summary_text, summary_ids, True, sampled_logprobs(rng, len(summary_ids)))])
        r_stream = (r_stream[0], [0] * len(r_stream[1]), r_stream[2])
        contexts.append({"trained": False, "messages": [user, reply],
                         "tokens": {"ids": u_stream[0] + r_stream[0], "loss_mask": u_stream[1] + r_stream[1],
                                    "logprobs": u_stream[2] + r_stream[2]}})
    math = 1.0 if correct and not truncated and not failed else 0.0
    fmt = 0.0 if truncated else 0.2
    length = round(-0.5 * max(0, answer_tokens - 1024) / 512, 6)
    rewards = {"format": fmt, "length_penalty": length, "math_answer": math}
    weights = {"format": 1.0, "length_penalty": 1.0, "math_answer": 1.0}
    feedback = {"math_answer": f"expected {expected}, found {value}" if not truncated else "no <answer> tag"}
    error = None
    if failed:
        rewards, weights, feedback = {}, {}, {}
        error = {"stage": "sampler", "message": "the sampler's request failed: timed out after 120 s (POST /v1/completions)"}
    wall = rng.uniform(2_000, 40_000)
    out = {"row_index": row_index, "rollout_index": rollout_index, "seed": rng.getrandbits(64),
           "row": {"question": question["text"], "expected": str(expected)},
           "contexts": contexts, "rewards": rewards, "weights": weights}
    if feedback:
        out["feedback"] = feedback
    out.update({"reward": 0.0 if failed else round(sum(rewards.values()), 6),
                "samples": 2 if tool else 1})
    if truncated:
        out["truncated"] = True
    out["step"] = step
    out["error"] = error
    out["timing"] = {"start_ms": round(rng.uniform(0, 60_000), 3), "wall_ms": round(wall, 3),
                     "sample_ms": round(wall * rng.uniform(0.8, 0.99), 3)}
    return out


def question(vocab, rng):
    n = rng.randint(50, 200)
    text, ids = vocab.text(rng, n)
    a, b = rng.randint(2, 999), rng.randint(2, 99)
    tail = f". What is {a} times {b}?"
    return {"text": text.lstrip() + tail, "ids": ids + vocab.encode(tail), "expected": a * b}


def metrics_line(rng, step, records):
    rewards = [r["reward"] for r in records]
    lengths = [sum(sum(c["tokens"]["loss_mask"]) for c in r["contexts"]) for r in records]
    mean = sum(rewards) / len(rewards)
    line = {"step": step, "loss": rng.gauss(0.0, 0.05), "grad_norm": abs(rng.gauss(1.0, 0.4)),
            "learning_rate": 1e-6, "reward": mean,
            "reward_std": (sum((x - mean) ** 2 for x in rewards) / len(rewards)) ** 0.5,
            "entropy": abs(rng.gauss(0.9, 0.1)), "frac_reward_zero_std": rng.random() * 0.3,
            "completions/mean_length": sum(lengths) / len(lengths), "completions/max_length": max(lengths),
            "completions/min_length": min(lengths),
            "completions/clipped_ratio": sum(1 for r in records if r.get("truncated")) / len(records),
            "rollouts/failed_ratio": sum(1 for r in records if r["error"]) / len(records),
            "clip_ratio/region_mean": rng.random() * 0.01, "num_tokens": float(sum(lengths)),
            "epoch": step / 1000}
    for name in ("format", "length_penalty", "math_answer"):
        values = [r["rewards"].get(name, 0.0) for r in records]
        line[f"rewards/{name}/mean"] = sum(values) / len(values)
    return line


def dumps(value):
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def build_run(args, run):
    """Writes the run folder (or reuses one built with the same arguments); returns what the checks need."""
    stamp_path = os.path.join(run, "bench.json")
    stamp = {"version": GENERATOR_VERSION, "size_mb": args.size_mb, "rows": args.rows, "group": args.group,
             "seed": args.seed, "model": os.path.abspath(args.model) if args.model else None}
    if os.path.exists(stamp_path):
        with open(stamp_path) as f:
            built = json.load(f)
        if built.get("stamp") == stamp:
            print(f"reusing the run in {run}", file=sys.stderr)
            return built["facts"]
    shutil.rmtree(run, ignore_errors=True)
    os.makedirs(run)
    rng = random.Random(args.seed)
    vocab = Vocab(args.model, rng)
    target = int(args.size_mb * 1e6)
    started = time.time()
    written = 0
    steps = 0
    facts = {"rollouts": 0, "eval_rollouts": 0, "search_matches": 0, "steps": 0, "step_rollouts": {},
             "first_trained_tokens": None, "tokens": 0, "max_tokens": 0, "min_tokens": 1 << 30,
             "vocab": vocab.name}
    dataset = [question(vocab, rng) for _ in range(512)]
    with open(os.path.join(run, "rollouts.jsonl"), "w", encoding="utf-8") as train, \
            open(os.path.join(run, "eval_rollouts.jsonl"), "w", encoding="utf-8") as evals, \
            open(os.path.join(run, "metrics.jsonl"), "w", encoding="utf-8") as metrics:
        while written < target:
            steps += 1
            batch = []
            for r in range(args.rows):
                row_index = rng.randrange(len(dataset))
                for g in range(args.group):
                    marker = facts["rollouts"] % SEARCH_EVERY == 0
                    record = rollout(vocab, rng, dataset[row_index], steps, row_index, g, marker)
                    facts["search_matches"] += marker
                    if facts["first_trained_tokens"] is None:
                        facts["first_trained_tokens"] = sum(record["contexts"][0]["tokens"]["loss_mask"])
                    n = sum(len(c["tokens"]["ids"]) for c in record["contexts"])
                    facts["tokens"] += n
                    facts["max_tokens"] = max(facts["max_tokens"], n)
                    facts["min_tokens"] = min(facts["min_tokens"], n)
                    line = dumps(record) + "\n"
                    train.write(line)
                    written += len(line.encode())
                    facts["rollouts"] += 1
                    batch.append(record)
            facts["step_rollouts"][str(steps)] = len(batch)
            line = metrics_line(rng, steps, batch)
            if steps % EVAL_EVERY == 0:
                eval_batch = []
                for row_index in range(8):
                    for g in range(2):
                        record = rollout(vocab, rng, dataset[row_index], steps, row_index, g, False)
                        text = dumps(record) + "\n"
                        evals.write(text)
                        written += len(text.encode())
                        facts["eval_rollouts"] += 1
                        eval_batch.append(record)
                line["eval/reward"] = sum(r["reward"] for r in eval_batch) / len(eval_batch)
            text = dumps(line) + "\n"
            metrics.write(text)
            written += len(text)
    facts["steps"] = steps
    facts["bytes"] = written
    print(f"built {run}: {facts['rollouts']} + {facts['eval_rollouts']} eval rollouts, {steps} steps, "
          f"{written / 1e6:.1f} MB in {time.time() - started:.1f} s", file=sys.stderr)
    with open(stamp_path, "w") as f:
        json.dump({"stamp": stamp, "facts": facts}, f)
    return facts


# ---- measuring ----

PAGE = os.sysconf("SC_PAGE_SIZE")


def tree_memory(root):
    """The memory in bytes of `root` and its descendants: the sum of their proportional set sizes (PSS: a
    page shared by n processes counts 1/n in each, so the sum counts it once)."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        stack.extend(children.get(pid, []))
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += int(re.search(r"^Pss:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024
        except (OSError, AttributeError):
            try:
                with open(f"/proc/{pid}/statm") as f:
                    total += int(f.read().split()[1]) * PAGE
            except OSError:
                pass
    return total


def timed(command, timeout):
    """Runs `command`; returns (seconds, peak MB of its process tree, exit code, stdout, stderr). The
    memory ([`tree_memory`]) is sampled every 50 ms."""
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    out, err = [], []
    readers = [threading.Thread(target=lambda s=stream, sink=sink: sink.append(s.read()))
               for stream, sink in ((process.stdout, out), (process.stderr, err))]
    for reader in readers:
        reader.start()
    peak = [0]
    finished = threading.Event()

    def sample():
        while not finished.wait(0.05):
            peak[0] = max(peak[0], tree_memory(process.pid))

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    seconds = time.monotonic() - started
    finished.set()
    sampler.join()
    for reader in readers:
        reader.join()
    return seconds, peak[0] / 1e6, process.returncode, out[0], err[0]


PROBE = """<script>
(() => {
  const done = performance.now();
  const nav = performance.getEntriesByType('navigation')[0] || {};
  const data = document.getElementById('holo-data');
  const heap = performance.memory ? performance.memory.usedJSHeapSize : null;
  if (data) data.remove();
  const out = document.createElement('pre');
  out.id = 'holo-bench';
  const write = (frame) => { out.textContent = JSON.stringify({ script_done_ms: done, frame_ms: frame,
    response_end_ms: nav.responseEnd, dom_interactive_ms: nav.domInteractive, js_heap_mb: heap && heap / 1e6 }); };
  write(null);
  document.body.appendChild(out);
  requestAnimationFrame(() => setTimeout(() => write(performance.now()), 0));
})();
</script>
"""


def probed(page, out):
    """A copy of `page` with PROBE after its scripts."""
    with open(page, encoding="utf-8") as f:
        html = f.read()
    at = html.rindex("</body>")
    with open(out, "w", encoding="utf-8") as f:
        f.write(html[:at] + PROBE + html[at:])


def chromium(args, url, profile, output="--dump-dom"):
    """Headless Chromium on `url` with `output` (`--dump-dom`, or `--screenshot=FILE`)."""
    command = [args.chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
               "--hide-scrollbars", "--window-size=1400,1600", "--enable-precise-memory-info",
               f"--virtual-time-budget={args.budget_ms}", f"--user-data-dir={profile}", output, url]
    seconds, rss, code, out, err = timed(command, args.timeout)
    return {"wall_s": seconds, "rss_mb": rss, "code": code, "dom": out.decode("utf-8", "replace"),
            "stderr": err.decode("utf-8", "replace")}


def text_of(dom, element_id):
    match = re.search(rf'id="{element_id}"[^>]*>([^<]*)<', dom)
    return match.group(1) if match else None


def listed(dom):
    return [int(i) for i in re.findall(r'<div class="item[^"]*" data-i="(\d+)"', dom)]


def check(scenario, result, facts):
    """Whether the page rendered what `scenario` should show; (ok, what it showed)."""
    dom = result["dom"]
    if result["code"] != 0:
        tail = result["stderr"].strip().splitlines()[-3:]
        return False, f"chromium exited {result['code']}: {' | '.join(tail)}"
    if 'id="list-items"' not in dom:
        return False, "no page in the DOM"
    probe = text_of(dom, "holo-bench")
    if probe is None:
        return False, "the page's script did not finish (no probe)"
    result["probe"] = json.loads(probe.replace("&quot;", '"'))
    total = facts["rollouts"] + facts["eval_rollouts"]
    items = listed(dom)
    count = text_of(dom, "count")
    if scenario in ("list", "serve"):
        want = f"{total} of {total} rollouts"
        ok = count == want and len(items) > 0 and items == list(range(len(items)))
        return ok, f"#count {count!r}, items {len(items)} ({items[:1]}…{items[-1:]})"
    if scenario == "selected":
        trained = len(re.findall(r'class="tok[^"]* trained', dom))
        ok = trained == facts["first_trained_tokens"] and 'class="item selected"' in dom
        return ok, f"{trained} trained token spans of {facts['first_trained_tokens']}"
    if scenario == "search":
        want = f"{facts['search_matches']} of {total} rollouts"
        ok = count == want and len(items) > 0
        return ok, f"#count {count!r} (want {want!r}), items {len(items)}"
    if scenario == "steps":
        rows = dom[: dom.find("<script")].count("<tr data-i=")
        want = min(facts["step_rollouts"]["1"], 100)
        return rows == want, f"{rows} rows of step 1 (want {want})"
    raise ValueError(scenario)


def serve(args, run, profile):
    """(c): `holo view --serve`, then Chromium over loopback, once with a screenshot (the load, timed) and
    once with `--dump-dom` (the check); (seconds to the address, screenshot run, dump run, error)."""
    command = [args.holo, "view", run, "--serve"] + (["--model", args.model] if args.model else [])
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = process.stdout.readline().strip()
        ready = time.monotonic() - started
        if not line.startswith("http://127.0.0.1:"):
            return ready, None, None, f"holo view --serve printed {line!r}"
        shot = chromium(args, line, profile, f"--screenshot={os.path.join(args.out, 'served.png')}")
        dump = chromium(args, line, profile)
        return ready, shot, dump, None
    finally:
        process.kill()
        process.wait()


def machine():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = re.search(r"Model name:\s*(.+)", out).group(1).strip()
    except (OSError, AttributeError):
        model = "unknown CPU"
    cores = os.cpu_count()
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    memory = ""
    try:
        with open("/proc/meminfo") as f:
            kb = int(re.search(r"MemTotal:\s*(\d+)", f.read()).group(1))
        memory = f", {kb / 1024 / 1024:.0f} GiB"
    except (OSError, AttributeError):
        pass
    return f"{model}, {cores} cores{memory}, load {load:.1f}"


def main():
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    run = os.path.join(args.out, "run")
    facts = build_run(args, run)
    data_mb = facts["bytes"] / 1e6
    total = facts["rollouts"] + facts["eval_rollouts"]
    chromium_version = subprocess.run([args.chromium, "--version"], capture_output=True, text=True).stdout.strip()
    rows = []
    failures = []

    page = os.path.join(args.out, "run.html")
    view = [args.holo, "view", run, "--out", page] + (["--model", args.model] if args.model else [])
    seconds, rss, code, _, err = timed(view, args.timeout)
    if code != 0:
        print(err.decode(errors="replace"), file=sys.stderr)
        sys.exit(f"holo view failed ({code})")
    page_mb = os.path.getsize(page) / 1e6
    rows.append(("(a) holo view → run.html", seconds, None, None, rss, f"page {page_mb:.1f} MB"))

    timed_page = os.path.join(args.out, "run.timed.html")
    probed(page, timed_page)
    tiny = os.path.join(args.out, "tiny.html")
    with open(tiny, "w") as f:
        f.write('<!doctype html><div id="list-items"></div>' + PROBE)
    profile = os.path.join(args.out, "profile")
    shutil.rmtree(profile, ignore_errors=True)
    baseline = chromium(args, f"file://{tiny}", profile)
    rows.append(("(b) chromium, a tiny page (its start)", baseline["wall_s"], None, None, baseline["rss_mb"],
                 "baseline" if baseline["code"] == 0 else f"exit {baseline['code']}"))

    scenarios = [("list", ""), ("selected", "#sel=0"), ("search", f"#q={SEARCH_WORD}"), ("steps", "#tab=steps&at=1")]
    results = {}
    for scenario, fragment in scenarios:
        result = chromium(args, f"file://{timed_page}{fragment}", profile)
        ok, shown = check(scenario, result, facts)
        results[scenario] = result
        probe = result.get("probe", {})
        rows.append((f"(b) chromium, file {fragment or '(the list)'}", result["wall_s"],
                     probe.get("script_done_ms"), probe.get("js_heap_mb"), result["rss_mb"],
                     ("ok: " if ok else "FAILED: ") + shown))
        if not ok:
            failures.append(f"{scenario}: {shown}")

    # The page as served has no probe: Chromium's whole wall time is all there is, and `--dump-dom`
    # prints its 50 MB data element back (slow in itself), so the load is timed with a screenshot, on the
    # file as well for comparison, and the DOM is checked in a second run.
    shot = chromium(args, f"file://{page}", profile, f"--screenshot={os.path.join(args.out, 'file.png')}")
    rows.append(("(b) chromium, file (the list), screenshot", shot["wall_s"], None, None, shot["rss_mb"],
                 "loaded" if shot["code"] == 0 else f"FAILED: chromium exited {shot['code']}"))
    if shot["code"] != 0:
        failures.append(f"file screenshot: chromium exited {shot['code']}")
    if not args.skip_serve:
        ready, shot, dump, error = serve(args, run, profile)
        if error:
            failures.append(f"serve: {error}")
            rows.append(("(c) holo view --serve", ready, None, None, None, "FAILED: " + error))
        else:
            rows.append(("(c) holo view --serve: address printed", ready, None, None, None, "read + rendered"))
            rows.append(("(c) chromium, http://127.0.0.1, screenshot", shot["wall_s"], None, None, shot["rss_mb"],
                         "loaded" if shot["code"] == 0 else f"FAILED: chromium exited {shot['code']}"))
            dom = dump["dom"]
            count = text_of(dom, "count")
            items = listed(dom)
            ok = (shot["code"] == 0 and dump["code"] == 0 and count == f"{total} of {total} rollouts"
                  and len(items) > 0 and items == list(range(len(items))))
            shown = (f"#count {count!r}, items {len(items)}" if dump["code"] == 0
                     else f"chromium exited {dump['code']}")
            rows.append(("(c) chromium, http://127.0.0.1, --dump-dom", dump["wall_s"], None, None, dump["rss_mb"],
                         ("ok: " if ok else "FAILED: ") + shown + f"; DOM {len(dom) / 1e6:.1f} MB printed"))
            if not ok:
                failures.append(f"serve: {shown}")

    print()
    print(f"holo view on a {data_mb:.1f} MB run: {facts['rollouts']} rollouts over {facts['steps']} steps "
          f"({args.rows} rows × G {args.group}) + {facts['eval_rollouts']} eval rollouts; "
          f"{facts['tokens'] / total:.0f} tokens per rollout on average ({facts['min_tokens']}–{facts['max_tokens']}); "
          f"ids: {facts['vocab']}")
    print(f"machine: {machine()}")
    print(f"holo: {args.holo}; {chromium_version}, --virtual-time-budget={args.budget_ms}")
    print()
    header = ("what", "wall s", "page JS ms", "JS heap MB", "peak PSS MB", "result")
    table = [header] + [(what, f"{wall:.2f}", "–" if js is None else f"{js:.0f}", "–" if heap is None else f"{heap:.0f}",
                         "–" if rss is None else f"{rss:.0f}", note)
                        for what, wall, js, heap, rss, note in rows]
    widths = [max(len(row[k]) for row in table) for k in range(len(header) - 1)]
    for row in table:
        print("  ".join(cell.ljust(width) if k == 0 else cell.rjust(width)
                        for k, (cell, width) in enumerate(zip(row, widths))) + "  " + row[-1])
    print()
    print("page JS ms: performance.now() when the page's script has drawn the view (from navigation start); "
          "wall s: the whole Chromium process, its start included; peak PSS: the most memory its processes held together.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "chromium": chromium_version, "data_mb": data_mb, "page_mb": page_mb,
                       "facts": {k: v for k, v in facts.items() if k != "step_rollouts"},
                       "rows": [dict(zip(("what", "wall_s", "page_js_ms", "js_heap_mb", "peak_pss_mb", "result"), row))
                                for row in rows],
                       "probes": {k: v.get("probe") for k, v in results.items()}}, f, indent=1)
    if failures:
        print("Chromium did not render: " + "; ".join(failures), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
