# owner() and lock_at() come from held.sh, which precedes this file (lock.RELEASE).
lock_at "$1" "$2" || exit 1
# shellcheck disable=SC2154  # lock_at sets $lock
gone="$lock.gone.$$"
if [ ! -d "$lock" ]; then echo gone
elif { [ -n "$3" ] && owner "$lock" | grep -qF -e "$3"; } || { [ -z "$3" ] && ! owner "$lock" | grep -q '"token"'; }; then
  rm -rf "$gone" || exit 1
  if err=$(mv -T "$lock" "$gone" 2>&1); then rm -rf "$gone" && echo removed
  elif [ ! -e "$lock" ]; then echo gone  # another release took it meanwhile
  else echo "$err" >&2; exit 1
  fi
else echo kept
fi
