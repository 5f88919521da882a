#!/usr/bin/env python3
"""Side-by-side benchmark: the holoc front end (Rust) against the Python errloom parser it replaces.

Both sides parse exactly the same set of corpus files (tests/corpus/errloom/*.hol and history/*.hol),
in-process, with the same method: find an iteration count by doubling (1, 2, 5, 10, 20, 50, ...) until one
batch takes at least --min-time, run that batch --repeat times, keep the fastest. The script prints the
time of one pass over the corpus on each side, the throughput in MB/s (10^6 bytes of .hol source per
second), a per-file table, and the ratio "holoc is N× faster". The design target is N >= 100.

Usage:

    python3 benches/errloom_compare.py --errloom-parser /path/to/errloom/holoware_parse.py

Getting errloom's parser: it is NOT part of this repository. It is the file errloom/holoware_parse.py of
https://github.com/holo-q/errloom (MIT licence), e.g.

    git clone https://github.com/holo-q/errloom /tmp/errloom
    python3 benches/errloom_compare.py --errloom-parser /tmp/errloom/errloom/holoware_parse.py

Only that file (and, when it sits next to it, errloom/holoware.py with the span classes) is loaded;
errloom itself need not be installed. Its imports of errloom's logging helpers (errloom.lib.log) and, when
`rich` is not installed, of rich.panel / rich.text are served by small stand-ins defined below, which do
the same per-call work as the originals with DEBUG logging off (errloom's default) and nothing more, so
they never make the Python side slower than errloom really is. If holoware.py is not next to the parser,
or fails to import, equivalent span data classes defined below are used.

The errloom parser rejects some corpus files (smola.hol: a holotype body that starts with a holotype, before
any role). Those are reported and left out of BOTH sides, so the two sides time the same bytes.

What is timed:
  - Python: `HolowareParser(text).parse()` on the already-decoded text of each file (errloom's own
    Holoware.parse); file reading and UTF-8 decoding are not timed.
  - Rust: `holoc::compile(bytes, &Options::default())` on the bytes of each file: UTF-8 check, lexer,
    parser, semantic checks and lowering to IR, plus dropping the result (the same call as the criterion
    bench, `cargo bench -p holoc --bench check`). holoc does strictly more work than the Python parser,
    which builds spans and checks nothing.
The Rust side runs in a small throwaway program that this script writes into a cache folder outside the
repository (under the system temp dir, or --work-dir), depending on ./holoc by path (default features
off) and built with `cargo run --release` (the release profile, as `cargo bench` uses). The first run
compiles holoc and its dependencies (a minute or two); later runs reuse the build.

Options: --repeat N (default 5), --min-time SECONDS per batch (default 0.2), --cargo PATH, --offline (pass
--offline to cargo), --work-dir DIR, --corpus DIR (repeatable), --json FILE (write all figures as JSON).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import types
import uuid as uuid_module
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from math import ceil
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CORPUS = [REPO / "tests" / "corpus" / "errloom", REPO / "tests" / "corpus" / "errloom" / "history"]
ERRLOOM_URL = "https://github.com/holo-q/errloom"


class BenchError(Exception):
    """A problem the user can fix (wrong path, missing tool); printed without a traceback."""


# --------------------------------------------------------------------------------------------------
# Stand-ins for the modules errloom/holoware_parse.py imports
# --------------------------------------------------------------------------------------------------

_indent = threading.local()


def _indent_stack() -> list:
    if not hasattr(_indent, "stack"):
        _indent.stack = []
    return _indent.stack


def _push(a1=1, a2=None, log_func: Optional[Callable] = None) -> None:
    """errloom.lib.log.push: push an indent segment; with a second argument, also log a header line."""
    stack = _indent_stack()
    if isinstance(a1, int):
        stack.append(".. " * a1)
    elif a2 is not None:
        if log_func is not None:
            log_func(f"{a1} {a2}")
        stack.append(a1 + " ")
    else:
        ceil(len(a1) / 3)
        stack.append(a1 + " ")


def _pop() -> None:
    stack = _indent_stack()
    if stack:
        stack.pop()


class _EnhancedLogger(logging.Logger):
    """errloom's logger class: a logging.Logger with push/pop of an indent stack."""

    def push(self, a1=1, a2=None, log_func=None):
        return _push(a1, a2, log_func=log_func or self.info)

    def push_debug(self, a1=1, a2=None):
        return _push(a1, a2, log_func=self.debug)

    def pop(self):
        return _pop()


