"""Fault-injection suite: what a user sees when inputs or the environment are bad.

Each test injects one fault (a bad argument, a corrupt or foreign file, a full disk, a failing rank, ...)
and asserts the error a user reads and that nothing was silently damaged. Run it on its own with
`python -m pytest tests/faults`. Tests that need a small filesystem mount a tmpfs (root only) and skip,
with the reason, only where mounting is not permitted.
"""
