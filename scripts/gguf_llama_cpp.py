#!/usr/bin/env python3
"""llama.cpp's own logits of every GGUF file in `holo-runtime/tests/fixtures/models/gguf/converted/`, for
`holo-runtime/tests/model/gguf_llama_cpp.rs`: what a user comparing holo with llama.cpp (or Ollama, which runs
it) sees from the same file.

    ~/.cache/holo-peers/venv/bin/python scripts/gguf_llama_cpp.py

llama.cpp is llama-cpp-python LLAMA_CPP_PYTHON's C library (llama.cpp LLAMA_CPP_COMMIT, the commit whose
converter wrote the files), built for the CPU into the converter's folder as `gguf_spm.py` describes. Each file
is run in its own process (a file llama.cpp refuses or crashes on is recorded with why, and the others still
run) with `logits_all`, a context of N_CTX tokens, flash attention off and keys and values cached in f32 (the
default f16 cache rounds them to 11 bits, 6e-3 on these logits), on `gguf_converted.py`'s SEQUENCES: past the
fixtures' sliding windows (4 positions) and Phi-3's original context (64). Every logit of the tiny vocabularies
is kept, rounded to DIGITS decimals.

Into `converted/llama_cpp.json`: llama-cpp-python's version, llama.cpp's commit, the context and cache types,
and per file its sha256 and either `logits` (per sequence its ids, positions and the logits at them) or
`refused` (llama.cpp's own error lines, or how its process ended).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gguf_converted import LLAMA_CPP_COMMIT, LLAMA_CPP_PYTHON, OUT, SEQUENCES, llama_cpp, sha256  # noqa: E402

# Larger than SEQUENCES' longest (80) and than Phi-3's original context (64): llama.cpp takes LongRoPE's
# long factors at every position of a context past the original one.
N_CTX = 128
# GGML_TYPE_F32: the cache's keys and values as the graph computed them.
CACHE_TYPE = 0
DIGITS = 5


def llama_cpp_logits(path: Path, verbose: bool = False) -> list:
    """llama.cpp's logits (`logits_all`) of SEQUENCES at their positions, on the CPU, keys and values cached
    in f32; with `verbose`, llama.cpp's log on stderr."""
    import numpy as np
    from llama_cpp import Llama

    model = Llama(model_path=str(path), n_ctx=N_CTX, n_batch=N_CTX, logits_all=True, n_threads=2,
                  n_threads_batch=2, flash_attn=False, type_k=CACHE_TYPE, type_v=CACHE_TYPE, verbose=verbose)
    out = []
    for ids, positions in SEQUENCES:
        model.reset()
        model.eval(ids)
        out.append({"ids": ids, "positions": positions,
                    "logits": [np.asarray(model.scores[p], dtype=np.float32).tolist() for p in positions]})
    return out


def rounded(sequences: list) -> list:
    return [{**sequence, "logits": [[round(value, DIGITS) for value in row] for row in sequence["logits"]]}
            for sequence in sequences]


def record(path: Path) -> dict:
    """`path`'s logits from a process of its own, or why llama.cpp gave none."""
    run = subprocess.run([sys.executable, __file__, "--file", str(path)], capture_output=True, text=True)
    if run.returncode == 0:
        return {"logits": rounded(json.loads(run.stdout))}
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    # llama.cpp's own error (`llama_model_load: error loading model: ...`) where it logged one; otherwise
    # the end of the log (a crash).
    errors = [line for line in lines if "error" in line] or lines[-3:]
    ended = f"exit status {run.returncode}" if run.returncode > 0 else f"signal {-run.returncode}"
    return {"refused": f"{ended}: {' | '.join(errors)}"}


def main() -> None:
    # llama-cpp-python's C library, built into the converter's folder.
    sys.path.insert(0, str(llama_cpp()[1]))
    if sys.argv[1:2] == ["--file"]:
        json.dump(llama_cpp_logits(Path(sys.argv[2]), verbose=True), sys.stdout)
        return
    files = {}
    for path in sorted(OUT.glob("*.gguf")):
        files[path.name] = {"sha256": sha256(path), **record(path)}
        print(path.name, "refused: " + files[path.name]["refused"] if "refused" in files[path.name] else "ok")
    recorded = {"llama_cpp_python": LLAMA_CPP_PYTHON, "llama_cpp_commit": LLAMA_CPP_COMMIT, "n_ctx": N_CTX,
                "cache": "f32", "flash_attn": False, "files": files}
    with open(OUT / "llama_cpp.json", "w") as f:
        json.dump(recorded, f, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()
