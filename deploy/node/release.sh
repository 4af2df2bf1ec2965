lock=$1; gone="$lock.gone.$$"
if [ ! -d "$lock" ]; then echo gone
elif { [ -n "$2" ] && grep -qsF -e "$2" "$lock/owner"; } || { [ -z "$2" ] && ! grep -qs '"token"' "$lock/owner"; }; then
  rm -rf "$gone" || exit 1
  if err=$(mv -T "$lock" "$gone" 2>&1); then rm -rf "$gone" && echo removed
  elif [ ! -e "$lock" ]; then echo gone  # another release took it meanwhile
  else echo "$err" >&2; exit 1
  fi
else echo kept
fi
