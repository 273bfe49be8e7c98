#!/usr/bin/env bash
# The transport conformance and fault suites' ucx cases with the ranks in two network namespaces
# joined by a veth pair, over UCX_TLS=tcp: even ranks in one namespace (10.77.0.1), odd ranks in
# the other (10.77.0.2), the suites unchanged (the harness joins each forked rank to its
# namespace: FLEXPERT_CONFORMANCE_NETNS). Needs root (ip netns, veth); without it, says so and
# exits 77 (ctest: skipped).
#   bash scripts/netns_conformance.sh [BUILD_DIR] [--rate 25gbit] [--hosts N] [--backend hier]
#                                     [-- command]
# --rate caps each namespace's link in both directions with tc's token bucket (a NIC
# stand-in). --hosts N (N > 2): N namespaces (10.77.0.1 ...) on a bridge in a namespace of its
# own instead of the veth pair; rank r lives in namespace r % N. --backend picks the suites'
# cases (default ucx); with hier and two namespaces, 4 ranks are 2 per namespace (shm within,
# ucx across).
set -euo pipefail
cd "$(dirname "$0")/.."
build=build
[ $# -gt 0 ] && [ "${1#--}" = "$1" ] && { build=$1; shift; }
rate=""
hosts=2
backend=ucx
while [ $# -gt 0 ]; do
  case "$1" in
    --rate) rate=$2; shift 2 ;;
    --hosts) hosts=$2; shift 2 ;;
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
cap() {  # cap NS DEV: tc's token bucket on DEV's egress in NS.
  [ -z "$rate" ] || tc -n "$1" qdisc add dev "$2" root tbf rate "$rate" burst 4mb latency 50ms
}
names=()
switch=""
cleanup() {
  for ns in "${names[@]}" ${switch:+"$switch"}; do ip netns del "$ns" 2>/dev/null || true; done
}
trap cleanup EXIT
if [ "$hosts" -le 2 ]; then
  names=("fxa$$" "fxb$$")
  ip netns add "${names[0]}"
  ip netns add "${names[1]}"
  # The same device name on both sides, so that one UCX_NET_DEVICES fits every rank.
  ip link add fxv0 netns "${names[0]}" type veth peer name fxv0 netns "${names[1]}"
else
  # Each namespace's fxv0 plugged into a bridge; capping a port caps what its host receives.
  switch="fxs$$"
  ip netns add "$switch"
  ip -n "$switch" link add fxbr type bridge
  ip -n "$switch" link set fxbr up
  for i in $(seq 0 $((hosts - 1))); do
    names+=("fx${i}h$$")
    ip netns add "${names[$i]}"
    ip link add fxv0 netns "${names[$i]}" type veth peer name "fxp$i" netns "$switch"
    ip -n "$switch" link set "fxp$i" master fxbr
    ip -n "$switch" link set "fxp$i" up
    cap "$switch" "fxp$i"
  done
fi
for i in "${!names[@]}"; do
  ns=${names[$i]}
  ip -n "$ns" addr add "10.77.0.$((i + 1))/24" dev fxv0
  ip -n "$ns" link set lo up
  ip -n "$ns" link set fxv0 up
  cap "$ns" fxv0
done
# UCX takes only links that are up with a carrier: wait for every end.
for _ in $(seq 50); do
  up=1
  for ns in "${names[@]}"; do ip -n "$ns" link show fxv0 | grep -q 'state UP' || up=0; done
  [ $up -eq 1 ] && break
  sleep 0.1
done
echo "namespaces ${names[*]} (10.77.0.1-${#names[@]})${switch:+ on a bridge}, fxv0${rate:+, capped at $rate}"
netns_list=$(IFS=,; echo "${names[*]}")
export UCX_TLS=tcp UCX_NET_DEVICES=fxv0 FLEXPERT_CONFORMANCE_NETNS="$netns_list"
if [ $# -gt 0 ]; then
  "$@"
  exit
fi
status=0
# This backend's cases only (the parameter names end in BACKEND_Nranks; "*hier*" would take
# hier_gpu too).
filter="*/${backend}_2ranks:*/${backend}_3ranks:*/${backend}_4ranks"
for t in transport_conformance_test transport_conformance_fault_test; do
  "$build/tests/transport/$t" --gtest_filter="$filter" || status=1
done
exit $status
