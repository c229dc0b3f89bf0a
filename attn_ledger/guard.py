"""The one seam between attn-ledger and code a user named: wrap every call into it in :func:`user_call`.

A check calls the user's kernel, forward, backward or factory like this::

    from attn_ledger.guard import outcome, user_call

    try:
        with user_call("attention(q, k, v, is_causal=True)"):
            out = fn(q, k, v, is_causal=True)
    except Exception as exc:  # an ordinary raise, or a UserCodeError from the guard
        finding = f"attention(q, k, v, is_causal=True) {outcome(exc)}"

What :func:`user_call` does depends on the policy in force, and the check never needs to know:

* Everywhere: ``SystemExit`` and any other ``BaseException`` the user's code raises become a
  :class:`UserCodeError` (an ordinary ``Exception``), so ``sys.exit(0)`` in a kernel is a finding
  and never ends the tool. ``KeyboardInterrupt`` passes through in the tool's own process, where
  it is the person at the terminal.
* In the tool's own process (:func:`in_process`): an optional per-call time limit, enforced with
  ``SIGALRM`` (it interrupts Python code; a hang inside C code returns only when the C code
  does, which is why the CLI runs user code in a worker), and optionally everything the call
  writes to stdout, at the file-descriptor level, sent to stderr, so stdout carries one report.
* In a worker process (:mod:`attn_ledger.runner.worker`): the guard tells the parent "call starting:
  WHAT" and "call done" around the call. The parent owns the clock; if the worker hangs, exits
  or crashes, the parent knows which call was in flight and reports it.

Call sites decide what a :class:`UserCodeError` means for them; the convention is that it is an
L1 ``call`` finding of the case (or module) in which it happened, while an ordinary exception in
a probe stays that probe's finding.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

from attn_ledger.errors import InputError, first_line

__all__ = ["CallStopped", "UserCodeError", "current_call", "forwarded", "in_process", "unannounced", "outcome", "rebuilt_exception", "reporting_to", "user_call"]


class UserCodeError(Exception):
    """A call into user code ended in a way checks cannot read as a result.

    ``str(exc)`` is the whole outcome as a phrase that follows the call's description:
    ``raised SystemExit(0)``, ``timed out after 2 s``, ``returned list, expected a Tensor``.
    ``what`` names the call (as given to :func:`user_call`), when known; ``data`` holds the
    outcome as values (``{"exception": "SystemExit", "message": "0"}``, ``{"timeout_s": 2.0}``,
    ``{"exit_status": 0}``, ``{"signal": "SIGSEGV"}``, ``{"returned": "list"}``).
    """

    def __init__(self, text: str, what: str | None = None, /, **data: Any) -> None:
        super().__init__(text)
        self.what = what
        self.data: dict[str, Any] = data

    def facts(self) -> dict[str, Any]:
        """``data`` with the call it is about, for a check's ``data``."""
        return {"call": self.what, **self.data}


class CallStopped(BaseException):
    """A call into user code in a worker never came back: the worker died or ran past the time limit.

    Raised in the tool's own process by the worker's supervisor. A ``BaseException``, so that no
    check's ``except Exception`` reads it as the user's exception: it goes up to the unit's loop,
    which records the unit's L1 ``call`` finding. ``detail`` names the call in flight and the cause;
    ``data`` says the same as values: ``{"call": ..., "timeout_s": 2.0}``, ``{"call": ..., "exit_status": 0}``,
    ``{"call": ..., "signal": "SIGSEGV"}``.
    """

    def __init__(self, detail: str, data: dict[str, Any]) -> None:
        super().__init__(detail)
        self.detail, self.data = detail, data


class _Timeout(BaseException):
    """Raised by the in-process alarm; a BaseException so that the user's ``except Exception`` cannot swallow it."""


@dataclass(frozen=True)
class _Policy:
    timeout: float | None = None
    stdout_to_stderr: bool = False
    channel: Any = None  # the worker's link to its parent: .started(what), .done()


_policy = _Policy()
_depth = 0  # nested user_call blocks (a forward inside a guarded backward) count as one call
_what: str | None = None  # the call in flight (the outermost block's name)


def forwarded(obj: Any) -> bool:
    """Whether ``obj`` is a stand-in whose calls into user code go to a worker
    (:class:`attn_ledger.probes.module.driver.RemoteModule`): a check then asks it, not torch, to observe or copy."""
    return getattr(type(obj), "forwards_user_calls", False) is True


def current_call() -> str | None:
    """The name of the user call in flight, if any: a stand-in that forwards the call elsewhere (a worker)
    names it there as the check named it here."""
    return _what if _depth else None


_REBUILT: dict[tuple[str, str], type] = {}


