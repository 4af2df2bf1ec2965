run=$1; shift
for want in "$@"; do
  f="$run/${want%%/*}/stall-${want#*/}"
  # shellcheck disable=SC2015  # a regular file, not a link, or the next one
  [ -f "$f" ] && [ ! -L "$f" ] || continue
  echo "@@node ${want%%/*}"; echo "@@stall ${want#*/}"; head -c 1048576 "$f"; echo
done
exit 0
