"""Helpers the tests share: imported by test modules, never a test module themselves.

A test module never imports another (tests/unit/test_suite_imports.py checks it): what two
of them need lives here, and fixtures several modules use live in a conftest.

Waiting and threads: ``polling`` (the one ``wait_for``), ``concurrency`` (sessions on
threads of their own, lock waiters). Rows: ``factories`` (factory-boy, any state),
``noop_jobs``, ``keyed_rows``, ``history``, ``backlog``, ``process_rows``, ``rollup``,
``flow``. Statements: ``enqueue``, ``explain`` (auto_explain plans), ``functions`` (the
PL/pgSQL functions' texts), ``prepared``. The worker: ``worker`` (payloads,
handlers, registries, running workers), ``handler_pool``, ``tasks_backend``, ``loop_watch``.
Processes and networks: ``processes`` (``manage.py`` commands), ``schedulers``, ``netns``,
``tcp_proxy``, ``pgbouncer``, ``otherdb``. Pages: ``admin`` (operators and clients),
``browser`` (Chromium), ``dom``. Measuring: ``timing``. Workflows: ``workflows``.
"""
