"""Fault cases: what a probe found going silently wrong, each pinned by a test."""
