"""The error a user sees for a bad checkpoint: it names the file and what is wrong."""


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, truncated or incompatible."""
