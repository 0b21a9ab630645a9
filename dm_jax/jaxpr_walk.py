"""Walking a jaxpr with the jaxprs nested in it (custom_vjp bodies, scans, conds, pjit).

Tests and `dm_jax.nn.fp8.fp8_dot_count` read traced programs this way: which dots run in
FP8, which kernels a call launches and with what grid, which reductions are over constants.
"""

from __future__ import annotations

from collections.abc import Iterator


def sub_jaxprs(eqn) -> Iterator:
    """The Jaxprs an equation holds in its parameters (a ClosedJaxpr's Jaxpr, one class in
    jax 0.11), in parameter order."""
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            inner = getattr(item, "jaxpr", item)
            if hasattr(inner, "eqns") and hasattr(inner, "invars"):
                yield inner


def equations(jaxpr) -> Iterator:
    """Every equation of `jaxpr` (a Jaxpr or ClosedJaxpr) and of the jaxprs nested in it,
    depth first, an equation before its sub-jaxprs' ones."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in sub_jaxprs(eqn):
            yield from equations(sub)
