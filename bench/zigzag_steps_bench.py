"""The kernel calls of one zigzag rank at P = 2, on one GPU, against one call over the whole sequence.

    python bench/zigzag_steps_bench.py

Causal, 32k tokens, 32 query and K/V heads, hdim 128, bf16. Rank 0 holds chunks 0 and 3 of 4: its
first step is one causal call over its 16k local rows, its second one rectangle (chunk 3 against
chunks 1 and 2), both in accumulate mode into fp32, as src/parallel/ring.cpp issues them. Prints
the median times (ms) of the whole-sequence call (t1f, t1b), of rank 0's forward with its fills and
final copy (rank_f), and of each step in accumulate mode and plain. Without GPU ranks this separates
what the kernels lose on the smaller shapes from what the transfers cost.
"""
import torch, ringflash
from ringflash import _C
torch.manual_seed(0)
dev = "cuda"
S, H, HKV, D = 32768, 32, 32, 128
dt = torch.bfloat16
def ev_time(fn, iters=10, warm=3):
    for _ in range(warm): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a = torch.cuda.Event(True); b = torch.cuda.Event(True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    ts.sort(); return ts[len(ts) // 2]
st = torch.cuda.current_stream().cuda_stream
q = torch.randn(1, S, H, D, device=dev, dtype=dt); k = torch.randn(1, S, HKV, D, device=dev, dtype=dt); v = torch.randn_like(k)
do = torch.randn_like(q)
out = torch.empty_like(q); lse = torch.empty(1, H, S, device=dev, dtype=torch.float32)
def full_f(): _C.attention_forward(q, k, v, out, lse, causal=True, stream=st)
_C.attention_forward(q, k, v, out, lse, causal=True, stream=st)
dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
def full_b(): _C.attention_backward(q, k, v, out, do, lse, dq, dk, dv, causal=True, stream=st)
t1f = ev_time(full_f); t1b = ev_time(full_b)
h = S // 2; c = S // 4
ql, kl, vl = q[:, :h].contiguous(), k[:, :h].contiguous(), v[:, :h].contiguous()
k2, v2 = k[:, h:].contiguous(), v[:, h:].contiguous()
acc = torch.empty(1, h, H, D, device=dev, dtype=torch.float32); lacc = torch.empty(1, H, h, device=dev, dtype=torch.float32)
outl = torch.empty_like(ql)
def step0_f(): _C.attention_forward(ql, kl, vl, acc, lacc, causal=True, q_offset=0, k_offset=0, accumulate=True, stream=st)
def step1_f(): _C.attention_forward(ql[:, c:], k2, v2, acc[:, c:], lacc[:, :, c:], causal=True, q_offset=3 * c, k_offset=c, accumulate=True, stream=st)
def fills(): acc.zero_(); lacc.fill_(float("-inf"))
def rank_f(): fills(); step0_f(); step1_f(); outl.copy_(acc)
def plain0_f(): _C.attention_forward(ql, kl, vl, outl, lacc, causal=True, q_offset=0, k_offset=0, stream=st)
def plain1_f(): _C.attention_forward(ql[:, c:], k2, v2, outl[:, c:], lacc[:, :, c:], causal=True, q_offset=3 * c, k_offset=c, stream=st)
fills(); rank_f()
r = dict(t1f=t1f, half_t1f=t1f / 2, rank_f=ev_time(rank_f), step0_acc=ev_time(lambda: (fills(), step0_f())),
         step1_acc=ev_time(step1_f), step0_plain=ev_time(plain0_f), step1_plain=ev_time(plain1_f), fills=ev_time(fills))
dol = do[:, :h].contiguous()
dqa = torch.zeros(1, h, H, D, device=dev, dtype=torch.float32); dka = torch.zeros(1, h, HKV, D, device=dev, dtype=torch.float32); dva = torch.zeros_like(dka)
dk2 = torch.zeros_like(dka); dv2 = torch.zeros_like(dka)
def step0_b(): _C.attention_backward(ql, kl, vl, outl, dol, lacc, dqa, dka, dva, causal=True, q_offset=0, k_offset=0, accumulate=True, stream=st)
def step1_b(): _C.attention_backward(ql[:, c:], k2, v2, outl[:, c:], dol[:, c:], lacc[:, :, c:], dqa[:, c:], dk2, dv2, causal=True, q_offset=3 * c, k_offset=c, accumulate=True, stream=st)
dql, dkl, dvl = torch.empty_like(ql), torch.empty_like(kl), torch.empty_like(vl)
def plain0_b(): _C.attention_backward(ql, kl, vl, outl, dol, lacc, dql, dkl, dvl, causal=True, q_offset=0, k_offset=0, stream=st)
def plain1_b(): _C.attention_backward(ql[:, c:], k2, v2, outl[:, c:], dol[:, c:], lacc[:, :, c:], dql[:, c:], dkl, dvl, causal=True, q_offset=3 * c, k_offset=c, stream=st)
r.update(t1b=t1b, half_t1b=t1b / 2, step0_b_acc=ev_time(step0_b), step1_b_acc=ev_time(step1_b), step0_b_plain=ev_time(plain0_b), step1_b_plain=ev_time(plain1_b))
print(torch.cuda.get_device_name(), {k: round(v, 3) for k, v in r.items()})
