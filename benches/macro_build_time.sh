#!/usr/bin/env bash
# macro_build_time.sh: what ten `include_holoware!` calls add to the build time of a crate (issue #3).
#
# It writes a throwaway library crate outside the repository (default
# ${TMPDIR:-/tmp}/holo-macro-build-time, or --work-dir) that depends on this repository's holo-macros and
# holo-runtime by absolute path (holo-runtime with default-features = false, so candle is not built), with
# the repository's Cargo.lock (the same dependency versions), its own [workspace] table and, like the
# workspace, `[profile.dev.package."*"] opt-level = 3`. Its hol/x0.hol ... hol/x9.hol are copies of the
# standard holowares hol/{qa,doublecheck,tool,codemath}.hol, which use only built-in holotypes. Two
# variants of src/lib.rs, otherwise identical:
#
#   A: ten `holo_macros::include_holoware!("hol/xN.hol");` calls (ten generated modules x0 ... x9);
#   B: the same file without the ten calls.
#
# After one warm-up build of each variant (registry and path dependencies compiled once, not timed), it
# measures wall seconds of `cargo build` (median of --repeat runs, default 5):
#
#   (1) the crate alone after `cargo clean -p holo-macro-build-time`, variant A and variant B, interleaved;
#       A - B is the extra build time of the ten include_holoware! calls;
#   (2) variant A rebuilt after appending a comment line `# edit N` to hol/x0.hol (the macro tracks the
#       file, so cargo rebuilds the crate; every macro call in it expands again);
#   (3) variant A rebuilt with nothing changed (cargo's own overhead, for reference).
#
# Every timed build is checked: (1) and (2) must compile the crate, (3) must not, and one that also
# compiled a dependency (the repository changed meanwhile) or waited for a cargo lock is discarded and run
# again. hol/x0.hol is restored at the end; the work dir is kept so that a second run reuses the dependency
# build (delete it to start afresh). Nothing is written inside the repository (the work dir may not be
# inside it). Times are wall seconds of the whole `cargo build` command, cargo's start-up included.
#
# Usage:
#
#   bash benches/macro_build_time.sh [--release] [--repeat N] [--work-dir DIR] [--offline]
#
#   --release    build with `cargo build --release` instead of the dev profile
#   --repeat N   timed builds per measurement (default 5)
#   --work-dir   where the throwaway crate and its target folder go
#   --offline    pass --offline to cargo
#
# The first run compiles holoc, holo-runtime and their dependencies (about ten minutes on 2 cores); the
# rest is 4 x repeat timed builds of the small crate (about a second each) and 3 untimed ones. Run it on
# an otherwise idle machine: other builds on the same cores inflate and scatter every figure. Needs bash
# 4+, cargo, awk and GNU coreutils (realpath -m, date +%N).

set -euo pipefail

crate=holo-macro-build-time
script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
repo=$(cd "$script_dir/.." && pwd -P)
work_dir="${TMPDIR:-/tmp}/holo-macro-build-time"
repeat=5
release=0
cargo_flags=()

usage() {
    sed -n '2,/^$/{s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"
}

die() {
    echo "macro_build_time.sh: $*" >&2
    exit 2
}

while [ $# -gt 0 ]; do
    case "$1" in
        --release) release=1; cargo_flags+=(--release) ;;
        --offline) cargo_flags+=(--offline) ;;
        --repeat) [ $# -ge 2 ] || die "--repeat needs a number"; repeat=$2; shift ;;
        --repeat=*) repeat=${1#--repeat=} ;;
        --work-dir) [ $# -ge 2 ] || die "--work-dir needs a folder"; work_dir=$2; shift ;;
        --work-dir=*) work_dir=${1#--work-dir=} ;;
        -h | --help) usage; exit 0 ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
    shift
done
case "$repeat" in
    '' | *[!0-9]* | 0) die "--repeat takes a positive integer, not '$repeat'" ;;
esac
command -v cargo >/dev/null || die "cargo not found on PATH"
if [ ! -f "$repo/Cargo.lock" ] || [ ! -d "$repo/holo-macros" ] || [ ! -d "$repo/holo-runtime" ]; then
    die "$repo does not look like the Holoware repository"
