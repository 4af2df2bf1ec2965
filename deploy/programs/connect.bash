end=$((SECONDS + $3))
while [ $SECONDS -lt $end ]; do
  # shellcheck disable=SC2016  # the inner script expands its own arguments
  if timeout 2 bash -c 'exec 3<>"/dev/tcp/$0/$1"' "$1" "$2" 2>/dev/null; then echo connected; exit 0; fi
  sleep 0.1
done
echo "cannot connect to $1:$2" >&2; exit 1
