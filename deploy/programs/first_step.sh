# $1 = the checkpoint directory, $2 = the tool's directory in it, $3 = the job, $4 = the run. stdin:
# the run's first step, a JSON object on one line (record.first_step_line). Adds it to the run's
# record (runs/RUN/run.json, as record.encode writes it: its last line the closing brace) as
# "first_step", once: a record that has one already, or that ends otherwise, is left as it is.
root=$1; sub=$2; name=$3; run=$4
tool_dir "$root" "$sub" "$name" runs "$run" || exit 1
f=$root/$sub/$name/runs/$run/run.json
# the tool's own file in the tool's own directory (tool_dir): never a link followed
{ [ -f "$f" ] && [ ! -L "$f" ]; } || { echo "no record of run $run in $root/$sub/$name/runs" >&2; exit 1; }
grep -q '^ "first_step": ' "$f" && exit 0
[ "$(tail -n 1 "$f")" = "}" ] || { echo "$f does not end as this tool writes a record: left as it is" >&2; exit 1; }
step=$(head -c 4096 | head -n 1)
case $step in "{"*"}") ;; *) echo "not a first step: $step" >&2; exit 1 ;; esac
# the record less its closing brace, a comma after its last field, then this one and the brace
{ sed '$d' "$f" | sed '$ s/$/,/' && printf ' "first_step": %s\n}\n' "$step"; } > "$f.tmp" && mv "$f.tmp" "$f"
