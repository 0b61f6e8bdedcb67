# shellcheck shell=bash
# Bash helpers for tests that drive the throw-away Slurm cluster of scripts/slurm-cluster.sh.
# Source it (". scripts/slurm-lib.sh"); needs bash 4.4+. There is no slurmdbd, so no sacct: job
# facts come from `scontrol show job`, which keeps finished jobs for MinJobAge=300 s.
#
#   slurm_cluster_setup [--gang] [--nodes N [--netns]]  start a cluster in a fresh /tmp/lsc.XXXX, stop it on EXIT
#   slurm_submit SBATCH_ARGS...         submit, print the job id
#   slurm_job_field JOB FIELD           one field of `scontrol show job` (JobState, ExitCode, ...)
#   slurm_wait_state JOB STATE... [TIMEOUT_S]
#   slurm_wait_until TIMEOUT_S WHAT COMMAND...
#   slurm_fail MESSAGE                  print diagnostics and exit 1
#   slurm_assert_no_processes DIR       fail if any process of the cluster in DIR remains

SLURM_LIB_SCRIPTS=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SLURM_CLUSTER_SH=$SLURM_LIB_SCRIPTS/slurm-cluster.sh
SLURM_WAIT_DEFAULT_S=${SLURM_WAIT_DEFAULT_S:-60}
# States after which a job never runs again (a requeued job passes through PENDING instead).
SLURM_FINAL_STATES="COMPLETED FAILED CANCELLED TIMEOUT NODE_FAIL OUT_OF_MEMORY BOOT_FAIL DEADLINE"

slurm_log() { echo "[$(date +%T)] $*" >&2; }

