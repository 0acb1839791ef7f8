# shellcheck shell=bash
# Sourced by the other scripts. Finds a Python >= 3.12, makes .venv with it and installs the
# pinned requirements (again only when a requirements file changed). Exports TG_ROOT and TG_PY.
set -euo pipefail
TG_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export TG_ROOT
TG_VENV="${TG_VENV:-$TG_ROOT/.venv}"

tg_is_312() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }

tg_find_python() {
  local c
  if [ -n "${TURNGUARD_PYTHON:-}" ]; then
    tg_is_312 "$TURNGUARD_PYTHON" && { echo "$TURNGUARD_PYTHON"; return 0; }
    echo "TURNGUARD_PYTHON=$TURNGUARD_PYTHON is not a Python >= 3.12" >&2; return 1
  fi
  for c in python3.14 python3.13 python3.12 python3 python; do
    if command -v "$c" >/dev/null 2>&1 && tg_is_312 "$c"; then command -v "$c"; return 0; fi
  done
  # pyenv and uv keep interpreters off PATH: look in their folders, newest first.
  local roots=()
  command -v pyenv >/dev/null 2>&1 && roots+=("$(pyenv root)/versions")
  roots+=("${PYENV_ROOT:-$HOME/.pyenv}/versions" "$HOME/.local/share/uv/python" /usr/local/bin /usr/bin /opt/python)
  for c in $(for r in "${roots[@]}"; do ls -d "$r"/*/bin/python3 "$r"/python3.1[2-9] 2>/dev/null; done | sort -rV); do
    if tg_is_312 "$c"; then echo "$c"; return 0; fi
  done
  return 1
}

if [ ! -x "$TG_VENV/bin/python" ] || ! tg_is_312 "$TG_VENV/bin/python"; then
  if ! base_py=$(tg_find_python); then
    cat >&2 <<'MSG'
turnguard needs Python >= 3.12 and found none (looked on PATH, under pyenv and uv).
Install one, e.g. `pyenv install 3.12` or your system's python3.12 package,
or point TURNGUARD_PYTHON at an interpreter.
MSG
    exit 1
  fi
  echo "turnguard: creating $TG_VENV with $base_py ($("$base_py" --version 2>&1))" >&2
  rm -rf "$TG_VENV"
  "$base_py" -m venv "$TG_VENV"
fi
TG_PY="$TG_VENV/bin/python"
export TG_PY

tg_install() {  # tg_install REQUIREMENTS_FILE
  local req="$TG_ROOT/$1" stamp="$TG_VENV/.installed-$(basename "$1")"
  local want; want=$(cat "$TG_ROOT"/requirements*.txt | sha256sum | cut -c1-16)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "turnguard: installing $1 into $TG_VENV" >&2
    "$TG_PY" -m pip install --disable-pip-version-check -q -r "$req" >&2
    echo "$want" >"$stamp"
  fi
}
