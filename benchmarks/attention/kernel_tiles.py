"""The cost model's view of each chunked kernel (benchmarks/attention/roofline.py): one function per kernel, written
from its loops, that says which tiles one program reads and writes and which products it computes.

Each function takes the launch's arguments by name (`a`: scalars and constexprs) and returns the function of one
program, called with a `Program` and the program's ids on the grid's three axes. A tensor is seen as a matrix [rows,
columns]: q [B H T, D], the states h [B Hkv NS F, D], a per-row vector such as Z_n [B H T, 1], z [B Hkv NS F, 1].
`read` and `write` name the kernel's parameter (its element size comes from the recorded launch), the first row and
the row count (multiples of 16), the first column and the column count (multiples of 16, or 0 and 1 for a vector).
A loop over the head or feature dim in chunks is one call over the whole range: what is counted is which tiles a
program touches, not how often. Loads that a mask leaves wholly empty (a key block before position 0, z past the
first value block) are not calls; a partly masked tile counts whole. Scalars (gamma, rho, the per-program sums of
rho's gradient) are left out. `dot(m, n, k)` is one product [m, k] x [k, n].

When a kernel changes, change its function here: the tile counts are the plain variables at its top.
"""

from __future__ import annotations

from hybrid_scale_kernels.utils import CHUNK

_SPREAD = [[sum(1 << (64 * (s + i)) for i in range(n)) for n in range(5)] for s in range(4)]
_COLUMNS: dict = {}  # (first column, columns) -> (columns per bit, the bits)


