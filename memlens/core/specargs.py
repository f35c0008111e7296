"""Every verb's Python function takes a TrainingSpec, or the spec's fields as keyword arguments.

``memlens.estimate(model="gpt2", batch_size=8)`` is ``memlens.estimate(TrainingSpec(model="gpt2",
batch_size=8))``; with a spec too, the fields change it (``memlens.fit(spec, "16GiB", batch_size=4)``);
a dict is read as a spec (``from_dict``, as a YAML file is). A keyword that is neither the
function's own argument nor a spec field is refused as ``from_dict`` refuses it (SpecError: "unknown
spec field", with the closest name).

>>> from memlens.core.spec import TrainingSpec
>>> show = with_spec_fields(lambda spec, method="simulate": (spec.describe(), method))
>>> show(model="gpt2", batch_size=8)
('gpt2 b=8 fp32 adamw', 'simulate')
>>> show(TrainingSpec(model="gpt2"), method="formula", precision="bf16")
('gpt2 b=1 bf16 adamw', 'formula')
>>> show(model="gpt2", batchsize=8)
Traceback (most recent call last):
memlens.core.errors.SpecError: unknown spec field 'batchsize'
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from .errors import SpecError
from .spec import TrainingSpec


def with_spec_fields(fn: Callable, param: str = "spec") -> Callable:
    """``fn`` (whose argument ``param`` is a TrainingSpec) also taking the spec's fields as keywords."""
    sig = inspect.signature(fn)
    own = set(sig.parameters)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        fields = {k: kwargs.pop(k) for k in list(kwargs) if k not in own}
        try:
            bound = sig.bind_partial(*args, **kwargs)
        except TypeError as e:
            raise SpecError(f"{fn.__name__}: {e}", hint=f"call it as {fn.__name__}{sig}") from None
        spec = bound.arguments.get(param)
        if spec is None and not fields and sig.parameters[param].default is inspect.Parameter.empty:
            raise SpecError(f"{fn.__name__} needs a spec", hint=f"e.g. memlens.{fn.__name__}(model='gpt2', batch_size=8), "
                            "or a TrainingSpec")
        if fields or isinstance(spec, dict):
            if spec is not None and not isinstance(spec, (TrainingSpec, dict)):
                raise SpecError(f"{fn.__name__}: {param} must be a TrainingSpec or a dict of its fields, got "
                                f"{type(spec).__name__}", hint="e.g. memlens.estimate(model='gpt2', batch_size=8)")
            base = spec.to_dict() if isinstance(spec, TrainingSpec) else dict(spec or {})
            bound.arguments[param] = TrainingSpec.from_dict({**base, **fields})
        return fn(*bound.args, **bound.kwargs)

    return call
