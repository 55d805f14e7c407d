"""CUDA behaviour on meta tensors: autocast's casting policy, fused kernels' memory, no syncs.

Meta tensors carry no autocast dispatch key, and some kernels choose their path by device, so
a step traced on the meta device differs from the same step on a GPU. This torch-function mode
(it sees calls above autograd, where autocast acts) makes the trace allocate what CUDA would:

- **autocast** (``aten/src/ATen/autocast_mode.cpp``, CUDA lists): matrix products and
  convolutions run in the low precision; the fp32 list (layer_norm, pow, exp, losses, ...)
  runs in fp32; softmax/log_softmax/sum/cumsum/prod get ``dtype=float32``; casts are not
  cached (tightfit's autocast runs with ``cache_enabled=False``: :func:`tightfit.levers.precision.autocast`).
- **dropout**: CUDA runs ``native_dropout`` (output + a 1-byte mask); the generic path would
  keep a mask in the input's dtype.
- **scaled_dot_product_attention**: the flash kernel (fp16/bf16, no mask) or the
  memory-efficient kernel (fp32 or a mask) as on sm80+: the output, a fp32 log-sum-exp and, in
  backward, the gradients plus a fp32 accumulator (FlashAttention-2's ``dq_accum``, sizes
  rounded as there: 128 rows, head dim to 32/64); no ``T x T`` matrix.
- ``Tensor.__bool__``/``item`` on meta tensors (data-dependent checks such as "is the
  attention mask all ones") answer True/1: the estimate assumes unpadded batches.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

LOW = frozenset("""linear matmul __matmul__ __rmatmul__ mm bmm baddbmm addmm addbmm addmv addr mv einsum
conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d conv_tbc prelu chain_matmul
multi_dot scaled_dot_product_attention""".split())
FP32 = frozenset("""acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow __pow__
__rpow__ softplus layer_norm group_norm frobenius_norm nuclear_norm cosine_similarity poisson_nll_loss
cosine_embedding_loss nll_loss hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss mse_loss
margin_ranking_loss multilabel_margin_loss soft_margin_loss triplet_margin_loss multi_margin_loss
binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp""".split())
FP32_OPT_DTYPE = frozenset("softmax log_softmax cumsum cumprod prod sum".split())
_LOW_DTYPES = (torch.float16, torch.bfloat16)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


# Argument types that are pytree leaves for certain (anything else goes through torch's pytree):
# the exact types first (a set lookup), then their subclasses.
_LEAF_TYPES = frozenset((torch.Tensor, torch.nn.Parameter, int, float, bool, type(None)))
_LEAVES = (torch.Tensor, int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
           torch.memory_format)


def _map_args(fn, args, kwargs):
    """``tree_map(fn, (args, kwargs))``, without torch's pytree where every argument is a tensor
    or a scalar (most calls: the pytree walk costs more than the casts it finds)."""
    if not all(type(x) in _LEAF_TYPES or isinstance(x, _LEAVES) for x in (*args, *kwargs.values())):
        return tree_map(fn, (args, kwargs))
    return tuple(fn(x) for x in args), {k: fn(v) for k, v in kwargs.items()}


class _FusedAttention(torch.autograd.Function):
    """Memory of the flash / memory-efficient SDPA kernels: q, k, v ``[B, H, T, D]``.

    ``running`` is True while the forward allocates: selective checkpointing keeps the outputs
    of the real kernels, so its policy keeps these too (:func:`fused_attention_running`)."""

    running = False

    @staticmethod
    def forward(ctx, q, k, v, flash):
        B, H, T, D = q.shape
        _FusedAttention.running = True
        try:
            out = q.new_empty(B, T, H, v.shape[-1]).transpose(1, 2)
            lse = q.new_empty(B, H, T if flash else _round_up(T, 32), dtype=torch.float32)
        finally:
            _FusedAttention.running = False
        ctx.flash = flash
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        B, H, T, D = q.shape
        grads = [t.new_empty(t.shape[0], t.shape[2], t.shape[1], t.shape[3]).transpose(1, 2) for t in (q, k, v)]
        if ctx.flash:
            work = [q.new_empty(B, H, _round_up(T, 128), dtype=torch.float32),
                    q.new_empty(B, _round_up(T, 128), H, _round_up(D, 32 if D <= 128 else 64), dtype=torch.float32)]
        else:
            work = [q.new_empty(B, H, T, dtype=torch.float32)]
        del work
        return grads[0], grads[1], grads[2], None


def fused_attention_running() -> bool:
    """Whether the stand-in for a fused attention kernel is allocating its outputs now."""
    return _FusedAttention.running


class CudaOnMeta(TorchFunctionMode):
    """Torch-function mode that makes meta-device tracing allocate as CUDA would (module doc).

    Args:
        precision: ``"fp32"``, ``"fp16"`` or ``"bf16"`` (the autocast dtype).
    """

    fused_dropout = True  # CUDA's native_dropout: a 1-byte mask

    def __init__(self, precision: str):
        super().__init__()
        self.dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)

    @contextlib.contextmanager
    def forward_region(self):
        """The autocast region of the forward (casts are not cached: nothing outlives it)."""
        yield

    def _cast(self, x, dtype, only_from=None):
        if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype
                and x.dtype != torch.float64 and (only_from is None or x.dtype in only_from)):
            return x
        return x.to(dtype)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ("__bool__", "item") and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            return True if name == "__bool__" else 1
        if self.dtype is not None:
            if name in LOW:
                args, kwargs = _map_args(lambda x: self._cast(x, self.dtype), args, kwargs)
            elif name in FP32:
                args, kwargs = _map_args(lambda x: self._cast(x, torch.float32, _LOW_DTYPES), args, kwargs)
            elif name in FP32_OPT_DTYPE and kwargs.get("dtype") is None and args \
                    and isinstance(args[0], torch.Tensor) and args[0].dtype in _LOW_DTYPES:
                kwargs = dict(kwargs, dtype=torch.float32)
        if name == "dropout" and self.fused_dropout and args and isinstance(args[0], torch.Tensor):
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            training = kwargs.get("training", args[2] if len(args) > 2 else True)
            if training and 0 < p < 1:
                return torch.native_dropout(args[0], p, True)[0]
        if name == "scaled_dot_product_attention":
            return self._sdpa(func, *args, **kwargs)
        return func(*args, **kwargs)

    def _sdpa(self, func, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        D = query.shape[-1]
        fused = query.dim() == 4 and key.shape[1] == query.shape[1] and D % 8 == 0 and D <= 256
        if not fused:
            return func(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)
        flash = attn_mask is None and query.dtype in _LOW_DTYPES
        if attn_mask is not None:
            torch.empty_like(attn_mask)  # the kernel's expanded/aligned copy of the mask, freed at once
        return _FusedAttention.apply(query, key, value, flash)


class CpuOnMeta(CudaOnMeta):
    """As :class:`CudaOnMeta`, for a step the CPU runs (``tightfit train`` on a CPU: the host's
    micro-batch, :func:`tightfit.planner.host.host_micro_batch`). Two kernels choose otherwise there:

    - **dropout** keeps its mask in the input's dtype (ATen's ``_dropout_impl``; the fused
      ``native_dropout`` with a 1-byte mask is for CUDA devices only, ``is_fused_kernel_acceptable``);
    - **scaled_dot_product_attention** runs the CPU flash kernel only without dropout
      (``sdp_utils_cpp.cpp``, ``check_for_dropout``); with dropout it takes the math path, which
      keeps the ``[B, H, T, T]`` softmax, the dropout mask and the dropped weights for the backward.
      BERT (2 layers, 2 heads, attention dropout 0.1) at T=256 and a batch of 1,024 took 5.0 GiB more
      host memory for its step, where the trace as on CUDA said 1.9 GiB in all.
    """

    fused_dropout = False

    def _sdpa(self, func, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        if dropout_p > 0:  # the math path, traced as it runs (matmul, softmax, dropout, matmul)
            return func(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)
        return super()._sdpa(func, query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                             is_causal=is_causal, **kw)
