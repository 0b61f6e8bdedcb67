# shellcheck shell=bash
# What every locus batch script shares: finding the binaries, the environment, the launcher
# (mpirun or srun) and running the app so that the batch shell can forward signals to it.
# Sourced by slurm/*.sbatch after they have set LOCUS_ROOT; see docs/SLURM.md.
#
# Environment read here (all optional):
#   LOCUS_BIN           directory holding locus-ingest, locus-train, locus-infer
#                       (default: $LOCUS_ROOT/build/apps, what scripts/build.sh builds)
#   LOCUS_LAUNCHER      mpirun (default) or srun (srun --mpi=pmix: Debian's Open MPI needs PMIx)
#   LOCUS_MPIRUN_ARGS   extra mpirun arguments, word-split (default: --bind-to none)
#   LOCUS_SRUN_ARGS     extra srun arguments, word-split
#   LOCUS_CONFIG        config file when none is given as the first argument
#   LOCUS_OVERRIDES     overrides (--section.key=value ...), word-split, before the arguments

readonly LOCUS_EXIT_CONFIG=2
readonly LOCUS_EXIT_CHECKPOINTED=75

locus_log() { echo "[locus-slurm $(date +%T) job ${SLURM_JOB_ID:-none}] $*"; }
locus_die() {
  echo "[locus-slurm job ${SLURM_JOB_ID:-none}] error: $*" >&2
  exit "$LOCUS_EXIT_CONFIG"
}

# Sets LOCUS_APP_PATH to the executable of app $1 and the environment every launch needs.
locus_setup() {
  local app=$1
  LOCUS_BIN=${LOCUS_BIN:-$LOCUS_ROOT/build/apps}
  LOCUS_APP_PATH=$LOCUS_BIN/$app
  [ -x "$LOCUS_APP_PATH" ] ||
    locus_die "$LOCUS_APP_PATH is not an executable: build it (scripts/build.sh) or point LOCUS_BIN at the directory holding $app"
  # Open MPI refuses root without these; set them only where they are needed.
  if [ "$(id -u)" = 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  fi
  # One BLAS thread per CPU given to each task unless the user chose; the apps' own thread
  # options (train.threads, infer.blas_threads) still apply on top.
  export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
}

# Fills the array LOCUS_ARGS with the app's arguments: `--config FILE` (the first argument
# when it is not an option, else LOCUS_CONFIG), then LOCUS_OVERRIDES, then the rest.
locus_parse_args() {
  local config=${LOCUS_CONFIG:-} overrides=()
  if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
    config=$1
    shift
  fi
  LOCUS_ARGS=()
  if [ -n "$config" ]; then
    [ -r "$config" ] || locus_die "cannot read config file '$config' (relative to $(pwd)): give a readable file"
    LOCUS_ARGS+=(--config "$config")
  fi
  # shellcheck disable=SC2206 # word splitting is the documented behaviour
  [ -n "${LOCUS_OVERRIDES:-}" ] && overrides=($LOCUS_OVERRIDES)
  LOCUS_ARGS+=("${overrides[@]}" "$@")
}

# Fills the array LOCUS_LAUNCH with the launcher command for all of the job's tasks, one gang.
locus_launcher() {
  local ntasks=${SLURM_NTASKS:-${SLURM_NPROCS:-1}} extra=()
  case "${LOCUS_LAUNCHER:-mpirun}" in
    mpirun)
      # shellcheck disable=SC2206
      extra=(${LOCUS_MPIRUN_ARGS---bind-to none})
      LOCUS_LAUNCH=(mpirun -n "$ntasks" "${extra[@]}")
      ;;
    srun)
      # shellcheck disable=SC2206
      extra=(${LOCUS_SRUN_ARGS:-})
      LOCUS_LAUNCH=(srun --mpi=pmix -n "$ntasks" "${extra[@]}")
      ;;
    *) locus_die "LOCUS_LAUNCHER='$LOCUS_LAUNCHER': use mpirun or srun" ;;
  esac
}

# The batch shell's signal handler: remember the signal and pass it on to the app.
# srun forwards every signal to every task of its step; mpirun forwards USR1/USR2 to every
# rank. SIGTERM must not go to mpirun: Open MPI 4.1's mpirun aborts the job on it and SIGKILLs
# the ranks 2 s later (odls_base_sigkill_timeout, twice), before a checkpoint can be written,
# and a second SIGTERM makes it exit at once. So mpirun runs with SIGTERM blocked (locus_run)
# and the shell hands SIGTERM to the app's ranks on this node itself: one rank hearing it is
# enough, locus-train agrees on the signal over all ranks at the next step boundary.
locus_forward() {
  LOCUS_SIGNALLED=$1
  case "${LOCUS_PHASE:-setup}" in
    running)
      if [ "$1" = TERM ] && [ "${LOCUS_LAUNCH[0]}" = mpirun ]; then
        local ranks
        ranks=$(pgrep -P "$LOCUS_CHILD" -x "$(basename "$LOCUS_APP_PATH" | cut -c 1-15)" | tr '\n' ' ')
        if [ -n "$ranks" ]; then
          locus_log "SIGTERM: passing it to the ranks on this node (pids ${ranks% }), not to mpirun (pid $LOCUS_CHILD)"
          # shellcheck disable=SC2086 # a list of pids
          kill -s TERM $ranks 2>/dev/null || true
          return
        fi
        locus_log "SIGTERM: no rank of ${LOCUS_APP_PATH##*/} on this node; forwarding SIGUSR1 to mpirun (pid $LOCUS_CHILD) instead"
        kill -s USR1 "$LOCUS_CHILD" 2>/dev/null || true
        return
      fi
      locus_log "SIG$1: forwarding it to ${LOCUS_LAUNCH[0]} (pid $LOCUS_CHILD)"
      kill -s "$1" "$LOCUS_CHILD" 2>/dev/null || true
      ;;
    setup) locus_log "SIG$1 before the app started: it will not be started" ;;
    *) locus_log "SIG$1 after the app ended" ;;
  esac
}

