#!/usr/bin/env bash
# Sourced by the A/B scripts (gpu_ab.sh, gpu_decode_ab.sh, gpu_gemm_bytes.sh): a variant's
# settings `NAME=VALUE,NAME2=VALUE2` into the array `envs`. A comma starts a new setting
# only before `NAME=`, so a value may hold commas (FLEXPERT_PROBE_SKIP=attn,merge).
variant_envs() {
  envs=()
  local parts part
  IFS=',' read -r -a parts <<<"$1"
  for part in "${parts[@]}"; do
    if ((${#envs[@]} > 0)) && [[ ! $part =~ ^[A-Za-z_][A-Za-z0-9_]*= ]]; then
      envs[-1]+=",$part"
    else
      envs+=("$part")
    fi
  done
}
