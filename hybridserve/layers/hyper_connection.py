"""Manifold-constrained hyper-connections (mHC): ``hc_mult`` residual streams mixed per block.

Every float32 rounding of the reference (transformers' ``DeepseekV4HyperConnection``) is kept, because
the bf16 path is checked bit for bit against it. Two consequences shape the code:

* ``torch.sigmoid`` on CPU rounds differently in its vectorised body and its scalar tail, so each
  sigmoid runs on a contiguous ``[T, hc]`` tensor exactly like the reference's (same split).
* The Sinkhorn loop (``sinkhorn_iters`` row/column normalisations) has no exact shortcut. Eagerly it
  is 3 in-place ATen ops per half-step. With :func:`set_compile` on, it runs with the ``pre``/``post``
  epilogues and the stream collapse as one ``torch.compile``d region whose sums are written as
  sequential adds: for ``hc_mult <= 4`` that is the order ATen sums in, so both paths agree bit for
  bit; for wider ``hc_mult`` they agree to float32 rounding.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.layers.norm import keep_fp32

log = logging.getLogger(__name__)

_TailOut = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
_compile_enabled = False
_warming = threading.local()  # ``on`` in the thread that compiles the tail before it is switched on
TAIL_GRAPHS = 64  # compiled mHC tails kept before dynamo runs the tail eagerly


def set_compile(enabled: bool) -> None:
    """Route the mHC Sinkhorn/collapse through ``torch.compile`` (off: eager, e.g. ``--enforce-eager``).

    Compilation is lazy (first forward after enabling), shared by all layers, uses one graph for every
    token count and is cached on disk by torch (``TORCHINDUCTOR_CACHE_DIR``). If compiling fails, a
    warning is logged and the eager path is used from then on.
    """
    global _compile_enabled
    _compile_enabled = enabled


def compile_enabled() -> bool:
    return _compile_enabled


def _param(*shape: int) -> nn.Parameter:
    return keep_fp32(nn.Parameter(torch.zeros(*shape, dtype=torch.float32), requires_grad=False))


def _constant(value: float, device: torch.device) -> torch.Tensor | float:
    """``value`` as a cached 0-dim float32 tensor in eager mode: adding it is the same float op as adding
    ``value``, minus the cost of wrapping a Python scalar into a tensor on every call (about half of a
    tiny op's time). Traced code gets the plain float (the graph holds it as a constant anyway)."""
    return value if torch.compiler.is_compiling() else _cached_constant(value, device)


@functools.cache
def _cached_constant(value: float, device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False):
        return torch.tensor(value, dtype=torch.float32, device=device)


def _rms_normed(flat: torch.Tensor, eps: torch.Tensor | float) -> torch.Tensor:
    """``unweighted_rms_norm`` of a float32 ``flat`` [T, N] with the same ops, minus no-op casts."""
    return flat * flat.square().mean(-1, keepdim=True).add_(eps).rsqrt_()


def _collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """``pre`` [T, hc] float32 weights -> weighted sum of the streams [T, D] in the streams' dtype."""
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def _sinkhorn_(comb: torch.Tensor, iters: int, eps: torch.Tensor | float) -> torch.Tensor:
    """Sinkhorn-Knopp in place on ``comb`` [T, hc, hc] (column pass first, as the reference)."""
    t, hc, _ = comb.shape
    col, row = comb.new_empty(t, 1, hc), comb.new_empty(t, hc, 1)
    comb.div_(torch.sum(comb, -2, keepdim=True, out=col).add_(eps))
    for _ in range(iters - 1):
        comb.div_(torch.sum(comb, -1, keepdim=True, out=row).add_(eps))
        comb.div_(torch.sum(comb, -2, keepdim=True, out=col).add_(eps))
    return comb


def mhc_tail_eager(
    pre: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, streams: torch.Tensor, iters: int, eps: float
) -> _TailOut:
    """From ``sigmoid(pre)``, ``sigmoid(post)`` [T, hc] and ``softmax(comb)`` [T, hc, hc] (all float32)
    to (post weights, doubly-stochastic comb, collapsed streams [T, D])."""
    e = _constant(eps, comb.device)
    return post + post, _sinkhorn_(comb + e, iters, e), _collapse(pre + e, streams)


def _sequential_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x.sum(dim, keepdim=True)`` added strictly left to right (ATen's order for up to 4 terms)."""
    parts = x.split(1, dim)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def mhc_tail_unrolled(
    pre: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, streams: torch.Tensor, iters: int, eps: float
) -> _TailOut:
    """:func:`mhc_tail_eager` as a pure, unrolled function of pointwise ops, for ``torch.compile``."""
    comb = comb + eps
    comb = comb / (_sequential_sum(comb, -2) + eps)
    for _ in range(iters - 1):
        comb = comb / (_sequential_sum(comb, -1) + eps)
        comb = comb / (_sequential_sum(comb, -2) + eps)
    collapsed = _sequential_sum((pre + eps).unsqueeze(-1) * streams, 1).squeeze(1).to(streams.dtype)
    return post * 2, comb, collapsed


@torch.compiler.nested_compile_region
def traced_tail(
    pre: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, streams: torch.Tensor, iters: int, eps: float
) -> _TailOut:
    """:func:`mhc_tail_eager`'s ops, out of place, as the tail a larger compiled graph traces. A nested
    compile region: dynamo traces its 2 x iters normalisations once per graph, not once per mHC site
    (every layer has two), and ``tracing`` inlines the copies back, so inductor sees the graph it saw
    before (the same kernels, the same bits). Out of place: a region over the in-place eager function
    itself gave the same bits but a slower warm warm-up of the bundled model (38.5 s against 31.8 s)."""
    comb = comb + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return post + post, comb, _collapse(pre + eps, streams)


def _sinkhorn_of_one(iters: int, eps: float) -> float:
    """Sinkhorn of a 1x1 mix equal to 1 by :func:`mhc_tail_eager`'s own float32 ops, as a number."""
    cpu = torch.device("cpu")  # explicit: models are built under a meta-device context
    e = torch.tensor(eps, dtype=torch.float32, device=cpu)
    return float(_sinkhorn_(torch.ones(1, 1, 1, device=cpu) + e, iters, e).item())


def one_stream_tail(
    pre: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, streams: torch.Tensor, value: float, eps: float
) -> _TailOut:
    """:func:`mhc_tail_eager` for ``hc_mult == 1`` in a traced graph, with the Sinkhorn result ``value``
    (``_sinkhorn_of_one``) in place of its 2 x iters dependent divisions: inductor inlines such a chain of
    one-element ops into an expression that doubles with every division (8 iterations compiled for
    minutes, the usual 20 never)."""
    return post + post, torch.full_like(comb, value), _collapse(pre + eps, streams)


@functools.cache
def _compiled_tail() -> Callable[..., _TailOut]:
    # One graph per model shape (hc_mult, hidden size, iterations): a process may load many models.
    return torch.compile(  # type: ignore[call-overload]  # torch's overloads lack recompile_limit
        mhc_tail_unrolled, fullgraph=True, dynamic=False, recompile_limit=TAIL_GRAPHS
    )


def _mark_tokens_dynamic(tensors: tuple[torch.Tensor, ...]) -> None:
    """One graph for every token count T, T=1 included (an unbacked size is never specialised)."""
    import torch._dynamo

    mark = getattr(torch._dynamo.decorators, "mark_unbacked", None)
    for t in tensors:
        if mark is not None:
            mark(t, 0)
        else:  # older torch: T=1 gets its own graph
            torch._dynamo.maybe_mark_dynamic(t, 0)


def mhc_tail(
    pre: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, streams: torch.Tensor, iters: int, eps: float
) -> _TailOut:
    """The compiled tail when enabled, else the eager one. Empty batches and ``hc_mult == 1`` stay eager
    (inductor's inliner blows up on the 1x1 chain, and there is nothing to mix). A tail traced into a
    larger compiled graph (a step graph fuses it there) is :func:`traced_tail`."""
    # is_compiling first: a traced graph then never reads (and guards on) the process-wide switch
    if torch.compiler.is_compiling() and comb.shape[-1] >= 2:
        return traced_tail(pre, post, comb, streams, iters, eps)
    eager = torch.compiler.is_compiling() or not (_compile_enabled or getattr(_warming, "on", False))
    if eager or streams.shape[0] == 0 or comb.shape[-1] < 2:
        return mhc_tail_eager(pre, post, comb, streams, iters, eps)
    _mark_tokens_dynamic((pre, post, comb, streams))
    try:
        return _compiled_tail()(pre, post, comb, streams, iters, eps)
    except Exception:  # a missing compiler, an unsupported torch: serve eagerly rather than fail
        log.warning("torch.compile of the mHC tail failed; using the eager path", exc_info=True)
        set_compile(False)
        return mhc_tail_eager(pre, post, comb, streams, iters, eps)


def warm_compiled_tail(modules: Iterable[nn.Module], device: torch.device, dtype: torch.dtype) -> bool:
    """Compile the mHC tail of a model (``modules``: its ``modules()``) now (one graph serves every token
    count), not in its first step, whether or not it is switched on yet (:func:`set_compile` after this
    lets other threads' steps take it only once it is compiled). -> whether there was one to compile."""
    hc = next((m for m in modules if isinstance(m, HyperConnection)), None)
    if hc is None or hc.hc < 2:
        return False
    _warming.on = True
    try:
        with torch.inference_mode():  # the real forward under the runner's mode: a step's strides, flags
            hc(torch.zeros(3, hc.hc, hc.fn.shape[1] // hc.hc, device=device, dtype=dtype))
    finally:
        _warming.on = False
    return True


class HyperConnection(nn.Module):
    """Computes collapse (pre), expand (post) and Sinkhorn-normalised mix (comb) weights."""

    def __init__(
        self, hc_mult: int, hidden_size: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float
    ) -> None:
        super().__init__()
        self.hc = hc_mult
        self.iters = sinkhorn_iters
        self.hc_eps = hc_eps
        self.norm_eps = norm_eps
        n = (2 + hc_mult) * hc_mult
        self.fn = _param(n, hc_mult * hidden_size)
        self.base = _param(n)
        self.scale = _param(3)
        self._scale_index: torch.Tensor | None = None
        # One stream: the softmax of its 1x1 mix is exactly 1, so Sinkhorn always gives this one number.
        self._one_stream_comb = _sinkhorn_of_one(sinkhorn_iters, hc_eps) if hc_mult == 1 else None

    def _expanded_scale(self) -> torch.Tensor:
        """``scale`` [3] repeated over the (pre, post, comb) columns of the projection -> [(2 + hc) * hc]."""
        if torch.compiler.is_compiling():  # a tensor cached on the module: a guard that fails once it is set
            widths = (self.hc, self.hc, self.hc * self.hc)
            return torch.cat([self.scale[i : i + 1].expand(n) for i, n in enumerate(widths)])
        index = self._scale_index
        if index is None or index.device != self.scale.device:
            hc = self.hc
            index = torch.tensor([0] * hc + [1] * hc + [2] * hc * hc, device=self.scale.device)
            self._scale_index = index
        return self.scale.index_select(0, index)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``streams`` [T, hc, D] -> (post [T, hc], comb [T, hc, hc], collapsed [T, D])."""
        hc = self.hc
        flat = _rms_normed(streams.flatten(1).float(), _constant(self.norm_eps, streams.device))
        mixes = F.linear(flat, self.fn).mul_(self._expanded_scale()).add_(self.base)
        pre = torch.sigmoid(mixes[:, :hc].contiguous())
        post = torch.sigmoid(mixes[:, hc : 2 * hc].contiguous())
        comb = torch.softmax(mixes[:, 2 * hc :].unflatten(-1, (hc, hc)), dim=-1)
        if self._one_stream_comb is not None and torch.compiler.is_compiling():
            return one_stream_tail(pre, post, comb, streams, self._one_stream_comb, self.hc_eps)
        return mhc_tail(pre, post, comb, streams, self.iters, self.hc_eps)

    def collapse(self, streams: torch.Tensor) -> torch.Tensor:
        """Only ``forward``'s collapsed streams [T, D] (same ops, so the same values), no Sinkhorn."""
        flat = _rms_normed(streams.flatten(1).float(), _constant(self.norm_eps, streams.device))
        mixes = F.linear(flat, self.fn).mul_(self._expanded_scale()).add_(self.base)
        pre = torch.sigmoid(mixes[:, : self.hc].contiguous())
        return _collapse(pre + _constant(self.hc_eps, streams.device), streams)


def hyper_residual(
    out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """Expand a block output into the streams and add the mixed residual (comb applied transposed)."""
    dtype = streams.dtype
    mixed = torch.bmm(comb.to(dtype).transpose(-1, -2), streams)
    return (post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2)).add_(mixed)


class HyperHead(nn.Module):
    """Final collapse of the streams before the last norm (``hc_head``)."""

    def __init__(self, hc_mult: int, hidden_size: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_eps = hc_eps
        self.norm_eps = norm_eps
        self.hc_fn = _param(hc_mult, hc_mult * hidden_size)
        self.hc_base = _param(hc_mult)
        self.hc_scale = _param(1)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        device = streams.device
        flat = _rms_normed(streams.flatten(1).float(), _constant(self.norm_eps, device))
        mixes = F.linear(flat, self.hc_fn).mul_(self.hc_scale).add_(self.hc_base)
        return _collapse(torch.sigmoid(mixes).add_(_constant(self.hc_eps, device)), streams)
