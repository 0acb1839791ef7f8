# shellcheck shell=bash
# Sourced by the other scripts. Finds a Python >= 3.12, makes a virtual environment with it and
# installs the pinned requirements (again only when a requirements file changed).
#
#   tg_setup              .venv (or $TG_VENV) with $TURNGUARD_PYTHON, else the newest Python
#                         >= 3.12 found; exports TG_ROOT, TG_VENV and TG_PY
#   tg_install FILE       pip install -r FILE into it (skipped when nothing changed)
#                         (making or installing holds VENV.lock, flock, to the end of
#                         tg_install: scripts started at once on one clone make it once)
#   tg_other_pythons      one interpreter per other supported minor version found (scripts/test)
#
# Interpreters are looked for on PATH (python3.14 ... python3), then under pyenv's and uv's
# folders. A candidate counts only if it runs: a pyenv shim for a version that is not selected
# fails and is skipped.
set -euo pipefail
TG_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export TG_ROOT
TG_MIN_MINOR=12  # Python 3.12 is the oldest supported

# tg_version PY: prints "3.13.0" and succeeds if PY runs; fails (printing why) otherwise.
tg_version() {
  local out
  if ! out=$("$1" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>&1); then
    printf '%s' "does not run (${out%%$'\n'*})"
    return 1
  fi
  printf '%s' "$out"
}

tg_supported_version() {  # tg_supported_version 3.13.0
  local minor="${1#3.}"
  minor="${minor%%.*}"
  [[ "$1" == 3.* && "$minor" =~ ^[0-9]+$ && "$minor" -ge "$TG_MIN_MINOR" ]]
}

