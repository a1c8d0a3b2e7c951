"""PyTorch peers of `epserve bench`, on its configs' shapes, for docs/benchmarks.md (same call).

On the GPU machine (torch is there), one process per GPU:
    python3 -m torch.distributed.run --nproc_per_node 4 scripts/bench/torch-peers.py --json $OUT/torch.json

Per config (tokens per rank, hidden, intermediate, experts, top-k as in server/bench.rs), uniform
random routing over distinct experts, bf16:
  - experts: this rank's SwiGLU FFN over the rows it receives, with torch._grouped_mm (CUTLASS
    grouped GEMM), beside dense cuBLAS (torch.mm) on the same rows; and in FP8 (W8A8, row-wise
    scales: torch._scaled_grouped_mm, dense torch._scaled_mm), activations quantized in the
    timed region as epserve's FP8 experts phase quantizes them;
  - layer: the whole EP layer as a PyTorch user writes it: router GEMM + top-k, all_to_all_single
    of counts and rows, grouped FFN, all_to_all_single back, weighted sum.
Times are medians over iterations of the slowest rank (CUDA events, ranks aligned by a barrier).
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

CONFIGS = {
    "decode": (128, 7168, 2048, 256, 8),
    "small": (1024, 2048, 768, 128, 8),
    "prefill": (4096, 7168, 2048, 256, 8),
    # One EP4 rank's experts on one GPU (server/bench.rs): 16 rows per expert, and 512.
    "decode-rank": (128, 7168, 2048, 64, 8),
    "prefill-rank": (4096, 7168, 2048, 64, 8),
}


def fp8_rowwise(t):
    """E4M3 rows of t with one f32 scale per row (amax / 448)."""
    s = t.abs().amax(-1).float().clamp(min=1e-12) / 448.0
    return (t.float() / s.unsqueeze(-1)).to(torch.float8_e4m3fn), s


def ffn_fp8(x, offs, gu, down):
    """The SwiGLU FFN in FP8: rows and activations quantized per row, weights per column."""
    (gu_q, gu_s), (dn_q, dn_s) = gu, down
    xq, xs = fp8_rowwise(x)
    h = torch._scaled_grouped_mm(xq, gu_q.transpose(-2, -1), xs, gu_s, offs=offs, out_dtype=torch.bfloat16)
    g, u = h.chunk(2, dim=-1)
    aq, as_ = fp8_rowwise(F.silu(g) * u)
    return torch._scaled_grouped_mm(aq, dn_q.transpose(-2, -1), as_, dn_s, offs=offs, out_dtype=torch.bfloat16)


def timed(fn, iters, warmup):
    """Median milliseconds of fn over iters, the slowest rank's per iteration."""
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        t = torch.tensor([a.elapsed_time(b)], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if i >= warmup:
            times.append(t.item())
    times.sort()
    return times[len(times) // 2]


def ffn(x, offs, w_gu, w_down):
    """SwiGLU FFN of expert-sorted rows x; offs: int32 cumulative row ends per expert."""
    gu = torch._grouped_mm(x, w_gu.transpose(-2, -1), offs=offs)
    g, u = gu.chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(g) * u, w_down.transpose(-2, -1), offs=offs)


def route(x, w_router, k):
    logits = x.float() @ w_router.t()
    w, ids = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
    return ids, w / w.sum(-1, keepdim=True)


def layer(x, w_router, w_gu, w_down, k, world):
    """One EP layer step: every token's k rows to their experts' ranks and back."""
    experts = w_router.shape[0]
    local = experts // world
    ids, w = route(x, w_router, k)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    rows = x[order // k]
    send = torch.bincount(flat // local, minlength=world)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    per_expert = torch.bincount(flat, minlength=experts)
    got_counts = torch.empty_like(per_expert)
    dist.all_to_all_single(got_counts, per_expert)
    send_l, recv_l = send.tolist(), recv.tolist()
    got = torch.empty(sum(recv_l), x.shape[1], dtype=x.dtype, device=x.device)
    dist.all_to_all_single(got, rows, recv_l, send_l)
    # Received rows are source-major; sort them by local expert for the grouped GEMM.
    counts = got_counts.view(world, local)
    expert_of = torch.repeat_interleave(
        torch.arange(local, device=x.device).repeat(world), counts.flatten()
    )
    by_expert = torch.argsort(expert_of, stable=True)
    offs = torch.cumsum(counts.sum(0), 0).to(torch.int32)
    y = torch.empty_like(got)
    y[by_expert] = ffn(got[by_expert], offs, w_gu, w_down)
    back = torch.empty_like(rows)
    dist.all_to_all_single(back, y, send_l, recv_l)
    out = torch.zeros(x.shape[0] * k, x.shape[1], dtype=torch.float32, device=x.device)
    out[order] = back.float()
    return (out.view(x.shape[0], k, -1) * w.unsqueeze(-1)).sum(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="decode,small,prefill")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--json")
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    results = []
    for name in args.configs.split(","):
        t, h, i, e, k = CONFIGS[name]
        local = e // world
        g = torch.Generator(device="cuda").manual_seed(1 + rank)
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=g)
        w_router = torch.randn(e, h, device="cuda", generator=g) / h**0.5
        w_gu = torch.randn(local, 2 * i, h, device="cuda", dtype=torch.bfloat16, generator=g) / h**0.5
        w_down = torch.randn(local, h, i, device="cuda", dtype=torch.bfloat16, generator=g) / i**0.5
        # The experts phase alone: the rows a rank receives under uniform routing, sorted.
        ids = torch.stack([torch.randperm(e, device="cuda", generator=g)[:k] for _ in range(world * t)])
        mine = ids[(ids // local) == rank] % local
        rows = torch.randn(mine.numel(), h, device="cuda", dtype=torch.bfloat16, generator=g)
        offs = torch.cumsum(torch.bincount(mine, minlength=local), 0).to(torch.int32)
        w_gu_dense, w_down_dense = w_gu[0], w_down[0]
        experts_ms = timed(lambda: ffn(rows, offs, w_gu, w_down), args.iters, args.warmup)

        def dense():
            gu = rows @ w_gu_dense.t()
            a, b = gu.chunk(2, dim=-1)
            return (F.silu(a) * b) @ w_down_dense.t()

        dense_ms = timed(dense, args.iters, args.warmup)
        layer_ms = timed(lambda: layer(x, w_router, w_gu, w_down, k, world), args.iters, args.warmup)
        flops = rows.shape[0] * 3 * 2 * h * i
        weight_bytes = local * 3 * h * i * 2
        fp8 = {}
        try:
            gu8, dn8 = fp8_rowwise(w_gu), fp8_rowwise(w_down)
            fp8_ms = timed(lambda: ffn_fp8(rows, offs, gu8, dn8), args.iters, args.warmup)
            # The two GEMMs alone, operands quantized beforehand (the anchors' figure).
            xq, xs = fp8_rowwise(rows)
            aq, as_ = fp8_rowwise(torch.randn(rows.shape[0], i, device="cuda", dtype=torch.bfloat16, generator=g))

            def gemms_fp8():
                torch._scaled_grouped_mm(xq, gu8[0].transpose(-2, -1), xs, gu8[1], offs=offs, out_dtype=torch.bfloat16)
                return torch._scaled_grouped_mm(aq, dn8[0].transpose(-2, -1), as_, dn8[1], offs=offs, out_dtype=torch.bfloat16)

            gemms_ms = timed(gemms_fp8, args.iters, args.warmup)
            (g0, gs0), (d0, ds0) = fp8_rowwise(w_gu_dense), fp8_rowwise(w_down_dense)

            def dense_fp8():
                xq, xs = fp8_rowwise(rows)
                gu = torch._scaled_mm(xq, g0.t(), scale_a=xs[:, None], scale_b=gs0[None, :], out_dtype=torch.bfloat16)
                a, b = gu.chunk(2, dim=-1)
                aq, as_ = fp8_rowwise(F.silu(a) * b)
                return torch._scaled_mm(aq, d0.t(), scale_a=as_[:, None], scale_b=ds0[None, :], out_dtype=torch.bfloat16)

            dense8_ms = timed(dense_fp8, args.iters, args.warmup)

            def dense_fp8_gemms():
                torch._scaled_mm(xq, g0.t(), scale_a=xs[:, None], scale_b=gs0[None, :], out_dtype=torch.bfloat16)
                return torch._scaled_mm(aq, d0.t(), scale_a=as_[:, None], scale_b=ds0[None, :], out_dtype=torch.bfloat16)

            dense8_gemms_ms = timed(dense_fp8_gemms, args.iters, args.warmup)
            fp8 = {
                "scaled_grouped_mm_us": fp8_ms * 1e3,
                "scaled_grouped_mm_tflops": flops / (fp8_ms * 1e-3) / 1e12,
                "scaled_grouped_mm_weight_tbps": weight_bytes / 2 / (fp8_ms * 1e-3) / 1e12,
                "scaled_grouped_mm_gemms_only_us": gemms_ms * 1e3,
                "scaled_grouped_mm_gemms_only_tflops": flops / (gemms_ms * 1e-3) / 1e12,
                "dense_fp8_us": dense8_ms * 1e3,
                "dense_fp8_tflops": flops / (dense8_ms * 1e-3) / 1e12,
                "dense_fp8_gemms_only_us": dense8_gemms_ms * 1e3,
                "dense_fp8_gemms_only_tflops": flops / (dense8_gemms_ms * 1e-3) / 1e12,
            }
        except Exception as e:  # an FP8 path this torch build lacks: say so, keep the rest
            fp8 = {"fp8_error": repr(e)}
        r = {
            "config": name,
            "world": world,
            "rows": rows.shape[0],
            "grouped_mm_us": experts_ms * 1e3,
            "grouped_mm_tflops": flops / (experts_ms * 1e-3) / 1e12,
            "grouped_mm_weight_tbps": weight_bytes / (experts_ms * 1e-3) / 1e12,
            "dense_us": dense_ms * 1e3,
            "dense_tflops": flops / (dense_ms * 1e-3) / 1e12,
            "layer_us": layer_ms * 1e3,
            "layer_tokens_per_s_per_gpu": t / (layer_ms * 1e-3),
            **fp8,
        }
        results.append(r)
        if rank == 0:
            print(json.dumps(r), flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
