#!/usr/bin/env python3
"""Which units of `cargo build -p holo-runtime --bin holo` does `cargo test --workspace` resolve otherwise?

The README's commands can share artifacts only where both resolve a package with the same features and
settings (profile names aside). This prints each unit of the first build that the second lacks, with the
features the test build adds or drops; one such unit rebuilds everything above it (a proc-macro
dependency's `syn` rebuilds serde and all that uses it). It reads cargo's unit graphs, an unstable flag:
RUSTC_BOOTSTRAP=1 lets a stable toolchain print them. Equal unit graphs are necessary, not sufficient:
see docs/architecture.md, "Build invariant".

    python3 scripts/build-sharing.py          # exit 1 when a unit differs
"""
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
    units = {}
    for unit in json.loads(out)["units"]:
        profile = {k: v for k, v in unit["profile"].items() if k != "name"}
        key = (unit["pkg_id"].split("#")[-1], tuple(unit["target"]["kind"]), unit["mode"])
        units.setdefault(key, []).append((frozenset(unit["features"]), json.dumps(profile, sort_keys=True)))
    return units


def main():
    run = unit_graph("build", "-p", "holo-runtime", "--bin", "holo")
    test = unit_graph("test", "--workspace", "--no-run")
    differing = 0
    for key, variants in sorted(run.items()):
        for features, profile in variants:
            others = test.get(key, [])
            if (features, profile) in others:
                continue
            differing += 1
            package, kind, mode = key
            if not others:
                print(f"{package} {kind[0]} {mode}: not in the test build")
                continue
            closest = min(others, key=lambda other: len(other[0] ^ features))
            added, dropped = sorted(closest[0] - features), sorted(features - closest[0])
            note = "" if closest[1] == profile else " (profile differs)"
            print(f"{package} {kind[0]} {mode}: test adds {added}, drops {dropped}{note}")
    total = sum(len(v) for v in run.values())
    print(f"{differing} of {total} units of the demo's build are resolved otherwise by the tests")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
