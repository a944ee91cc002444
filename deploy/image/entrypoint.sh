#!/bin/sh
# The kvcanary image's entrypoint. Arguments that begin with an option are Locust's, as for the
# official Locust image: the Locust operator starts its master and workers with a command seed
# ("--locustfile ... --kvc-target ...") plus --master/--worker flags, and no command. Anything
# else is a command of its own: "replay canary ..." (the Kubernetes Job), "kvcal ...", "sleep".
# exec, so that the command is PID 1 and gets the pod's SIGTERM: replay and kvcanary's Locust
# scenario both handle it (the run directory is finished, exit 143).
set -eu
case "${1:-}" in
    -*) exec locust "$@" ;;
    "") exec replay --help ;;
    *) exec "$@" ;;
esac
