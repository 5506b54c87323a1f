"""Alembic migrations: ``alembic upgrade head`` (or ``server.migrate.upgrade``) creates a
database; ``diloco serve`` applies them at start."""
