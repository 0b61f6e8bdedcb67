# shellcheck shell=bash
# Moving a requeued training job off the nodes its straggler detector judged slow: sourced by
# slurm/train.sbatch (after slurm/locus-job.sh). locus-train's rank 0 keeps the current
# stragglers in <checkpoint.dir>/stragglers (docs/FORMATS.md, "The stragglers file"); when the
# job is requeued, their nodes are added to the job's excluded nodes, so the next run is
# scheduled elsewhere. See README, "Anomalies and stragglers", and docs/SLURM.md.
#
# Opt-in: only with LOCUS_EXCLUDE_STRAGGLERS=1 in the job's environment (a verdict taken on a
# node shared with other work can be wrong, and excluding nodes of a small partition can leave
# the job pending for good; docs/SLURM.md).
#
# Environment (optional):
#   LOCUS_STRAGGLERS       the stragglers file (default: <checkpoint.dir>/stragglers, the
#                          directory taken from the arguments or the [checkpoint] section of
#                          the config file)
#   LOCUS_EXCLUDE_STRAGGLERS=1  exclude the stragglers' nodes on requeue (default 0: never)

# Prints the checkpoint directory of the training arguments "$@" (LOCUS_ARGS): the last
# --checkpoint.dir, else `dir` in the [checkpoint] section of the --config file; "" if none.
locus_checkpoint_dir() {
  local dir="" config="" prev=""
  for a in "$@"; do
    case "$a" in
      --checkpoint.dir=*) dir=${a#--checkpoint.dir=} ;;
      --config=*) config=${a#--config=} ;;
    esac
    [ "$prev" = --checkpoint.dir ] && dir=$a
    [ "$prev" = --config ] && config=$a
    prev=$a
  done
  if [ -z "$dir" ] && [ -n "$config" ] && [ -r "$config" ]; then
    dir=$(awk -F= '
      /^[ \t]*\[/ { section = $0; gsub(/[][ \t]/, "", section); next }
      section == "checkpoint" && $1 ~ /^[ \t]*dir[ \t]*$/ {
        v = substr($0, index($0, "=") + 1); sub(/[ \t]*[;#].*$/, "", v)
        gsub(/^[ \t]+|[ \t]+$/, "", v); found = v
      }
      END { print found }' "$config")
  fi
  printf '%s\n' "$dir"
}

# Prints the nodes of a stragglers file, comma-separated (the node column, or the host where
# the node is "-"); "" when the file is missing or lists none.
locus_straggler_nodes() {
  [ -r "$1" ] || return 0
  awk '!/^#/ && NF >= 3 { n = ($3 == "-") ? $2 : $3; if (!(n in seen)) { seen[n]; out = out (out == "" ? "" : ",") n } }
       END { print out }' "$1"
}

# After `scontrol requeue` of job $1 (pending again): adds the stragglers' nodes to its
# ExcNodeList, keeping the nodes already excluded. Logs what it did; never fails the script.
locus_exclude_stragglers() {
  local job=$1 file nodes old
  [ "${LOCUS_EXCLUDE_STRAGGLERS:-0}" = 1 ] || return 0
  file=${LOCUS_STRAGGLERS:-}
  if [ -z "$file" ]; then
    local dir
    dir=$(locus_checkpoint_dir "${LOCUS_ARGS[@]}")
    [ -n "$dir" ] || return 0
    file=$dir/stragglers
  fi
  nodes=$(locus_straggler_nodes "$file")
  [ -n "$nodes" ] || return 0
  old=$(scontrol show job "$job" 2>/dev/null | sed -n 's/.*ExcNodeList=\([^ ]*\).*/\1/p' | head -n 1)
  [ "$old" = "(null)" ] && old=""
  if scontrol update JobId="$job" ExcNodeList="${old:+$old,}$nodes"; then
    locus_log "stragglers in $file: job $job will not run on ${nodes} again (ExcNodeList=${old:+$old,}$nodes)"
  else
    locus_log "stragglers in $file (nodes $nodes), but 'scontrol update JobId=$job ExcNodeList=...' failed: the job may run on them again"
  fi
}
