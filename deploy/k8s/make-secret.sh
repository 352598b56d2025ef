#!/bin/sh
# Create (or update) Secret mobius-<NODE>-tls from one node's own directory, at its site:
# tls.key made there by `mobius-fed certs request`, tls.crt and ca.crt from the admin's
# `mobius-fed certs sign`. The key goes from the site's disk to its own cluster only.
#
#   mobius-fed certs request --node worker-2 --out worker-2          # at the site
#   # send worker-2/worker-2.csr to the admin; put the tls.crt and ca.crt that come back
#   # into worker-2/
#   deploy/k8s/make-secret.sh worker-2 worker-2 [-n NAMESPACE ...]  # extra arguments: kubectl
#
# Runs `mobius-fed certs check` first (when mobius-fed is on PATH; MOBIUSFED=... picks
# another), so a bundle for another node, an expired certificate or a stray key is refused
# here, not in a crash-looping pod. KUBECTL=... picks another kubectl binary; DRY_RUN=1
# prints the manifest instead of applying it.
set -eu

usage() { echo "usage: $0 NODE DIR [kubectl args...]" >&2; exit 2; }
[ $# -ge 2 ] || usage
node=$1
dir=$2
shift 2
case $node in
    coordinator | worker-[0-9] | worker-[1-9]*[0-9]) ;;
    *) echo "$0: NODE is coordinator or worker-<i>, not '$node'" >&2; exit 2 ;;
esac
kubectl=${KUBECTL:-kubectl}
mobius=${MOBIUSFED:-mobius-fed}

for f in ca.crt tls.crt tls.key; do
    [ -f "$dir/$f" ] || {
        echo "$0: missing $dir/$f (tls.key: certs request; tls.crt, ca.crt: certs sign)" >&2
        exit 1
    }
done
if command -v "$mobius" >/dev/null 2>&1; then
    "$mobius" certs check --node "$node" --dir "$dir" >&2
fi
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
