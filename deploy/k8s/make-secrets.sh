#!/bin/sh
# Create (or update) one Secret per node from a `mobius-fed certs init` directory:
#   mobius-coordinator-tls, mobius-worker-0-tls .. mobius-worker-<P-1>-tls
# each with keys ca.crt, tls.crt, tls.key taken from that node's bundle CERTS/nodes/<node>/,
# so every pod mounts its own key and no other. The CA key and the operator's key stay on
# the admin machine.
#
#   mobius-fed certs init --workers 4 --out certs
#   deploy/k8s/make-secrets.sh certs 4 [-n NAMESPACE ...]   # extra arguments go to kubectl
#
# KUBECTL=... picks another kubectl binary; DRY_RUN=1 prints the manifests instead.
set -eu

usage() { echo "usage: $0 CERTS_DIR [WORKERS] [kubectl args...]" >&2; exit 2; }
[ $# -ge 1 ] || usage
certs=$1
shift
workers=4
if [ $# -ge 1 ]; then
    case $1 in
        '' | *[!0-9]*) ;;
        *) workers=$1; shift ;;
    esac
fi
kubectl=${KUBECTL:-kubectl}

nodes=coordinator
i=0
while [ "$i" -lt "$workers" ]; do
    nodes="$nodes worker-$i"
    i=$((i + 1))
done

for node in $nodes; do
    dir=$certs/nodes/$node
    for f in ca.crt tls.crt tls.key; do
        [ -f "$dir/$f" ] || { echo "$0: missing $dir/$f (made by mobius-fed certs init)" >&2; exit 1; }
    done
    manifest=$("$kubectl" create secret generic "mobius-$node-tls" "$@" \
        --from-file=ca.crt="$dir/ca.crt" \
        --from-file=tls.crt="$dir/tls.crt" \
        --from-file=tls.key="$dir/tls.key" \
        --dry-run=client -o yaml)
    if [ "${DRY_RUN:-0}" = 1 ]; then
        printf '%s\n---\n' "$manifest"
    else
        printf '%s\n' "$manifest" | "$kubectl" apply "$@" -f -
    fi
done
