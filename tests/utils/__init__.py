"""Helpers for tests that start real processes on 127.0.0.1 and always stop them."""
