"""What a fuzz case is: a call with its arguments, and what must come of it.

A valid call must return a result its judge accepts (:class:`Agrees`); a bad call
must raise ValueError, TypeError or IndexError with a message naming the bad
argument (:class:`Raises`). Anything else - another exception type, a message that
names nothing, a silent return - fails the case with a one-line reason.
"""

from __future__ import annotations

import contextlib
import os
import re
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

# What bad input may raise: everything else (RuntimeError from a kernel's TORCH_CHECK,
# AttributeError from touching None, a reshape error) is a failure of validation.
BAD_INPUT_ERRORS = (ValueError, TypeError, IndexError)


@dataclass(frozen=True)
class Agrees:
    """The call returns, and ``judge(result)`` raises AssertionError if the result is wrong."""

    judge: Callable[[Any], None]


@dataclass(frozen=True)
class Raises:
    """The call raises one of BAD_INPUT_ERRORS whose message names one of ``names`` (the
    argument as the function or op schema names it, or what it must agree with) as a
    whole word: "x" must stand alone, not hide inside "exceed".

    binding: the value is one torch's dispatcher refuses before a raw op's code runs (a
    list for a Tensor, a str or an int beyond int64 for an int, ...): the op cannot raise
    its own error there, so torch's schema-mismatch error naming the argument is accepted.
    """

    names: tuple[str, ...]
    binding: bool = False


@dataclass
class Call:
    """``fn`` called with ``args`` in order; names in ``keywords`` are passed by keyword."""

    fn: Callable
    args: dict[str, Any]
    keywords: tuple[str, ...] = ()

    def __call__(self):
        positional = [value for name, value in self.args.items() if name not in self.keywords]
        named = {name: self.args[name] for name in self.keywords}
        return self.fn(*positional, **named)

    def replaced(self, name: str, value) -> "Call":
        assert name in self.args, f"{getattr(self.fn, '__name__', self.fn)} has no argument {name!r}"
        return Call(self.fn, {**self.args, name: value}, self.keywords)


@dataclass
class Case:
    """One reproducible case: ``kind`` says what was drawn ("valid ..." or "bad ...")."""

    kind: str
    run: Callable[[], Any]
    expect: Agrees | Raises
    arguments: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        shown = ", ".join(f"{name}={describe(value)}" for name, value in self.arguments.items())
        return f"{self.kind} | {shown}"


def describe(value) -> str:
    """A short, exact-enough picture of an argument: dtype, shape, strides, device."""
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        text = f"{dtype}{list(value.shape)}"
        if not value.is_contiguous():
            text += f"@strides{list(value.stride())}"
        if value.device.type != "cpu":
            text += f"@{value.device}"
        if value.requires_grad:
            text += "+grad"
        return text
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        if len(value) > 4:  # a tensor passed as a nested list: its length says enough
            return f"{type(value).__name__} of {len(value)}"
        inner = ", ".join(describe(v) for v in value)
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    if isinstance(value, torch.nn.Module):
        return value.__class__.__name__
    if isinstance(value, torch.Generator):
        return f"Generator({value.device})"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def judge_outcome(case: Case, *, show_traceback: bool = False) -> str | None:
    """Run the case; None if it behaved as expected, else why not (one line).

    show_traceback: print the traceback of any exception to stderr (replaying one case).
    """
    try:
        result = case.run()
    except Exception as error:  # noqa: BLE001 - every escape is a verdict here
        if show_traceback:
            traceback.print_exc()
        return _judge_exception(case, error)
    if isinstance(case.expect, Raises):
        return f"no error: returned {describe(result)} (expected an error naming {' or '.join(case.expect.names)})"
    try:
        with threads(1):
            case.expect.judge(result)
    except AssertionError as error:
        if show_traceback:
            traceback.print_exc()
        return f"wrong result: {error}"
    except Exception as error:  # noqa: BLE001 - the reference itself failed on valid input
        if show_traceback:
            traceback.print_exc()
        return f"the reference or judge raised {type(error).__name__}: {_first_line(error)}"
    return None


@contextlib.contextmanager
def threads(count: int):
    """torch's intra-op threads set to ``count`` inside. Judges run with one: torch's
    parallel CPU reductions (index_put_ with accumulate, the gradient of a gather) add in
    a varying order, and a verdict near the bar must not flip from run to run. The
    kernels under test keep every thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _judge_exception(case: Case, error: BaseException) -> str | None:
    kind = type(error).__name__
    if isinstance(case.expect, Agrees):
        return f"valid input raised {kind}: {_first_line(error)} [at {_innermost_frame(error)}]"
    if case.expect.binding and _dispatcher_refused(error, case.expect.names):
        return None
    if not isinstance(error, BAD_INPUT_ERRORS):
        return f"raised {kind} (not ValueError/TypeError/IndexError): {_first_line(error)}"
    message = str(error)
    if not any(names_word(message, name) for name in case.expect.names):
        return f"{kind} message does not name {' or '.join(case.expect.names)}: {_first_line(error)}"
    return None


def _dispatcher_refused(error: Exception, names) -> bool:
    """torch's own refusal of an argument's type at a raw op's boundary."""
    message = str(error)
    return (any(f"for argument '{name}'" in message for name in names)
            or "There were no tensor arguments to this function" in message)


def names_word(message: str, name: str) -> bool:
    """Whether ``name`` occurs in ``message`` delimited by non-identifier characters."""
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", message) is not None


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else "(no message)"
    return text if len(text) <= 300 else text[:297] + "..."


def _innermost_frame(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "?"
    frame = frames[-1]
    return f"{os.path.basename(frame.filename)}:{frame.lineno}"
