"""The table of programs the differential suite runs through every entry point.

A program is a name and a ``make()`` that returns fresh ``(fn_or_module, args, kwargs)``;
the suite seeds the global RNG before every ``make()`` so two calls build identical
copies (one for eager, one compiled). A ``make`` that takes ``n`` can be rebuilt at
another size (``jit`` calls it with ``n + 2`` to test a size change).

Options: ``tags`` (the class of behaviour it stands for), ``must_match`` (plain supported
behaviour: a typed refusal counts as a failure, except by an entry in ``may_refuse``), ``calls`` (calls per comparison, for
state carried between calls), ``backward`` (whether to run a backward), ``outer`` (a
context the entry point calls the program under: ``no_grad``, an outer autocast),
``eager_raises`` (eager raises: the compiled program must raise too), ``double_backward``
(the backward adds the squared input gradients taken with ``create_graph=True``: a gradient
penalty through the compiled program), ``tol`` (rtol, atol).

The programs live in the ``p_*`` modules by class; this module collects them.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from aotgrad.ir.records import reach

PROGRAMS: dict[str, "Program"] = {}


@dataclass(frozen=True)
class Program:
    name: str
    make: Callable
    tags: frozenset = field(default_factory=frozenset)
    must_match: bool = False
    may_refuse: tuple = ()      # entries whose typed refusal of a must_match program is their documented limit
    calls: int = 1
    backward: bool = True
    outer: Callable = contextlib.nullcontext
    eager_raises: bool = False
    double_backward: bool = False
    tol: tuple = (1.3e-6, 1e-5)


def program(name, *tags, **options):
    """Register the decorated ``make`` as program ``name``."""
    def register(make):
        assert name not in PROGRAMS, f"duplicate program {name}"
        PROGRAMS[name] = Program(name, make, frozenset(tags), **options)
        return make
    return register


def fn(f, *args, **kwargs):
    """A program's ``(fn, args, kwargs)``."""
    return f, args, kwargs


def r(*shape, rg=False, dtype=torch.float32):
    """A fresh random leaf."""
    t = torch.randn(shape, dtype=dtype) if dtype.is_floating_point or dtype.is_complex else \
        torch.randint(-5, 5, shape, dtype=dtype)
    return t.requires_grad_(rg)


def leaf_with(t, stride, offset):
    """A leaf with ``t``'s values and requires_grad at the given strides and storage offset."""
    storage = torch.zeros(max(reach(t.shape, stride, offset), offset, 1), dtype=t.dtype).untyped_storage()
    out = torch.empty(0, dtype=t.dtype).set_(storage, offset, t.shape, stride)
    with torch.no_grad():
        out.copy_(t)
    return out.requires_grad_(t.requires_grad)


def transposed_leaf(*shape, rg=False, dtype=torch.float32):
    """A leaf whose last two dimensions are stored transposed."""
    t = r(*shape, dtype=dtype)
    stride = list(torch.empty(*shape[:-2], shape[-1], shape[-2]).stride())
    stride[-1], stride[-2] = stride[-2], stride[-1]
    return leaf_with(t, tuple(stride), 0).requires_grad_(rg)


def offset_leaf(*shape, offset=5, rg=False):
    """A contiguous leaf starting ``offset`` elements into its storage."""
    t = r(*shape)
    return leaf_with(t, torch.empty(shape).stride(), offset).requires_grad_(rg)


def views_of(base_shape, rg, *views):
    """Non-leaf views of one intermediate (``base.add(1)``): aliased inputs the way AOTAutograd's tests make them."""
    base = torch.randn(*base_shape, requires_grad=rg)
    x = base.add(1) if rg else base
    return [v(x) for v in views]


from . import p_alias, p_mutation, p_modes, p_functions, p_misc, p_aotdispatch, p_dtype_views, p_call_modes, p_blocks, p_input_writes, p_layouts, p_ops, p_meta_mutation, p_data_dependent, p_hook_state, p_storage, p_input_flags, p_backward_writes  # noqa: E402,F401  (fill PROGRAMS)
