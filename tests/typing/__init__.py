"""Modules for the type checker only, never imported: see tests/unit/test_typing.py."""
