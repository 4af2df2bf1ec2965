lock_at() {
  # lock_at ROOT KEY: sets $lock to the lock KEY in ROOT ("" = $HOME/.ddp-deploy, made where
  # missing), after checking ROOT is this user's own directory, not a link, and that no one else
  # can write into it: a lock that another local user (or a job running as one) could plant,
  # rename or remove would let them hold off or break every launch. Fails with a line naming the
  # directory and what to do.
  la_root=${1:-$HOME/.ddp-deploy}
  [ -e "$la_root" ] || [ -L "$la_root" ] || mkdir -m 0700 -- "$la_root" 2>/dev/null || [ -d "$la_root" ] || {
    echo "cannot make the lock directory $la_root" >&2; return 1; }
  la_is=$(stat -c '%F %u %a' -- "$la_root" 2>/dev/null) || { echo "cannot read $la_root" >&2; return 1; }
  # shellcheck disable=SC2086  # three words: type (one word for a directory), owner, mode
  set -- $la_is "$2"
  if [ "$1 $2" != "directory $(id -u)" ] || [ $((0$3 & 022)) != 0 ]; then
    echo "the lock directory $la_root is not this user's own ($la_is): another user can write there; move it aside" >&2
    return 1
  fi
  # shellcheck disable=SC2034  # $lock is the result, read by the program this file precedes
  lock=$la_root/$4
}
owner() {
  # The start of the lock's owner file, bounded: a reader of the whole of a huge one would take its
  # size in memory here and in the operator's tool. The tool's own owner files are ASCII JSON of at
  # most 12 KiB (lock.OWNER_MAX is the same number); any other byte is printed as '?', so that a
  # binary one reaches the operator as text.
  head -c 16384 "$1/owner" 2>/dev/null | LC_ALL=C tr -c '\n -~' '[?*]'
}
held() {
  # A lock taken before this node's last boot has no holder any more (its boot file: TAKE writes
  # the node's boot id there): it is cleared here, as a reboot clears a lock kept in memory.
  if [ -f "$1/boot" ] && [ "$(head -c 64 "$1/boot")" != "$(cat /proc/sys/kernel/random/boot_id)" ]; then
    old="$1.gone.$$"; rm -rf "$old" && mv -T "$1" "$old" 2>/dev/null && rm -rf "$old"
    [ -e "$1" ] || return 1
  fi
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
