# shellcheck shell=bash
# The stage framework of bench/device_check.sh and bench/multi_gpu_check.sh, sourced by both:
#
#   source "$(dirname "${BASH_SOURCE[0]}")/stages.sh"
#   stages_init "$OUT/summary.txt" device_check 9 "$OUT/bench.log" "### gpu_bench table"
#   environment_banner; ...                 # then the script's own environment lines
#   if wants build; then banner "build ..."; ...; record build ok "..."; fi
#   finish_stages build test sanitize bench # never returns
#
# Each stage is recorded once as ok or FAILED with a one-line detail; the summary file is rewritten
# after every record, so a run that is cut off still leaves one. The caller runs with
# `set -o pipefail` (run_logged's status comes through a pipe) and sets STAGES (the stages to run,
# separated by spaces) and KILL_AFTER (seconds between timeout(1)'s SIGTERM and its SIGKILL; empty:
# no SIGKILL).

# stages_init SUMMARY TITLE WIDTH [LOG MARKER]...
#   SUMMARY  the summary file; its first line is "==== TITLE summary (date) ===="
#   WIDTH    the width of the stage column
#   LOG MARKER  pairs: where LOG has a line starting with MARKER (plain text, no regex or /), the
#            summary ends with LOG from that line on (a benchmark's table)
stages_init() {
  SUMMARY=$1
  SUMMARY_TITLE=$2
  STAGE_WIDTH=$3
  shift 3
  SUMMARY_TABLES=("$@")
  declare -gA RESULT=() DETAIL=()
  ORDER=()
  FAILED=0
}

banner() { printf '\n==== %s ====\n' "$*"; }

# record STAGE ok|FAILED|skipped DETAIL
record() {
  [[ -v "RESULT[$1]" ]] || ORDER+=("$1")
  RESULT[$1]=$2
  DETAIL[$1]=$3
  [[ $2 == FAILED ]] && FAILED=1
  write_summary
}

write_summary() {
  {
    echo "==== $SUMMARY_TITLE summary ($(date -u +%Y-%m-%dT%H:%M:%SZ)) ===="
    printf "%-${STAGE_WIDTH}s %-8s %s\n" stage result detail
    local s i log marker
    for s in "${ORDER[@]}"; do
      printf "%-${STAGE_WIDTH}s %-8s %s\n" "$s" "${RESULT[$s]}" "${DETAIL[$s]}"
    done
    for ((i = 0; i + 1 < ${#SUMMARY_TABLES[@]}; i += 2)); do
      log=${SUMMARY_TABLES[i]}
      marker=${SUMMARY_TABLES[i + 1]}
      if [[ -f $log ]] && grep -q "^$marker" "$log"; then
        echo
        sed -n "/^$marker/,\$p" "$log"
      fi
    done
  } >"$SUMMARY"
}

wants() { [[ " $STAGES " == *" $1 "* ]]; }

# What timeout(1) exit statuses mean.
status_text() {
  case $1 in
    0) echo "ok" ;;
    124) echo "timed out" ;;
    137) echo "killed (timeout or out of memory)" ;;
    *) echo "exit status $1" ;;
  esac
}

# The "environment" banner and the commit being checked; the caller prints the rest.
environment_banner() {
  banner "environment"
  echo "repo: $(git rev-parse --short HEAD 2>/dev/null || echo '?')" \
    "($(git status --porcelain 2>/dev/null | wc -l) changed files)"
}

# run_logged [-a] LOG SECONDS COMMAND...: runs COMMAND under timeout(1), its output and errors to
# the terminal and to LOG (-a: appended); returns COMMAND's exit status (timeout(1)'s 124 or 137
# when it was stopped). Assignments before the call (VAR=value run_logged ...) reach COMMAND.
run_logged() {
  local tee_args=()
  if [[ $1 == -a ]]; then
    tee_args=(-a)
    shift
  fi
  local log=$1 seconds=$2
  shift 2
  timeout ${KILL_AFTER:+"--kill-after=$KILL_AFTER"} "$seconds" "$@" 2>&1 | tee "${tee_args[@]}" "$log"
}

# pytest_stage STAGE LOG SECONDS SKIPS COMMAND...: runs the pytest COMMAND with run_logged and
# records STAGE from its exit status and closing counts: ok when it exits 0 and something passed;
# with SKIPS=skips-fail only when nothing was skipped either (SKIPS=skips-ok lets tests skip).
pytest_stage() {
  local stage=$1 log=$2 seconds=$3 skips=$4
  shift 4
  local start=$SECONDS rc
  run_logged "$log" "$seconds" "$@"
  rc=$?
  local elapsed=$((SECONDS - start)) counts passed skipped
  counts=$(grep -E "[0-9]+ (passed|failed|skipped|error|errors)" "$log" | tail -n 1 \
             | grep -oE "[0-9]+ (passed|failed|skipped|xfailed|xpassed|errors?|deselected)" \
             | paste -sd, - | sed 's/,/, /g')
  passed=$(grep -oE "[0-9]+ passed" <<<"$counts" | grep -oE "[0-9]+" || echo 0)
  skipped=$(grep -oE "[0-9]+ skipped" <<<"$counts" | grep -oE "[0-9]+" || echo 0)
  local shortfall=""
  if [[ $skips == skips-ok ]]; then
    [[ ${passed:-0} -gt 0 ]] || shortfall="nothing passed: ${counts:-no counts} (${elapsed} s)"
  elif [[ ${passed:-0} -eq 0 || ${skipped:-0} -ne 0 ]]; then
    shortfall="not every test ran: ${counts:-no counts} (${elapsed} s; skip reasons in ${log##*/})"
  fi
  if [[ $rc -ne 0 ]]; then
    record "$stage" FAILED "$(status_text $rc): ${counts:-no counts} (${elapsed} s; -x stops at the first failure)"
  elif [[ -n $shortfall ]]; then
    record "$stage" FAILED "$shortfall"
  else
    record "$stage" ok "${counts:-no counts} (${elapsed} s)"
  fi
}

# finish_stages KNOWN...: records every stage of STAGES that is not among KNOWN as FAILED, prints
# the summary and exits, non-zero if any stage failed.
finish_stages() {
  local stage
  for stage in $STAGES; do
    [[ " $* " == *" $stage "* ]] || record "$stage" FAILED "unknown stage (choose from $*)"
  done
  write_summary
  echo
  cat "$SUMMARY"
  exit "$FAILED"
}