def _get_logger(name: Optional[str] = None) -> _EnhancedLogger:
    logger = _EnhancedLogger(name or "errloom")
    logger.setLevel(logging.WARNING)  # errloom's default: DEBUG messages are dropped
    return logger


def _indent_decorator(func=None, *, a1=1, a2=None, log_func=None):
    """errloom.lib.log.indent_decorator: push an indent around each call of the decorated function."""

    def decorator(fn):
        def wrapper(*args, **kwargs):
            _push(a1, a2, log_func=log_func)
            try:
                return fn(*args, **kwargs)
            finally:
                _pop()

        wrapper.__name__ = fn.__name__
        wrapper.__doc__ = fn.__doc__
        return wrapper

    if callable(func):
        return decorator(func)
    if func is not None:
        a1, a2 = func, ""
    return decorator


class _RichStandIn:
    """rich.panel.Panel / rich.text.Text when rich is not installed: keeps its arguments, renders nothing."""

    def __init__(self, *args, **kwargs):
        self.args = args
        self.kwargs = kwargs

    def append(self, *args, **kwargs):
        return self


# The span classes of errloom/holoware.py (fields, defaults and set_args as there; errloom's runtime
# methods, which the parser never calls, left out).


@dataclass
class Span(ABC):
    uuid: str = field(default_factory=lambda: str(uuid_module.uuid4()))
    kargs: list = field(default_factory=list)
    kwargs: dict = field(default_factory=dict)

    @abstractmethod
    def get_color(self) -> str: ...

    def set_args(self, k: list, kw: dict, kwinject: dict) -> "Span":
        self.kargs = k.copy()
        names = {f.name for f in fields(self)}
        remaining = {}
        for key, value in kw.items():
            if key in names:
                setattr(self, key, value)
            else:
                remaining[key] = value
        self.kwargs = {**remaining, **kwinject}
        return self


@dataclass
class ContextResetSpan(Span):
    train: bool = False

    def get_color(self) -> str:
        return "yellow"


@dataclass
class EgoSpan(Span):
    ego: str = ""

    def get_color(self) -> str:
        return "bold cyan"


@dataclass
class SampleSpan(Span):
    goal: str = ""
    fence: str = ""

    def get_color(self) -> str:
        return "bold green"


@dataclass
class TextSpan(Span):
    text: str = ""

    def get_color(self) -> str:
        return "white"


@dataclass
class ObjSpan(Span):
    var_ids: list = field(default_factory=list)

    def get_color(self) -> str:
        return "bold magenta"


@dataclass
class ClassSpan(Span):
    class_name: str = ""
    body: Optional["Holoware"] = None

    def get_color(self) -> str:
        return "bold blue"


@dataclass
class Holoware:
    name: Optional[str] = None
    code: Optional[str] = None
    filepath: Optional[str] = None
    spans: list = field(default_factory=list)


def _module(name: str, package: bool = False, **attributes) -> types.ModuleType:
    module = types.ModuleType(name)
    if package:
        module.__path__ = []
    module.__dict__.update(attributes)
    sys.modules[name] = module
    return module


