#!/usr/bin/env bash
# Two "hosts" on one machine: two network namespaces joined by a veth pair,
# and a command run in the first. What runs there reaches the second only
# over the veth: bench/vllm_pattern.py --owner-netns nbhost-b puts its owner
# there. UCX is restricted to TCP on the veth (UCX_TLS=tcp,
# UCX_NET_DEVICES=nbeth0; the same name in both namespaces), so neither
# process maps the other's memory through UCX, and each BOUNCE process
# names a host of its own (failpoint another_host: a random boot id), so
# that its same-host paths (CMA, peer-mapped) are not taken and its gates
# are those for another host, with every setting at its default. Each
# namespace's default route goes over the veth, so BOUNCE's control plane
# binds the veth address with its defaults.
#
#   scripts/two-hosts.sh [--rate 100gbit] [--delay 5us] -- COMMAND...
#
# --rate shapes the veth (tc tbf) in both directions: a NIC of that speed;
# --delay adds one-way latency (tc netem). Needs root (ip netns). The
# namespaces are removed on exit, also on failure.
set -euo pipefail

RATE="" DELAY=""
while [ $# -gt 0 ]; do
    case "$1" in
        --rate) RATE="$2"; shift 2 ;;
        --delay) DELAY="$2"; shift 2 ;;
        --) shift; break ;;
        *) echo "two-hosts.sh: unknown option $1 (usage: two-hosts.sh [--rate R] [--delay D] -- CMD...)" >&2; exit 2 ;;
    esac
done
[ $# -gt 0 ] || { echo "two-hosts.sh: no command given" >&2; exit 2; }

A=nbhost-a B=nbhost-b DEV=nbeth0
cleanup() { ip netns del "$A" 2>/dev/null || true; ip netns del "$B" 2>/dev/null || true; }
cleanup
trap cleanup EXIT

ip netns add "$A"
ip netns add "$B"
ip link add nbtmp-a type veth peer name nbtmp-b
ip link set nbtmp-a netns "$A"
ip link set nbtmp-b netns "$B"
i=1
for ns in "$A" "$B"; do
    tmp=nbtmp-$([ "$ns" = "$A" ] && echo a || echo b)
    ip -n "$ns" link set "$tmp" name "$DEV"
    ip -n "$ns" addr add "10.77.0.$i/24" dev "$DEV"
    ip -n "$ns" link set lo up
    ip -n "$ns" link set "$DEV" up
    ip -n "$ns" route add default via "10.77.0.$((3 - i))" dev "$DEV"
    if [ -n "$DELAY" ]; then
        # netem shapes both: one-way delay, and the rate when given.
        ip netns exec "$ns" tc qdisc add dev "$DEV" root netem delay "$DELAY" ${RATE:+rate "$RATE"} || {
            echo "two-hosts.sh: --delay needs the kernel's netem qdisc (module sch_netem), which tc could not add here" >&2
            exit 2
        }
    elif [ -n "$RATE" ]; then
        ip netns exec "$ns" tc qdisc add dev "$DEV" root tbf rate "$RATE" burst 4mb latency 10ms || {
            echo "two-hosts.sh: --rate needs the kernel's tbf qdisc (module sch_tbf), which tc could not add here" >&2
            exit 2
        }
    fi
    i=$((i + 1))
done
echo "[two-hosts] $A 10.77.0.1 <-> $B 10.77.0.2 over a veth pair (${RATE:-unshaped}${DELAY:+, +$DELAY one way}); UCX_TLS=tcp; BOUNCE failpoint another_host" >&2
ip netns exec "$A" env UCX_TLS=tcp UCX_NET_DEVICES="$DEV" \
    NIXL_BOUNCE_FAILPOINTS="${NIXL_BOUNCE_FAILPOINTS:+$NIXL_BOUNCE_FAILPOINTS,}another_host" "$@"
