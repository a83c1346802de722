"""Chunked attention on one device: the query in ``num_chunks_q`` chunks, keys and values in
``num_chunks_kv`` chunks, one kernel call per (query chunk, key chunk) pair.

This is the chunked flash attention of the IPU seed (``flash_attention_qkv_packed``,
``ChunkedAttention``), on ringflash's kernels. Each call gets the global positions of its chunks
(``q_offset`` / ``k_offset`` of ``ringflash._C.attention_forward``), so causal masks, windows and
ALiBi see the whole sequence, and a pair that the mask removes entirely is never called. The
partial results of one query chunk merge in the kernel's fp32 accumulate mode:

    lse = logaddexp(lse1, lse2),   out = exp(lse1 - lse) * out1 + exp(lse2 - lse) * out2,

where a row that has seen no key yet has lse = -inf and out = 0, and so never produces NaN.

Memory. ringflash's kernels never hold the (Sq, Sk) score matrix, so a single chunk pair is already
memory-efficient; chunking bounds the rows that one kernel call reads and writes, its *working
set*. Forward, per query row: q, out and (when q is fp16 or bf16) the row of an fp32 accumulator
of out, plus the fp32 lse; per key row: k and v. Backward, per query row: q, out, dout, the fp32
lse and the fp32 dq; per key row: k, v and the fp32 dk and dv. Beyond the inputs and outputs, the
forward keeps one query chunk's fp32 accumulator (none for fp32 inputs, which merge into out
itself); the backward keeps one key chunk's fp32 dk and dv and, for fp16 and bf16 inputs, one
fp32 dq the size of q: partial results are summed in fp32, never rounded in between. With one
chunk pair there are no accumulators at all.

``num_chunks_q=None`` / ``num_chunks_kv=None`` choose the counts automatically, separately for the
forward and the backward: starting from one chunk each, the count of the side whose chunk takes
more bytes doubles until the working set is at most ``max_chunk_bytes`` (default
``DEFAULT_MAX_CHUNK_BYTES``, 256 MiB); see ``choose_num_chunks``. A count larger than the
sequence length uses one row per chunk. Chunks are as even as possible (sizes differ by at most
one row), so no length has to be divisible by a count.

Layouts (flash-attn's): q (B, Sq, Hq, D), k and v (B, Sk, Hkv, D) with Hq a multiple of Hkv;
out like q; lse float32 (B, Hq, Sq). ``flash_attention_qkv_packed`` takes the seed's packed
layout instead, (3, ..., S, D). The ops are ``torch.ops.ringflash.chunked_attention_forward`` and
``chunked_attention_backward``, torch custom ops with fake implementations and autograd, so
``torch.compile(fullgraph=True)`` traces them.
"""

import math
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _C
from .interface import _window
from .ops import _check_traced, _custom_op, _detach, _empty_grads, _empty_outputs, _register_autograd, _stream

__all__ = [
    "DEFAULT_MAX_CHUNK_BYTES",
    "ChunkedAttention",
    "choose_num_chunks",
    "chunked_attention",
    "chunked_attention_backward",
    "chunked_attention_forward",
    "flash_attention_qkv_packed",
]

# Default bound on the working set of one chunk pair (see the module docstring).
DEFAULT_MAX_CHUNK_BYTES = 256 * 1024 * 1024

_FP32_BYTES = 4


def _row_bytes(q: Tensor, k: Tensor, backward: bool) -> Tuple[int, int]:
    """Bytes that one query row and one key row add to the working set of a kernel call."""
    batch, _, heads_q, head_dim = q.shape
    heads_kv = k.shape[2]
    size = q.dtype.itemsize
    q_row = batch * heads_q * head_dim
    k_row = batch * heads_kv * head_dim
    if backward:
        # q, out, dout; dq in fp32; lse in fp32. k, v; dk and dv in fp32.
        return q_row * (3 * size + _FP32_BYTES) + batch * heads_q * _FP32_BYTES, k_row * 2 * (size + _FP32_BYTES)
    # q, out; the fp32 accumulator of out unless out is fp32 itself; lse in fp32. k, v.
    accumulator = 0 if q.dtype == torch.float32 else _FP32_BYTES
    return q_row * (2 * size + accumulator) + batch * heads_q * _FP32_BYTES, k_row * 2 * size


