"""The two kinds of failure the CLI reports, each with its exit code.

Every message is one line that names the bad value and ends with the fix.
"""


class ZplanError(Exception):
    exit_code = 1


class UsageError(ZplanError):
    """The user asked for something malformed: exit code 2."""

    exit_code = 2


class PlanError(ZplanError):
    """The input is well formed but no plan can work (e.g. nothing fits): exit code 1."""

    exit_code = 1
