# $1 = the job's uid ("": this user), $2 = the checkpoint directory, $3 = the tool's directory in
# it, $4 = the job, $5 = the run, $6 = runs to keep, $7 = the TensorBoard directory. stdin: the
# run's record. The records go where only this tool writes (tool_dir); the TensorBoard files are
# the job's, removed with its rights (as_job).
# shellcheck disable=SC2034  # job_uid is read by job_root and as_job
job_uid=$1; root=$2; sub=$3; name=$4; run=$5; keep=$6; tb=$7
run_dir "$root" "$sub" "$name" "$run" || exit 1
job=$root/$sub/$name
cat > "$job/runs/$run/run.json.tmp" && mv "$job/runs/$run/run.json.tmp" "$job/runs/$run/run.json" || exit 1
cp "$job/runs/$run/run.json" "$job/launch.json.tmp" && mv "$job/launch.json.tmp" "$job/launch.json" || exit 1
# shellcheck disable=SC2010  # run ids match the pattern: no odd characters
ls -1 "$job/runs" | grep -E '^[0-9]{8}-[0-9]{6}-[0-9a-f]{4}$' | sort -r | tail -n +$((keep + 1)) | while read -r old; do
  [ "$old" = "$run" ] && continue
  # shellcheck disable=SC2115  # $old is a run id (the pattern above), $job and $tb always given
  rm -rf "$job/runs/$old" && as_job rm -rf -- "$tb/$old" && echo "pruned $old"
done
exit 0
