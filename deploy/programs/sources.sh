# shellcheck disable=SC2010  # run ids match the pattern: no odd characters
ls -1 "$2" 2>/dev/null | grep -E '^[0-9]{8}-[0-9]{6}-[0-9a-f]{4}$' | sort
echo @@jsonl
[ -e "$1" ] || exit 0
exec cat "$1"
