#!/usr/bin/env bash
# Clang's thread-safety analysis over every source that uses the annotated lock types
# of src/core/mutex.h (GUARDED_BY, REQUIRES, ...): -fsyntax-only, so it costs seconds,
# and a violation fails (scripts/test.sh runs this; the project builds with GCC).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v clang++ >/dev/null || { echo "clang++ not found (scripts/setup.sh installs it)"; exit 1; }
# The sources that include src/core/mutex.h, directly or through a header that does.
mapfile -t files < <(python3 - <<'PY'
import re, subprocess
srcs = subprocess.run(["git", "ls-files", "src/*.cc", "src/*.h"], capture_output=True,
                      text=True, check=True).stdout.split()
inc = {f: set(re.findall(r'#include "([^"]+)"', open(f, encoding="utf-8").read())) for f in srcs}
users, grew = {"core/mutex.h"}, True
while grew:
    grew = False
    for f, names in inc.items():
        key = f[len("src/"):]
        if key not in users and names & users:
            users.add(key)
            grew = True
print("\n".join(sorted(f for f in srcs if f.endswith(".cc") and f[len("src/"):] in users)))
PY
)
for f in "${files[@]}"; do
  clang++ -std=c++20 -fsyntax-only -Wthread-safety -Werror=thread-safety \
    -Wno-unknown-warning-option -Iinclude -Isrc "$f"
done
echo "thread safety: ${#files[@]} files checked"
