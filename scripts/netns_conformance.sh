#!/usr/bin/env bash
# The transport conformance and fault suites' ucx cases with the ranks in two network namespaces
# joined by a veth pair, over UCX_TLS=tcp: even ranks in one namespace (10.77.0.1), odd ranks in
# the other (10.77.0.2), the suites unchanged (the harness joins each forked rank to its
# namespace: FLEXPERT_CONFORMANCE_NETNS). Needs root (ip netns, veth); without it, says so and
# exits 77 (ctest: skipped).
#   bash scripts/netns_conformance.sh [BUILD_DIR] [--rate 25gbit] [--backend hier] [-- extra test args]
# --rate caps the veth in both directions with tc's token bucket (a NIC stand-in). --backend
# picks the suites' cases (default ucx); with hier, 4 ranks are 2 per namespace (shm within,
# ucx across).
set -euo pipefail
cd "$(dirname "$0")/.."
build=build
[ $# -gt 0 ] && [ "${1#--}" = "$1" ] && { build=$1; shift; }
rate=""
backend=ucx
while [ $# -gt 0 ]; do
  case "$1" in
    --rate) rate=$2; shift 2 ;;
    --backend) backend=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
if [ "$(id -u)" -ne 0 ]; then
  echo "netns conformance: needs root (ip netns add, veth pairs); skipped"
  exit 77
fi
if ! command -v ip >/dev/null; then
  echo "netns conformance: no 'ip' (iproute2); skipped"
  exit 77
fi
a="fxa$$"
b="fxb$$"
cleanup() { ip netns del "$a" 2>/dev/null || true; ip netns del "$b" 2>/dev/null || true; }
trap cleanup EXIT
ip netns add "$a"
ip netns add "$b"
# The same device name on both sides, so that one UCX_NET_DEVICES fits every rank.
ip link add fxv0 netns "$a" type veth peer name fxv0 netns "$b"
ip -n "$a" addr add 10.77.0.1/24 dev fxv0
ip -n "$b" addr add 10.77.0.2/24 dev fxv0
for ns in "$a" "$b"; do
  ip -n "$ns" link set lo up
  ip -n "$ns" link set fxv0 up
  if [ -n "$rate" ]; then
    tc -n "$ns" qdisc add dev fxv0 root tbf rate "$rate" burst 4mb latency 50ms
  fi
done
# UCX takes only links that are up with a carrier: wait for both ends.
for _ in $(seq 50); do
  ip -n "$a" link show fxv0 | grep -q 'state UP' && ip -n "$b" link show fxv0 | grep -q 'state UP' && break
  sleep 0.1
done
echo "namespaces $a (10.77.0.1) and $b (10.77.0.2), veth fxv0${rate:+, capped at $rate}"
export UCX_TLS=tcp UCX_NET_DEVICES=fxv0 FLEXPERT_CONFORMANCE_NETNS="$a,$b"
if [ $# -gt 0 ]; then
  "$@"
  exit
fi
status=0
for t in transport_conformance_test transport_conformance_fault_test; do
  "$build/tests/transport/$t" --gtest_filter="*${backend}*" || status=1
done
exit $status