# tg_candidates: every interpreter worth trying, newest first within each source, one per line.
tg_candidates() {
  local c r roots=()
  for c in python3.14 python3.13 python3.12 python3 python; do
    command -v "$c" 2>/dev/null || true
  done
  command -v pyenv >/dev/null 2>&1 && roots+=("$(pyenv root 2>/dev/null)/versions")
  roots+=("${PYENV_ROOT:-$HOME/.pyenv}/versions" "$HOME/.local/share/uv/python" /opt/python)
  for r in "${roots[@]}"; do
    ls -d "$r"/*/bin/python3 2>/dev/null || true
  done | sort -rV
  ls -d /usr/local/bin/python3.1[2-9] /usr/bin/python3.1[2-9] 2>/dev/null | sort -rV || true
}

# tg_scan: sets TG_FOUND to "VERSION<TAB>PATH" lines, newest first, for each candidate that
# runs a supported Python, and TG_SKIPPED to why each other one was skipped (for messages).
TG_FOUND=""
TG_SKIPPED=""
tg_scan() {
  local c v seen=" "
  TG_FOUND=""
  TG_SKIPPED=""
  while IFS= read -r c; do
    [ -n "$c" ] || continue
    case "$seen" in *" $c "*) continue ;; esac
    seen+="$c "
    if v=$(tg_version "$c") && tg_supported_version "$v"; then
      TG_FOUND+="$v"$'\t'"$c"$'\n'
    else
      [[ "$v" == does* ]] || v="is Python $v"
      TG_SKIPPED+="  $c $v"$'\n'
    fi
  done < <(tg_candidates)
  TG_FOUND=$(printf '%s' "$TG_FOUND" | sort -t$'\t' -k1,1rV)
}

# tg_find_python: the interpreter to use, on stdout; a message saying what was looked at and
# what to do, on stderr, when there is none.
tg_find_python() {
  local v found
  if [ -n "${TURNGUARD_PYTHON:-}" ]; then
    if [ ! -e "$TURNGUARD_PYTHON" ] && ! command -v "$TURNGUARD_PYTHON" >/dev/null 2>&1; then
      echo "turnguard: TURNGUARD_PYTHON=$TURNGUARD_PYTHON: no such file or command" >&2
      return 1
    fi
    if ! v=$(tg_version "$TURNGUARD_PYTHON"); then
      echo "turnguard: TURNGUARD_PYTHON=$TURNGUARD_PYTHON $v" >&2
      return 1
    fi
    if ! tg_supported_version "$v"; then
      echo "turnguard: TURNGUARD_PYTHON=$TURNGUARD_PYTHON is Python $v; turnguard needs Python >= 3.$TG_MIN_MINOR" >&2
      return 1
    fi
    command -v "$TURNGUARD_PYTHON"
    return 0
  fi
  tg_scan
  found="${TG_FOUND%%$'\n'*}"
  if [ -n "$found" ]; then
    printf '%s\n' "${found#*$'\t'}"
    return 0
  fi
  {
    echo "turnguard needs Python >= 3.$TG_MIN_MINOR and found none. Looked at:"
    if [ -n "$TG_SKIPPED" ]; then
      printf '%s' "$TG_SKIPPED"
    else
      echo "  no python3 on PATH, under pyenv or under uv"
    fi
    echo "Install one (e.g. \`pyenv install 3.13\` or your system's python3.13 package), or set"
    echo "TURNGUARD_PYTHON=/path/to/python3.12-or-newer."
  } >&2
  return 1
}

# tg_other_pythons: one interpreter for each supported minor version other than TG_PY's.
tg_other_pythons() {
  local mine v c
  mine=$(tg_version "$TG_PY")
  mine="${mine%.*}"
  local minors=" $mine "
  tg_scan
  while IFS=$'\t' read -r v c; do
    [ -n "$c" ] || continue
    v="${v%.*}"
    case "$minors" in *" $v "*) continue ;; esac
    minors+="$v "
    printf '%s\n' "$c"
  done <<<"$TG_FOUND"
}

# tg_setup [VENV [PYTHON]]: make sure VENV exists with PYTHON (default: what tg_find_python
# says). An existing environment is kept unless TURNGUARD_PYTHON (or PYTHON) names another
# interpreter, or it no longer runs a supported Python.
tg_setup() {
  TG_VENV="${1:-${TG_VENV:-$TG_ROOT/.venv}}"
  local want="${2:-}" base_file
  base_file="$TG_VENV/.turnguard-python"
  if [ -z "$want" ] && [ -n "${TURNGUARD_PYTHON:-}" ]; then
    want=$(tg_find_python) || exit 1
  fi
  if ! tg_venv_kept "$want" "$base_file"; then
    tg_lock_venv
    if ! tg_venv_kept "$want" "$base_file"; then  # (or the script waited for made it)
      [ -n "$want" ] || want=$(tg_find_python) || exit 1
      echo "turnguard: creating $TG_VENV with $want (Python $(tg_version "$want"))" >&2
      rm -rf "$TG_VENV"
      "$want" -m venv "$TG_VENV"
      realpath "$want" >"$base_file"
    fi
  fi
  TG_PY="$TG_VENV/bin/python"
  export TG_VENV TG_PY
}

tg_venv_kept() {  # tg_venv_kept WANT BASE_FILE: TG_VENV runs a supported Python, WANT's if given
  local v
  [ -x "$TG_VENV/bin/python" ] && v=$(tg_version "$TG_VENV/bin/python") \
    && tg_supported_version "$v" \
    && { [ -z "$1" ] || [ "$(realpath "$1")" = "$(cat "$2" 2>/dev/null || true)" ]; }
}

# Making or installing into an environment holds TG_VENV.lock (flock) until tg_install ends:
# two scripts started at once on a fresh clone (or the suite's run beside a test that runs
# scripts/test itself) each saw no environment and made it, the second under the first, or
# installed into it twice at once. The second now waits, says so, and finds it made. An
# environment already made takes no lock. Without flock, or where the lock file cannot be
# made, nothing is waited for (as before).
tg_lock_venv() {
  [ -z "${TG_VENV_LOCK:-}" ] || return 0
  if command -v flock >/dev/null 2>&1 && { exec {TG_VENV_LOCK}>>"$TG_VENV.lock"; } 2>/dev/null
  then
    if ! flock -n "$TG_VENV_LOCK"; then
      echo "turnguard: waiting for another script's set-up of $TG_VENV to end" >&2
      flock "$TG_VENV_LOCK"
    fi
  else
    TG_VENV_LOCK=
  fi
}

tg_install() {  # tg_install REQUIREMENTS_FILE
  local req="$TG_ROOT/$1" stamp="$TG_VENV/.installed-$(basename "$1")"
  local want; want=$(cat "$TG_ROOT"/requirements*.txt | sha256sum | cut -c1-16)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    tg_lock_venv
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then  # (or the script waited for did)
      echo "turnguard: installing $1 into $TG_VENV" >&2
      "$TG_PY" -m pip install --disable-pip-version-check -q -r "$req" >&2
      echo "$want" >"$stamp"
    fi
  fi
  if [ -n "${TG_VENV_LOCK:-}" ]; then
    exec {TG_VENV_LOCK}>&-  # (the lock goes with it)
    TG_VENV_LOCK=
  fi
}
