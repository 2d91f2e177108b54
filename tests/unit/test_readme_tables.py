"""The README's reference tables match the code: settings, command options, metrics.

README.md documents every ``JOBS`` key with its default (jobs/core/conf.py), every ``runworker`` and
``runscheduler`` option with its default and environment variable (the commands' parsers), and
every Prometheus metric with its type and labels (jobs/worker/metrics.py and
jobs/scheduler/metrics.py). These tests parse the Markdown and compare, both ways, so a renamed
setting, a changed default or a new metric fails here instead of leaving the README wrong.
No database.
"""

from __future__ import annotations

import ast
import re
from datetime import timedelta
from pathlib import Path

import pytest
from django.core.management.base import BaseCommand
from prometheus_client import REGISTRY
from prometheus_client.metrics import MetricWrapperBase

from jobs.core.conf import DEFAULTS
from jobs.management.commands import runscheduler, runworker
from jobs.scheduler import metrics as scheduler_metrics
from jobs.worker import metrics as worker_metrics
from jobs.worker.config import DEFAULT_COMPONENT
from jobs.worker.metrics import TypeHistogram

README = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")

_DURATION = re.compile(r"(\d+(?:\.\d+)?) (s|min|h|days?)")
_UNITS = {"s": "seconds", "min": "minutes", "h": "hours", "day": "days", "days": "days"}
_CODE = re.compile(r"`([^`]+)`")
#: An option cell: `--name`, optionally followed by [`ENV_VAR`].
_OPTION = re.compile(r"`(--[\w-]+)`(?:\s+\[`(\w+)`\])?")
#: In the runscheduler paragraph: `--name` [`ENV_VAR`] (default).
_PROSE_OPTION = re.compile(_OPTION.pattern + r"\s+\(([^)]*)\)")
_ENV_NAME = re.compile(r"\b(?:WORKER|SCHEDULER)_[A-Z_]+\b")
#: Options whose parser default None stands for a default applied later (worker/config.py).
_EFFECTIVE_DEFAULT = {"--component": lambda value: value or DEFAULT_COMPONENT}


