#!/usr/bin/env bash
# Test hosts on one machine: P network namespaces, each with its own address and a rate-limited
# link, so MPI ranks exchange over real TCP links the way separate machines would.
#
#   scripts/hosts.sh up P [RATE]    P hosts $PREFIX0 … (default syncstep-host0 …), each link
#                                   shaped to RATE (tc's syntax, default 1gbit) each way
#   scripts/hosts.sh down           removes every namespace `up` made (under this prefix)
#   scripts/hosts.sh hostfile       an Open MPI hostfile: one address per host, one slot each
#   scripts/hosts.sh bytes          per host: "ADDRESS TX_BYTES RX_BYTES" of its link
#   scripts/hosts.sh run P -- ARGS  mpirun, P ranks one per host, the ARGS (a program and its
#                                   arguments), with the flags these hosts need
#
# Layout: the hosts' links meet on a bridge inside a namespace of its own ($PREFIX-net), which
# also holds the address mpirun starts from (.254), so nothing in the machine's own network
# namespace is touched and several sets (other prefixes and subnets) can exist side by side.
# SYNCSTEP_HOSTS_PREFIX and SYNCSTEP_HOSTS_SUBNET (the first three octets of a /24) choose them.
set -euo pipefail

PREFIX="${SYNCSTEP_HOSTS_PREFIX:-syncstep-host}"
SUBNET="${SYNCSTEP_HOSTS_SUBNET:-10.77.0}"
HUB="$PREFIX-net"
HERE="$(cd "$(dirname "$0")" && pwd)"

die() {
    echo "hosts.sh: $*" >&2
    exit 1
}

preflight() {
    [ "$(id -u)" -eq 0 ] || die "network namespaces need root (run as root, or under sudo)"
    command -v ip >/dev/null || die "'ip' is missing: install iproute2"
    command -v tc >/dev/null || die "'tc' is missing: install iproute2"
    [[ "$PREFIX" =~ ^[A-Za-z0-9_-]{1,20}$ ]] || die "SYNCSTEP_HOSTS_PREFIX: letters, digits, - and _, at most 20"
    [[ "$SUBNET" =~ ^[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}$ ]] || die "SYNCSTEP_HOSTS_SUBNET: three octets, e.g. 10.77.0"
}

# Our hosts, in order: only names this prefix and a number, so nothing else is ever listed.
hosts() {
    ip netns list | awk '{print $1}' | grep -E "^${PREFIX}[0-9]+$" | sort -V || true
}

# A token bucket on the egress of a device in a namespace: one direction of one link. The burst,
# 512 KiB (4 ms at 1gbit), is enough for a timer tick's worth of packets, so the bucket keeps up
# its rate, and small beside the gradient's tens of megabytes, so a transfer runs at the rate.
shape() {
    ip netns exec "$1" tc qdisc replace dev "$2" root tbf rate "$3" burst 512kb latency 100ms
}

up() {
    local p="${1:?usage: hosts.sh up P [RATE]}" rate="${2:-1gbit}" n
    [[ "$p" =~ ^[0-9]+$ ]] && [ "$p" -ge 1 ] && [ "$p" -le 200 ] || die "P must be 1 … 200"
    down
    ip netns add "$HUB"
    ip -n "$HUB" link set lo up
    ip -n "$HUB" link add br0 type bridge
    ip -n "$HUB" addr add "$SUBNET.254/24" dev br0
    ip -n "$HUB" link set br0 up
    for ((n = 0; n < p; n++)); do
        ip netns add "$PREFIX$n"
        ip -n "$PREFIX$n" link set lo up
        # The pair is made inside the hub and one end moved, so no name lands in the root namespace.
        ip -n "$HUB" link add "veth$n" type veth peer name eth0 netns "$PREFIX$n"
        ip -n "$HUB" link set "veth$n" master br0 up
        ip -n "$PREFIX$n" addr add "$SUBNET.$((n + 1))/24" dev eth0
        ip -n "$PREFIX$n" link set eth0 up
        shape "$PREFIX$n" eth0 "$rate"  # what the host sends
        shape "$HUB" "veth$n" "$rate"   # what it receives
    done
    echo "hosts.sh: $p hosts ${PREFIX}0 … on $SUBNET.0/24 at $rate each way"
}