def choose_num_chunks(q: Tensor, k: Tensor, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
                      backward: bool = False) -> Tuple[int, int]:
    """(num_chunks_q, num_chunks_kv) that automatic chunking uses for q (B, Sq, Hq, D) and
    k (B, Sk, Hkv, D): starting from (1, 1), the count of the side whose chunk takes more bytes
    doubles (capped at its length) until one chunk pair's working set (see the module docstring)
    is at most max_chunk_bytes, or until every chunk is one row long."""
    _check_chunk_options("choose_num_chunks", 1, 1, max_chunk_bytes)
    if q.dim() != 4 or k.dim() != 4:
        raise _C.InvalidArgument(f"[choose_num_chunks] q and k must have shape (B, S, H, D), got "
                                 f"{tuple(q.shape)} and {tuple(k.shape)}")
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    q_row, k_row = _row_bytes(q, k, backward)
    n_q = n_kv = 1

    def sides():
        return q_row * math.ceil(seqlen_q / n_q), k_row * math.ceil(seqlen_k / n_kv)

    while sum(sides()) > max_chunk_bytes:
        q_bytes, k_bytes = sides()
        can_q, can_kv = n_q < seqlen_q, n_kv < seqlen_k
        if can_q and (q_bytes >= k_bytes or not can_kv):
            n_q = min(2 * n_q, seqlen_q)
        elif can_kv:
            n_kv = min(2 * n_kv, seqlen_k)
        else:
            break
    return n_q, n_kv


