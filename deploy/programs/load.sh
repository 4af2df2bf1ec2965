# On the containerd image store, the image that has held the name $1 until now is what keeps its
# unpacked layers (snapshots) alive. A new image sent without the layers the node holds is unpacked
# on top of those snapshots, and docker load moves the name before it unpacks: containerd's garbage
# collector may drop them in between (the load then fails: "parent snapshot ... does not exist").
# A second name holds the old image until the load has ended.
hold=
if [ "$(docker_store 2>/dev/null)" = containerd ] && docker tag "$1" "ddp-deploy-load-hold:$$" >/dev/null 2>&1; then
  hold="ddp-deploy-load-hold:$$"
fi
out=$(docker load 2>&1); rc=$?
if [ -n "$hold" ]; then docker image rm -f "$hold" >/dev/null 2>&1; fi
printf '%s\n' "$out" | sed -e '/^$/d' -e 's/^/LOAD /'
echo "EXIT $rc"
sh -c "$0" sh "$1"
exit $rc
