"""asyncrl's own errors: a failed call on a worker, a run that diverged. Configuration errors are
`transport.checks.ConfigError` (every layer raises them); the daemons' are in `daemons.errors`."""

from __future__ import annotations


class AsyncRLError(Exception):
    """Base class of the errors the programming model and the trainer raise; the launcher prints
    their message as one paragraph."""


class TrainingError(AsyncRLError):
    """A run cannot go on as configured (NaN loss or reward, …); the message says what to change."""
