dir=$1; shift
for run in "$@"; do
  echo "@@run $run"
  for log in "$dir/$run"/*/log; do
    [ -f "$log" ] && grep -a -h -E '^(\[rank[0-9]+\]: )*METRICS ' "$log"
  done
done
exit 0