def load_errloom_parser(parser_path: Path, holoware_path: Optional[Path]) -> tuple[type, dict]:
    """Imports errloom's holoware_parse.py under its own name with stand-ins for what it imports.

    Returns (HolowareParser, notes) where notes says which stand-ins were used.
    """
    if not parser_path.is_file():
        raise BenchError(
            f"--errloom-parser {parser_path}: no such file.\n"
            f"Pass the path to errloom/holoware_parse.py from a checkout of {ERRLOOM_URL} (MIT), e.g.\n"
            f"  git clone {ERRLOOM_URL} /tmp/errloom\n"
            f"  python3 {Path(__file__).name} --errloom-parser /tmp/errloom/errloom/holoware_parse.py"
        )
    notes = {}
    for name in [m for m in sys.modules if m == "errloom" or m.startswith("errloom.")]:
        del sys.modules[name]
    errloom = _module("errloom", package=True)
    lib = _module("errloom.lib", package=True)
    log = _module(
        "errloom.lib.log",
        getLogger=_get_logger,
        indent_decorator=_indent_decorator,
        push=_push,
        pop=_pop,
        EnhancedLogger=_EnhancedLogger,
    )
    errloom.lib, lib.log = lib, log

    try:
        import rich  # noqa: F401
        import rich.panel  # noqa: F401
        import rich.text  # noqa: F401

        try:
            from importlib.metadata import version

            notes["rich"] = f"installed ({version('rich')})"
        except Exception:  # rich without package metadata (vendored): its version is unknown
            notes["rich"] = "installed"
    except ImportError:
        _module("rich", package=True)
        _module("rich.panel", Panel=_RichStandIn)
        _module("rich.text", Text=_RichStandIn)
        notes["rich"] = "not installed: stand-in for rich.panel.Panel / rich.text.Text"

    builtin = dict(
        Span=Span, ContextResetSpan=ContextResetSpan, EgoSpan=EgoSpan, SampleSpan=SampleSpan,
        TextSpan=TextSpan, ObjSpan=ObjSpan, ClassSpan=ClassSpan, Holoware=Holoware,
    )
    if holoware_path is None and (parser_path.parent / "holoware.py").is_file():
        holoware_path = parser_path.parent / "holoware.py"
    if holoware_path is None:
        notes["span classes"] = "stand-ins defined in this script (no holoware.py next to the parser)"
    else:
        try:
            _import_file("errloom.holoware", holoware_path)
            notes["span classes"] = str(holoware_path)
        except Exception as error:  # noqa: BLE001 - any failure: fall back to the stand-ins
            notes["span classes"] = f"stand-ins defined in this script ({holoware_path} failed to import: {error})"
            holoware_path = None
    if holoware_path is None:
        _module("errloom.holoware", **builtin)

    try:
        parser_module = _import_file("errloom.holoware_parse", parser_path)
    except ImportError as error:
        raise BenchError(
            f"{parser_path} imports something this script has no stand-in for: {error}.\n"
            f"Pass errloom/holoware_parse.py from {ERRLOOM_URL}."
        ) from error
    except SyntaxError as error:
        raise BenchError(f"{parser_path} is not Python source: {error}") from error
    parser = getattr(parser_module, "HolowareParser", None)
    if parser is None:
        raise BenchError(f"{parser_path} defines no HolowareParser; pass errloom/holoware_parse.py from {ERRLOOM_URL}.")
    return parser, notes


