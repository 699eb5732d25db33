#!/usr/bin/env bash
# Network test bed: edge and cloud in their own network namespaces, joined through a "link" namespace where the
# userspace delay proxy (bench/linkproxy.py) runs. Needs root (CAP_NET_ADMIN + CAP_SYS_ADMIN).
#
#   edge ns  tdm-e 10.203.1.2/24 <-veth-> tdm-le 10.203.1.1/24  link ns  tdm-lc 10.203.2.1/24 <-veth-> tdm-c 10.203.2.2/24  cloud ns
#
# There is no route between edge and cloud: the only path is the proxy in the link namespace, so every byte takes
# the emulated link, and no traffic leaves the addresses created here.
#
#   deploy/netbed.sh up             create namespaces, veths, addresses
#   deploy/netbed.sh rate MBIT      bandwidth limit (tbf) on both directions of the edge link; 0 removes it
#   deploy/netbed.sh down           delete everything (idempotent)
#   deploy/netbed.sh check          exit 0 if namespaces can be created here, else say why
set -euo pipefail

EDGE=tdm-edge LINK=tdm-link CLOUD=tdm-cloud

down() {
  for ns in "$EDGE" "$LINK" "$CLOUD"; do
    ip netns del "$ns" 2>/dev/null || true  # veths go with their namespace
  done
}

check() {
  local probe="tdm-probe-$$"
  if ! out=$(ip netns add "$probe" 2>&1); then
    echo "network namespaces are not permitted here (run as root with CAP_NET_ADMIN): $out" >&2
    exit 3
  fi
  ip netns del "$probe"
}

up() {
  down
  for ns in "$EDGE" "$LINK" "$CLOUD"; do
    ip netns add "$ns"
    ip -n "$ns" link set lo up
  done
  ip link add tdm-e netns "$EDGE" type veth peer name tdm-le netns "$LINK"
  ip link add tdm-c netns "$CLOUD" type veth peer name tdm-lc netns "$LINK"
  ip -n "$EDGE" addr add 10.203.1.2/24 dev tdm-e
  ip -n "$LINK" addr add 10.203.1.1/24 dev tdm-le
  ip -n "$LINK" addr add 10.203.2.1/24 dev tdm-lc
  ip -n "$CLOUD" addr add 10.203.2.2/24 dev tdm-c
  for pair in "$EDGE tdm-e" "$LINK tdm-le" "$LINK tdm-lc" "$CLOUD tdm-c"; do
    set -- $pair
    ip -n "$1" link set "$2" up
  done
}

rate() {
  local mbit="$1"
  for pair in "$EDGE tdm-e" "$LINK tdm-le"; do  # edge uplink, edge downlink
    set -- $pair
    tc -n "$1" qdisc del dev "$2" root 2>/dev/null || true
    if [ "$mbit" != "0" ]; then
      # burst: at least one 10 ms worth of bytes; latency bounds the queue (drops past it, like a real bottleneck)
      tc -n "$1" qdisc add dev "$2" root tbf rate "${mbit}mbit" burst "$(( mbit * 1250 + 15000 ))" latency 400ms
    fi
  done
}

case "${1:-}" in
  up) check; up ;;
  down) down ;;
  rate) rate "${2:?rate in mbit/s}" ;;
  check) check ;;
  *) echo "usage: $0 up|rate MBIT|down|check" >&2; exit 2 ;;
esac
