#!/usr/bin/env bash
# GPU jobs under Slurm, without a GPU (docs/SLURM.md, "GPU jobs"): the throw-away cluster's node
# declares 2 stand-in GPUs (slurm-cluster.sh --gpus 2), so Slurm schedules GPU requests and sets
# CUDA_VISIBLE_DEVICES as on a GPU cluster. The product's batch scripts then
#   1. give each of 2 ranks its own GPU, with --gres=gpu:2 under mpirun (every rank sees both and
#      takes its node-local rank modulo 2) and with --gpus-per-task=1 under LOCUS_LAUNCHER=srun
#      (each task sees its own): checked by a stand-in app (LOCUS_BIN) that applies the apps'
#      rule to what each rank sees; the launch line names the job's GPUs;
#   2. run the real locus-train (--train.backend=cuda) and locus-infer (--infer.backend=cuda) in
#      GPU jobs: on this GPU-less host each ends its job with exit 2 (a configuration error, not
#      requeued), its message naming CUDA_VISIBLE_DEVICES and the GPUs Slurm gave the job;
#      (a build without CUDA refuses too, exit 2, its message saying the build has no CUDA);
#   3. a request beyond the node's GPUs (--gres=gpu:3) is refused at submission.
#   test_slurm_gpu_gres.sh APPS_DIR cuda|no-cuda   (the directory holding locus-train and
#                                                   locus-infer, and whether they have CUDA)
set -euo pipefail
# shellcheck source=scripts/slurm-lib.sh
. "$(dirname "$0")/../../scripts/slurm-lib.sh"
# shellcheck source=tests/slurm/locus-jobs-lib.sh
. "$(dirname "$0")/locus-jobs-lib.sh"

apps=$(cd "${1:?usage: $0 APPS_DIR cuda|no-cuda}" && pwd)
build_kind=${2:?usage: $0 APPS_DIR cuda|no-cuda}
# What each refusal must say: on a CUDA build, the GPUs Slurm gave the job (no device seen);
# without CUDA, that the build has none.
case $build_kind in
  cuda)
    train_refusal="train.backend = cuda, but host .*CUDA_VISIBLE_DEVICES=0,1; Slurm's SLURM_.*GPUS=0,1"
    infer_refusal="infer.backend = cuda, but host .*CUDA_VISIBLE_DEVICES=0; Slurm's SLURM_.*GPUS=0" ;;
  no-cuda)
    train_refusal="train.backend = cuda is not available here; available: cpu (this build has no CUDA backend"
    infer_refusal="infer.backend = cuda, but this build of locus has no CUDA backend" ;;
  *) echo "$0: the second argument is cuda or no-cuda, not '$build_kind'" >&2; exit 2 ;;
esac
slurm_cluster_setup --gpus 2
cd "$LSC_WORK"

# Waits for job $1 to end; prints "STATE EXIT_CODE".
wait_end() {
  local job=$1
  ended() { case " $SLURM_FINAL_STATES " in *" $(slurm_job_field "$job" JobState) "*) return 0 ;; esac; return 1; }
  slurm_wait_until 120 "job $job ended" ended >&2 || slurm_fail "job $job did not end: $(scontrol show job "$job")"
  echo "$(slurm_job_field "$job" JobState) $(slurm_job_field "$job" ExitCode)"
}