def rebuilt_exception(error: dict[str, Any]) -> Exception:
    """An exception the user's code raised (in the driver), rebuilt from its facts: same type name and
    message, and a subclass of the builtin exception it derives from (a TypeError stays a TypeError)."""
    import builtins

    name = error["type"] if str(error.get("type", "")).isidentifier() else "Exception"
    base = next((getattr(builtins, b) for b in error.get("bases", ())
                 if isinstance(getattr(builtins, b, None), type) and issubclass(getattr(builtins, b), Exception)),
                Exception)
    cls = _REBUILT.get((name, base.__name__))
    if cls is None:
        cls = base if base.__name__ == name else type(name, (base,), {"__module__": "user_code"})
        _REBUILT[(name, base.__name__)] = cls
    try:
        exc = cls(error.get("message", ""))
    except Exception:  # a builtin that takes other arguments (UnicodeDecodeError)
        exc = type(name, (Exception,), {"__module__": "user_code"})(error.get("message", ""))
    exc.at_call = bool(error.get("at_call", False))  # raised by the call itself, not inside the user's code
    return exc


def outcome(exc: BaseException) -> str:
    """How a failed call ended, as a phrase: ``raised ValueError: bad shape``, ``raised SystemExit(0)``."""
    if isinstance(exc, UserCodeError):
        return str(exc)
    return f"raised {type(exc).__name__}: {first_line(exc)}"


def _base_exception(exc: BaseException, what: str) -> UserCodeError:
    text = repr(exc)
    return UserCodeError(f"raised {text if len(text) <= 200 else text[:197] + '...'}", what,
                         exception=type(exc).__name__, message=first_line(exc, ""))


@contextlib.contextmanager
def user_call(what: str) -> Iterator[None]:
    """Run the body as one call into user code, named ``what`` in any finding about it.

    Raises:
        UserCodeError: the body raised ``SystemExit`` or another ``BaseException`` (not
            ``KeyboardInterrupt`` in the tool's own process), or ran past the in-process time limit.
            Ordinary exceptions pass through unchanged.
    """
    global _depth, _what
    if _depth:
        yield
        return
    policy = _policy
    _depth, _what = _depth + 1, what
    if policy.channel is not None:
        policy.channel.started(what)
    try:
        with _alarm(policy.timeout), _stdout_to_stderr(policy.stdout_to_stderr):
            yield
    except _Timeout:
        raise UserCodeError(f"timed out after {policy.timeout:g} s", what, timeout_s=policy.timeout) from None
    except KeyboardInterrupt as exc:
        if policy.channel is None:
            raise
        raise _base_exception(exc, what) from None
    except (Exception, CallStopped):  # CallStopped: the worker's call never came back, for the unit's loop
        raise
    except BaseException as exc:  # SystemExit, GeneratorExit, a user-defined BaseException
        raise _base_exception(exc, what) from None
    finally:
        _depth -= 1
        if policy.channel is not None:
            policy.channel.done()


@contextlib.contextmanager
def _alarm(seconds: float | None) -> Iterator[None]:
    if seconds is None:
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise _Timeout()

    previous = signal.signal(signal.SIGALRM, expire)
    started = time.monotonic()
    outer, interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer > 0:  # someone else's alarm (pytest-timeout, for one) was running: give it back what is left
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - started), 1e-3), interval)


@contextlib.contextmanager
def _stdout_to_stderr(active: bool) -> Iterator[None]:
    if not active:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 1)
        os.close(saved)


@contextlib.contextmanager
def _installed(policy: _Policy) -> Iterator[None]:
    global _policy
    saved, _policy = _policy, policy
    try:
        yield
    finally:
        _policy = saved


def in_process(timeout: float | None = None, stdout_to_stderr: bool = False) -> contextlib.AbstractContextManager[None]:
    """Run user calls in this process: at most ``timeout`` seconds each (None: no limit), output optionally moved off stdout.

    Raises:
        InputError: a timeout is asked for off the main thread or where there is no ``SIGALRM``.
    """
    if timeout is not None and (threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer")):
        raise InputError(f"timeout: got {timeout!r}, but a time limit on in-process calls needs SIGALRM and the main thread")
    return _installed(_Policy(timeout=timeout, stdout_to_stderr=stdout_to_stderr))


def unannounced() -> contextlib.AbstractContextManager[None]:
    """Inside a worker: user calls the parent already knows of (it named the call when it asked for it) go
    unannounced, so that a call costs one message back; an exit is still a :class:`UserCodeError`."""
    return _installed(_Policy())


def reporting_to(channel: Any) -> contextlib.AbstractContextManager[None]:
    """Inside a worker: announce each user call to the parent through ``channel.started(what)`` / ``channel.done()``."""
    return _installed(_Policy(channel=channel))

