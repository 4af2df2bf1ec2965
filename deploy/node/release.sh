lock=$1
if [ ! -d "$lock" ]; then echo gone
elif { [ -n "$2" ] && grep -qsF -e "$2" "$lock/owner"; } || { [ -z "$2" ] && ! grep -qs '"token"' "$lock/owner"; }; then
  rm -rf "$lock" && echo removed
else echo kept
fi
