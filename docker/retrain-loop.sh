#!/bin/sh
# The compose `retrainer`: every RETRAIN_EVERY_S seconds (default a day), train a new artifact into
# /artifacts/runs/<UTC time> with the given `dcmc train` arguments and publish it as /artifacts/current;
# every `api` worker swaps it in without a restart (hot reload). A failed run leaves the published model
# serving. The newest KEEP_RUNS runs (default 3) are kept; older ones are deleted. After a publish the
# rating stream is compacted up to what the new artifact read (`dcmc compact`, COMPACT=1, the default):
# the api's workers swap the new model in, and a worker still on the old one folds the compacted head in
# if it restarts before its reload; COMPACT=0 keeps the whole stream.
set -u
while true; do
  sleep "${RETRAIN_EVERY_S:-86400}"
  stamp=$(date -u +%Y%m%dT%H%M%SZ)
  if dcmc train "$@" --out "/artifacts/runs/$stamp" --publish /artifacts/current; then
    rm -rf "/artifacts/runs/$stamp.ckpt"
    if [ "${COMPACT:-1}" = 1 ]; then
      dcmc compact --artifacts /artifacts/current || echo "compacting the rating stream failed; it stays whole" >&2
    fi
    current=$(readlink /artifacts/current)
    ls -1d /artifacts/runs/*/ 2>/dev/null | sort -r | tail -n "+$(( ${KEEP_RUNS:-3} + 1 ))" | while read -r old; do
      case "$current" in *"$(basename "$old")"*) ;; *) rm -rf "$old" ;; esac
    done
  else
    echo "retraining failed; /artifacts/current still serves $(readlink /artifacts/current)" >&2
  fi
done
