# A host CPU node's probe, asked to keep its good answer for the next launch (agent/probe.py
# --kept: under the operator's key of the command and the interpreter's installation).
# $1 = reuse | keep, $2 = the probe command's key; the probe's argv follows. A trainer on the node
# older than --kept says so (argparse: exit 2): probed as before, without keeping.
mode=$1; key=$2; shift 2
err=$(mktemp) || exec "$@"
out=$("$@" --kept "$mode" "$key" 2> "$err")
rc=$?
if [ "$rc" = 2 ] && grep -q 'unrecognized arguments: --kept' "$err"; then
  rm -f "$err"
  exec "$@"
fi
[ -n "$out" ] && printf '%s\n' "$out"
cat "$err" >&2
rm -f "$err"
exit "$rc"
