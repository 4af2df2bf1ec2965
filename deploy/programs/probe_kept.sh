# A CPU node's probe answer, kept for the next launch (deploy/checks/preflight.py).
# $1 = reuse | keep, $2 = the probe command's key (sha256 of its argv, made by the operator: the
# image's name, the code snapshot's path, which is named by its content, the environment, the
# flags), $3 = the image's name; the probe's argv follows.
# The answer is kept under the key and the image's id, so a rebuilt image, other code or other
# flags are another key. Only a good answer is kept (torch imported, the program's imports
# resolved): a failure is probed again every time. reuse: print a kept answer, after a line
# "PROBE_KEPT <when it was probed, epoch seconds>", where there is one; else probe, as keep does.
mode=$1; key=$2; image=$3; shift 3
id=$(docker image inspect --format '{{.Id}}' "$image" 2>/dev/null) || exec "$@"  # no image: the probe says why
dir=${XDG_CACHE_HOME:-$HOME/.cache}/ddp-deploy/probe
kept=$dir/$key-${id#sha256:}
if [ "$mode" = reuse ] && [ -s "$kept" ]; then
  printf 'PROBE_KEPT %s\n' "$(stat -c %Y "$kept")"
  cat "$kept"
  exit 0
fi
out=$("$@")
rc=$?
[ -n "$out" ] && printf '%s\n' "$out"
line=$(printf '%s\n' "$out" | grep '^PROBE {' | tail -n 1)
case $line in
  *'"error": null'*'"program_error": null'*)
    if [ "$rc" = 0 ] && mkdir -p "$dir" && chmod 700 "$dir"; then
      find "$dir" -type f -mtime +7 -delete 2>/dev/null  # images and snapshots long gone
      printf '%s\n' "$line" > "$kept.$$" && mv -f "$kept.$$" "$kept"
    fi ;;
esac
exit "$rc"