def section(text: str, heading: str) -> str:
    """The text of a ``## heading`` section, up to the next heading of that level."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"README has no '## {heading}' section"
    return match.group(1)


def table(text: str, first_header: str) -> list[list[str]]:
    """The body rows (cells stripped) of the Markdown table whose first header cell is given."""
    for block in re.findall(r"(?:^\|.*\n?)+", text, re.M):
        rows = [
            [c.strip() for c in line.strip().strip("|").split("|")]
            for line in block.split("\n")
            if line
        ]
        if rows[0][0] == first_header:
            return rows[2:]
    raise AssertionError(f"no table headed '{first_header}'")


def value(cell: str):
    """A documented default: — or off is None; `10 s` a timedelta; literals; else the text."""
    text = cell.strip().strip("`")
    if text in ("—", "off"):
        return None
    if duration := _DURATION.fullmatch(text):
        return timedelta(**{_UNITS[duration.group(2)]: float(duration.group(1))})
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def names(cell: str) -> list[str]:
    """The backticked names of a cell (— means none)."""
    return _CODE.findall(cell)


def same(documented, actual) -> bool:
    """Equal and of the same type (so `"5"`, `True` and `1` are not `5`)."""
    return type(documented) is type(actual) and documented == actual


def test_parsers_on_a_literal_table():
    text = "## A\n\n| key | default | x |\n| --- | --- | --- |\n| `K` | `14 days` | y |\n\n## B\n"
    assert table(section(text, "A"), "key") == [["`K`", "`14 days`", "y"]]
    assert value("`1 min`") == timedelta(minutes=1) and value("1 s") == timedelta(seconds=1)
    assert [value(c) for c in ('`"default"`', "`True`", "`{}`", "—", "off", "`127.0.0.1`")] == [
        "default",
        True,
        {},
        None,
        None,
        "127.0.0.1",
    ]
    assert names("`job_type`, `outcome`") == ["job_type", "outcome"] and names("—") == []
    assert not same(value("`5`"), True) and not same(value('`"5"`'), 5)
    prose = "`--once` (one pass), `--http-port`\n[`SCHEDULER_HTTP_PORT`] (off)"
    assert _PROSE_OPTION.findall(prose) == [
        ("--once", "", "one pass"),
        ("--http-port", "SCHEDULER_HTTP_PORT", "off"),
    ]
    with pytest.raises(AssertionError):
        table(text, "metric")


# Configuration ------------------------------------------------------------------------------

CONFIG_ROWS = table(section(README, "Configuration"), "key")


def test_configuration_table_lists_every_setting_with_its_default():
    assert len(CONFIG_ROWS) >= 20
    documented = {names(key)[0]: default for key, default, _ in CONFIG_ROWS}
    assert set(documented) == set(DEFAULTS), (
        f"only in README: {sorted(set(documented) - set(DEFAULTS))}; "
        f"only in jobs.core.conf.DEFAULTS: {sorted(set(DEFAULTS) - set(documented))}"
    )
    wrong = [
        f"{key}: README says {cell}, jobs.core.conf.DEFAULTS has {DEFAULTS[key]!r}"
        for key, cell in documented.items()
        if not same(value(cell), DEFAULTS[key])
    ]
    assert not wrong, "\n".join(wrong)


# Command options ----------------------------------------------------------------------------

COMMON = {a.dest for a in BaseCommand().create_parser("manage.py", "x")._actions}


def options(command) -> dict[str, object]:
    """The command's own parser actions by option string (Django's common ones left out)."""
    parser = command.Command().create_parser("manage.py", command.__name__.rpartition(".")[2])
    return {a.option_strings[-1]: a for a in parser._actions if a.dest not in COMMON}


def check_options(command, documented: list[tuple[str, str, str]], monkeypatch) -> None:
    """documented: (option, env var or "", default cell). Compare both ways with the parser."""
    for _, env, _ in documented:
        if env:
            monkeypatch.delenv(env, raising=False)
    actions = options(command)
    name = command.__name__.rpartition(".")[2]
    listed = {option for option, _, _ in documented}
    assert listed == set(actions), (
        f"{name}: only in README: {sorted(listed - set(actions))}; "
        f"only in the parser: {sorted(set(actions) - listed)}"
    )
    wrong = []
    for option, env, cell in documented:
        action = actions[option]
        if action.const is True:  # store_true: the cell describes the default (False) in words
            actual, expected = action.default, False
        else:
            actual = _EFFECTIVE_DEFAULT.get(option, lambda v: v)(action.default)
            expected = value(cell)
            if isinstance(expected, timedelta) and actual is not None:
                expected = expected.total_seconds()
        if expected != actual or isinstance(actual, bool) != isinstance(expected, bool):
            wrong.append(f"{name} {option}: README says {cell}, the parser has {actual!r}")
        if env:
            probe = "4321" if action.type in (int, float) else "probe-value"
            monkeypatch.setenv(env, probe)
            got = options(command)[option].default
            monkeypatch.delenv(env)
            if got != (action.type or str)(probe):
                wrong.append(f"{name} {option}: setting {env}={probe} left the default {got!r}")
    source = Path(command.__file__).read_text(encoding="utf-8")
    envs = {env for _, env, _ in documented}
    wrong += [
        f"{name} reads {env}, the README does not list it"
        for env in sorted(set(_ENV_NAME.findall(source)) - envs)
    ]
    assert not wrong, "\n".join(wrong)


def test_runworker_table_lists_every_option_with_its_default_and_environment_variable(monkeypatch):
    rows = table(section(README, "Configuration"), "option")
    assert len(rows) >= 9
    cells = [(_OPTION.fullmatch(option), option, default) for option, default, _ in rows]
    assert all(match for match, _, _ in cells), [o for match, o, _ in cells if not match]
    documented = [(*match.groups(""), default) for match, _, default in cells]
    check_options(runworker, documented, monkeypatch)


def test_runscheduler_paragraph_lists_every_option_with_its_default(monkeypatch):
    paragraph = re.search(r"^`runscheduler` options:.*?(?=\n\n)", README, re.M | re.S)
    assert paragraph, "README has no '`runscheduler` options:' paragraph"
    documented = _PROSE_OPTION.findall(paragraph.group(0))
    assert len(documented) >= 7
    check_options(runscheduler, documented, monkeypatch)


# Metrics ------------------------------------------------------------------------------------


def exposed_name(metric: MetricWrapperBase | TypeHistogram) -> str:
    """The name a metric is scraped by: prometheus_client strips _total from counters.

    ``_name``, ``_type`` and ``_labelnames`` are prometheus_client's private attributes; its
    public collect() shows no label names for a metric without children yet. The worker's
    own histograms (TypeHistogram) say theirs in public attributes.
    """
    if isinstance(metric, TypeHistogram):
        return metric.name
    return metric._name + "_total" if metric._type == "counter" else metric._name


def kind_and_labels(metric: MetricWrapperBase | TypeHistogram) -> tuple[str, tuple[str, ...]]:
    if isinstance(metric, TypeHistogram):
        return metric.type, metric.labelnames
    return metric._type, tuple(metric._labelnames)


def test_metrics_table_lists_every_metric_with_its_type_and_labels():
    rows = table(section(README, "Metrics and logs"), "metric")
    documented = {name: row for row in rows for name in names(row[0])}
    assert len(documented) >= 20
    wrong = []
    for name, (cell, kind, labels, _) in documented.items():
        metric = REGISTRY._names_to_collectors.get(name)
        if metric is None or exposed_name(metric) != name:
            wrong.append(f"{cell}: no metric {name} in the Prometheus registry")
        elif kind_and_labels(metric) != (kind, tuple(names(labels))):
            wrong.append(f"{name}: README says {kind} {labels}, code has {kind_and_labels(metric)}")
    defined = [
        m
        for module in (worker_metrics, scheduler_metrics)
        for m in vars(module).values()
        if isinstance(m, MetricWrapperBase | TypeHistogram)
    ]
    wrong += [
        f"{exposed_name(m)} is not in the README's metrics table"
        for m in defined
        if exposed_name(m) not in documented
    ]
    assert len(defined) >= 20
    assert not wrong, "\n".join(wrong)
