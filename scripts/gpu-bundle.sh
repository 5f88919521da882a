#!/usr/bin/env bash
# Makes what `scripts/gpu-check.sh --prebuilt DIR` needs on a GPU machine that has no cargo, no TRL and no
# network (the machines this project is lent; docs/cuda.md), here, on a machine without a GPU:
#
#   DIR/bin.tar.xz    holo, the sample_bench example and the test executables (local_parity, grpo_parity,
#                     sft_parity, precision), built with `--features cuda` for CUDA_COMPUTE_CAP (scripts/
#                     cuda-build.sh's toolkit), stripped; GNU time beside them
#   DIR/*.whl         what TRL 1.16 needs that the machines' Python lacks: trl, datasets, dill, multiprocess
#   DIR/manifest.txt  the commit, the compute capability, the tests, and the path the tests were built in
#                     (they find their fixtures there: gpu-check.sh links it to the copy it runs in)
#
#     bash scripts/gpu-bundle.sh DIR       # DIR: a folder in this repository that git ignores, e.g. .gpu
#
# Prints the bundle's size and fails when the bundle and the files that travel with the working tree (tracked
# and untracked-not-ignored) exceed 60 MiB: the device tool takes 64 MiB in all. Needs cargo, PyPI (the
# toolkit, the wheels), xz, strip and GNU time (/usr/bin/time, carried along for machines without it).
#
# Environment: CUDA_COMPUTE_CAP (default 90: H100/H200); JOBS (cargo's and nvcc's parallelism, default 1);
# CARGO_TARGET_DIR (default target/cuda, so that the cuda `holo`, which needs libcuda.so.1 to start, does not
# replace target/release/holo).
set -euo pipefail

ROOT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TESTS=(local_parity grpo_parity sft_parity precision)
# TRL as the peers' venv pins it (../shared/peers/requirements.lock.txt), and what it needs that the lent
# machines' Python lacks (device KINDS.md's package list): datasets, and datasets' dill and multiprocess.
WHEELS=(trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19)
LIMIT_MIB=60
JOBS="${JOBS:-1}"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT_DIR/target/cuda}"

log() { printf '[gpu-bundle %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
fail() { log "$*"; exit 1; }

if [ $# -ne 1 ]; then
    echo "usage: bash scripts/gpu-bundle.sh DIR (a folder in this repository that git ignores)" >&2
    exit 2
fi
for tool in cargo python3 xz strip git; do
    command -v "$tool" >/dev/null || fail "no $tool on PATH"
done
[ -x /usr/bin/time ] || fail "no GNU time at /usr/bin/time (Debian package \`time\`): the bundle carries it"

DIR="$(realpath -m "$1")"
case "$DIR/" in
    "$ROOT_DIR"/?*) ;;
    *) fail "$DIR is not inside the repository $ROOT_DIR: the device tool carries only paths inside it" ;;
esac
git -C "$ROOT_DIR" check-ignore -q "$DIR/" ||
    fail "git does not ignore $DIR: list it in .gitignore (as /.gpu/ is), so that it travels only as a carry path"