# Everything useful for a post-mortem: queue, job records, the tail of each daemon log.
slurm_diagnostics() {
  [ -n "${LSC_DIR:-}" ] && [ -z "${SLURM_DIAGNOSED:-}" ] || return 0
  SLURM_DIAGNOSED=1
  echo "======== diagnostics for the cluster in $LSC_DIR ========" >&2
  if [ -f "$LSC_DIR/etc/slurm.conf" ] && [ -n "$(bash "$SLURM_CLUSTER_SH" pids "$LSC_DIR")" ]; then
    SLURM_CONF=$LSC_DIR/etc/slurm.conf squeue 2>&1 | head -n 20 >&2 || true
    SLURM_CONF=$LSC_DIR/etc/slurm.conf scontrol show job 2>&1 | head -n 120 >&2 || true
  fi
  local f
  for f in "$LSC_DIR"/log/*.log "$LSC_DIR"/log/watchdog.out; do
    [ -s "$f" ] || continue
    echo "---- last lines of $f ----" >&2
    tail -n 25 "$f" >&2
  done
}

slurm_fail() {
  echo "FAIL: $*" >&2
  slurm_diagnostics
  exit 1
}

# Start a cluster in a fresh short temp dir (exported as LSC_DIR, with LSC_WORK for job files),
# point the Slurm clients at it and stop it when the shell exits, whatever the outcome. The
# watchdog stops it too if the test is killed before its EXIT trap can run. LSC_KEEP=1 keeps
# the directory for inspection.
slurm_cluster_setup() {
  LSC_DIR=$(mktemp -d /tmp/lsc.XXXX)
  LSC_WORK=$LSC_DIR/work
  export LSC_DIR LSC_WORK
  trap slurm_cluster_teardown EXIT
  bash "$SLURM_CLUSTER_SH" start "$LSC_DIR" --lifetime "${LSC_LIFETIME:-300}" "$@" ||
    slurm_fail "could not start the cluster"
  eval "$(bash "$SLURM_CLUSTER_SH" env "$LSC_DIR")"
  mkdir -p "$LSC_WORK"
  # mpirun inside jobs runs as root here.
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
}

slurm_cluster_teardown() {
  local rc=$?
  trap - EXIT
  set +e # clean up as much as possible whatever fails
  [ $rc = 0 ] || slurm_diagnostics
  if [ -n "${LSC_DIR:-}" ] && [ -d "$LSC_DIR" ]; then
    bash "$SLURM_CLUSTER_SH" stop "$LSC_DIR" || rc=1
    if [ "${LSC_KEEP:-0}" = 1 ]; then
      echo "kept $LSC_DIR (LSC_KEEP=1)" >&2
    else
      rm -rf "$LSC_DIR" || { echo "could not remove $LSC_DIR" >&2; rc=1; }
    fi
  fi
  exit $rc
}

# Submit a batch job; prints its id. Arguments are passed to sbatch.
slurm_submit() {
  local out
  out=$(sbatch --parsable "$@") || slurm_fail "sbatch $* failed"
  echo "${out%%;*}"
}

# The value of FIELD in `scontrol show job JOB` (first record; use JOB_TASK for an array task).
# Values are taken up to the next blank, so fields whose values contain blanks come out cut.
slurm_job_field() {
  local job=$1 field=$2 rec
  rec=$(scontrol show job -o "$job" 2>/dev/null | head -n 1) || return 1
  [[ " $rec" =~ \ $field=([^ ]*) ]] || return 1
  echo "${BASH_REMATCH[1]}"
}

# Poll until the job is in one of STATES; returns 1 (with a message) after TIMEOUT_S seconds or
# as soon as the job is in a final state that is not wanted.
slurm_wait_state() {
  local job=$1 timeout=$SLURM_WAIT_DEFAULT_S states=() state="" deadline
  shift
  while [ $# -gt 0 ]; do
    if [[ "$1" =~ ^[0-9]+$ ]] && [ $# = 1 ]; then timeout=$1; else states+=("$1"); fi
    shift
  done
  [ ${#states[@]} -gt 0 ] || { echo "slurm_wait_state: no state given for job $job" >&2; return 2; }
  deadline=$((SECONDS + timeout))
  while :; do
    state=$(slurm_job_field "$job" JobState || true)
    case " ${states[*]} " in *" $state "*) return 0 ;; esac
    case " $SLURM_FINAL_STATES " in
      *" $state "*)
        echo "job $job ended $state while waiting for ${states[*]}" >&2
        return 1
        ;;
    esac
    if [ $SECONDS -ge $deadline ]; then
      echo "job $job still ${state:-unknown to scontrol} after ${timeout}s of waiting for ${states[*]}" >&2
      return 1
    fi
    sleep 0.2
  done
}

# Poll COMMAND every 0.2 s until it succeeds; returns 1 after TIMEOUT_S, naming WHAT.
slurm_wait_until() {
  local timeout=$1 what=$2 deadline
  shift 2
  deadline=$((SECONDS + timeout))
  until "$@"; do
    if [ $SECONDS -ge $deadline ]; then
      echo "gave up after ${timeout}s waiting for $what" >&2
      return 1
    fi
    sleep 0.2
  done
}

# Checks from outside slurm-cluster.sh that nothing of the cluster in DIR runs any more: no
# process names DIR on its command line or has a file under DIR open, and `pids` finds none.
slurm_assert_no_processes() {
  local dir=$1 found="" p
  for p in $(pgrep -f -- "$dir" || true); do
    [ "$p" != $$ ] && [ "$p" != "$BASHPID" ] && found+=" $p:$(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null || true)"
  done
  # From /, since find holds its starting directory open.
  for p in $(cd / && find /proc/[0-9]*/fd -mindepth 1 -maxdepth 1 -lname "$dir/*" 2>/dev/null | cut -d/ -f3 | sort -u); do
    [ "$p" != $$ ] && [ "$p" != "$BASHPID" ] && found+=" $p($(cat "/proc/$p/comm" 2>/dev/null || true) has $(find "/proc/$p/fd" -mindepth 1 -lname "$dir/*" -printf '%l ' 2>/dev/null || true)open)"
  done
  found+=$(bash "$SLURM_CLUSTER_SH" pids "$dir" | sed 's/^/ pid /' | tr '\n' ' ')
  [ -z "${found// /}" ] || slurm_fail "processes of the cluster in $dir remain:$found"
}
