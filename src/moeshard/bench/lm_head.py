"""`moeshard bench lm-head`: the LM head split over TP by vocabulary vs. replicated on every rank.

The measurement behind moeshard's choice of a vocab-parallel embedding and LM head (see
moeshard.models.layers.VocabParallelEmbedding). Both run on the same ranks, weights and rows in
the same run; the vocab-parallel logits are checked equal to the replicated ones before timing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from moeshard.bench.layer import median_ms
from moeshard.parallel import Layout, RankPool, ops, set_layout

ROWS = (1, 16, 256)  # decode-sized to prefill-sized batches of rows that need logits
PARITY = 1e-2  # the same dot products, blocked differently: at most bf16 rounding apart


def rank_bench(vocab: int, hidden: int, dtype_name: str, repeats: int) -> dict:
    parallel = set_layout(Layout(tp=2))
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(0)
    full_VD = torch.randn(vocab, hidden, generator=g).to(dtype)
    mine_VD = full_VD.chunk(2)[parallel.tp_rank].contiguous()
    out = {}
    for rows in ROWS:
        x_ND = torch.randn(rows, hidden, generator=g).to(dtype)

        def vocab_parallel():
            return ops.tp_all_gather(F.linear(x_ND, mine_VD).T.contiguous()).T

        def replicated():
            return F.linear(x_ND, full_VD)

        diff = (vocab_parallel().float() - replicated().float()).abs().max().item()
        out[rows] = (median_ms(vocab_parallel, repeats), median_ms(replicated, repeats), diff)
    return out


def run_bench_lm_head(args) -> int:
    if args.vocab % 2 or args.vocab < 2 or args.hidden < 1:
        raise ValueError(f"--vocab must be a positive even number (it is split over 2 ranks), got {args.vocab}.")
    console = Console(highlight=False)
    with console.status("bench lm-head on 2 ranks"), RankPool(2) as ranks:
        per_rank = ranks.run(rank_bench, args.vocab, args.hidden, args.dtype, args.repeats)
    bytes_per = torch.finfo(getattr(torch, args.dtype)).bits // 8
    table = Table(title=f"LM head [{args.vocab} × {args.hidden}] {args.dtype}, TP=2 (slowest rank)")
    for column in ("rows", "vocab-parallel ms", "replicated ms", "ratio (replicated / vocab-parallel)", "max |Δ|"):
        table.add_column(column, justify="right")
    for rows in ROWS:
        par, rep = (max(r[rows][i] for r in per_rank) for i in (0, 1))
        table.add_row(
            str(rows), f"{par:.2f}", f"{rep:.2f}", f"{rep / par:.2f}", f"{max(r[rows][2] for r in per_rank):.1e}"
        )
    console.print(table)
    mib = args.vocab * args.hidden * bytes_per / 2**20
    console.print(
        f"weight per rank: vocab-parallel {mib / 2:.0f} MiB, replicated {mib:.0f} MiB (twice that when untied)."
    )
    worst = max(r[rows][2] for r in per_rank for rows in ROWS)
    if worst > PARITY:
        console.print(f"[bold red]vocab-parallel logits differ from replicated ones by {worst:.1e}[/]")
    return 1 if worst > PARITY else 0
