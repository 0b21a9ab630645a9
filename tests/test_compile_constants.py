"""No reduction over trace-time constants in a training step.

XLA constant-folds every operation whose operands are all constants, one element at a time
in its HLO evaluator: a reduction over a mask or a padded tensor built from static shapes
costs seconds of compilation per occurrence at training sizes ("Constant folding an
instruction is taking > 16s"). These tests walk the jaxpr of the attention VJP and of a
model's gradient, propagate constness from literals, iota and captured constants, and fail
on any reduction whose operand does not depend on the inputs.
"""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.extend import core as jcore

import dm_jax
from dm_jax.jaxpr_walk import equations, sub_jaxprs
from dm_jax.models import HybridLM, preset

_REDUCTIONS = {"reduce_max", "reduce_min", "reduce_sum", "reduce_prod", "argmax", "argmin"}
_LOOPS = {"scan", "while"}  # a loop carry is not constant even when its initial value is
_OPAQUE = {"pallas_call"}  # kernel bodies: XLA does not fold inside a custom call


def constant_reductions(jaxpr, const_in=None, where="") -> list[str]:
    """'primitive shape @ source' of every reduction whose operands are all constants."""
    const = dict(zip(jaxpr.invars, const_in or [False] * len(jaxpr.invars)))
    const.update({v: True for v in jaxpr.constvars})
    found = []
    for eqn in jaxpr.eqns:
        ins = [isinstance(a, jcore.Literal) or const.get(a, False) for a in eqn.invars]
        name = eqn.primitive.name
        if name in _REDUCTIONS and all(ins):
            src = jax._src.source_info_util.summarize(eqn.source_info)
            found.append(f"{name} {eqn.invars[0].aval.shape} @ {src} ({where})")
        if name not in _OPAQUE:
            for sub in sub_jaxprs(eqn):
                n = len(sub.invars)
                if name in _LOOPS:
                    sub_in = [False] * n
                elif n == len(ins):
                    sub_in = ins
                elif n == len(ins) - 1:  # cond branches: operands after the index
                    sub_in = ins[1:]
                else:
                    sub_in = [False] * n
                found += constant_reductions(sub, sub_in, f"{where}/{name}")
        out_const = all(ins) and name not in _OPAQUE and name not in _LOOPS
        for v in eqn.outvars:
            const[v] = out_const
    return found


def test_the_walk_finds_a_reduction_over_a_constant_mask():
    def masked_max(x):
        mask = jnp.arange(64)[:, None] >= jnp.arange(64)[None, :]  # static causal mask
        return x.max() + jnp.max(jnp.where(mask, 1.0, 0.0))

    found = constant_reductions(jax.make_jaxpr(masked_max)(jnp.ones(3)).jaxpr)
    assert len(found) == 1 and "reduce_max (64, 64)" in found[0]


@pytest.mark.parametrize("implementation", ["reference", "triton_interpret"])
@pytest.mark.parametrize("delta", ["matched", "stale"])
def test_attention_vjp_reduces_no_constant(implementation, delta):
    q = jax.ShapeDtypeStruct((2, 200, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 200, 2, 64), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((2, 200), jnp.int32)

    def fwd_bwd(q, k, v, do, seg):
        attend = lambda q, k, v: dm_jax.attention(
            q, k, v, causal=True, delta=delta, segment_ids=seg, implementation=implementation
        )
        out, vjp = jax.vjp(attend, q, k, v)
        return out, vjp(do)

    jaxpr = jax.make_jaxpr(fwd_bwd)(q, kv, kv, q, seg).jaxpr
    assert constant_reductions(jaxpr) == []


@pytest.mark.parametrize("scan_layers", [True, False])
def test_training_gradient_reduces_no_constant(scan_layers):
    cfg = preset("gdn_gqa", pattern=("gdn", "attn") * 2, scan_layers=scan_layers)
    model = nnx.eval_shape(lambda: HybridLM(cfg, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, tokens, segments):
        logits = nnx.merge(graphdef, params, rest)(tokens[:, :-1], segment_ids=segments)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    tokens = jax.ShapeDtypeStruct((2, 129), jnp.int32)
    segments = jax.ShapeDtypeStruct((2, 128), jnp.int32)
    jaxpr = jax.make_jaxpr(jax.grad(loss))(params, tokens, segments).jaxpr
    assert constant_reductions(jaxpr) == []


def test_the_equation_walk_enters_scans_and_custom_vjp_bodies():
    @jax.custom_vjp
    def double(x):
        return jnp.sin(x) * 2.0

    double.defvjp(lambda x: (double(x), x), lambda x, g: (g * 2.0 * jnp.cos(x),))

    def fn(x):
        return jax.lax.scan(lambda c, _: (double(c), None), x, None, length=3)[0]

    names = [eqn.primitive.name for eqn in equations(jax.make_jaxpr(fn)(jnp.ones(2)))]
    assert names.index("scan") < names.index("sin")  # the scan, then its body's custom_vjp