def _import_file(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise BenchError(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    parent, _, child = name.rpartition(".")
    setattr(sys.modules[parent], child, module)
    return module


# --------------------------------------------------------------------------------------------------
# Timing (the same method on both sides; the Rust program below implements it again)
# --------------------------------------------------------------------------------------------------


def _batch_sizes():
    scale = 1
    while True:
        for step in (1, 2, 5):
            yield step * scale
        scale *= 10


def best_seconds(fn: Callable[[], object], repeat: int, min_time: float) -> float:
    """Seconds per call: the fastest of `repeat` batches, each long enough to take >= min_time."""
    timer = time.perf_counter
    for number in _batch_sizes():
        start = timer()
        for _ in range(number):
            fn()
        if timer() - start >= min_time:
            break
    best = float("inf")
    for _ in range(repeat):
        start = timer()
        for _ in range(number):
            fn()
        best = min(best, (timer() - start) / number)
    return best


# --------------------------------------------------------------------------------------------------
# The Rust side: a throwaway program linking holoc
# --------------------------------------------------------------------------------------------------

RUST_MAIN = r"""
//! Generated by benches/errloom_compare.py: times holoc::compile on the files given, in-process.
//! Usage: holoc-errloom-compare MIN_TIME_S REPEAT FILE...
//! Prints `file<TAB>path<TAB>bytes<TAB>errors<TAB>seconds` per file, then `pass<TAB>seconds`.
use std::hint::black_box;
use std::time::Instant;

use holoc::{compile, Options};

fn best_seconds(min_time: f64, repeat: usize, mut f: impl FnMut()) -> f64 {
    let mut number: u64 = 1;
    'sizes: for scale in (0..).map(|e| 10u64.pow(e)) {
        for step in [1, 2, 5] {
            number = step * scale;
            let start = Instant::now();
            for _ in 0..number {
                f();
            }
            if start.elapsed().as_secs_f64() >= min_time {
                break 'sizes;
            }
        }
    }
    let mut best = f64::INFINITY;
    for _ in 0..repeat {
        let start = Instant::now();
        for _ in 0..number {
            f();
        }
        best = best.min(start.elapsed().as_secs_f64() / number as f64);
    }
    best
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let min_time: f64 = args[0].parse().expect("MIN_TIME_S");
    let repeat: usize = args[1].parse().expect("REPEAT");
    let paths = &args[2..];
    let files: Vec<Vec<u8>> = paths
        .iter()
        .map(|path| std::fs::read(path).unwrap_or_else(|e| panic!("{path}: {e}")))
        .collect();
    let options = Options::default();
    for (path, file) in paths.iter().zip(&files) {
        let errors = compile(file, &options).has_errors();
        let seconds = best_seconds(min_time, repeat, || {
            black_box(compile(black_box(file), &options));
        });
        println!("file\t{path}\t{}\t{errors}\t{seconds:e}", file.len());
    }
    let seconds = best_seconds(min_time, repeat, || {
        for file in &files {
            black_box(compile(black_box(file), &options));
        }
    });
    println!("pass\t{seconds:e}");
}
"""

RUST_MANIFEST = """\
# Generated by benches/errloom_compare.py; safe to delete.
[package]
name = "holoc-errloom-compare"
version = "0.0.0"
edition = "2021"
publish = false

[dependencies]
holoc = {{ path = {holoc}, default-features = false }}

[workspace]
"""


class RustSide:
    """The throwaway program in `work_dir`: written and built by `build()`, timed by `run()`."""

    def __init__(self, cargo: str, work_dir: Path, offline: bool):
        cargo_path = shutil.which(cargo)
        if cargo_path is None:
            raise BenchError(
                f"cargo not found (looked for {cargo!r} on PATH). Install Rust from https://rustup.rs or pass "
                f"--cargo /path/to/cargo."
            )
        self.holoc_dir = REPO / "holoc"
        if not (self.holoc_dir / "Cargo.toml").is_file():
            raise BenchError(f"{self.holoc_dir}/Cargo.toml not found; run this script from the holoware repository")
        self.work_dir = work_dir
        self.cargo = [cargo_path]
        self.flags = ["--release", "--quiet", "--manifest-path", str(work_dir / "Cargo.toml")]
        if offline:
            self.flags.append("--offline")
        self.version = subprocess.run([cargo_path, "--version"], stdout=subprocess.PIPE, text=True).stdout.strip()

    def build(self) -> None:
        (self.work_dir / "src").mkdir(parents=True, exist_ok=True)
        _write_if_changed(self.work_dir / "Cargo.toml", RUST_MANIFEST.format(holoc=json.dumps(str(self.holoc_dir))))
        _write_if_changed(self.work_dir / "src" / "main.rs", RUST_MAIN.lstrip())
        if (REPO / "Cargo.lock").is_file() and not (self.work_dir / "Cargo.lock").is_file():
            # The same dependency versions as the repository's own build, and no registry look-up.
            shutil.copyfile(REPO / "Cargo.lock", self.work_dir / "Cargo.lock")
        print(f"building the holoc side in {self.work_dir} (the first build takes a minute or two) ...",
              file=sys.stderr, flush=True)
        command = [*self.cargo, "build", *self.flags]
        if subprocess.run(command).returncode != 0:
            raise BenchError(f"building the Rust side failed: {' '.join(command)}")

    def run(self, files: list[Path], repeat: int, min_time: float) -> dict:
        print("timing the holoc (Rust) side ...", file=sys.stderr, flush=True)
        command = [*self.cargo, "run", *self.flags, "--", repr(min_time), str(repeat), *map(str, files)]
        result = subprocess.run(command, stdout=subprocess.PIPE, text=True)
        if result.returncode != 0:
            raise BenchError(f"the Rust side failed (exit {result.returncode}): {' '.join(command[:7])} ...")
        per_file, pass_seconds = {}, None
        for line in result.stdout.splitlines():
            parts = line.split("\t")
            if parts[0] == "file":
                per_file[parts[1]] = {"bytes": int(parts[2]), "errors": parts[3] == "true", "seconds": float(parts[4])}
            elif parts[0] == "pass":
                pass_seconds = float(parts[1])
        if pass_seconds is None or len(per_file) != len(files):
            raise BenchError(f"unexpected output from the Rust side:\n{result.stdout}")
        return {"per_file": per_file, "pass_seconds": pass_seconds, "cargo": self.version}


def _write_if_changed(path: Path, text: str) -> None:
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


def corpus_files(dirs: list[Path]) -> list[Path]:
    files = []
    for directory in dirs:
        if not directory.is_dir():
            raise BenchError(f"corpus folder {directory} not found")
        files += sorted(directory.glob("*.hol"))
    if not files:
        raise BenchError(f"no .hol files in {', '.join(map(str, dirs))}")
    return files


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f} µs"


def _mbs(size: int, seconds: float) -> str:
    return f"{size / seconds / 1e6:,.1f} MB/s"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description="Benchmark holoc (Rust) against the Python errloom parser on the errloom corpus, "
        "and print how many times faster holoc is.",
        epilog=f"errloom's parser is not in this repository: get errloom/holoware_parse.py from {ERRLOOM_URL} "
        "(MIT), e.g. `git clone " + ERRLOOM_URL + " /tmp/errloom`, then pass "
        "--errloom-parser /tmp/errloom/errloom/holoware_parse.py. See benches/README.md.",
    )
    parser.add_argument("--errloom-parser", required=True, type=Path, metavar="PATH",
                        help="path to errloom/holoware_parse.py (from a checkout of holo-q/errloom)")
    parser.add_argument("--errloom-holoware", type=Path, metavar="PATH",
                        help="errloom/holoware.py with the span classes (default: the one next to the parser, "
                        "else stand-ins defined in this script)")
    parser.add_argument("--corpus", type=Path, action="append", metavar="DIR",
                        help="folder of .hol files, repeatable (default: tests/corpus/errloom and its history/)")
    parser.add_argument("--repeat", type=int, default=5, help="timed batches per measurement; the fastest counts (5)")
    parser.add_argument("--min-time", type=float, default=0.2, metavar="SECONDS",
                        help="minimum duration of one timed batch (0.2)")
    parser.add_argument("--cargo", default=os.environ.get("CARGO", "cargo"), help="cargo to build the Rust side with")
    parser.add_argument("--offline", action="store_true", help="pass --offline to cargo")
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "holoc-errloom-compare",
                        help="where the throwaway Rust program is written and built (outside the repository)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write every figure to FILE as JSON")
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.min_time <= 0:
        parser.error("--repeat must be >= 1 and --min-time > 0")

    try:
        work_dir = args.work_dir.resolve()
        if work_dir == REPO or REPO in work_dir.parents:
            raise BenchError(f"--work-dir {work_dir} is inside the repository; pick a folder outside it")
        rust_side = RustSide(args.cargo, work_dir, args.offline)
        errloom_parser, notes = load_errloom_parser(args.errloom_parser.resolve(), args.errloom_holoware)
        files = corpus_files(args.corpus or DEFAULT_CORPUS)

        texts, rejected = {}, {}
        for path in files:
            text = path.read_bytes().decode("utf-8")
            try:
                errloom_parser(text).parse()
                texts[path] = text
            except Exception as error:  # noqa: BLE001 - a rejection is any exception, as in errloom
                rejected[path] = f"{type(error).__name__}: {error}"
        if not texts:
            raise BenchError("the errloom parser rejected every file; nothing to compare")
        rust_side.build()
        accepted = list(texts)
        sizes = {path: path.stat().st_size for path in accepted}
        total = sum(sizes.values())

        print("timing the errloom (Python) side ...", file=sys.stderr, flush=True)
        py_file = {
            path: best_seconds(lambda text=text: errloom_parser(text).parse(), args.repeat, args.min_time)
            for path, text in texts.items()
        }
        sources = list(texts.values())

        def python_pass():
            for text in sources:
                errloom_parser(text).parse()

        py_pass = best_seconds(python_pass, args.repeat, args.min_time)
        rust = rust_side.run(accepted, args.repeat, args.min_time)
    except BenchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    rust_pass = rust["pass_seconds"]
    ratio = py_pass / rust_pass
    rel = lambda path: os.path.relpath(path, REPO)  # noqa: E731
    parser_sha = hashlib.sha256(args.errloom_parser.read_bytes()).hexdigest()[:12]

    print()
    print(f"errloom parser : {args.errloom_parser} (sha256 {parser_sha})")
    print(f"  span classes : {notes['span classes']}")
    print(f"  rich         : {notes['rich']}")
    print(f"python         : {platform.python_implementation()} {platform.python_version()}")
    print(f"rust           : {rust['cargo']}, release profile, holoc::compile with Options::default()")
    print(f"machine        : {platform.machine()}, {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"method         : fastest of {args.repeat} batches of >= {args.min_time} s each, per side")
    print(f"corpus         : {len(files)} files; errloom rejected {len(rejected)}:")
    for path, why in rejected.items():
        print(f"    {rel(path)}  ({why})")
    print(f"timed set      : {len(accepted)} files, {total:,} bytes (identical on both sides)")
    print()
    width = max(len(rel(path)) for path in accepted)
    print(f"{'file':<{width}}  {'bytes':>6}  {'errloom (Python)':>16}  {'holoc (Rust)':>12}  {'ratio':>7}")
    for path in accepted:
        r = rust["per_file"][str(path)]
        note = "  (holoc reports errors)" if r["errors"] else ""
        print(f"{rel(path):<{width}}  {sizes[path]:>6}  {_us(py_file[path]):>16}  {_us(r['seconds']):>12}  "
              f"{py_file[path] / r['seconds']:>6.0f}×{note}")
    print()
    print(f"{'one corpus pass':<{width}}  {total:>6}  {_us(py_pass):>16}  {_us(rust_pass):>12}  {ratio:>6.0f}×")
    print(f"{'throughput':<{width}}  {'':>6}  {_mbs(total, py_pass):>16}  {_mbs(total, rust_pass):>12}")
    print()
    verdict = "meets" if ratio >= 100 else "MISSES"
    print(f"holoc is {ratio:,.0f}× faster than the errloom parser ({verdict} the >= 100× design target)")

    if args.json:
        args.json.write_text(json.dumps({
            "errloom_parser": str(args.errloom_parser), "errloom_parser_sha256": parser_sha, "notes": notes,
            "python": platform.python_version(), "cargo": rust["cargo"], "repeat": args.repeat,
            "min_time_s": args.min_time, "rejected": {rel(p): why for p, why in rejected.items()},
            "files": {rel(p): {"bytes": sizes[p], "python_s": py_file[p], "rust_s": rust["per_file"][str(p)]["seconds"],
                               "rust_errors": rust["per_file"][str(p)]["errors"]} for p in accepted},
            "pass": {"bytes": total, "python_s": py_pass, "rust_s": rust_pass, "ratio": ratio},
        }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