def _columns(c0: int, nc: int) -> tuple[int, int]:
    unit = 16 if nc >= 16 else 1
    assert nc in (1, *range(16, 1025, 16)) and c0 % unit == 0 and (c0 + nc) // unit <= 64, (c0, nc)
    _COLUMNS[c0, nc] = unit, ((1 << (nc // unit)) - 1) << (c0 // unit)
    return _COLUMNS[c0, nc]


def _mark(tiles: dict, name: str, rows: tuple[int, int], cbits: int) -> None:
    """Set the bits of rows [r0, r0 + nr) (multiples of 16) and columns `cbits` of tensor `name` in `tiles`: one key
    (name, 64-row block) per block, one 64-bit word per 16-row part of it, one bit per 16 columns (per column of a
    vector)."""
    r0, nr = rows
    assert r0 % 16 == 0 and nr % 16 == 0, rows
    r, end = r0 // 16, (r0 + nr) // 16
    while r < end:
        block, part = divmod(r, 4)
        n = min(end - r, 4 - part)
        key = (name, block)
        tiles[key] = tiles.get(key, 0) | cbits * _SPREAD[part][n]
        r += n


class Program:
    """The distinct tiles one program reads and writes, and its products' FLOPs."""

    __slots__ = ("reads", "writes", "flops", "units")

    def __init__(self, units: dict):
        self.reads: dict = {}
        self.writes: dict = {}
        self.flops = 0.0
        self.units = units  # (tensor name -> columns per bit: 16, or 1 for a vector), shared by the launch

    def read(self, name: str, r0: int, nr: int, c0: int = 0, nc: int = 1) -> None:
        self._add(self.reads, name, (r0, nr), (c0, nc))

    def write(self, name: str, r0: int, nr: int, c0: int = 0, nc: int = 1) -> None:
        self._add(self.writes, name, (r0, nr), (c0, nc))

    def _add(self, tiles: dict, name: str, rows: tuple[int, int], cols: tuple[int, int]) -> None:
        unit, cbits = _COLUMNS.get(cols) or _columns(*cols)
        if self.units.setdefault(name, unit) != unit:
            raise ValueError(f"{name} is read as a vector and as a matrix in one kernel")
        r0, nr = rows
        if nr == 64 and not r0 & 63:  # (one whole 64-row block: most calls)
            key = (name, r0 >> 6)
            tiles[key] = tiles.get(key, 0) | cbits * _SPREAD[0][4]
        else:
            _mark(tiles, name, rows, cbits)

    def dot(self, m: int, n: int, k: int) -> None:
        self.flops += 2.0 * m * n * k


def states(a: dict):
    """_chunk_states: program (feature block, value block, batch x KV head x segment) walks its segment's chunks."""
    C, F, NS, L, P = CHUNK, a["F"], a["NS"], a["L"], a["P"]
    BF, BDV, T = a["BLOCK_F"], a["BLOCK_DV"], a["T"]

    def program(p: Program, pf: int, pd: int, z: int) -> None:
        f0, d0, bh, seg = pf * BF, pd * BDV, z // P, z % P
        if a.get("HAS_INIT") and seg == 0:
            p.read("H0", bh * F + f0, BF, d0, BDV)
            p.read("Z0", bh * F + f0, BF)  # (by every value block's programs)
        for c in range(seg * L, min(seg * L + L, NS)):
            st = bh * NS + c
            p.write("HKV", st * F + f0, BF, d0, BDV)
            if pd == 0:  # (z: the first value block's programs)
                p.write("HK", st * F + f0, BF)
            p.read("FK", bh * T + c * C, C, f0, BF)
            p.read("V", bh * T + c * C, C, d0, BDV)
            p.dot(BF, BDV, C)
        if P > 1:
            p.write("END", (bh * P + seg) * F + f0, BF, d0, BDV)
            if pd == 0:
                p.write("ZEND", (bh * P + seg) * F + f0, BF)

    return program


def segment_fix(a: dict):
    """_segment_fix: on the states' grid, segment p > 0 sums the earlier segments' ends and adds them to its states."""
    F, NS, L, P, BF, BDV = a["F"], a["NS"], a["L"], a["P"], a["BLOCK_F"], a["BLOCK_DV"]

    def program(p: Program, pf: int, pd: int, z: int) -> None:
        f0, d0, bh, seg = pf * BF, pd * BDV, z // P, z % P
        if seg == 0:
            return
        for q in range(seg):
            p.read("END", (bh * P + q) * F + f0, BF, d0, BDV)
            if pd == 0:
                p.read("ZEND", (bh * P + q) * F + f0, BF)
        for c in range(seg * L, min(seg * L + L, NS)):
            st = bh * NS + c
            p.read("HKV", st * F + f0, BF, d0, BDV)
            p.write("HKV", st * F + f0, BF, d0, BDV)
            if pd == 0:
                p.read("HK", st * F + f0, BF)
                p.write("HK", st * F + f0, BF)

    return program


def output(a: dict):
    """_chunk_output: program (GF query heads of a batch x KV head, query chunk), each head in turn: the state, two
    passes over the NB + 1 key blocks (the row max, then g E + L times v), the sinks' tile; y in one or two dtypes,
    the row stats."""
    C, T, H, G, D, F, NS, NB = CHUNK, a["T"], a["H"], a["G"], a["D"], a["F"], a["NS"], a["NB"]
    GF = a["GF"]
    BS = a["BLOCK_S"]
    soft, lin, sinks = a["SOFT"], a["LIN"], a["SINKS"]
    Hkv = H // G

    def program(p: Program, pid: int, c: int, _: int) -> None:
        for bhq in range(pid * GF, pid * GF + GF):  # (the GF query heads the program folds, in turn)
            head = bhq % H
            bk = (bhq // H) * Hkv + head // G
            q, kv = bhq * T + c * C, bk * T  # the query rows, the KV head's first row
            st0 = max(c - NB, 0)
            blocks = range(st0 * C, min((c + 1) * C, T), C)
            if lin and (a.get("HAS_INIT") or c >= NB + 1):  # phi_q h and phi_q z, over feature chunks of FC
                st = bk * NS + st0
                p.read("FQ", q, C, 0, F)
                p.read("HKV", st * F, F, 0, D)
                p.read("HK", st * F, F)
                p.dot(C, D, F)
            if soft:  # the first pass: the scores of every block, for the row max
                for kb in blocks:
                    p.read("Q", q, C, 0, D)
                    p.read("K", kv + kb, C, 0, D)
                    p.dot(C, C, D)
            if sinks:  # the sinks' scores, then E_s v_s
                p.read("Q", q, C, 0, D)
                p.read("K", kv, BS, 0, D)
                p.read("V", kv, BS, 0, D)
                p.dot(C, BS, D)
                p.dot(C, D, BS)
            for kb in blocks:  # the second pass
                if lin and c * C + C - 1 - kb >= a["lin_off"]:  # (a block with L terms)
                    p.read("FQ", q, C, 0, F)
                    p.read("FK", kv + kb, C, 0, F)
                    p.dot(C, C, F)
                if soft:
                    p.read("Q", q, C, 0, D)
                    p.read("K", kv + kb, C, 0, D)
                    p.dot(C, C, D)
                p.read("V", kv + kb, C, 0, D)
                p.dot(C, D, C)
            p.write("Y", q, C, 0, D)
            if a.get("LO"):  # y's rounding error (half precision, training)
                p.write("YLO", q, C, 0, D)
            for name in ("DE", "DL") if a.get("DENS") else ():
                p.write(name, q, C)
            for name in ("M", "ZS", "IDX") if a.get("STATS") else ():
                p.write(name, q, C)

    return program


def bwd_dq(a: dict):
    """_chunk_bwd_dq: program (GF query heads of a batch x KV head, query chunk), each head in turn: dlz, each key
    block's ds and dp (`_bwd_q_block`), the sinks' tile, dq, dphi_q with the state's term."""
    C, T, H, G, D, F, NS, NB = CHUNK, a["T"], a["H"], a["G"], a["D"], a["F"], a["NS"], a["NB"]
    GF = a["GF"]
    BS = a["BLOCK_S"]
    soft, lin, sinks, hybrid, multi = a["SOFT"], a["LIN"], a["SINKS"], a["HYBRID"], a["MULTI"]
    Hkv = H // G

    def program(p: Program, pid: int, c: int, _: int) -> None:
        for bhq in range(pid * GF, pid * GF + GF):  # (the GF query heads the program folds, in turn)
            head = bhq % H
            bk = (bhq // H) * Hkv + head // G
            q, kv = bhq * T + c * C, bk * T
            p.read("ZS", q, C)
            p.read("DY", q, C, 0, D)  # dlz = do . y
            p.read("Y", q, C, 0, D)
            if a.get("Y_LO"):  # (y's rounding error)
                p.read("YLO", q, C, 0, D)
            p.write("DLZ", q, C)
            p.read("M", q, C)
            keys = [kb * C for kb in range(c - NB, c + 1) if 0 <= kb * C < T]  # (a block before 0: masked, no load)
            for kb in range(
                c - NB, c + 1
            ):  # _bwd_q_block: dp = do v^T, the scores q k^T (computed on masked blocks too)
                if kb * C in keys:
                    p.read("V", kv + kb * C, C, 0, D)
                    if soft:
                        p.read("Q", q, C, 0, D)
                        p.read("K", kv + kb * C, C, 0, D)
                p.dot(C, C, D)
                if soft:
                    p.dot(C, C, D)
                if multi:  # the block's dq and dphi_q added to the program's fp32 rows
                    lin_block = lin and (c - kb) * C + C - 1 >= a["lin_off"]  # (a block with L terms)
                    if kb * C in keys:
                        p.read("K", kv + kb * C, C, 0, D)
                        if lin_block:
                            p.read("FK", kv + kb * C, C, 0, F)
                    p.read("DQ32", q, C, 0, D)
                    p.write("DQ32", q, C, 0, D)
                    p.dot(C, D, C)
                    if lin_block:
                        p.read("DFQ32", q, C, 0, F)
                        p.write("DFQ32", q, C, 0, F)
                        p.dot(C, F, C)
            if sinks:  # the sinks' scores and dp
                p.read("Q", q, C, 0, D)
                p.read("DY", q, C, 0, D)
                p.read("K", kv, BS, 0, D)
                p.read("V", kv, BS, 0, D)
                p.dot(C, BS, D)
                p.dot(C, BS, D)
            if hybrid:
                p.read("IDX", q, C)
                p.write("RSUM", q, C)
            if sinks:  # the sinks' ds and E per row, for _chunk_bwd_dkv
                p.write("SINK_DS", q, C, 0, BS)
                p.write("SINK_E", q, C, 0, BS)
            if multi:  # dq, a head-dim chunk at a time
                p.read("DQ32", q, C, 0, D)
            else:  # ds k of each block
                for kb in keys:
                    p.read("K", kv + kb, C, 0, D)
                for _ in range(NB + 1):
                    p.dot(C, D, C)
            if sinks:
                p.read("K", kv, BS, 0, D)
                p.dot(C, D, BS)
            # (hybrid: c_n's argmax key's row of K, a window or sink key: a row of the tiles read above)
            p.write("DQ", q, C, 0, D)
            if lin:
                st0 = max(c - NB, 0)
                if multi:
                    p.read("DFQ32", q, C, 0, F)
                else:  # dp times the L weights, against phi_k, of each block (chunk c's own where lin_off < CHUNK)
                    own = a["OWN_L"]
                    for kb in keys:
                        if kb < c * C or own:
                            p.read("FK", kv + kb, C, 0, F)
                    for _ in range(NB + own):
                        p.dot(C, F, C)
                if a.get("HAS_INIT") or c >= NB + 1:  # the state's term: do h^T - dlz z
                    st = bk * NS + st0
                    p.read("DY", q, C, 0, D)
                    p.read("HKV", st * F, F, 0, D)
                    p.read("HK", st * F, F)
                    p.dot(C, F, D)
                p.write("DFQ", q, C, 0, F)

    return program


def dstates(a: dict):
    """_chunk_dstates: program (feature block, value block, batch x KV head x segment) walks its segment's states in
    reverse; each takes phi_q and do of the G query heads' chunk that reads it. Split (P > 1): each segment's own sums
    for `_dstates_fix`."""
    C, T, H, G, F, NS, NB = CHUNK, a["T"], a["H"], a["G"], a["F"], a["NS"], a["NB"]
    BF, BDV, Hkv, decay, L, P = a["BLOCK_F"], a["BLOCK_DV"], a["Hkv"], a["DECAY"], a["L"], a["P"]

    def program(p: Program, pf: int, pd: int, z: int) -> None:
        f0, d0, bh, seg = pf * BF, pd * BDV, z // P, z % P
        b, kvh = bh // Hkv, bh % Hkv
        last = 0 if a.get("HAS_INIT") else 1
        lo, hi = max(seg * L, last), min(seg * L + L, NS)
        for s in range(hi - 1, lo - 1, -1):
            st = bh * NS + s
            if decay:  # rho's gradient through the carry and the lags, against h_s: <eh, h_s>
                p.read("HKV", st * F + f0, BF, d0, BDV)
                if pd == 0:
                    p.read("HK", st * F + f0, BF)
            for qc in range(s + NB if s > 0 else 0, s + NB + 1):
                for hh in range(G):
                    rows = (b * H + kvh * G + hh) * T + qc * C
                    p.read("FQ", rows, C, f0, BF)
                    p.read("DY", rows, C, d0, BDV)
                    p.read("ZS", rows, C)
                    p.read("DLZ", rows, C)
                    p.dot(BF, BDV, C)
                    if decay:  # (phi_q^T (e lag do))
                        p.dot(BF, BDV, C)
            if s > 0:
                p.write("DHKV", st * F + f0, BF, d0, BDV)
                if pd == 0:
                    p.write("DHK", st * F + f0, BF)
            else:
                p.write("DH0", bh * F + f0, BF, d0, BDV)
                if pd == 0:
                    p.write("DZ0", bh * F + f0, BF)
        if P > 1:
            sp = bh * P + seg
            p.write("END", sp * F + f0, BF, d0, BDV)
            if pd == 0:
                p.write("ZEND", sp * F + f0, BF)

    return program


def dstates_fix(a: dict):
    """_dstates_fix: on the reverse scan's grid, segment seg < P - 1 sums the later segments' ends and adds them,
    decayed, to its states' gradients (read and written back); with the decay, rho's share from its states (read)."""
    F, NS, L, P, BF, BDV, decay = a["F"], a["NS"], a["L"], a["P"], a["BLOCK_F"], a["BLOCK_DV"], a["DECAY"]

    def program(p: Program, pf: int, pd: int, z: int) -> None:
        f0, d0, bh, seg = pf * BF, pd * BDV, z // P, z % P
        if seg == P - 1:
            return
        for q in range(seg + 1, P):
            p.read("END", (bh * P + q) * F + f0, BF, d0, BDV)
            if pd == 0:
                p.read("ZEND", (bh * P + q) * F + f0, BF)
        last = 0 if a.get("HAS_INIT") else 1
        for s in range(max(seg * L, last), seg * L + L):
            st = bh * NS + s
            name, zname, row = ("DHKV", "DHK", st * F) if s > 0 else ("DH0", "DZ0", bh * F)
            if decay:
                p.read("HKV", st * F + f0, BF, d0, BDV)
                if pd == 0:
                    p.read("HK", st * F + f0, BF)
            p.read(name, row + f0, BF, d0, BDV)
            p.write(name, row + f0, BF, d0, BDV)
            if pd == 0:
                p.read(zname, row + f0, BF)
                p.write(zname, row + f0, BF)

    return program


def bwd_dkv(a: dict):
    """_chunk_bwd_dkv: program (batch x KV head, key chunk), the whole head and feature dims: the state h_{c+1}'s
    share of dv and dphi_k; for each of the G query heads and each query block of BLOCK_Q rows of chunks c .. c + NB,
    dp, the scores and phi_q phi_k^T once, then ds^T q, (g E + L)^T do and the L terms' dp^T phi_q; dk, dv, dphi_k
    stored once; the sinks' terms of chunk c's rows (ds^T q and E^T do, added to the KV head's fp32 sums), and the
    sums written to the sink keys' rows by the KV head's last program (counted as the last chunk's)."""
    C, T, H, G, D, F, NS, NB, NC = CHUNK, a["T"], a["H"], a["G"], a["D"], a["F"], a["NS"], a["NB"], a["NC"]
    BQ, BS, BD = a["BLOCK_Q"], a["BLOCK_S"], a["BLOCK_D"]
    soft, lin, sinks, hybrid = a["SOFT"], a["LIN"], a["SINKS"], a["HYBRID"]
    Hkv = H // G

    def program(p: Program, bkv: int, c: int, _: int) -> None:
        kv = bkv * T + c * C  # this chunk's key rows
        if lin and c <= NS - 2:  # the keys' share of h_{c+1}: phi_k dh into dv, dh v^T + dz into dphi_k
            st = bkv * NS + c + 1
            p.read("FK", kv, C, 0, F)
            p.read("DHKV", st * F, F, 0, D)
            p.dot(C, D, F)
            p.read("V", kv, C, 0, D)
            p.dot(F, C, D)
            p.read("DHK", st * F, F)
        for hh in range(G if soft or lin else 0):
            q_base = ((bkv // Hkv) * H + (bkv % Hkv) * G + hh) * T
            for q0 in range(c * C, min((c + NB + 1) * C, T), BQ):
                q = q_base + q0
                p.read("ZS", q, BQ)
                p.read("DLZ", q, BQ)
                p.read("DY", q, BQ, 0, D)
                p.read("V", kv, C, 0, D)
                p.dot(BQ, C, D)  # dp = do v^T
                if soft:
                    p.read("Q", q, BQ, 0, D)
                    p.read("K", kv, C, 0, D)
                    p.dot(BQ, C, D)  # the scores
                    p.read("M", q, BQ)
                    if hybrid:
                        p.read("IDX", q, BQ)
                        p.read("RSUM", q, BQ)
                    p.dot(C, D, BQ)  # ds^T q
                if lin and q0 + BQ - 1 - c * C >= a["lin_off"]:  # (a block with L terms)
                    p.read("FQ", q, BQ, 0, F)
                    p.read("FK", kv, C, 0, F)
                    p.dot(BQ, C, F)  # phi_q phi_k^T
                    p.dot(F, C, BQ)  # phi_q^T (dp w)
                p.dot(C, D, BQ)  # (g E + L)^T do
        p.write("DK", kv, C, 0, D)
        p.write("DV", kv, C, 0, D)
        if lin:
            p.write("DFK", kv, C, 0, F)
        if sinks:
            for hh in range(G):
                q = ((bkv // Hkv) * H + (bkv % Hkv) * G + hh) * T + c * C
                p.read("SINK_DS", q, C, 0, BS)
                p.read("SINK_E", q, C, 0, BS)
                p.read("Q", q, C, 0, D)
                p.read("DY", q, C, 0, D)
                p.read("ZS", q, C)
                p.dot(D, BS, C)  # q^T ds
                p.dot(D, BS, C)  # do^T E
            p.read("SINK_DKV", bkv * 2 * BS, 2 * BS, 0, BD)  # (atomic adds: read and written)
            p.write("SINK_DKV", bkv * 2 * BS, 2 * BS, 0, BD)
            if c == NC - 1:  # the last program: the sums into the sink keys' rows
                p.write("DK", bkv * T, BS, 0, D)
                p.write("DV", bkv * T, BS, 0, D)

    return program


KERNELS = {
    "_chunk_states": states,
    "_segment_fix": segment_fix,
    "_chunk_output": output,
    "_chunk_bwd_dq": bwd_dq,
    "_chunk_dstates": dstates,
    "_dstates_fix": dstates_fix,
    "_chunk_bwd_dkv": bwd_dkv,
}
