"""scripts/lib.sh's ensure_venv as scripts/test calls it: a failed install fails the leg.

scripts/test runs ``(ensure_venv …) && echo VENV`` inside ``$(leg_venv …) || die``. In both
places bash ignores ``set -e`` for everything the subshell runs, so ensure_venv goes on after a
command that failed. These tests copy lib.sh into a scratch root (fake requirements and
pyproject, pip offline) and call it in that same shape.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

LEG = """
set -euo pipefail
source "$SCRATCH/scripts/lib.sh"
leg_venv() { (ensure_venv "$ROOT/requirements/ci.txt" "$VENV" 3.12 >&2) && echo "$VENV"; }
venv=$(leg_venv) || die "could not install the test set"
echo "installed: $venv"
"""


@pytest.fixture
def scratch(tmp_path):
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "lib.sh", tmp_path / "scripts" / "lib.sh")
    (tmp_path / "requirements").mkdir()
    # A pin pip cannot install (a wheel that is not there), and a project it cannot build.
    (tmp_path / "requirements" / "ci.txt").write_text(
        str(tmp_path / "missing" / "not_there-1.0-py3-none-any.whl") + "\n"
    )
    (tmp_path / "pyproject.toml").write_text("not toml [\n")
    return tmp_path


def run_leg(scratch: Path, venv: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {
        **os.environ,
        "SCRATCH": str(scratch),
        "VENV": str(venv),
        "PIP_NO_INDEX": "1",  # never the network
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        **env,
    }
    return subprocess.run(
        ["bash", "-c", LEG], env=environ, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_a_failed_install_fails_the_leg_and_is_not_stamped(scratch, tmp_path):
    venv = tmp_path / "venv"
    result = run_leg(scratch, venv, PYTHON=sys.executable)

    assert not list(venv.glob(".installed-*")), "the failed install was stamped"
    assert result.returncode != 0, result.stdout + result.stderr


@pytest.mark.slow
def test_a_python_that_does_not_run_leaves_the_existing_venv_alone(scratch, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (venv / "kept").write_text("")

    result = run_leg(scratch, venv, PYTHON=str(tmp_path / "no-such-python3"))

    assert result.returncode != 0
    assert "is not a working Python" in result.stderr
    assert (venv / "kept").exists(), "the venv was deleted"
