"""The one version-guarded hook that routes `generate(..., assistant_model=<PEagleDrafter>)` to peagle's loop.

transformers' official way to replace a decoding method is `generate(custom_generate=<callable>)`: generate()
prepares the generation config, the logits processors, the stopping criteria and the cache, then runs the
callable in place of its own loop.  `import peagle` wraps `GenerationMixin.generate` just enough to keep
`assistant_model=head` as the entry users know: a call with a P-EAGLE head becomes the same call with
`custom_generate=peagle_decoding` and the head passed to it; every other call reaches transformers untouched.
The loop itself ([`decoding.peagle_decoding`]) runs batch 1 and batch N alike.  Why version-guarded:
docs/DESIGN.md section 6.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import sys
import threading
import warnings
from collections.abc import Callable

import transformers
from transformers.generation.utils import GenerationMixin

from ..modeling_peagle import PEagleDrafter
from .checks import (
    SUPPORTED_TRANSFORMERS,
    _raise_if_incompatible,
    check_assistant,
    check_user_request,
)
from .decoding import peagle_decoding
from .settings import DraftingOptions, PEagleCall
from .stopping import stop_strings_as_criteria

PEAGLE_OPTIONS = tuple(f.name for f in dataclasses.fields(DraftingOptions))
"""`generate()` options peagle reads itself (transformers' own loop does not know them, [`DraftingOptions`]): the
tree budget, prompt lookup as a branch of the head's trees, the drafter's attention window and an observer of the
verified rounds."""


_relay = {"users": 0, "previous": None}
_relay_lock = threading.Lock()


def _show_at_callers_line(message, category, filename, lineno, file=None, line=None):
    """`warnings.showwarning` while a call passes through the wrapper: a warning transformers attributes to the
    wrapper (its decorators warn with `stacklevel=2`, one frame short of the user's) is issued again at the line
    that called `generate()`, under the user's filters; every other warning is shown as it came."""
    here = _wrap_generate.__code__.co_filename
    frame = sys._getframe(1) if filename == here else None
    while frame is not None and not (frame.f_code.co_name == "generate" and frame.f_code.co_filename == here):
        frame = frame.f_back
    if frame is None or frame.f_back is None:
        return _relay["previous"](message, category, filename, lineno, file, line)
    # the wrapper's own registry must not keep the next call (from another line) from warning
    globals().get("__warningregistry__", {}).pop((str(message), category, lineno), None)
    caller = frame.f_back
    registry = caller.f_globals.setdefault("__warningregistry__", {})
    name = caller.f_globals.get("__name__")
    where = caller.f_code.co_filename, caller.f_lineno
    warnings.warn_explicit(
        message, category, *where, module=name, registry=registry, module_globals=caller.f_globals
    )


@contextlib.contextmanager
def _warnings_at_callers_line():
    """[`_show_at_callers_line`] in place for the call: installed by the first of concurrent calls (any thread),
    removed by the last, so calls in several threads neither lose nor keep it."""
    with _relay_lock:
        if _relay["users"] == 0:
            _relay["previous"] = warnings.showwarning
            warnings.showwarning = _show_at_callers_line
        _relay["users"] += 1
    try:
        yield
    finally:
        with _relay_lock:
            _relay["users"] -= 1
            if _relay["users"] == 0 and warnings.showwarning is _show_at_callers_line:
                warnings.showwarning = _relay["previous"]


def _wrap_generate(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        head = kwargs.get("assistant_model")
        if head is None and args:
            head = signature.bind_partial(self, *args).arguments.get("assistant_model")
        check_assistant(head)
        if not isinstance(head, PEagleDrafter):  # transformers' own call; its warnings name the caller's line
            with _warnings_at_callers_line():
                return original(self, *args, **kwargs)
        _raise_if_incompatible()
        arguments = signature.bind_partial(self, *args, **kwargs).arguments
        arguments.pop("self")
        extra = arguments.pop("kwargs", {})
        config = arguments.get("generation_config") or getattr(self, "generation_config", None)
        given = check_user_request({**arguments, **extra})
        stop = extra.pop("stop_strings", None) or getattr(config, "stop_strings", None)
        if stop:  # generate() keeps the tokenizer from a custom_generate loop: build the criterion here
            criteria = arguments.get("stopping_criteria")
            arguments["stopping_criteria"] = stop_strings_as_criteria(stop, extra.get("tokenizer"), criteria)
            if getattr(config, "stop_strings", None):
                arguments["generation_config"] = config = copy.deepcopy(config)
                config.stop_strings = None
        arguments.pop("assistant_model")
        streamer = arguments.pop("streamer", None)
        # peagle's own options, read through both doors as transformers reads its own: a keyword, else the
        # generation config's attribute (a GenerationConfig passed whole, or the target's)
        options = {name: extra.pop(name, None) for name in PEAGLE_OPTIONS}
        for name, value in options.items():
            if value is None:
                options[name] = getattr(config, name, None)
        with _warnings_at_callers_line():
            return original(
                self,
                **arguments,
                **extra,
                custom_generate=peagle_decoding,
                peagle=PEagleCall(head, streamer, given, DraftingOptions(**options)),
            )

    return generate


def install_generate_hook() -> bool:
    """Route `generate(..., assistant_model=<PEagleDrafter>)` to peagle's decoding loop; idempotent.

    Wraps `GenerationMixin.generate`: a call with a P-EAGLE head runs with `custom_generate=peagle_decoding`;
    every other call passes through untouched.  Returns whether the hook is in place; on a transformers without
    `generate(custom_generate=...)` it warns and leaves transformers alone.
    """
    current = GenerationMixin.generate
    if getattr(current, "_peagle_hook", False):
        return True
    if "custom_generate" not in inspect.signature(current).parameters:
        warnings.warn(
            f"transformers {transformers.__version__} has no generate(custom_generate=...); peagle heads cannot "
            f"draft inside generate() (needs transformers{SUPPORTED_TRANSFORMERS}).",
            stacklevel=2,
        )
        return False
    wrapper = _wrap_generate(current)
    wrapper._peagle_hook = True
    GenerationMixin.generate = wrapper
    return True


def uninstall_generate_hook() -> None:
    """Restore transformers' own `generate`."""
    current = GenerationMixin.generate
    if getattr(current, "_peagle_hook", False):
        GenerationMixin.generate = current.__wrapped__


__all__ = ["install_generate_hook", "uninstall_generate_hook"]
