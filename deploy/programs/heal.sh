# $1 = what: put | add | read; $2 = the checkpoint directory, $3 = the tool's directory in it, $4 =
# the job, $5 = the run (add). The watcher's files, where only this tool writes (tool_dir): put:
# stdin (its first line) becomes the job's "watch" (who watches it, what it does now), whole or not
# at all; add: stdin's first line is appended to the run's "heal" (each decision, kept with the run:
# runs.LIST_RUNS reads them); read: "@@watch LINE", where there is a record.
what=$1; root=$2; sub=$3; name=$4; run=${5:-}
job=$root/$sub/$name
case "$what" in
  put)
    tool_dir "$root" "$sub" "$name" || exit 1
    head -c 8192 | head -n 1 > "$job/watch.tmp" && mv "$job/watch.tmp" "$job/watch" ;;
  add)
    run_dir "$root" "$sub" "$name" "$run" || exit 1
    head -c 8192 | head -n 1 >> "$job/runs/$run/heal" ;;
  read)
    [ -f "$job/watch" ] && [ ! -L "$job/watch" ] && head -c 8192 "$job/watch" | head -n 1 | sed 's/^/@@watch /'
    exit 0 ;;
  *) echo "heal.sh: put, add or read, not $what" >&2; exit 2 ;;
esac
