job=$1; run=$2; keep=$3; tb=$4
mkdir -p "$job/runs/$run" || exit 1
cat > "$job/runs/$run/run.json.tmp" && mv "$job/runs/$run/run.json.tmp" "$job/runs/$run/run.json" || exit 1
cp "$job/runs/$run/run.json" "$job/launch.json.tmp" && mv "$job/launch.json.tmp" "$job/launch.json" || exit 1
# shellcheck disable=SC2010  # run ids match the pattern: no odd characters
ls -1 "$job/runs" | grep -E '^[0-9]{8}-[0-9]{6}-[0-9a-f]{4}$' | sort -r | tail -n +$((keep + 1)) | while read -r old; do
  [ "$old" = "$run" ] && continue
  # shellcheck disable=SC2115  # $old is a run id (the pattern above), $job and $tb always given
  rm -rf "$job/runs/$old" "$tb/$old" && echo "pruned $old"
done
exit 0
