#!/bin/sh
# Prints, one a line, the distribution packages that own the shared libraries the given
# binaries load (ldd), so the runtime image installs exactly those. Libraries no package owns
# (the CUDA base image's own) are skipped. Looks each library's real path up in dpkg's file
# lists, under /lib and under /usr/lib: on merged-/usr systems dpkg may have either.
# Usage: runtime_packages.sh BINARY...
set -eu
libs=$(ldd "$@" | awk '/=> \// {print $3}' | sort -u | xargs -r realpath | sort -u)
[ -n "$libs" ] || exit 0
# One pass over dpkg's file lists (dpkg -S takes about a second a library).
pats=$(mktemp)
trap 'rm -f "$pats"' EXIT
for l in $libs; do
  s=${l#/usr}
  printf '%s\n/usr%s\n' "$s" "$s"
done >"$pats"
grep -lxF -f "$pats" /var/lib/dpkg/info/*.list | sed 's#.*/##; s/\.list$//; s/:.*//' | sort -u
