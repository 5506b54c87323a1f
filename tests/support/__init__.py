"""Helpers for the tests that run real servers, databases and volunteer processes."""