def _check_chunk_options(op: str, num_chunks_q, num_chunks_kv, max_chunk_bytes) -> None:
    """Counts are ints >= 0 here (0: automatic; the public functions map None to 0 and refuse 0)."""
    for name, value in (("num_chunks_q", num_chunks_q), ("num_chunks_kv", num_chunks_kv)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _C.InvalidArgument(f"[{op}] {name} must be an int >= 1, or automatic, got {value!r}")
    if isinstance(max_chunk_bytes, bool) or not isinstance(max_chunk_bytes, int) or max_chunk_bytes <= 0:
        raise _C.InvalidArgument(f"[{op}] max_chunk_bytes must be an int > 0, got {max_chunk_bytes!r}")


def _public_count(op: str, name: str, value) -> int:
    """None (automatic) -> 0; a positive int stays; anything else is an InvalidArgument."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _C.InvalidArgument(f"[{op}] {name} must be an int >= 1, or None for automatic, got {value!r}")
    return value


def _bounds(length: int, count: int) -> List[Tuple[int, int]]:
    """[begin, end) of `count` chunks of `length` rows, as even as possible; empty chunks dropped."""
    count = max(1, min(count, length))
    cuts = [length * i // count for i in range(count + 1)]
    return [(a, b) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]


class _Plan:
    """Chunk bounds and global positions: query row i of the chunk starting at a sits at
    q_pos + a + i, key row j of the chunk starting at c at k_pos + c + j."""

    def __init__(self, q: Tensor, k: Tensor, counts: Tuple[int, int], causal: bool, window_left: int,
                 window_right: int, q_offset: Optional[int], k_offset: int):
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        self.q_chunks = _bounds(seqlen_q, counts[0])
        self.kv_chunks = _bounds(seqlen_k, counts[1])
        self.k_pos = k_offset
        # The library's default alignment: the last query at the last key (bottom-right).
        self.q_pos = k_offset + seqlen_k - seqlen_q if q_offset is None else q_offset
        # A key is visible when lo <= pk - pq <= hi.
        self.lo = -math.inf if window_left < 0 else -window_left
        self.hi = math.inf if window_right < 0 else window_right
        if causal:
            self.hi = min(self.hi, 0)

    def visible(self, qc: Tuple[int, int], kc: Tuple[int, int]) -> bool:
        """Whether some query of chunk qc sees some key of chunk kc: pk - pq takes every integer
        value from (first key - last query) to (last key - first query)."""
        smallest = (self.k_pos + kc[0]) - (self.q_pos + qc[1] - 1)
        largest = (self.k_pos + kc[1] - 1) - (self.q_pos + qc[0])
        return max(self.lo, smallest) <= min(self.hi, largest)

    def offsets(self, qc: Tuple[int, int], kc: Tuple[int, int]) -> dict:
        return dict(q_offset=self.q_pos + qc[0], k_offset=self.k_pos + kc[0])


def _rows(t: Tensor, chunk: Tuple[int, int]) -> Tensor:
    """Rows of a (B, S, H, D) tensor."""
    return t[:, chunk[0]:chunk[1]]


def _lse_rows(lse: Tensor, chunk: Tuple[int, int]) -> Tensor:
    """Rows of a (B, H, S) log-sum-exp."""
    return lse[:, :, chunk[0]:chunk[1]]


def _fp32_like(t: Tensor) -> Tensor:
    """t itself when it is fp32; else an fp32 tensor of its shape, not initialised."""
    if t.dtype == torch.float32:
        return t
    return torch.empty(t.shape, dtype=torch.float32, device=t.device)


def _fp32_zeros(t: Tensor) -> Tensor:
    """_fp32_like(t), zeroed."""
    return _fp32_like(t).zero_()


def _supported(op: str, q: Tensor, k: Tensor, v: Tensor, options: dict, q_offset: Optional[int],
               k_offset: int) -> bool:
    """Whether the library takes these inputs and options. When it does not, the caller repeats the
    check on the whole tensors through the real entry point, which raises the library's own error
    (validation comes before any compute); the chunks' calls would report the chunks' shapes."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise _C.InvalidArgument(f"[{op}] {name} must have shape (B, S, H, D), got {tuple(t.shape)}")
    return _C.attention_support(q, k, v, q_offset=q_offset, k_offset=k_offset, **options)[0]


def _kernel_options(q: Tensor, alibi_slopes: Optional[Tensor], softmax_scale: Optional[float], causal: bool,
                    window_left: int, window_right: int, softcap: float, deterministic: bool) -> dict:
    return dict(softmax_scale=softmax_scale, causal=causal, window_left=window_left, window_right=window_right,
                softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic, stream=_stream(q))


def _chunked_attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    alibi_slopes: Optional[Tensor],
    softmax_scale: Optional[float],
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool,
    q_offset: Optional[int],
    k_offset: int,
    num_chunks_q: int,
    num_chunks_kv: int,
    max_chunk_bytes: int,
) -> Tuple[Tensor, Tensor]:
    """Returns (out, lse). A count of 0 is automatic. Options as in ringflash._C.attention_forward."""
    op = "chunked_attention_forward"
    _check_chunk_options(op, num_chunks_q, num_chunks_kv, max_chunk_bytes)
    q, k, v, alibi_slopes = (_detach(t) for t in (q, k, v, alibi_slopes))
    out, lse = _empty_outputs(q, packed=False)  # lse (B, Hq, Sq)
    options = _kernel_options(q, alibi_slopes, softmax_scale, causal, window_left, window_right, softcap,
                              deterministic)
    if not _supported(op, q, k, v, options, q_offset, k_offset):
        _C.attention_forward(q, k, v, out, lse, q_offset=q_offset, k_offset=k_offset, **options)

    auto = choose_num_chunks(q, k, max_chunk_bytes) if 0 in (num_chunks_q, num_chunks_kv) else (0, 0)
    counts = (num_chunks_q or auto[0], num_chunks_kv or auto[1])
    plan = _Plan(q, k, counts, causal, window_left, window_right, q_offset, k_offset)
    for qc in plan.q_chunks:
        out_c, lse_c = _rows(out, qc), _lse_rows(lse, qc)
        kv_chunks = [kc for kc in plan.kv_chunks if plan.visible(qc, kc)]
        if not kv_chunks:  # these rows see no key
            out_c.zero_()
            lse_c.fill_(-math.inf)
            continue
        if len(kv_chunks) == 1:  # nothing to merge: the kernel writes out and lse directly
            kc = kv_chunks[0]
            _C.attention_forward(_rows(q, qc), _rows(k, kc), _rows(v, kc), out_c, lse_c,
                                 **plan.offsets(qc, kc), **options)
            continue
        # (B, chunk, Hq, D) fp32: the first key chunk writes it (overwrite_out), the last rounds the
        # merged rows into out (final_out) unless out is the accumulator itself.
        acc = _fp32_like(out_c)
        for i, kc in enumerate(kv_chunks):
            final = out_c if i == len(kv_chunks) - 1 and acc is not out_c else None
            _C.attention_forward(_rows(q, qc), _rows(k, kc), _rows(v, kc), acc, lse_c, accumulate=True,
                                 overwrite_out=i == 0, final_out=final, **plan.offsets(qc, kc), **options)
    return out, lse


