job=$1; script=$2; run=$3; shift 3
# shellcheck disable=SC2163  # each line is NAME=value: exported as such
while IFS= read -r kv; do export "$kv"; done
id=$(sbatch --parsable "$script") || exit 1
id=${id%%;*}
echo "$id $run" > "$job/slurm-job.tmp" && mv "$job/slurm-job.tmp" "$job/slurm-job" || exit 1
echo "$id"
