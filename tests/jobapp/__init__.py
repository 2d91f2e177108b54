"""A tiny installed app whose ``jobs.py`` the registry discovers at start-up (tests only)."""