case "$(realpath -m "$CARGO_TARGET_DIR")/" in
    "$DIR"/*) fail "$DIR would hold the build ($CARGO_TARGET_DIR), and is replaced by the bundle: name another folder" ;;
esac
# DIR is replaced by the new bundle: only a bundle's files may be there.
if [ -d "$DIR" ]; then
    others="$(find "$DIR" -mindepth 1 -maxdepth 1 ! -name bin.tar.xz ! -name manifest.txt ! -name '*.whl' \
        -printf '%f\n' | paste -sd ' ')"
    [ -z "$others" ] || fail "$DIR holds files that are not a bundle's ($others): name an empty or a bundle's folder"
fi

start=$SECONDS
eval "$(bash "$ROOT_DIR/scripts/cuda-build.sh" --env)"

# ---- 1. build: one cargo run, so that the binaries and the tests share one feature set --------------------
log "cargo build --release -p holo-runtime --features cuda (compute capability $CUDA_COMPUTE_CAP, -j $JOBS," \
    "into $CARGO_TARGET_DIR)"
STAGE="$(mktemp -d "${TMPDIR:-/tmp}/gpu-bundle.XXXXXX")"
trap 'rm -rf "$STAGE"' EXIT
tests=()
for test in "${TESTS[@]}"; do tests+=(--test "$test"); done
(cd "$ROOT_DIR" && cargo build -j "$JOBS" --release -p holo-runtime --features cuda --bin holo --example sample_bench \
    "${tests[@]}" --message-format=json-render-diagnostics) >"$STAGE/messages.json"
log "built in $((SECONDS - start)) s"

# The executables by name (the tests' file names carry a hash).
python3 "$ROOT_DIR/scripts/cargo_executables.py" "$STAGE/messages.json" holo sample_bench "${TESTS[@]}" \
    >"$STAGE/executables"

# ---- 2. binaries: stripped, in one xz archive ----------------------------------------------------------------
# The executables share much of their bytes (candle's kernels: in `holo`, 33 MB of sm_90a machine code in
# .nv_fatbin and the PTX in .rodata's 21 MB): a dictionary larger than one executable lets xz store the shared
# part once (17 MB for the five, against 12 MB for `holo` alone). Python's lzma unpacks it on the GPU machine.
mkdir -p "$STAGE/bin"
while read -r name path; do
    strip -o "$STAGE/bin/$name" "$path"
done <"$STAGE/executables"
cp /usr/bin/time "$STAGE/bin/time"
raw=$(du -cb "$STAGE"/bin/* | tail -n 1 | cut -f 1)
largest=$(du -b "$STAGE"/bin/* | sort -n | tail -n 1 | cut -f 1)
dict_mib=$(( (largest >> 20) + 16 ))
log "compressing $((raw >> 20)) MiB of stripped binaries (xz, dictionary $dict_mib MiB)"
names=()
while read -r name _; do names+=("$name"); done <"$STAGE/executables"
tar -C "$STAGE/bin" -cf - "${names[@]}" time | xz -T1 --lzma2="preset=9,dict=${dict_mib}MiB" >"$STAGE/bin.tar.xz"

# ---- 3. wheels -----------------------------------------------------------------------------------------------
log "downloading ${WHEELS[*]}"
mkdir -p "$STAGE/wheels"
python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp -d "$STAGE/wheels" "${WHEELS[@]}"

# ---- 4. the bundle -----------------------------------------------------------------------------------------------
commit="$(git -C "$ROOT_DIR" rev-parse HEAD)"
[ -z "$(git -C "$ROOT_DIR" status --porcelain --untracked-files=no)" ] || commit="$commit (with uncommitted changes)"
mkdir -p "$STAGE/bundle"
mv "$STAGE/bin.tar.xz" "$STAGE"/wheels/*.whl "$STAGE/bundle/"
{
    echo "commit=$commit"
    echo "made=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "compute_cap=$CUDA_COMPUTE_CAP"
    echo "cuda=$(nvcc --version | grep -o 'release [0-9.]*' | cut -d' ' -f2)"
    echo "tests=${TESTS[*]}"
    # The tests read their fixtures below env!("CARGO_MANIFEST_DIR"), the physical path cargo ran in.
    echo "build_root=$(cd "$ROOT_DIR" && pwd -P)"
} >"$STAGE/bundle/manifest.txt"

bundle=$(du -cb "$STAGE"/bundle/* | tail -n 1 | cut -f 1)
# What travels besides the carried bundle: tracked files and untracked ones that git does not ignore.
# (A tracked file deleted here does not travel: stat's complaint about it is dropped.)
tree=$(cd "$ROOT_DIR" && git ls-files -z --cached --others --exclude-standard |
    { xargs -0 -r stat -c %s -- 2>/dev/null || true; } | awk '{ total += $1 } END { print total + 0 }')
(cd "$STAGE/bundle" && du -b -- * | sort -k 2) >&2
mib() { awk -v bytes="$1" 'BEGIN { printf "%.1f MiB", bytes / 1048576 }'; }
log "bundle: $(mib "$bundle"); with the working tree ($(mib "$tree")): $(mib $((bundle + tree))) of $LIMIT_MIB MiB"
[ $((bundle + tree)) -le $((LIMIT_MIB << 20)) ] ||
    fail "too large: $(mib $((bundle + tree))) > $LIMIT_MIB MiB (the device tool takes 64 MiB with the working" \
        "tree); $DIR left as it was"
rm -rf "$DIR"
mv "$STAGE/bundle" "$DIR"
log "bundle in $DIR, made in $((SECONDS - start)) s"
