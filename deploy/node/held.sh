owner() {
  # The start of the lock's owner file: any local user can plant one in /tmp, and a reader of the
  # whole of a huge one would take its size in memory here and in the operator's tool. The tool's
  # own owner files are ASCII JSON of at most 12 KiB (lock.OWNER_MAX is the same number); any other
  # byte is printed as '?', so that a binary one reaches the operator as text.
  head -c 16384 "$1/owner" 2>/dev/null | LC_ALL=C tr -c '\n -~' '[?*]'
}
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
  owner "$1"
  return 0
}