fi

work_dir=$(realpath -m "$work_dir")
case "$work_dir/" in
    "$repo/"*) die "the work dir $work_dir is inside the repository; choose one outside it" ;;
esac

# The crate's own build output stays in the work dir, whatever the environment says; plain cargo output,
# which build() reads.
export CARGO_TARGET_DIR="$work_dir/target" CARGO_TERM_COLOR=never
unset HOLOWARE_MANIFEST_DIR CARGO_BUILD_TARGET_DIR

mkdir -p "$work_dir/src" "$work_dir/hol" "$work_dir/logs"
cd "$work_dir"

# --- the crate -------------------------------------------------------------------------------------

cat >Cargo.toml <<EOF
# Written by benches/macro_build_time.sh of $repo; throwaway.
[package]
name = "$crate"
version = "0.0.0"
edition = "2021"
publish = false

[dependencies]
holo-macros = { path = '$repo/holo-macros' }
holo-runtime = { path = '$repo/holo-runtime', default-features = false }

[profile.dev.package."*"]
opt-level = 3

# Not a member of the repository's workspace.
[workspace]
EOF
cp "$repo/Cargo.lock" Cargo.lock

sources=(qa doublecheck tool codemath)
for n in 0 1 2 3 4 5 6 7 8 9; do
    cp "$repo/hol/${sources[n % 4]}.hol" "hol/x$n.hol"
done
cp hol/x0.hol logs/x0.hol.orig
trap 'cp "$work_dir/logs/x0.hol.orig" "$work_dir/hol/x0.hol" 2>/dev/null || true' EXIT

common='//! Written by benches/macro_build_time.sh: a throwaway crate that times include_holoware!.

pub use holo_runtime;

/// The same in both variants, so that the crate is never empty.
pub fn answer() -> holo_runtime::Text {
    holo_runtime::Text::from("42")
}
'
{
    printf '%s\n' "$common"
    for n in 0 1 2 3 4 5 6 7 8 9; do
        printf 'holo_macros::include_holoware!("hol/x%d.hol");\n' "$n"
    done
} >logs/lib_a.rs
printf '%s' "$common" >logs/lib_b.rs

use_variant() {
    cp "logs/lib_$1.rs" src/lib.rs
}

# --- timing ----------------------------------------------------------------------------------------

# Runs `cargo build` and prints its wall seconds; the build log goes to logs/$1.log. $2: "compiles"
# when the build must compile the crate, "fresh" when it must compile nothing, "warm" (not a
# measurement) when anything goes. Returns 3 when a measured build also compiled a dependency (the
# repository's holo-* crates changed meanwhile) or waited for a cargo lock: that figure is worthless, the
# caller runs it again.
build() {
    local log="logs/$1.log" start end
    start=$(date +%s.%N)
    if ! cargo build ${cargo_flags[@]+"${cargo_flags[@]}"} >"$log" 2>&1; then
        cat "$log" >&2
        die "cargo build failed (log: $work_dir/$log)"
    fi
    end=$(date +%s.%N)
    if [ "$2" = warm ]; then
        elapsed "$start" "$end"
        return 0
    fi
    if awk -v c="$crate" '($1 == "Compiling" && $2 != c) || $1 == "Blocking" { f = 1 }
            END { exit !f }' "$log"; then
        return 3
    fi
    if [ "$2" = compiles ] && ! grep -q "Compiling $crate " "$log"; then
        die "expected cargo to compile $crate (log: $work_dir/$log)"
    fi
    if [ "$2" = fresh ] && grep -q "Compiling " "$log"; then
        die "expected a no-op build (log: $work_dir/$log)"
    fi
    elapsed "$start" "$end"
}

elapsed() {
    awk -v s="$1" -v e="$2" 'BEGIN { printf "%.3f\n", e - s }'
}

clean_crate() {
    cargo clean ${cargo_flags[@]+"${cargo_flags[@]}"} -p "$crate" >/dev/null 2>&1
}

edits=0