chunked_attention_forward = _custom_op(_chunked_attention_forward)


@chunked_attention_forward.register_fake
def _chunked_attention_forward_fake(q, k, v, alibi_slopes, softmax_scale, causal, window_left, window_right,
                                    softcap, deterministic, q_offset, k_offset, num_chunks_q, num_chunks_kv,
                                    max_chunk_bytes):
    op = "chunked_attention_forward"
    _check_chunk_options(op, num_chunks_q, num_chunks_kv, max_chunk_bytes)
    _check_traced(op, [("q", q), ("k", k), ("v", v), ("alibi_slopes", alibi_slopes)], packed=False)
    return _empty_outputs(q, packed=False)


def _chunked_attention_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    alibi_slopes: Optional[Tensor],
    softmax_scale: Optional[float],
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool,
    q_offset: Optional[int],
    k_offset: int,
    num_chunks_q: int,
    num_chunks_kv: int,
    max_chunk_bytes: int,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Returns (dq, dk, dv) of the forward with the same options, given its out and lse (over all
    keys). A count of 0 is automatic, chosen for the backward's working set."""
    op = "chunked_attention_backward"
    _check_chunk_options(op, num_chunks_q, num_chunks_kv, max_chunk_bytes)
    dout, q, k, v, out, lse, alibi_slopes = (_detach(t) for t in (dout, q, k, v, out, lse, alibi_slopes))
    dq, dk, dv = _empty_grads(q, k, v)
    options = _kernel_options(q, alibi_slopes, softmax_scale, causal, window_left, window_right, softcap,
                              deterministic)
    if not _supported(op, q, k, v, options, q_offset, k_offset):
        _C.attention_backward(q, k, v, out, dout, lse, dq, dk, dv, q_offset=q_offset, k_offset=k_offset, **options)

    auto = choose_num_chunks(q, k, max_chunk_bytes, backward=True) if 0 in (num_chunks_q, num_chunks_kv) else (0, 0)
    counts = (num_chunks_q or auto[0], num_chunks_kv or auto[1])
    plan = _Plan(q, k, counts, causal, window_left, window_right, q_offset, k_offset)
    if len(plan.q_chunks) == 1 and len(plan.kv_chunks) == 1:
        # One pair: no accumulators.
        _C.attention_backward(q, k, v, out, dout, lse, dq, dk, dv, q_offset=q_offset, k_offset=k_offset,
                              **options)
        return dq, dk, dv

    # Key chunks outside, query chunks inside: dk and dv of one key chunk are complete after its
    # inner loop (the first query chunk that sees it writes them, overwrite_dkdv, and the others
    # add; with none they are zeros); dq sums over every key chunk, in fp32.
    dq_acc = _fp32_zeros(dq)  # (B, Sq, Hq, D) fp32
    for kc in plan.kv_chunks:
        dk_c, dv_c = _rows(dk, kc), _rows(dv, kc)
        dk_acc, dv_acc = _fp32_like(dk_c), _fp32_like(dv_c)  # (B, chunk, Hkv, D) fp32
        written = False
        for qc in plan.q_chunks:
            if plan.visible(qc, kc):
                _C.attention_backward(_rows(q, qc), _rows(k, kc), _rows(v, kc), _rows(out, qc), _rows(dout, qc),
                                      _lse_rows(lse, qc), _rows(dq_acc, qc), dk_acc, dv_acc, accumulate=True,
                                      overwrite_dkdv=not written, **plan.offsets(qc, kc), **options)
                written = True
        if not written:
            dk_acc.zero_()
            dv_acc.zero_()
        if dk_acc is not dk_c:
            dk_c.copy_(dk_acc)
            dv_c.copy_(dv_acc)
    if dq_acc is not dq:
        dq.copy_(dq_acc)
    return dq, dk, dv


