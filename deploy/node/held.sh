held() {
  taken=$(stat -c %Y "$1/owner" 2>/dev/null || stat -c %Y "$1" 2>/dev/null) || return 1
  beat=$(stat -c %Y "$1/heartbeat" 2>/dev/null || echo "$taken")
  now=$(date +%s)
  echo "held $((now - taken)) $((now - beat))"
  cat "$1/owner" 2>/dev/null
  return 0
}
