"""The split-K decode attention's settings by batch size: keys per partition, the grid's partition cap and the
kernel's tile, in one table the runner reads and a benchmark may replace (`DecodeTable.parse`, for an A/B of the
whole engine without editing code). Sizes count decode programs per partition: rows x KV heads.

Spec strings, comma-separated: `P:K` (up to P programs, K keys per partition), `K` (past the last P), either with
`/BxW` (BLOCK_N B, W warps), and `max=N` (the grid's partitions at most). The `P:K` entries are the whole partition
table (none: K keys at every size); what else a spec leaves out keeps its default. The default table is
"8:64,32:128,128:256,512/64x4,max=64"; `min=N` (the grid's partitions at least, where WAVES gives fewer) is
left out of it.
"""

from __future__ import annotations

from dataclasses import dataclass

DECODE_PARTITIONS = ((8, 64), (32, 128), (128, 256))  # (up to this many programs, keys per split-K partition)
LONG_PARTITION = 512
MAX_PARTITIONS = 64  # split-K partitions of a decode grid at most; longer contexts get longer partitions
WAVES = 4  # (sequence, KV head, partition) programs per SM that a long context's decode grid aims for
DECODE_TILES = ()  # (up to this many programs, BLOCK_N, num_warps) of paged_decode
DECODE_TILE = (64, 4)  # (BLOCK_N, num_warps) past DECODE_TILES
WARPS = (1, 2, 4, 8, 16)


def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class DecodeTable:
    partitions: tuple[tuple[int, int], ...] = DECODE_PARTITIONS  # (programs up to, keys per partition)
    long_partition: int = LONG_PARTITION  # past the last entry
    tiles: tuple[tuple[int, int, int], ...] = DECODE_TILES  # (programs up to, BLOCK_N, num_warps)
    long_tile: tuple[int, int] = DECODE_TILE  # past the last tile entry
    max_partitions: int = MAX_PARTITIONS
    min_partitions: int = 1

    def __post_init__(self):
        for name, rows in (("partitions", self.partitions), ("tiles", self.tiles)):
            limits = [r[0] for r in rows]
            if limits != sorted(set(limits)) or any(n < 1 for n in limits):
                raise ValueError(f"decode table {name}: program limits {limits} must rise, from 1 up")
        if not {t[0] for t in self.tiles} <= {p[0] for p in self.partitions}:
            raise ValueError("decode table: a tile's program limit is one of the partition table's")
        for bn, nw in [t[1:] for t in self.tiles] + [self.long_tile]:
            if bn < 16 or bn & (bn - 1) or nw not in WARPS:
                raise ValueError(f"decode tile {bn}x{nw}: BLOCK_N is a power of two >= 16, num_warps one of {WARPS}")
        if any(k < 1 for k in [p for _, p in self.partitions] + [self.long_partition]):
            raise ValueError(f"decode table {self.spec()}: keys per partition are positive")
        for cap in (self.max_partitions, self.min_partitions):
            if cap < 1 or cap & (cap - 1):
                raise ValueError(f"decode table {self.spec()}: the partition caps are powers of two (a graph key each)")
        if self.min_partitions > self.max_partitions:
            raise ValueError(f"decode table {self.spec()}: min= above max=")

    def tile(self, programs: int) -> tuple[int, int]:
        """(BLOCK_N, num_warps) of a grid of `programs` programs per partition."""
        return next(((bn, nw) for limit, bn, nw in self.tiles if programs <= limit), self.long_tile)

    def partition(self, programs: int) -> int:
        """Keys per split-K partition: a batch of few programs cuts its contexts finer, so that more of the GPU's SMs
        share the keys (one program walks its keys serially). A multiple of the tile's BLOCK_N, as the kernel runs."""
        part = next((p for limit, p in self.partitions if programs <= limit), self.long_partition)
        bn = self.tile(programs)[0]
        return -(-part // bn) * bn

    def grid_cap(self, programs: int, sms: int) -> int:
        """Split-K partitions of a decode grid at most: a power of two that gives WAVES programs per SM, so that a
        long context keeps the GPU busy at small batches, within max_partitions. One grid serves every context (the
        kernel lengthens the partitions), so a CUDA graph per power of two up to this covers any context."""
        return min(self.max_partitions, max(self.min_partitions, pow2(-(-WAVES * sms // programs))))

    @classmethod
    def parse(cls, spec: str) -> DecodeTable:
        """The table of a spec string (the module docstring)."""
        parts, tiles, kw = [], [], {}
        for entry in filter(None, (e.strip() for e in spec.split(","))):
            try:
                if entry.startswith(("max=", "min=")):
                    kw[entry[:3] + "_partitions"] = int(entry[4:])
                    continue
                head, _, tile = entry.partition("/")
                bn_nw = tuple(int(x) for x in tile.split("x")) if tile else None
                if bn_nw is not None and len(bn_nw) != 2:
                    raise ValueError
                if ":" in head:
                    limit, keys = (int(x) for x in head.split(":"))
                    parts.append((limit, keys))
                    if bn_nw:
                        tiles.append((limit, *bn_nw))
                else:
                    kw["long_partition"] = int(head)
                    if bn_nw:
                        kw["long_tile"] = bn_nw
            except ValueError:
                raise ValueError(f"decode table entry {entry!r}: want P:K, K (either with /BxW) or max=N") from None
        return cls(partitions=tuple(parts), tiles=tuple(tiles), **kw)

    def spec(self) -> str:
        tiles = {limit: (bn, nw) for limit, bn, nw in self.tiles}
        rows = [f"{limit}:{p}" + (f"/{tiles[limit][0]}x{tiles[limit][1]}" if limit in tiles else "")
                for limit, p in self.partitions]
        floor = [f"min={self.min_partitions}"] if self.min_partitions > 1 else []
        return ",".join(rows + [f"{self.long_partition}/{self.long_tile[0]}x{self.long_tile[1]}",
                                f"max={self.max_partitions}"] + floor)


# The fp8 cache (e4m3 bytes and a scale a token and head, decoded in the kernel) wants wider tiles and, at a few
# sequences, longer partitions: its decode is bound by the per-element decode, not by the bytes it reads. The H200's
# sweep (`python -m tools.bench_decode_attention --kv-cache-dtype fp8`, 2026-12-04, docs/BENCHMARKS.md): at batch 1 /
# 4k our bf16 table's 64 keys, 64 x 4 took 15.3 us, 128 keys at 128 x 4 11.3; batch 4 / 4k 39.8 us against 24.1 for
# 512 keys at 128 x 4; batch 16 / 16k 369.3 against ~285 for 128 keys at 128 x 4 (at the runner's cap of 8). Past 128
# programs (batch 64 at 8 KV heads), the second sweep (2026-12-04, late): 128-key partitions at 128 x 4 and at least 4
# of them, 1,425.5 -> 1,104.7 us at 16k and 370.4 -> 293.8 at 4k (the bf16 rows' 512 keys at 64 x 4, capped at 2).
FP8_SPEC = "8:128/128x4,32:512/128x4,128:128/128x4,128/128x4,max=64,min=4"


def for_cache(kv_quant: str | None) -> DecodeTable:
    """The runner's table for a KV cache of `kv_quant`'s elements (None: the activations' dtype, or "int8")."""
    return DecodeTable.parse(FP8_SPEC) if kv_quant == "fp8" else DecodeTable()
