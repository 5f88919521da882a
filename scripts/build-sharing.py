#!/usr/bin/env python3
"""Which packages of `cargo build -p holo-runtime --bin holo` does `cargo test --workspace` build again?

The README's commands share an artifact only where both builds make the same unit: the same package,
features, settings (profile names aside) and, recursively, the same dependencies. A feature that only the
tests turn on changes that unit and everything above it: a proc-macro dependency's `syn` rebuilds serde and
all that derives with it; `regex-automata`'s `default` rebuilds tokenizers and candle. Build scripts and
proc-macros (the host side) and the code they link into (the target side) resolve features apart, so a
package can be built once for each. This prints each unit the tests build again whose dependencies all
agree with the demo's (the root of a rebuild), with the features the test build adds or drops. It reads cargo's unit graphs,
an unstable flag: RUSTC_BOOTSTRAP=1 lets a stable toolchain print them.

    python3 scripts/build-sharing.py          # exit 1 when a unit differs
"""
import hashlib
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def unit_graph(*args):
    env = dict(os.environ, RUSTC_BOOTSTRAP="1")
    out = subprocess.run(
        ["cargo", *args, "-q", "-Z", "unstable-options", "--unit-graph"],
        cwd=ROOT, env=env, check=True, capture_output=True, text=True,
    ).stdout
    return json.loads(out)


def package(pkg_id):
    """`name@version` of a package id (a path package's id may give only its version)."""
    source, _, fragment = pkg_id.partition("#")
    if "@" in fragment:
        return fragment
    return f"{source.rstrip('/').rsplit('/', 1)[-1]}@{fragment}"


def signatures(graph):
    """Each unit's signature (itself and its dependencies, recursively) and side (host or target)."""
    units = graph["units"]
    memo = {}

    def signature(index):
        if index not in memo:
            unit = units[index]
            profile = {k: v for k, v in unit["profile"].items() if k != "name"}
            deps = sorted((d["extern_crate_name"], signature(d["index"])) for d in unit["dependencies"])
            text = json.dumps([unit["pkg_id"], unit["target"]["kind"], unit["target"]["name"],
                               unit["mode"], sorted(unit["features"]), profile, deps], sort_keys=True)
            memo[index] = hashlib.sha1(text.encode()).hexdigest()
        return memo[index]

    # The target side: reachable from the roots without entering a build script or a proc-macro.
    target, stack = set(), list(graph["roots"])
    while stack:
        index = stack.pop()
        if index in target:
            continue
        target.add(index)
        for dep in units[index]["dependencies"]:
            kind = units[dep["index"]]["target"]["kind"]
            if "proc-macro" not in kind and "custom-build" not in kind:
                stack.append(dep["index"])
    return units, {i: (signature(i), "target" if i in target else "host") for i in range(len(units))}


# Packages the tests build with other features by design: holoc's own binary and tests turn on its `cli` and
# `lsp`, so every workspace crate above holoc is built again for the tests (they are rebuilt for their test
# targets anyway).
EXPECTED = ("holoc@", "holo-")


def main():
    run_units, run = signatures(unit_graph("build", "-p", "holo-runtime", "--bin", "holo"))
    test_units, test = signatures(unit_graph("test", "--workspace", "--no-run"))
    built = {key[0] for key in run.values()}
    packages = {u["pkg_id"] for u in run_units}
    # What the `holo` binary links (the demo's target side): building one of these again is what costs
    # (candle, tokenizers). Tools the demo builds only for its build scripts and proc-macros, which a
    # test-only crate needs with other features, are built again in seconds and not counted.
    linked = {run_units[i]["pkg_id"] for i, (_, side) in run.items() if side == "target"}
    # Units of the tests that the demo's build does not have although it builds their package.
    again = [i for i, (sig, _) in test.items() if sig not in built and test_units[i]["pkg_id"] in packages]
    avoidable = []
    for i in again:
        unit = test_units[i]
        name = package(unit["pkg_id"])
        if any(d["index"] in again for d in unit["dependencies"]) or name.startswith(EXPECTED):
            continue
        if unit["pkg_id"] not in linked:
            continue
        avoidable.append(i)
        kind = unit["target"]["kind"][0]
        features = set(unit["features"])
        others = [u for u in run_units if u["pkg_id"] == unit["pkg_id"] and u["target"]["kind"] == unit["target"]["kind"]]
        closest = set(min(others, key=lambda o: len(set(o["features"]) ^ features))["features"]) if others else set()
        print(f"{name} {kind} {unit['mode']} ({test[i][1]}): the tests add {sorted(features - closest)}, "
              f"drop {sorted(closest - features)}")
    rebuilt = sorted({package(test_units[i]["pkg_id"]) for i in again})
    print(f"the tests build {len(rebuilt)} packages of the demo's build again: {', '.join(rebuilt)}")
    print(f"{len(avoidable)} of what the holo binary links is built again for a reason that can be avoided")
    return 1 if avoidable else 0


if __name__ == "__main__":
    sys.exit(main())
