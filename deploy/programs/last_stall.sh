last_stall() {
  [ -f "$1/stalls" ] && as_job tail -n 1 -- "$1/stalls" 2>/dev/null | head -c 200 | head -n 1 | sed 's/^/stall /'
  return 0
}
