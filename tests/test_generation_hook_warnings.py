"""transformers' own warnings point at the user's line, not at peagle's generate() wrapper (generation/hook.py):
its decorators warn with `stacklevel=2`, which names whatever called them, and with peagle imported that is the
wrapper.  A call without a head is transformers' own call, warnings included."""

from __future__ import annotations

import functools
import inspect
import warnings

import pytest
import torch

from helpers import make_target
from peagle.generation.hook import _wrap_generate


def _warns_about_its_caller(func):
    """What transformers' `deprecate_kwarg` does: warn at the caller's line (`stacklevel=2`), then run `func`."""

    @functools.wraps(func)
    def wrapped(*args, **kwargs):
        if "old" in kwargs:
            warnings.warn("`old` is deprecated", FutureWarning, stacklevel=2)
        return func(*args, **kwargs)

    return wrapped


@_warns_about_its_caller
def _generate(self, inputs=None, assistant_model=None, **kwargs):
    warnings.warn("said where it is said", UserWarning, stacklevel=1)  # a warning with its own location
    return inputs


def _line() -> int:
    return inspect.currentframe().f_back.f_lineno


def test_a_warning_about_the_caller_names_the_callers_line():
    wrapper = _wrap_generate(_generate)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        here = _line() + 1
        assert wrapper(object(), 7, old=1) == 7
        there = _line() + 1
        wrapper(object(), 8, old=1)  # another line of the user's: warned there too
    future = [w for w in caught if w.category is FutureWarning]
    assert [(w.filename, w.lineno) for w in future] == [(__file__, here), (__file__, there)]
    own = [w for w in caught if w.category is UserWarning]
    assert own and all(w.filename == __file__ and w.lineno != here for w in own)  # left where it was said
    assert all("hook.py" not in w.filename for w in caught)


def test_the_users_filters_still_apply():
    wrapper = _wrap_generate(_generate)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("ignore")
        wrapper(object(), 7, old=1)
    assert caught == []
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(FutureWarning, match="`old` is deprecated"):
            wrapper(object(), 7, old=1)


def test_transformers_past_key_values_warning_names_the_users_line():
    """The issue's case: `past_key_values=` on a call without a head (transformers 5.25 deprecates the name)."""
    from transformers import DynamicCache
    from transformers.generation.utils import GenerationMixin

    target = make_target()
    ids = torch.tensor([[5, 6, 7]])
    kw = dict(max_new_tokens=2, do_sample=False)
    with warnings.catch_warnings(record=True) as plain:
        warnings.simplefilter("always")
        GenerationMixin.generate.__wrapped__(
            target, ids, past_key_values=DynamicCache(config=target.config), **kw
        )
    if not any("past_key_values" in str(w.message) for w in plain):
        pytest.skip("this transformers does not deprecate generate(past_key_values=)")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        here = _line() + 1
        target.generate(ids, past_key_values=DynamicCache(config=target.config), **kw)
    named = [w for w in caught if "past_key_values" in str(w.message)]
    assert named and all((w.filename, w.lineno) == (__file__, here) for w in named)


def test_the_same_warning_names_the_users_line_on_a_call_with_a_head():
    from transformers import DynamicCache

    from helpers import make_head

    target = make_target()
    head = make_head(target)
    ids = torch.tensor([[5, 6, 7]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        here = _line() + 1
        target.generate(
            ids, past_key_values=DynamicCache(config=target.config), max_new_tokens=2, assistant_model=head
        )
    named = [w for w in caught if "past_key_values" in str(w.message)]
    if not named:
        pytest.skip("this transformers does not deprecate generate(past_key_values=)")
    assert all((w.filename, w.lineno) == (__file__, here) for w in named)