chunked_attention_backward = _custom_op(_chunked_attention_backward)


@chunked_attention_backward.register_fake
def _chunked_attention_backward_fake(dout, q, k, v, out, lse, alibi_slopes, softmax_scale, causal, window_left,
                                     window_right, softcap, deterministic, q_offset, k_offset, num_chunks_q,
                                     num_chunks_kv, max_chunk_bytes):
    op = "chunked_attention_backward"
    _check_chunk_options(op, num_chunks_q, num_chunks_kv, max_chunk_bytes)
    _check_traced(op, [("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout), ("lse", lse),
                       ("alibi_slopes", alibi_slopes)], packed=False)
    return _empty_grads(q, k, v)


_chunked = _register_autograd(chunked_attention_forward, chunked_attention_backward, num_tensors=1)  # alibi_slopes


def _attention(op: str, q, k, v, num_chunks_q, num_chunks_kv, causal, softmax_scale, window_size, softcap,
               alibi_slopes, deterministic, q_offset, k_offset, max_chunk_bytes):
    n_q = _public_count(op, "num_chunks_q", num_chunks_q)
    n_kv = _public_count(op, "num_chunks_kv", num_chunks_kv)
    _check_chunk_options(op, n_q, n_kv, max_chunk_bytes)
    left, right = _window(op, window_size)
    for name, value, allow_none in (("q_offset", q_offset, True), ("k_offset", k_offset, False)):
        if not (value is None and allow_none) and (isinstance(value, bool) or not isinstance(value, int)):
            raise _C.InvalidArgument(f"[{op}] {name} must be an int{' or None' if allow_none else ''}, got {value!r}")
    return _chunked(q, k, v, alibi_slopes, softmax_scale, bool(causal), left, right,
                    float(softcap), bool(deterministic), q_offset, k_offset, n_q, n_kv,
                    max_chunk_bytes)


def chunked_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    num_chunks_q: Optional[int] = None,
    num_chunks_kv: Optional[int] = None,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_softmax_lse: bool = False,
    *,
    q_offset: Optional[int] = None,
    k_offset: int = 0,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
):
    """Attention over a padded batch, computed chunk pair by chunk pair.

    q: (B, Sq, Hq, D); k, v: (B, Sk, Hkv, D), Hq a multiple of Hkv; fp32, fp16 or bf16.
    num_chunks_q / num_chunks_kv: ints >= 1, or None to choose them from max_chunk_bytes (see the
    module docstring). Options as in flash_attn_func: softmax_scale defaults to 1 / sqrt(D); causal
    aligns the last query with the last key (bottom-right) when Sq != Sk; window_size (left, right),
    -1 unbounded; softcap; alibi_slopes float32 (Hq,) or (B, Hq).

    q_offset / k_offset: global positions of the first query and first key (the masks and ALiBi
    compare pq = q_offset + i with pk = k_offset + j). q_offset=None is bottom-right,
    k_offset + Sk - Sq; q_offset=0 with k_offset=0 is top-left, as in torch's
    scaled_dot_product_attention.

    Returns out (B, Sq, Hq, D), or (out, lse) with return_softmax_lse, lse float32 (B, Hq, Sq) with no
    gradient. Gradients flow to q, k and v.
    """
    out, lse = _attention("chunked_attention", q, k, v, num_chunks_q, num_chunks_kv, causal, softmax_scale,
                          window_size, softcap, alibi_slopes, deterministic, q_offset, k_offset, max_chunk_bytes)
    return (out, lse) if return_softmax_lse else out


