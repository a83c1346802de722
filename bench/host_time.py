"""Host time of one call on one GPU: each call's median over 30, timed with time.perf_counter while
a GPU sleep enqueued before it keeps the GPU busy, so that no call waits for the GPU. bf16, batch 4,
4k tokens, 16 heads of 128, causal; SDPA's cuDNN backend beside it for reference.

    python bench/host_time.py

bench/NOTES.md (h32) has the figures from before and after eager calls skipped the custom ops'
dispatch."""

import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import ringflash
from ringflash import _C

B, S, H, D = 4, 4096, 16, 128
CALLS = 30
SLEEP_CYCLES = 20_000_000  # the GPU sleep before each timed call, longer than any call's host time


def host(name, fn):
    """Prints the median and the least host time of fn over CALLS calls."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(CALLS):
        torch.cuda._sleep(SLEEP_CYCLES)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        torch.cuda.synchronize()
    times.sort()
    print(f"{name:44s} {times[len(times) // 2] * 1e6:8.1f} us (min {times[0] * 1e6:.1f})", flush=True)


def main():
    q, k, v, dout = [torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    qg, kg, vg = [t.clone().requires_grad_() for t in (q, k, v)]
    dq, dk, dv = [torch.empty_like(q) for _ in range(3)]
    out = torch.empty_like(q)
    lse = torch.empty(B, H, S, device="cuda", dtype=torch.float32)
    stream = torch.cuda.current_stream().cuda_stream

    def forward_backward():
        qg.grad = kg.grad = vg.grad = None
        ringflash.flash_attn_func(qg, kg, vg, causal=True).backward(dout)

    host("_C.attention_forward", lambda: _C.attention_forward(q, k, v, out, lse, causal=True, stream=stream))
    host("_C.attention_backward",
         lambda: _C.attention_backward(q, k, v, out, dout, lse, dq, dk, dv, causal=True, stream=stream))
    host("flash_attn_func (no grad)", lambda: ringflash.flash_attn_func(q, k, v, causal=True))
    host("flash_attn_func (grad)", lambda: ringflash.flash_attn_func(qg, kg, vg, causal=True))
    host("flash_attn_func fwd+bwd", forward_backward)
    host("torch.empty x2", lambda: (torch.empty_like(q), torch.empty(B, H, S, device="cuda")))
    host("torch.cuda.current_stream().cuda_stream", lambda: torch.cuda.current_stream(q.device).cuda_stream)
    qs, ks, vs = [t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        host("sdpa cudnn (grad)", lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True))


if __name__ == "__main__":
    main()
