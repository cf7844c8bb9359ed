#!/bin/sh
# Run the given `dcmc train ... --out DIR [--publish LINK]` command unless DIR already holds a verified
# artifact, so `docker compose up` trains once and later ups reuse the artifact in the shared volume
# (publishing it again when LINK is missing).
set -eu
out=""
link=""
prev=""
for arg in "$@"; do
  [ "$prev" = "--out" ] && out="$arg"
  [ "$prev" = "--publish" ] && link="$arg"
  prev="$arg"
done
if [ -n "$out" ] && python -c "import sys; from model.artifact import verify; verify(sys.argv[1])" "$out" 2>/dev/null; then
  echo "artifact $out is present and verified; not retraining (delete it to retrain)"
  if [ -n "$link" ] && [ ! -e "$link" ]; then
    exec dcmc publish --artifacts "$out" --link "$link"
  fi
  exit 0
fi
exec "$@"
