progress() {
  now=$(date +%s)
  for f in "$1"/*; do
    name=${f##*/}
    case $name in ''|*[!0-9]*) continue ;; esac
    # shellcheck disable=SC2015  # any test or stat failing skips the file
    [ -f "$f" ] && [ ! -L "$f" ] && m=$(stat -c %Y "$f" 2>/dev/null) || continue
    # the file is the job's: read with its rights (as_job), so a link swapped in is read as the job would
    echo "beat $name $((now - m)) $(as_job head -c 64 -- "$f" 2>/dev/null | head -n 1 | tr -cd '0-9a-z -')"
  done
  m=$(as_job stat -L -c %Y -- "$2" 2>/dev/null) && echo "quiet $((now - m))"
}
