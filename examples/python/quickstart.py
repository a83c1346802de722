"""ringflash's single-device functions, with flash-attn 2.x's names and layouts."""

import torch

import ringflash

print(ringflash.build_info())

# A padded batch: (B, S, H, D). 8 query heads share 2 key/value heads (GQA); K and V are not repeated.
q = torch.randn(2, 1024, 8, 64, dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(2, 1024, 2, 64, dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(2, 1024, 2, 64, dtype=torch.bfloat16, requires_grad=True)
out, lse = ringflash.flash_attn_func(q, k, v, causal=True, return_softmax_lse=True)
out.backward(torch.randn_like(out))
print("out", tuple(out.shape), out.dtype, "| lse", tuple(lse.shape), lse.dtype, "| dq", tuple(q.grad.shape))

# A packed batch of three documents (the second one empty): (T, H, D) and int32 cu_seqlens.
cu_seqlens = torch.tensor([0, 300, 300, 1024], dtype=torch.int32)
q, k, v = (torch.randn(1024, 4, 128) for _ in range(3))
out, lse = ringflash.flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen_q=724, max_seqlen_k=724,
                                            causal=True, return_softmax_lse=True)
print("packed out", tuple(out.shape), "| lse", tuple(lse.shape))

# The same attention as torch's SDPA, which takes (B, H, S, D).
q, k, v = (torch.randn(1, 256, 4, 64) for _ in range(3))
ours = ringflash.flash_attn_func(q, k, v, causal=True)
theirs = torch.nn.functional.scaled_dot_product_attention(
    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)
print("max |ringflash - torch sdpa| =", (ours - theirs).abs().max().item())
