held() {
  # A lock being taken has its directory before its owner file (TAKE writes it next): wait for it
  # up to 5 s, so that the holder can be named; one never completed is shown without an owner.
  # (2 s were not enough once, on a loaded 2-core machine: a clean-clone run at 7d3745d.)
  tries=0
  while [ -d "$1" ] && [ ! -e "$1/owner" ] && [ "$tries" -lt 50 ]; do sleep 0.1; tries=$((tries + 1)); done
  taken=$(stat -c %Y "$1/owner" 2>/dev/null || stat -c %Y "$1" 2>/dev/null) || return 1
  beat=$(stat -c %Y "$1/heartbeat" 2>/dev/null || echo "$taken")
  now=$(date +%s)
  echo "held $((now - taken)) $((now - beat))"
  cat "$1/owner" 2>/dev/null
  return 0
}
