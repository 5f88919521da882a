#!/bin/sh
# Builds llama.cpp's `llama-server` and `llama-quantize` from the sources the PyPI `llama-cpp-python` sdist
# vendors (Debian 12 has no llama.cpp package), for benches/serve_compare.py. cmake and ninja come as binary
# wheels into the peer venv (`--only-binary`: building cmake from source takes an hour on 2 cores). About
# 25 minutes on 2 cores. With a GGUF given, also writes its F32 copy beside the binaries (the same weights
# at the precision `holo serve` computes in, so that the two servers are compared at equal precision).
#
#     sh scripts/build_llama_server.sh [OUT_DIR] [MODEL.gguf]     # OUT_DIR defaults to /tmp/llamacpp
set -eu
OUT=${1:-/tmp/llamacpp}
MODEL=${2:-}
VERSION=0.3.36
PY=${PEER_PYTHON:-$HOME/.cache/holo-peers/venv/bin/python}
mkdir -p "$OUT"
cd "$OUT"
if [ ! -d "llama_cpp_python-$VERSION" ]; then
    URL=$("$PY" - "$VERSION" <<'PY'
import json, sys, urllib.parse, urllib.request
version = sys.argv[1]
api = "https://pypi.org/pypi/llama-cpp-python/json"
data = json.load(urllib.request.urlopen(api))
files = data.get("releases", {}).get(version) or data["urls"]
# The index may answer with a URL relative to the API's.
print(urllib.parse.urljoin(api, next(u["url"] for u in files if u["packagetype"] == "sdist")))
PY
)
    "$PY" -c "import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], 'llama.tar.gz')" "$URL"
    tar xzf llama.tar.gz
fi
"$PY" -m pip install -q --only-binary :all: cmake ninja
BIN=$(dirname "$PY")
SRC="llama_cpp_python-$VERSION/vendor/llama.cpp"
PATH="$BIN:$PATH" cmake -S "$SRC" -B "$SRC/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
PATH="$BIN:$PATH" cmake --build "$SRC/build" -j "$(nproc)" --target llama-server llama-quantize
echo "llama-server: $OUT/$SRC/build/bin/llama-server"
if [ -n "$MODEL" ]; then
    "$SRC/build/bin/llama-quantize" --allow-requantize "$MODEL" "$OUT/model-f32.gguf" F32
    echo "F32 copy: $OUT/model-f32.gguf"
fi
