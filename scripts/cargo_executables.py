#!/usr/bin/env python3
"""The executables a `cargo build --message-format=json...` run made, by target name.

    python3 scripts/cargo_executables.py MESSAGES NAME...

MESSAGES: cargo's JSON messages, one a line. Prints `NAME PATH` for each NAME (a binary's, an example's or an
integration test's target name; the tests' file names carry a hash), in the order given; exits 1 naming those
that cargo reported no executable for. Used by scripts/gpu-bundle.sh and scripts/gpu-check.sh.
"""
import json
import sys


def main():
    messages, names = sys.argv[1], sys.argv[2:]
    found = {}
    with open(messages) as lines:
        for line in lines:
            message = json.loads(line)
            if message.get("reason") == "compiler-artifact" and message.get("executable"):
                found[message["target"]["name"]] = message["executable"]
    missing = [name for name in names if name not in found]
    if missing:
        sys.exit(f"cargo reported no executable for {', '.join(missing)}")
    for name in names:
        print(name, found[name])


if __name__ == "__main__":
    main()
