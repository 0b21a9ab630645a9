"""FP8 register operands for wgmma: the regroup of P (and dS) and its token permutation.

An FP8 wgmma takes its A operand from registers in the 8-bit layout (``WGMMA_8BIT``: four
consecutive columns of an 8 x 16 tile per register), while the FP32 accumulator layout that
S, P and dS come in (``WGMMA``) holds two consecutive columns of an 8 x 8 tile per
register, and casting to e4m3 keeps that layout. jax has no relayout between the two, so
:func:`regroup_fp8` joins, per row half, the 2-element registers of the 8-column tiles 2g
and 2g+1 into one 4-element register: no shuffles, no shared memory. Read as
``WGMMA_8BIT`` the result holds, inside every block of 16 columns,

    new column 4t + 2h + e  <-  source column 8h + 2t + e       (t < 4, h < 2, e < 2)

a permutation of the contraction index. A dot does not care about the order of its
contraction index as long as both operands share it, so the other operand (V^T for
P @ V) is stored with its token axis permuted the same way by the quantize pre-pass
(:func:`permute_tokens`, one reshape + transpose). :func:`permute_columns` is the same
permutation in plain JAX, for the interpret twin, which cannot run raw Mosaic code.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

GROUP = 16  # columns per 8-bit register tile


def permute_columns(x, axis=-1):
    """Apply the regroup's permutation along ``axis`` (length a multiple of 16)."""
    axis = axis % x.ndim
    n = x.shape[axis]
    if n % GROUP:
        raise ValueError(f"permute_columns: axis length {n} is not a multiple of {GROUP}")
    shape = x.shape[:axis] + (n // GROUP, 2, 4, 2) + x.shape[axis + 1 :]
    y = x.reshape(shape)
    # source (h, t, e) -> new (t, h, e)
    y = jnp.swapaxes(y, axis + 1, axis + 2)
    return y.reshape(x.shape)


def permute_tokens(x_BHDT):
    """V^T (or any K-major operand) [B, H, D, T] with its token axis permuted to match
    :func:`regroup_fp8`'s column order (T a multiple of 16)."""
    return permute_columns(x_BHDT, axis=-1)


def operand_fn(interpret: bool):
    """The FP8 register operand of a kernel: the raw regroup on the GPU, its permutation in
    plain JAX for the interpret twin (which cannot run raw Mosaic code)."""
    return permute_columns if interpret else regroup_fp8


def regroup_fp8(x_fp8):
    """[rows, cols] e4m3 in the accumulator layout -> the same registers read as the
    8-bit wgmma operand layout (columns permuted as in the module docstring).

    Raw Mosaic GPU code (``plgpu.inline_mgpu``): runs on the GPU only.
    """
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jax.experimental.pallas import mosaic_gpu as plgpu

    shape, dtype = x_fp8.shape, x_fp8.dtype

    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA,),
        return_type=plgpu.ShapeDtypeStruct(shape, dtype, layout=plgpu.Layout.WGMMA_8BIT),
    )
    def regroup(_, x):
        source = x.registers  # [.., cols / 8, .., row half, ..]: 2 columns per register
        new_shape = fa.WGMMA_LAYOUT_8BIT.registers_shape(shape)
        assert source.shape[1] == 2 * new_shape[1], (source.shape, new_shape)
        new = np.empty(new_shape, dtype=object)
        for idx in np.ndindex(new_shape):
            low = source[(idx[0], 2 * idx[1]) + idx[2:]]
            high = source[(idx[0], 2 * idx[1] + 1) + idx[2:]]
            new[idx] = mgpu_utils.vector_concat([low, high])
        return fa.FragmentedArray(_registers=new, _layout=fa.WGMMA_LAYOUT_8BIT, _is_signed=None)

    return regroup(x_fp8)
