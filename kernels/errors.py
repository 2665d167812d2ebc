"""The one exception type kvtier raises for bad input (a ValueError, so callers that
already catch ValueError keep working)."""


class KvtierError(ValueError):
    """Bad argument: the message names the argument and the bad value."""


def fail(arg: str, value, why: str) -> "KvtierError":
    """Build the error for argument `arg` holding `value`; callers `raise fail(...)`."""
    return KvtierError(f"{arg}={value!r}: {why}")
