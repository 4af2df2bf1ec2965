held() {
  # TAKE puts a lock in place with its owner file. Versions before it made the directory first and
  # wrote the owner file next, so one of theirs can be seen without it: wait for it up to 5 s, so
  # that the holder can be named; one never completed is shown without an owner.
  tries=0
  while [ -d "$1" ] && [ ! -e "$1/owner" ] && [ "$tries" -lt 50 ]; do sleep 0.1; tries=$((tries + 1)); done
  taken=$(stat -c %Y "$1/owner" 2>/dev/null || stat -c %Y "$1" 2>/dev/null) || return 1
  beat=$(stat -c %Y "$1/heartbeat" 2>/dev/null || echo "$taken")
  now=$(date +%s)
  echo "held $((now - taken)) $((now - beat))"
  cat "$1/owner" 2>/dev/null
  return 0
}
