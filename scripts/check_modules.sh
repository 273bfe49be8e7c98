#!/usr/bin/env bash
# The module order of docs/ARCHITECTURE.md ("Modules"): a module may include only
# itself and the modules before it. Fails (exit 1) naming each include that runs
# against the order. Run by scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
ORDER=(core checkpoint tokenizer kernels transport cluster eplb moe model cuda factory engine
       serve cli)
declare -A rank
for i in "${!ORDER[@]}"; do rank[${ORDER[$i]}]=$i; done
bad=0
for dir in src/*/; do
  m=$(basename "$dir")
  if [ -z "${rank[$m]+x}" ]; then
    echo "src/$m is not in the module order (scripts/check_modules.sh, docs/ARCHITECTURE.md)"
    bad=1
    continue
  fi
  while IFS=: read -r file line text; do
    dep=$(sed -E 's/.*#include "([a-z_]+)\/.*/\1/' <<<"$text")
    [ -n "${rank[$dep]+x}" ] || continue
    if ((rank[$dep] > rank[$m])); then
      echo "$file:$line: $m includes $dep, which comes after it in the module order"
      bad=1
    fi
  done < <(grep -rnE '^#include "[a-z_]+/' "$dir" || true)
done
if ((bad)); then exit 1; fi
echo "module order: ok (${ORDER[*]})"
