# Helpers sourced by scripts/test, scripts/demo and scripts/lock. Not meant to be run directly.
# shellcheck shell=bash

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MIN_PYTHON=3.12 # Django 6.0 needs it.
# sha256 of the files named as arguments (sha256sum is not on every system; Python is).
HASH_FILES='import hashlib, sys; print(hashlib.sha256(b"".join(open(f, "rb").read() for f in sys.argv[1:])).hexdigest())'

die() {
    printf 'error: %s\n' "$*" >&2
    exit 1
}

step() {
    printf '\n==> %s\n' "$*"
}

# python_ok CMD [VERSION]: CMD runs and is Python >= 3.12 (or exactly VERSION, e.g. 3.12).
# It is really run, because a pyenv shim exists on PATH even when it cannot start anything.
python_ok() {
    local want=${2:-}
    "$1" - "$MIN_PYTHON" "$want" >/dev/null 2>&1 <<'EOF'
import sys
minimum, exact = sys.argv[1], sys.argv[2]
have = sys.version_info[:2]
ok = have == tuple(map(int, exact.split("."))) if exact else have >= tuple(map(int, minimum.split(".")))
sys.exit(0 if ok else 1)
EOF
}

# same_python A B: both commands run the same Python build.
same_python() {
    local version='import sys; print(sys.version)'
    [[ $("$1" -c "$version" 2>/dev/null) == $("$2" -c "$version" 2>/dev/null) ]]
}

# find_python [VERSION]: print the path of a suitable interpreter or exit with advice.
# $PYTHON wins; then the usual names on PATH; then pyenv's and uv's installed versions.
# shellcheck disable=SC2120 # VERSION is optional; only scripts/lock passes it.
find_python() {
    local want=${1:-} candidate version pyenv
    if [[ -n ${PYTHON:-} ]]; then
        python_ok "$PYTHON" "$want" || die "PYTHON=$PYTHON is not a working Python ${want:-$MIN_PYTHON+}"
        echo "$PYTHON"
        return
    fi
    for candidate in python3.13 python3.12 python3 python; do
        if command -v "$candidate" >/dev/null && python_ok "$candidate" "$want"; then
            # The real binary, not a shim that may depend on the caller's environment.
            "$candidate" -c 'import sys; print(sys.executable)'
            return
        fi
    done
    # pyenv may have a suitable version that is not selected here (shims then refuse to run).
    pyenv=$(command -v pyenv || true)
    [[ -z $pyenv && -x ${PYENV_ROOT:-$HOME/.pyenv}/bin/pyenv ]] && pyenv=${PYENV_ROOT:-$HOME/.pyenv}/bin/pyenv
    if [[ -n $pyenv ]]; then
        # Plain CPython versions only (no virtualenvs, conda or pypy), newest first.
        for version in $("$pyenv" versions --bare 2>/dev/null | grep -E '^3\.[0-9]+(\.[0-9]+)?$' | sort -rV); do
            candidate=$(PYENV_VERSION=$version "$pyenv" which python 2>/dev/null) || continue
            if python_ok "$candidate" "$want"; then
                echo "$candidate"
                return
            fi
        done
    fi
    # uv-managed Pythons (`uv python install`) need not be on PATH.
    if command -v uv >/dev/null; then
        candidate=$(uv python find --no-project "${want:->=$MIN_PYTHON}" 2>/dev/null || true)
        if [[ -n $candidate ]] && python_ok "$candidate" "$want"; then
            echo "$candidate"
            return
        fi
    fi
    cat >&2 <<EOF
error: this project needs Python ${want:-$MIN_PYTHON or newer} and none was found
(tried \$PYTHON, python3.13, python3.12, python3, python, pyenv and uv).
Install one, for example:
    Debian 13 / Ubuntu 24.04+:  sudo apt-get install python3 python3-venv
    macOS (Homebrew):           brew install python@3.13
    pyenv:                      pyenv install 3.13
    uv:                         uv python install 3.13
or point at one you have:       PYTHON=/path/to/python3.13 $0
EOF
    exit 1
}

