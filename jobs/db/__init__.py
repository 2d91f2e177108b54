"""Database plumbing below the models: the database's clock, bounds on every call of the
long-running processes' own connections, and what a SQLSTATE means.
"""
