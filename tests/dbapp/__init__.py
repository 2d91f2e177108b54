"""Job types that live in the ``other`` database, for the several-databases tests.

Installed only in the processes those tests start (``--settings tests.dbapp.settings``): in
the test session itself a type bound to ``other`` would make every scheduler of every test
visit a database that only the several-databases tests create.
"""