down() {
    local ns
    for ns in $(hosts); do ip netns delete "$ns"; done
    if ip netns list | awk '{print $1}' | grep -qx "$HUB"; then ip netns delete "$HUB"; fi
}

hostfile() {
    local ns
    for ns in $(hosts); do echo "$SUBNET.$((${ns#"$PREFIX"} + 1)) slots=1"; done
}

bytes() {
    local ns s
    for ns in $(hosts); do
        s=/sys/class/net/eth0/statistics
        echo "$SUBNET.$((${ns#"$PREFIX"} + 1)) $(ip netns exec "$ns" cat $s/tx_bytes $s/rx_bytes | xargs)"
    done
}

# The one mpirun recipe for these hosts (tests and docs use it):
#   plm_rsh_agent        host-rsh runs each daemon inside its host's namespace, as ssh would;
#   plm_rsh_no_tree_spawn  mpirun starts every daemon itself;
#   routed direct, rtc ^hwloc  every daemon talks to mpirun directly, and none maps hwloc's
#                        topology through shared memory: daemons sharing one kernel can crash or
#                        hang there;
#   btl tcp,self, *_if_include  ranks talk over the hosts' links only (no shared memory, no
#                        other interface);
#   bind-to none         the hosts share the machine's cores, so no rank may hold one (rtc ^hwloc
#                        binds nothing already; this says so);
#   mpi_yield_when_idle  MPI's waits yield the core: the hosts share the machine's cores.
#   oob_tcp_keepalive_*  mpirun gives up a daemon whose link is cut after 5 + 3 × 2 s, naming
#                        its host, rather than after Open MPI's default 300 + 9 × 20 s.
run() {
    local p="${1:?usage: hosts.sh run P -- PROGRAM ARGS...}"
    shift
    [ "${1:-}" = "--" ] && shift
    [ $# -ge 1 ] || die "run: nothing to run"
    command -v mpirun >/dev/null || die "run: mpirun is missing: scripts/setup-mpi.sh installs Open MPI"
    [ "$(hosts | wc -l)" -ge "$p" ] || die "run: $p ranks, but only $(hosts | wc -l) hosts are up"
    HOSTFILE="$(mktemp)"
    trap 'rm -f "$HOSTFILE"' EXIT
    hostfile >"$HOSTFILE"
    export SYNCSTEP_HOSTS_PREFIX="$PREFIX" SYNCSTEP_HOSTS_SUBNET="$SUBNET"
    ip netns exec "$HUB" mpirun --hostfile "$HOSTFILE" -np "$p" --map-by node --bind-to none \
        --oversubscribe --allow-run-as-root \
        --mca plm_rsh_agent "$HERE/host-rsh" --mca plm_rsh_no_tree_spawn 1 \
        --mca routed direct --mca rtc ^hwloc \
        --mca btl tcp,self --mca btl_tcp_if_include "$SUBNET.0/24" \
        --mca oob_tcp_if_include "$SUBNET.0/24" --mca mpi_yield_when_idle 1 \
        --mca oob_tcp_keepalive_time 5 --mca oob_tcp_keepalive_intvl 2 \
        --mca oob_tcp_keepalive_probes 3 \
        "$@"
}

preflight
case "${1:-}" in
    up | down | hostfile | bytes | run)
        cmd="$1"
        shift
        "$cmd" "$@"
        ;;
    *) die "usage: hosts.sh up P [RATE] | down | hostfile | bytes | run P -- PROGRAM ARGS..." ;;
esac