# ensure_venv REQUIREMENTS [VENV [VERSION]]: install these pins and this project (editable) into
# VENV (default .venv), then put it first on PATH. VERSION (e.g. 3.12) is the interpreter to
# prefer for a new VENV; any supported one is used where it is missing. Installs only when the
# inputs changed since the last install, so reruns are fast. Every step checks its own status:
# callers run this in $(...) or before ||, where set -e does not apply.
ensure_venv() {
    local requirements=$1 venv=${2:-$ROOT/.venv} prefer=${3:-} base stamp digest
    [[ -f $requirements ]] || die "no such requirements file: $requirements"
    # Start over if the venv is missing, too old, broken (its base interpreter was removed), or
    # made by another interpreter than the one $PYTHON asks for.
    if ! python_ok "$venv/bin/python" || { [[ -n ${PYTHON:-} ]] && ! same_python "$PYTHON" "$venv/bin/python"; }; then
        if [[ -n $prefer && -z ${PYTHON:-} ]]; then
            base=$( (find_python "$prefer") 2>/dev/null) || base=$(find_python) || exit 1
        else
            base=$(find_python) || exit 1 # find_python said why
        fi
        step "creating ${venv#"$ROOT"/} with $("$base" -V 2>&1) ($base)"
        rm -rf "$venv"
        "$base" -m venv "$venv" ||
            die "could not create $venv (Debian/Ubuntu: sudo apt-get install python3-venv)"
    fi
    # One stamp per requirements file, so switching between demo and test stays fast.
    stamp=$venv/.installed-$(basename "$requirements")
    digest=$("$venv/bin/python" -c "$HASH_FILES" "$ROOT"/requirements/*.txt "$ROOT/pyproject.toml") ||
        die "could not hash the requirements with $venv/bin/python"
    if [[ ! -f $stamp || $(cat "$stamp") != "$digest" ]]; then
        step "installing $requirements into ${venv#"$ROOT"/}"
        rm -f "$stamp"
        "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$requirements" ||
            die "could not install $requirements into $venv"
        "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -e "$ROOT" ||
            die "could not install this project into $venv"
        echo "$digest" >"$stamp"
    fi
    export VIRTUAL_ENV=$venv
    export PATH=$venv/bin:$PATH
}

# apt_install PACKAGE WHAT: install a Debian package some tests need, when this is root with
# apt-get (as on a fresh CI machine); where that cannot be done, those tests (WHAT) skip
# themselves and say why. The log goes to var/apt-PACKAGE.log.
apt_install() {
    local package=$1 what=$2 log=$ROOT/var/apt-$1.log
    if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
        echo "note: no $package and no root apt-get to install it: $what will be skipped" >&2
        return 0
    fi
    step "installing $package with apt-get, for $what (log: var/apt-$package.log)"
    mkdir -p "$ROOT/var"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$package"; } >"$log" 2>&1; then
        echo "warning: could not install $package (see $log): $what will be skipped" >&2
    fi
}

# ensure_chromium: the browser test (tests/acceptance/test_browser.py) drives Debian's Chromium.
ensure_chromium() {
    [[ -x ${CHROMIUM:-/usr/bin/chromium} ]] || apt_install chromium "the browser test"
}

# ensure_pgbouncer: the pooler tests (tests/integration/test_pgbouncer.py and the process tests)
# start Debian's PgBouncer in transaction mode in front of the test database.
ensure_pgbouncer() {
    command -v pgbouncer >/dev/null || [[ -x /usr/sbin/pgbouncer ]] ||
        apt_install pgbouncer "the pooler tests"
}

# ensure_iproute2: the many-hosts test (tests/acceptance/test_hosts.py) runs workers as hosts in
# network namespaces it makes with iproute2's ip, which a minimal Debian image lacks.
ensure_iproute2() {
    command -v ip >/dev/null || apt_install iproute2 "the many-hosts test"
}
