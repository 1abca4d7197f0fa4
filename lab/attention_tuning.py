"""attention_bw's kernel-config search: the small sweep (tile configs at the heuristic split count, then split
counts x minimum chunks for the two best) and the full grid (every tile config x every split count). Each takes
`run_cfg(config, splits) -> ms` and returns [(ms, config, splits)]; a config that fails (e.g. out of shared memory)
is skipped from then on and noted."""
from __future__ import annotations

from graphcap.kernels.attention.plan import KernelConfig

TUNE = {  # (block_n, num_warps, num_stages)
    "sliding": [(32, 4, 3), (32, 4, 2), (64, 4, 2), (64, 8, 2), (16, 4, 2), (32, 8, 3)],
    "full": [(32, 8, 3), (32, 8, 2), (16, 4, 2), (32, 4, 2), (64, 8, 2), (16, 8, 3)],
}


def cfg_name(c: KernelConfig) -> str:
    return f"bn{c.block_n}/w{c.num_warps}/st{c.num_stages}/mc{c.min_chunk}"


def sweep(layer: str, run_cfg, s0: int, base: KernelConfig, failed: set, notes: list) -> list:
    """Tile configs at the heuristic split count, then split counts x minimum chunks for the two best tile configs.
    Returns [(ms, config, splits)]."""
    timed = []
    for bn, nw, ns in TUNE[layer]:
        cfg = KernelConfig(block_n=bn, num_warps=nw, num_stages=ns, min_chunk=max(bn, base.min_chunk), max_chunk=0)
        if (layer, bn, nw, ns) in failed:
            continue
        try:
            timed.append((run_cfg(cfg, s0), cfg, s0))
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: skip this config from now on
            failed.add((layer, bn, nw, ns))
            notes.append(f"{layer} BLOCK_N={bn} num_warps={nw} num_stages={ns}: {type(e).__name__}: {str(e)[:160]}")
    timed.sort(key=lambda x: x[0])
    for _, cfg, _ in timed[:2]:
        for s in sorted({max(1, s0 // 2), s0 * 2, s0 * 4} - {s0}):
            for mc in (cfg.block_n, 4 * cfg.block_n):
                c2 = KernelConfig(cfg.block_n, cfg.num_warps, cfg.num_stages, mc, max_chunk=0)
                timed.append((run_cfg(c2, min(s, 256)), c2, min(s, 256)))
    return timed


GRID_TILES = [(bn, nw, ns) for bn in (16, 32, 64) for nw in (4, 8) for ns in (1, 2, 3, 4)]
GRID_SPLITS = (1, 2, 3, 4, 6, 8, 9, 12, 16, 18, 24, 32, 48)


def grid(layer: str, run_cfg, n: int, failed: set, notes: list, tiles=GRID_TILES) -> list:
    """Every tile config x every split count (min_chunk = BLOCK_N, so the splits are what was asked): for the shapes
    where the heuristic misses its goal. Returns [(ms, config, splits)]."""
    timed = []
    for bn, nw, ns in tiles:
        if (layer, bn, nw, ns) in failed:
            continue
        for s in GRID_SPLITS:
            if s > 1 and -(-n // s) < bn:  # fewer than one tile per split: the extra splits would be empty
                continue
            cfg = KernelConfig(block_n=bn, num_warps=nw, num_stages=ns, min_chunk=bn, max_chunk=0)
            try:
                timed.append((run_cfg(cfg, s), cfg, s))
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: skip this tile config from now on
                failed.add((layer, bn, nw, ns))
                notes.append(f"{layer} BLOCK_N={bn} num_warps={nw} num_stages={ns}: {type(e).__name__}: "
                             f"{str(e)[:160]}")
                break
    return timed
