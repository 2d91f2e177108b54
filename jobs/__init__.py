"""Durable background jobs for Django on PostgreSQL."""
