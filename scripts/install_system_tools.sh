#!/usr/bin/env bash
# Install the system tools mobius-fed's tests and namespace testbed exec, where missing.
# Debian/Ubuntu (apt-get) as root; elsewhere it prints what to install and exits 0, and the
# tests that need a missing tool skip, naming it.
#   ip, tc      iproute2     the namespace testbed (`mobius-fed testbed up`), WAN shaping
#   iptables    iptables     WAN delay lines and edge cuts in the testbed
#   unshare     util-linux   per-service mount namespaces in the testbed
#   mount       mount        the testbed's /etc/hosts, the tmpfs ENOSPC tests
#   chromium    chromium     the dashboard's real-browser test
#   openssl     openssl      a signing request made with a site's own tools (tests/test_enroll.py)
set -uo pipefail
declare -A PKG=([ip]=iproute2 [tc]=iproute2 [iptables]=iptables [unshare]=util-linux
                [mount]=mount [umount]=mount [chromium]=chromium [openssl]=openssl)
missing=()
for tool in ip tc iptables unshare mount umount chromium openssl; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("${PKG[$tool]}")
done
[ ${#missing[@]} -eq 0 ] && exit 0
mapfile -t pkgs < <(printf '%s\n' "${missing[@]}" | sort -u)
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "missing system tools; install: ${pkgs[*]} (the tests that need them skip)"
  exit 0
fi
log=/tmp/mobius-system-tools.log
if { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
       apt-get install -y -qq "${pkgs[@]}"; } >"$log" 2>&1; then
  echo "installed: ${pkgs[*]}"
else
  echo "could not install ${pkgs[*]} (see $log); the tests that need them skip"
fi
