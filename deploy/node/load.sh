out=$(docker load 2>&1); rc=$?
printf '%s\n' "$out" | sed -e '/^$/d' -e 's/^/LOAD /'
echo "EXIT $rc"
sh -c "$0" sh "$1"
exit $rc