def flash_attention_qkv_packed(
    qkv: Tensor,
    num_chunks_q: Optional[int] = None,
    num_chunks_kv: Optional[int] = None,
    causal: bool = True,
    softmax_scale: Optional[float] = 1.0,
    *,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
) -> Tensor:
    """The IPU seed's function: attention from q, k and v stacked in front.

    qkv: (3, ..., S, D): q, k, v each (..., S, D), the layout of torch's scaled_dot_product_attention
    ((B, H, S, D)) or the seed's (N, S, D); every leading index is an independent sequence.
    Returns (..., S, D). As in the seed, the defaults are causal and *unscaled*
    (softmax(q k^T) v: scale q beforehand, or pass softmax_scale=None for 1 / sqrt(D)).
    Unlike the seed, S need not be divisible by the chunk counts, and None chooses them.
    """
    op = "flash_attention_qkv_packed"
    if qkv.dim() < 3 or qkv.shape[0] != 3:
        raise _C.InvalidArgument(f"[{op}] qkv must have shape (3, ..., S, D), got {tuple(qkv.shape)}")
    seqlen, head_dim = qkv.shape[-2], qkv.shape[-1]
    q, k, v = (t.reshape(-1, seqlen, 1, head_dim) for t in qkv.unbind(0))  # (..., S, D) -> (N, S, 1, D)
    out, _ = _attention(op, q, k, v, num_chunks_q, num_chunks_kv, causal, softmax_scale, (-1, -1), 0.0, None, False,
                        None, 0, max_chunk_bytes)
    return out.reshape(qkv.shape[1:])  # (N, S, 1, D) -> (..., S, D)


class ChunkedAttention(torch.nn.Module):
    """The IPU seed's module: ``forward(qkv)`` is ``flash_attention_qkv_packed`` with this module's
    chunk counts (None: automatic) and options; qkv (3, ..., S, D) -> (..., S, D)."""

    def __init__(self, num_chunks_q: Optional[int] = None, num_chunks_kv: Optional[int] = None,
                 causal: bool = True, softmax_scale: Optional[float] = 1.0,
                 max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES):
        super().__init__()
        op = "ChunkedAttention"
        _public_count(op, "num_chunks_q", num_chunks_q)
        _public_count(op, "num_chunks_kv", num_chunks_kv)
        _check_chunk_options(op, 1, 1, max_chunk_bytes)
        self.num_chunks_q = num_chunks_q
        self.num_chunks_kv = num_chunks_kv
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.max_chunk_bytes = max_chunk_bytes

    def forward(self, qkv: Tensor) -> Tensor:
        return flash_attention_qkv_packed(qkv, self.num_chunks_q, self.num_chunks_kv, self.causal,
                                          self.softmax_scale, max_chunk_bytes=self.max_chunk_bytes)

    def extra_repr(self) -> str:
        return (f"num_chunks_q={self.num_chunks_q}, num_chunks_kv={self.num_chunks_kv}, causal={self.causal}, "
                f"softmax_scale={self.softmax_scale}")