# 1. Which GPU each rank would use: a stand-in locus-train applies the apps' rule (device =
# node-local rank modulo the visible devices) to what Slurm and the launcher gave it.
mkdir -p probe
cat > probe/locus-train <<'EOF'
#!/bin/bash
rank=${OMPI_COMM_WORLD_RANK:-$SLURM_PROCID}
local_rank=${OMPI_COMM_WORLD_LOCAL_RANK:-$SLURM_LOCALID}
IFS=, read -r -a visible <<< "${CUDA_VISIBLE_DEVICES:-}"
if [ ${#visible[@]} = 0 ]; then echo "probe rank $rank: no GPU visible"; exit 1; fi
echo "probe rank $rank sees CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES, uses GPU ${visible[$((local_rank % ${#visible[@]}))]}"
EOF
chmod +x probe/locus-train
for how in "mpirun --gres=gpu:2" "mpirun --gpus-per-task=1" "srun --gpus-per-task=1" \
           "srun --gres=gpu:2"; do
  read -r launcher request <<< "$how"
  log=probe-$launcher-${request//[^a-z0-9]/}.log
  job=$(LOCUS_BIN=$PWD/probe LOCUS_LAUNCHER=$launcher slurm_submit -o "$log" --ntasks=2 \
    "$request" "$LOCUS_REPO/slurm/train.sbatch")
  read -r state code <<< "$(wait_end "$job")"
  [ "$state" = COMPLETED ] || slurm_fail "$how: job ended $state ($code): $(cat "$log")"
  used=$(sed -n 's/^probe rank [0-9]* sees .* uses GPU //p' "$log" | sort -u | paste -sd, -)
  [ "$used" = 0,1 ] || slurm_fail "$how: the 2 ranks would use GPU(s) '$used', not 0 and 1: $(cat "$log")"
  grep -q "tasks, GPUs 0,1 (CUDA_VISIBLE_DEVICES=0,1)" "$log" ||
    slurm_fail "$how: the launch line does not name the job's GPUs: $(cat "$log")"
  if [ "$how" = "mpirun --gpus-per-task=1" ]; then
    grep -q "binds a GPU per task only for srun" "$log" ||
      slurm_fail "$how: the launch line does not say that mpirun ranks see all the job's GPUs: $(cat "$log")"
  fi
  slurm_log "$how: ranks on GPUs $used; $(grep -o 'probe rank 1 sees [^ ]*' "$log")"
done

# 2. The real apps in GPU jobs: a configuration error on every rank here, exit 2, naming what
# Slurm gave them.
locus_make_csv data.csv 64 1
"$apps/locus-ingest" --ingest.csv=data.csv --ingest.csv_label=label --ingest.output=data.h5 \
  --ingest.report=data.json > ingest.log 2>&1 || slurm_fail "ingest failed: $(cat ingest.log)"
job=$(LOCUS_BIN=$apps slurm_submit -o train.log --ntasks=2 --gres=gpu:2 \
  "$LOCUS_REPO/slurm/train.sbatch" --data.train=data.h5 --data.test= --train.backend=cuda \
  --train.output=model.h5 --train.metrics=)
read -r state code <<< "$(wait_end "$job")"
[ "$state" = FAILED ] && [ "${code%%:*}" = 2 ] ||
  slurm_fail "locus-train in a GPU job: ended $state ($code), expected FAILED with exit 2: $(cat train.log)"
grep -q "$train_refusal" train.log ||
  slurm_fail "locus-train's refusal ($build_kind build) does not say '$train_refusal': $(cat train.log)"
[ "$(slurm_job_field "$job" Restarts)" = 0 ] || slurm_fail "the configuration error was requeued"
[ ! -e model.h5 ] || slurm_fail "a model was written"

job=$(LOCUS_BIN=$apps LOCUS_LAUNCHER=srun slurm_submit -o infer.log --ntasks=1 --gpus-per-task=1 \
  "$LOCUS_REPO/slurm/infer.sbatch" --infer.backend=cuda --infer.model=none.h5 \
  --infer.input=data.h5 --infer.output=pred.h5)
read -r state code <<< "$(wait_end "$job")"
[ "$state" = FAILED ] && [ "${code%%:*}" = 2 ] ||
  slurm_fail "locus-infer in a GPU job: ended $state ($code), expected FAILED with exit 2: $(cat infer.log)"
grep -q "$infer_refusal" infer.log ||
  slurm_fail "locus-infer's refusal ($build_kind build) does not say '$infer_refusal': $(cat infer.log)"
[ ! -e pred.h5 ] || slurm_fail "a prediction file was written"
slurm_log "locus-train and locus-infer in GPU jobs ($build_kind build): exit 2, the refusal saying why"

# 3. More GPUs than a node has: refused when submitted, nothing queued.
if out=$(sbatch --parsable --ntasks=1 --gres=gpu:3 "$LOCUS_REPO/slurm/train.sbatch" 2>&1); then
  slurm_fail "sbatch accepted --gres=gpu:3 on nodes of 2 GPUs (job ${out%%;*})"
fi
slurm_log "ok: GPU requests scheduled, one GPU per rank under mpirun and srun, refusals named ($out)"
