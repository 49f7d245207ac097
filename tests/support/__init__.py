"""Helpers shared by test suites (importable because pytest puts tests/ on sys.path)."""
