#!/bin/sh
# The image's entrypoint: picks the binary by role, so one image serves every role.
#   router|prefill|decode|kvstore ARGS...  runs tandem-<role> ARGS...
#   tandem-* or tandem ARGS...              runs that binary (Kubernetes sets `command`)
#   anything else                           runs it as given (sh, sleep, ...)
#   --help or nothing                       prints this
set -e
case "${1:-}" in
  router|prefill|decode|kvstore)
    role=$1
    shift
    exec "tandem-$role" "$@"
    ;;
  ""|-h|--help)
    echo "usage: <router|prefill|decode|kvstore|tandem> [ARGS...]   (e.g. decode --help)"
    exit 0
    ;;
  *)
    exec "$@"
    ;;
esac
