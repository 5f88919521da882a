#!/usr/bin/env python3
"""Lists circles of files that import each other inside each workspace crate.

docs/architecture.md keeps holo-train and holo-model free of them: a type that several files share lives in
a file below all of them, and
every crate of the workspace keeps to it. A file's imports are the paths it names through `crate::` or `super::` (in `use`
items and in code); a module's `mod.rs`/`lib.rs` re-exporting its children is not counted, since a parent
that declares a child is not a use of it. Exits 1 when any crate has a circle.

    python3 scripts/import-circles.py   # .ci/run runs it
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
CRATES = {
    "holoc": "holoc/src",
    "holo-core": "holo-runtime/holo-core/src",
    "holo-sandbox": "holo-runtime/holo-sandbox/src",
    "holo-model": "holo-runtime/holo-model/src",
    "holo-train": "holo-runtime/holo-train/src",
    "holo-serve": "holo-runtime/holo-serve/src",
    "holo-engines": "holo-runtime/holo-engines/src",
}
PATH = re.compile(r"\b(crate|super)((?:::[A-Za-z_][A-Za-z0-9_]*)+|::\{)")
TEST_MODULE = re.compile(r"^#\[cfg\(test\)\]\s*\n\s*mod tests\b", re.M)


def module_of(src: pathlib.Path, file: pathlib.Path) -> tuple:
    parts = list(file.relative_to(src).with_suffix("").parts)
    if parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    return tuple(parts)


def strip(text: str) -> str:
    """Drops comments and the unit tests, which may import anything of their module's parent."""
    text = re.sub(r"//[^\n]*", "", text)
    m = TEST_MODULE.search(text)
    return text[: m.start()] if m else text


def targets(module: tuple, text: str, modules: set) -> set:
    found = set()
    for m in PATH.finditer(text):
        head, rest = m.group(1), m.group(2)
        names = [n for n in rest.split("::") if n and n != "{"]
        if head == "crate":
            base = []
        else:
            # `super` from a file `a/b.rs` (module a::b) is `a`; from `a/mod.rs` (module a) it is the root.
            base = list(module[:-1])
            while names and names[0] == "super":
                names.pop(0)
                base = base[:-1]
        path = tuple(base)
        best = path if path in modules else None
        for name in names:
            path = path + (name,)
            if path in modules:
                best = path
            else:
                break
        if best is not None and best != module and best != ():
            found.add(best)
    return found


def circles(src: pathlib.Path) -> list:
    files = {module_of(src, f): f for f in src.rglob("*.rs")}
    modules = set(files)
    edges = {}
    for module, file in files.items():
        text = strip(file.read_text())
        found = targets(module, text, modules)
        # A parent naming its own children (re-exports, `mod` items) is declaration, not use.
        edges[module] = {t for t in found if t[: len(module)] != module or module == ()}
        if module == ():
            edges[module] = set()
    # Tarjan's strongly connected components.
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted("::".join(c) for c in comp))

    sys.setrecursionlimit(10000)
    for v in sorted(modules):
        if v not in index:
            visit(v)
    return out


def main() -> int:
    failed = False
    for crate, folder in CRATES.items():
        found = circles(ROOT / folder)
        print(f"{crate}: {len(found)} circle(s)")
        for comp in found:
            print("    " + " <-> ".join(comp))
        failed |= bool(found)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
