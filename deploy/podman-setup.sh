#!/usr/bin/env bash
# Makes podman able to start containers where the defaults cannot (run as root, idempotent).
#
# Podman raises each container's open-files limit (RLIMIT_NOFILE) above the caller's hard
# limit by default; where the caller may not raise it (a container or sandbox without
# CAP_SYS_RESOURCE) every `podman run` fails with "setrlimit ... operation not permitted".
# There, and only there, containers.conf gets `default_ulimits = []` under [containers]
# (containers then inherit the caller's limits).
set -euo pipefail
CONF=/etc/containers/containers.conf

command -v podman >/dev/null 2>&1 || exit 0
if python3 -c 'import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (1048576, 1048576))' \
	2>/dev/null; then
	exit 0
fi
if [ -f "$CONF" ] && grep -qE '^[[:space:]]*default_ulimits[[:space:]]*=' "$CONF"; then
	exit 0
fi
mkdir -p "$(dirname "$CONF")"
touch "$CONF"
if grep -qE '^[[:space:]]*\[containers\]' "$CONF"; then
	sed -i -E '0,/^[[:space:]]*\[containers\]/s//&\ndefault_ulimits = []/' "$CONF"
else
	printf '\n[containers]\ndefault_ulimits = []\n' >>"$CONF"
fi
echo "podman-setup: $CONF: default_ulimits = [] (this host may not raise RLIMIT_NOFILE)"
