# $1 = the job's uid ("": the job runs as this user), $2 = the checkpoint directory, $3 = the tool's
# directory in it, $4 = the job, $5 = the run, $6 = the node, then the command. Makes the node's
# directory of the run, where a container's launcher (as the job's user) keeps its output, and
# runs the command. Every part above it is checked to be this tool's alone (tool_dir), so no link
# the job planted turns the chown into one of another directory.
job_uid=$1; root=$2; sub=$3; job=$4; run=$5; node=$6; shift 6
run_dir "$root" "$sub" "$job" "$run" || exit 1
dir=$root/$sub/$job/runs/$run/$node
mkdir -m 0755 -- "$dir" 2>/dev/null
if [ ! -d "$dir" ] || [ -L "$dir" ]; then echo "cannot make $dir" >&2; exit 1; fi
if [ -n "$job_uid" ] && [ "$(id -u)" = 0 ]; then chown -h "$job_uid:$job_uid" -- "$dir" || exit 1; fi
exec "$@"
