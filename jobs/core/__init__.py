"""The vocabulary every other layer shares: settings, progress, the handler's context.

Nothing here touches the database or imports another part of the app but :mod:`jobs.errors`.
"""