# One timed build of kind $1 (clean-a, clean-b, edit, fresh), log name $2; the seconds go to $seconds.
# A build that also compiled a dependency is discarded and done again (at most 3 tries).
measure() {
    local kind=$1 name=$2 mode try rc
    for try in 1 2 3; do
        case "$kind" in
            clean-*) use_variant "${kind#clean-}"; clean_crate; mode=compiles ;;
            edit) edits=$((edits + 1)); printf '# edit %d\n' "$edits" >>hol/x0.hol; mode=compiles ;;
            fresh) mode=fresh ;;
            *) die "unknown measurement $kind" ;;
        esac
        rc=0
        seconds=$(build "$name" "$mode") || rc=$?
        [ "$rc" = 0 ] && return 0
        [ "$rc" = 3 ] || exit "$rc"
        echo "  ($name, try $try: a dependency was rebuilt or a cargo lock waited for; discarded)" >&2
    done
    die "dependencies kept being rebuilt during $name; is the repository being edited? run again later"
}

median() {
    printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END {
        if (NR % 2) printf "%.3f", v[(NR + 1) / 2]; else printf "%.3f", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

profile=dev
if [ "$release" = 1 ]; then profile=release; fi
echo "crate: $work_dir (profile $profile, $repeat repeats; repository $repo)"

echo "warming up: variant B, then variant A (dependencies are compiled once; not timed) ..."
use_variant b
warm_b=$(build warm-b warm)
use_variant a
warm_a=$(build warm-a warm)
echo "  warm-up builds: B ${warm_b}s, A ${warm_a}s"

seconds=
a_runs=() b_runs=() edit_runs=() fresh_runs=()
echo "(1) the crate alone after cargo clean -p $crate, A and B interleaved ..."
for ((i = 1; i <= repeat; i++)); do
    if ((i % 2)); then order=(a b); else order=(b a); fi
    for v in "${order[@]}"; do
        measure "clean-$v" "clean-$v-$i"
        if [ "$v" = a ]; then a_runs+=("$seconds"); else b_runs+=("$seconds"); fi
        echo "  run $i, variant ${v^^}: ${seconds}s"
    done
done

echo "(2) variant A after appending '# edit N' to hol/x0.hol ..."
use_variant a
build prepare-edit warm >/dev/null
for ((i = 1; i <= repeat; i++)); do
    measure edit "edit-$i"
    edit_runs+=("$seconds")
    echo "  run $i: ${seconds}s"
done

echo "(3) variant A, nothing changed ..."
for ((i = 1; i <= repeat; i++)); do
    measure fresh "fresh-$i"
    fresh_runs+=("$seconds")
    echo "  run $i: ${seconds}s"
done

cp logs/x0.hol.orig hol/x0.hol

med_a=$(median "${a_runs[@]}")
med_b=$(median "${b_runs[@]}")
med_edit=$(median "${edit_runs[@]}")
med_fresh=$(median "${fresh_runs[@]}")
extra=$(awk -v a="$med_a" -v b="$med_b" 'BEGIN { printf "%.3f", a - b }')
per_call=$(awk -v a="$med_a" -v b="$med_b" 'BEGIN { printf "%.3f", (a - b) / 10 }')

echo
echo "cargo build ($profile profile) of $crate, wall seconds, median of $repeat"
printf '%-58s %8s   %s\n' "measurement" "median" "runs"
printf '%-58s %8s   %s\n' "(1) A: ten include_holoware! calls, after clean -p" "$med_a" "${a_runs[*]}"
printf '%-58s %8s   %s\n' "(1) B: no macro calls, after clean -p" "$med_b" "${b_runs[*]}"
printf '%-58s %8s\n' "    A - B: extra time of ten include_holoware! calls" "$extra"
printf '%-58s %8s\n' "    per call ((A - B) / 10)" "$per_call"
printf '%-58s %8s   %s\n' "(2) A: rebuild after editing one .hol file" "$med_edit" "${edit_runs[*]}"
printf '%-58s %8s   %s\n' "(3) A: rebuild, nothing changed" "$med_fresh" "${fresh_runs[*]}"