# Traps the signals to forward (by name: USR1 TERM ...). Call before locus_run so that a
# signal arriving during setup is remembered.
locus_trap() {
  local sig
  for sig in "$@"; do
    # shellcheck disable=SC2064 # the signal name is fixed now
    trap "locus_forward $sig" "$sig"
  done
}

# The GPUs Slurm gave the job and how its ranks will find theirs, for the launch line ("" in a
# job without GPUs). Under srun each task sees the GPUs of its step on its node (one each with
# --gpus-per-task=1); under mpirun every rank of a node sees all the job's GPUs there, and the
# apps take the node-local rank modulo their count (train.device / infer.device override).
locus_gpu_note() {
  local gpus=${SLURM_JOB_GPUS:-${SLURM_STEP_GPUS:-}}
  [ -n "$gpus" ] || [ -n "${SLURM_GPUS_PER_TASK:-}" ] || return 0
  local note="GPUs ${gpus:-?} (CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset})"
  if [ "${LOCUS_LAUNCH[0]}" = mpirun ]; then
    note+=", each rank takes node-local rank modulo the node's GPUs"
    if [ -n "${SLURM_GPUS_PER_TASK:-}" ]; then
      note+=" (--gpus-per-task binds a GPU per task only for srun: LOCUS_LAUNCHER=srun)"
    fi
  else
    note+=", each task those of its srun step"
  fi
  echo ", $note"
}

# Runs the app under the launcher with LOCUS_ARGS and sets LOCUS_RC to its exit code. The
# launcher runs in the background so that bash runs traps while it waits: a trapped signal
# makes `wait` return early, so wait again until the launcher is really gone. A signal that
# came before the launch means the app is not started at all: LOCUS_RC is then 75
# ("checkpointed", there was nothing to save) for USR1 and 128 + the signal number otherwise.
locus_run() {
  locus_launcher
  local cmd=("${LOCUS_LAUNCH[@]}" "$LOCUS_APP_PATH" "${LOCUS_ARGS[@]}")
  if [ -n "${LOCUS_SIGNALLED:-}" ]; then
    LOCUS_RC=$LOCUS_EXIT_CHECKPOINTED
    [ "$LOCUS_SIGNALLED" = USR1 ] || LOCUS_RC=$((128 + $(kill -l "$LOCUS_SIGNALLED")))
    locus_log "not starting ${LOCUS_APP_PATH##*/}: SIG$LOCUS_SIGNALLED came first (code $LOCUS_RC)"
    return
  fi
  locus_log "restart ${SLURM_RESTART_COUNT:-0}, $(hostname), ${SLURM_JOB_NODELIST:+nodes $SLURM_JOB_NODELIST, }${SLURM_NTASKS:-1} tasks$(locus_gpu_note): ${cmd[*]}"
  if [ "${LOCUS_LAUNCH[0]}" = mpirun ]; then
    # mpirun with SIGTERM blocked (its ranks get an unblocked mask from Open MPI): Slurm's
    # SIGTERM at preemption, cancellation or the time limit goes to every process of the batch
    # step, and mpirun would kill the ranks within 2 s. The ranks get it themselves and
    # checkpoint; mpirun ends when they do. perl is in every Debian system (perl-base).
    perl -e 'use POSIX; sigprocmask(SIG_BLOCK, POSIX::SigSet->new(SIGTERM)) or die "sigprocmask: $!\n";
             exec { $ARGV[0] } @ARGV or do { print STDERR "cannot run $ARGV[0]: $!\n"; exit 127 }' "${cmd[@]}" &
  else
    "${cmd[@]}" &
  fi
  LOCUS_CHILD=$!
  LOCUS_PHASE=running
  # A signal that came in the instant between the launch and the line above: pass it on now.
  if [ -n "${LOCUS_SIGNALLED:-}" ]; then locus_forward "$LOCUS_SIGNALLED"; fi
  while kill -0 "$LOCUS_CHILD" 2>/dev/null; do wait "$LOCUS_CHILD" || true; done
  wait "$LOCUS_CHILD"
  LOCUS_RC=$?
  LOCUS_PHASE=ended
  if [ "$LOCUS_RC" = "$LOCUS_EXIT_CHECKPOINTED" ] && [ "${LOCUS_LAUNCH[0]}" = mpirun ]; then
    locus_log "${LOCUS_APP_PATH##*/} exited with code $LOCUS_RC (checkpointed; Open MPI's message above that the job was aborted over a non-zero exit code is expected)"
  else
    locus_log "${LOCUS_APP_PATH##*/} exited with code $LOCUS_RC"
  fi
}
