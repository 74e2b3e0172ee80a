"""Errors torsh-tune raises for user mistakes and failed runs.

Every user-facing message has the form "<what> must be <rule>, but got <value>" so the
CLI can print it as one line and exit with status 2.
"""

from __future__ import annotations

__all__ = [
    "BenchError",
    "ConfigError",
    "EmulationError",
    "LaunchError",
    "TorshTuneError",
    "TrialError",
    "int_at_least",
    "invalid",
]


class TorshTuneError(Exception):
    """Base class of every error torsh-tune raises on purpose."""


class ConfigError(TorshTuneError, ValueError):
    """A configuration value, flag or file is invalid (exit status 2)."""


class LaunchError(TorshTuneError):
    """The run could not be started or supervised (missing torchrun, bad launcher template)."""


class EmulationError(LaunchError):
    """The emulated cluster cannot be set up here (not root, no iproute2, a failing `ip`/`tc`)."""


class TrialError(TorshTuneError):
    """An autotuner trial failed in a way that is recorded rather than raised to the user."""


class BenchError(TorshTuneError):
    """The bench run did not produce results."""


def invalid(what: str, rule: str, value: object) -> ConfigError:
    """Build the canonical one-line ConfigError: `<what> must be <rule>, but got <value>`."""
    return ConfigError(f"{what} must be {rule}, but got {value!r}")


def int_at_least(what: str, raw: str, low: int) -> int:
    """`raw` (text from a flag, spec or environment variable) as an integer >= `low`.

    Raises:
        ConfigError: `<what> must be an integer >= low, but got raw` otherwise.
    """
    try:
        value = int(raw)
    except ValueError:
        raise invalid(what, f"an integer >= {low}", raw) from None
    if value < low:
        raise invalid(what, f"an integer >= {low}", value)
    return value
