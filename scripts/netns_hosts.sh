#!/usr/bin/env bash
# Two "hosts" on this machine for trying zerodp across hosts without a cluster: two network
# namespaces joined by a veth pair (10.77.0.1 and 10.77.0.2), each under its own hostname (a UTS
# namespace), Open MPI over TCP between them. Needs root (or CAP_SYS_ADMIN), iproute2, util-linux.
#
#   scripts/netns_hosts.sh up                   # make the namespaces zdp-h1 and zdp-h2
#   scripts/netns_hosts.sh run N CMD ARGS...    # mpirun with N ranks on each host running CMD
#   scripts/netns_hosts.sh down                 # remove them
#
# Example: scripts/netns_hosts.sh run 2 target/release/zerodp bench comm --sizes 1G --raw-mpi
# `tests/mpi_backend.rs` builds the same setup for its multi-host tests.
set -euo pipefail
NS=(zdp-h1 zdp-h2)
IPS=(10.77.0.1 10.77.0.2)
AGENT=/tmp/zerodp-netns-agent.sh

up() {
    for i in 0 1; do
        ip netns add "${NS[$i]}"
        ip -n "${NS[$i]}" link set lo up
    done
    ip link add zdp-v1 type veth peer name zdp-v2
    for i in 0 1; do
        ip link set "zdp-v$((i + 1))" netns "${NS[$i]}"
        ip -n "${NS[$i]}" addr add "${IPS[$i]}/24" dev "zdp-v$((i + 1))"
        ip -n "${NS[$i]}" link set "zdp-v$((i + 1))" up
    done
    # Open MPI's launch agent, in ssh's place: `agent HOST COMMAND` runs COMMAND on that host.
    cat >"$AGENT" <<AGENT
#!/bin/sh
host="\$1"; shift
case "\$host" in
  ${IPS[0]}) ns=${NS[0]} ;;
  ${IPS[1]}) ns=${NS[1]} ;;
  *) echo "no such namespace host: \$host" >&2; exit 255 ;;
esac
exec ip netns exec "\$ns" unshare --uts sh -c "hostname \$ns && \$*"
AGENT
    chmod +x "$AGENT"
    echo "hosts ${NS[0]} (${IPS[0]}) and ${NS[1]} (${IPS[1]}) are up"
}

down() {
    for ns in "${NS[@]}"; do ip netns del "$ns" 2>/dev/null || true; done
    rm -f "$AGENT"
}

run() {
    local n="$1"; shift
    [ -x "$AGENT" ] || { echo "run '$0 up' first" >&2; exit 2; }
    exec ip netns exec "${NS[0]}" unshare --uts sh -c 'hostname "$0" && exec "$@"' "${NS[0]}" \
        mpirun --allow-run-as-root --oversubscribe --host "${IPS[0]}:$n,${IPS[1]}:$n" -np $((2 * n)) \
        --mca plm_rsh_agent "$AGENT" --mca btl_tcp_if_include 10.77.0.0/24 \
        --mca oob_tcp_if_include 10.77.0.0/24 "$@"
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    run) shift; run "$@" ;;
    *) sed -n '2,12p' "$0"; exit 2 ;;
esac
