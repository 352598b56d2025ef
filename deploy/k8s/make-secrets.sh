#!/bin/sh
# Labs: one Secret per node from a `mobius-fed certs init` directory, where every key was
# made on one machine: mobius-coordinator-tls, mobius-worker-0-tls .. mobius-worker-<P-1>-tls
# from each node's bundle CERTS/nodes/<node>/ (make-secret.sh, once per node). The CA key
# and the operator's key stay on that machine. Real sites make their own key and Secret:
# make-secret.sh NODE DIR (docs/keys.md).
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

nodes=coordinator
i=0
while [ "$i" -lt "$workers" ]; do
    nodes="$nodes worker-$i"
    i=$((i + 1))
done

for node in $nodes; do
    dir=$certs/nodes/$node
    "$(dirname "$0")/make-secret.sh" "$node" "$dir" "$@"
done
