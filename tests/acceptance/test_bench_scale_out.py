"""``bench/scale_out.py --quick`` end to end: it drains, prints its tables and draws its PNG.

The script runs as its README says with DATABASE_URL unset: it starts a PostgreSQL of its own
(the embedded binaries, ``pg_stat_statements`` loaded), drains 2,000 no-op jobs with 1 and with
2 real worker processes, and stops the server again. Only that it runs is checked, not its
figures: a test run shares the machine with everything else.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# once: the same on every Django version, so scripts/test runs it in the first leg only.
pytestmark = [pytest.mark.acceptance, pytest.mark.slow, pytest.mark.once]

ROOT = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def table_rows(output: str, header: str) -> list[list[str]]:
    """The cells of the table whose header starts with ``header`` (after its rule)."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.strip():
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    return rows


def test_quick_run_drains_with_one_and_two_processes_and_draws_the_plot(tmp_path):
    plot = tmp_path / "scale-out.png"
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "scale_out.py"), "--quick", "--plot", str(plot)],
        cwd=ROOT,
        env={**env, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    rows = table_rows(done.stdout, "procs  conc  jobs/s")
    assert [(cells[0], cells[1]) for cells in rows] == [("1", "100"), ("2", "100")], done.stdout
    assert all(float(cells[2].replace(",", "")) > 0 for cells in rows), done.stdout
    bottlenecks = re.findall(r"^  ([12]) x 100: .+x of 1 process", done.stdout, re.M)
    assert bottlenecks == ["1", "2"], done.stdout
    assert "statements (pg_stat_statements" in done.stdout  # its own server loads it
    data = plot.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000, len(data)
