"""The one exception type kvtier raises for bad input (below every subpackage: kernels,
platforms, pools, adapters and the store tier all raise it).

It is a ValueError (Python's convention for a bad argument) and a RuntimeError (the
engines' own ops reject bad input with RuntimeError, TORCH_CHECK's type), so engine code
written ``except RuntimeError`` around an adapter call and code that catches ValueError
both keep working."""


class KvtierError(ValueError, RuntimeError):
    """Bad argument: the message names the argument and the bad value."""


def fail(arg: str, value, why: str) -> "KvtierError":
    """Build the error for argument `arg` holding `value`; callers `raise fail(...)`."""
    return KvtierError(f"{arg}={value!r}: {why}")


def as_arg(arg: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, a `KvtierError` it raises raised again naming ``arg`` first
    (the caller's name for what ``fn`` names by its own, such as ``layers[1]`` or ``t``)."""
    try:
        return fn(*args, **kwargs)
    except KvtierError as e:
        raise KvtierError(f"{arg}: {e}") from None
