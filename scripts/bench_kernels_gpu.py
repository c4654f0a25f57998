"""GPU benchmark for vlmq.kernels decode attention (H200 target, a few minutes).

1. Paged decode attention over batch sizes x context lengths: achieved memory
   bandwidth (KV + q + out bytes / time) as a fraction of the device peak, next to
   torch SDPA over the same KV stored contiguously (the baseline, same process).
2. Shared-prefix (cascade) decode vs per-sequence paged decode for groups of 4, 16
   and 64 sequences sharing a 1000-4000 token prefix: speedup and max |difference|.

Prints a table and writes JSON (rewritten after every row, so a run stopped early keeps what it measured;
"complete" says whether it finished). ``--dry-run`` runs tiny shapes on the CPU (Triton
interpreter when triton is installed, else the torch reference) to check the script.

    python scripts/bench_kernels_gpu.py                 # GPU, defaults: Qwen2-VL-7B heads
    python scripts/bench_kernels_gpu.py --dry-run --out /tmp/bench.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU; checks the script, not speed")
    p.add_argument("--peak-bw", type=float, default=4.8e12, help="device peak memory bandwidth, bytes/s (H200)")
    p.add_argument("--num-heads", type=int, default=28)
    p.add_argument("--num-kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--context-lens", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--group-sizes", type=int, nargs="+", default=[4, 16, 64])
    p.add_argument("--prefix-lens", type=int, nargs="+", default=[1000, 4000])
    p.add_argument("--suffix-len", type=int, default=64, help="own tokens per sequence after the shared prefix")
    p.add_argument("--cascade-batch", type=int, default=64, help="sequences per cascade step")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--impl", choices=["auto", "triton", "torch"], default=None,
                   help="default: auto on a GPU; triton (interpreter) or torch with --dry-run")
    p.add_argument("--out", default="bench_kernels_gpu.json")
    args = p.parse_args(argv)
    if args.dry_run:
        args.num_heads, args.num_kv_heads, args.head_dim, args.dtype = 4, 2, 64, "float32"
        args.batch_sizes, args.context_lens, args.group_sizes = [2], [40], [2]
        args.prefix_lens, args.suffix_len, args.cascade_batch, args.iters = [48], 5, 4, 1
    return args


def timed(fn, iters: int, cuda: bool) -> float:
    """Median seconds per call after a warm-up.

    On a GPU the call is captured in a CUDA graph (so Python launch overhead is not
    measured; eager if capture fails), L2 is flushed before each replay (H200 L2 is
    50 MB) and each replay is timed with CUDA events.
    """
    import torch

    fn()
    if not cuda:
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]
    run = graph_or_eager(fn)
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        flush.zero_()
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in events)[iters // 2] / 1e3


def graph_or_eager(fn):
    import torch

    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay
    except RuntimeError as e:  # capture not possible: time the eager call (includes launch overhead)
        print(f"note: CUDA graph capture failed ({e}); timing eager calls")
        return fn


def paged_cache(tables_spec, args, dtype, device):
    """Random cache plus block tables; tables_spec[i] = (shared block ids or [], own token count)."""
    import torch

    bs = args.block_size
    own_blocks = [-(-n // bs) for _, n in tables_spec]
    num_shared = max([max(s) + 1 for s, _ in tables_spec if s] + [0])
    num_blocks = num_shared + sum(own_blocks)
    shape = (num_blocks, bs, args.num_kv_heads, args.head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    perm = torch.randperm(num_blocks, device=device)
    rows, next_block = [], num_shared
    for (shared, _), n_own in zip(tables_spec, own_blocks, strict=True):
        rows.append(list(shared) + list(range(next_block, next_block + n_own)))
        next_block += n_own
    width = max(len(r) for r in rows)
    table = torch.zeros(len(rows), width, dtype=torch.int32, device=device)
    for i, r in enumerate(rows):
        table[i, :len(r)] = perm[torch.tensor(r, dtype=torch.long, device=device)].int()
    return k_cache, v_cache, table


def bench_decode(args, K, dtype, device, impl, rows: list[dict], save) -> None:
    for batch in args.batch_sizes:
        for ctx in args.context_lens:
            rows.append(decode_row(args, K, dtype, device, impl, batch, ctx))
            save()


def decode_row(args, K, dtype, device, impl, batch, ctx):
    import torch

    item = torch.finfo(dtype).bits // 8
    k_cache, v_cache, table = paged_cache([([], ctx)] * batch, args, dtype, device)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(batch, args.num_heads, args.head_dim, dtype=dtype, device=device)
    t = timed(lambda: K.paged_decode_attention(q, k_cache, v_cache, table, lens, max_context_len=ctx, impl=impl),
              args.iters, device.type == "cuda")
    moved = 2 * batch * ctx * args.num_kv_heads * args.head_dim * item + 2 * q.numel() * item  # KV + q + out
    try:
        t_sdpa = timed(sdpa_baseline(q, k_cache, v_cache, table, ctx, args), args.iters, device.type == "cuda")
    except RuntimeError as e:  # e.g. out of memory in a math-backend fallback: keep the kernel numbers
        print(f"note: SDPA baseline failed at batch {batch}, context {ctx}: {e}")
        t_sdpa = float("nan")
    return dict(batch=batch, context_len=ctx, us=t * 1e6, bandwidth_gbs=moved / t / 1e9,
                frac_of_peak=moved / t / args.peak_bw, sdpa_us=t_sdpa * 1e6, speedup_vs_sdpa=t_sdpa / t)


def sdpa_baseline(q, k_cache, v_cache, table, ctx, args):
    """torch SDPA over the same KV laid out contiguously [B, Hkv, ctx, D] (gather done once, outside timing)."""
    import torch.nn.functional as F

    def contiguous(cache):
        blocks = cache[table.long()].flatten(1, 2)[:, :ctx]  # [B, ctx, Hkv, D]
        return blocks.transpose(1, 2).contiguous()

    k, v = contiguous(k_cache), contiguous(v_cache)
    qq = q[:, :, None, :]  # [B, H, 1, D]
    group = args.num_heads // args.num_kv_heads
    return lambda: F.scaled_dot_product_attention(qq, k, v, enable_gqa=group > 1)


def bench_cascade(args, K, dtype, device, impl, rows: list[dict], save) -> None:
    # group 16 first: the target (cascade >= 3x per-sequence decode at group 16)
    groups = sorted((g for g in args.group_sizes if g <= args.cascade_batch), key=lambda g: (g != 16, g))
    for group in groups:
        for prefix in args.prefix_lens:
            rows.append(cascade_row(args, K, dtype, device, impl, prefix, group))
            save()


def cascade_row(args, K, dtype, device, impl, prefix, group):
    import torch

    batch, bs = args.cascade_batch, args.block_size
    n_pre = -(-prefix // bs)  # prefix rounded up to whole blocks: tables are [shared blocks, own blocks]
    spec = [(list(range(i // group * n_pre, (i // group + 1) * n_pre)), args.suffix_len) for i in range(batch)]
    k_cache, v_cache, table = paged_cache(spec, args, dtype, device)
    ctx = n_pre * bs + args.suffix_len
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    indptr = torch.arange(0, batch + 1, group, dtype=torch.int32, device=device)
    pre = torch.full((indptr.numel() - 1,), n_pre * bs, dtype=torch.int32, device=device)
    q = torch.randn(batch, args.num_heads, args.head_dim, dtype=dtype, device=device)
    plan = K.CascadePlan.from_lens(lens, indptr, pre)

    def cascade():
        return K.cascade_decode_attention(q, k_cache, v_cache, table, lens, indptr, pre, plan=plan, impl=impl)

    def decode():
        return K.paged_decode_attention(q, k_cache, v_cache, table, lens, max_context_len=ctx, impl=impl)

    err = float((cascade()[0].float() - decode()[0].float()).abs().max())
    cuda = device.type == "cuda"
    t_c, t_d = timed(cascade, args.iters, cuda), timed(decode, args.iters, cuda)
    return dict(prefix_len=n_pre * bs, group_size=group, batch=batch, suffix_len=args.suffix_len,
                cascade_us=t_c * 1e6, decode_us=t_d * 1e6, speedup=t_d / t_c, max_abs_diff=err)


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    if not rows:
        return
    cols = list(rows[0])
    print("  ".join(f"{c:>14}" for c in cols))
    for r in rows:
        print("  ".join(f"{r[c]:>14.4g}" if isinstance(r[c], float) else f"{r[c]:>14}" for c in cols))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    cuda_wanted = not args.dry_run
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is defined (imported lazily)
    import importlib.util

    import torch

    from vlmq import kernels as K

    if cuda_wanted and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU, or pass --dry-run for a CPU smoke run")
    device = torch.device("cuda" if cuda_wanted else "cpu")
    interp = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
    impl = args.impl or ("auto" if cuda_wanted else ("triton" if interp else "torch"))
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    result = dict(
        device=torch.cuda.get_device_name() if cuda_wanted else platform.processor() or "cpu",
        dry_run=args.dry_run, impl=impl, peak_bw=args.peak_bw, dtype=args.dtype, num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads, head_dim=args.head_dim, block_size=args.block_size,
        torch=torch.__version__, timing="CUDA graph replay, L2 flushed, median" if cuda_wanted else "perf_counter",
        decode=[], cascade=[], complete=False,
    )

    def save() -> None:  # after every row: a run stopped by its time limit keeps the rows it measured
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)

    # cascade first: it is shorter, and the decode table's largest cells take the longest
    bench_cascade(args, K, dtype, device, impl, result["cascade"], save)
    print_table("shared-prefix (cascade) decode vs per-sequence decode", result["cascade"])
    bench_decode(args, K, dtype, device, impl, result["decode"], save)
    print_table(f"paged decode ({args.dtype}, H={args.num_heads}/{args.num_kv_heads}, D={args.head_dim})",
                result["decode"])
    result["complete"] = True
    save()
    print(f"\nwrote {args.out}")
    return result


if __name__ == "__main__":
    main()
