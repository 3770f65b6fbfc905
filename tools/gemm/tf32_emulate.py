"""Runs `src/backend/cuda/kernels/tf32.cu`'s indexing on the CPU, thread by thread, against
numpy's product: every cp.async (alignment, bounds, zero fill), the commit groups a chunk's
loads fall in against the waits before its use, the stage a chunk is read from, the `mma.sync`
m16n8k8 fragments as the PTX ISA lays them out, the split-K fix-up and the epilogue. Shared
memory starts as NaN, so a read of a value never loaded shows in the result. Mirrors the
kernel by hand: change both together.

    python3 tools/gemm/tf32_emulate.py      (needs numpy)
"""
import numpy as np

BM = BN = 64
BK = 32
STAGES = 3
SA = BK + 4
THREADS = 128


def split_rows(k, tiles, sms, max_splits=8, min_chunks=4):
    """`tf32.rs`: rows of K per piece."""
    chunks = -(-k // BK)
    splits = max(1, min(-(-sms // tiles), chunks // min_chunks, max_splits))
    return -(-chunks // splits) * BK


def tf32(x):
    """cvt.rna.tf32.f32: round to 10 fraction bits, ties away from zero (finite values)."""
    u = np.float32(x).view(np.uint32)
    if (u & 0x7F800000) != 0x7F800000:
        u = np.uint32((int(u) + 0x1000) & 0xFFFFE000)
    return float(np.uint32(u).view(np.float32))


def run(m, k, n, kn, sms=132, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.uniform(-2, 2, (m, k)).astype(np.float32)
    w = rng.uniform(-2, 2, (k, n)).astype(np.float32)
    bias = rng.uniform(-2, 2, n).astype(np.float32)
    A, lda = a.ravel(), k
    if kn:
        B, ldb, sb = w.ravel(), n, BN + 8
        b_tile = BK * sb
    else:
        B, ldb, sb = np.ascontiguousarray(w.T).ravel(), k, BK + 4
        b_tile = BN * sb
    a_tile = BM * SA
    gx, gy = -(-n // BN), -(-m // BM)
    per = split_rows(k, gx * gy, sms)
    gz = -(-k // per)
    part = np.full(gz * m * n, np.nan, np.float32)
    count = [0] * (gx * gy)
    out = np.full(m * n, np.nan, np.float32)

    def cp16(smem, si, glob, gi, ok):
        assert si % 4 == 0 and gi % 4 == 0, "16-byte alignment"
        if ok:
            assert 0 <= gi and gi + 4 <= len(glob), "read past the operand"
            smem[si:si + 4] = glob[gi:gi + 4]
        else:
            smem[si:si + 4] = 0

    for bz in range(gz):
        for by in range(gy):
            for bx in range(gx):
                As = np.full(STAGES * a_tile, np.nan, np.float32)
                Bs = np.full(STAGES * b_tile, np.nan, np.float32)
                m0, n0 = by * BM, bx * BN
                kb = bz * per
                ke = min(k, kb + per)
                chunks = -(-(ke - kb) // BK)
                groups, pending = [], set()  # loads (operand, chunk) per commit group
                stage_of = {}

                def load_a(s, c):
                    kc = kb + c * BK
                    for tid in range(THREADS):
                        for j in range(BM * BK // 4 // THREADS):
                            v = tid + THREADS * j
                            r, col = v // (BK // 4), (v % (BK // 4)) * 4
                            ok = m0 + r < m and kc + col < ke
                            cp16(As, s * a_tile + r * SA + col, A, (m0 + r) * lda + kc + col if ok else 0, ok)
                    pending.add(("a", c))
                    stage_of[("a", s)] = c

                def load_b(s, c):
                    kc = kb + c * BK
                    for tid in range(THREADS):
                        for j in range(BN * BK // 4 // THREADS):
                            v = tid + THREADS * j
                            if kn:
                                r, col = v // (BN // 4), (v % (BN // 4)) * 4
                                ok = kc + r < ke and n0 + col < n
                                cp16(Bs, s * b_tile + r * sb + col, B, (kc + r) * ldb + n0 + col if ok else 0, ok)
                            else:
                                r, col = v // (BK // 4), (v % (BK // 4)) * 4
                                ok = n0 + r < n and kc + col < ke
                                cp16(Bs, s * b_tile + r * sb + col, B, (n0 + r) * ldb + kc + col if ok else 0, ok)
                    pending.add(("b", c))
                    stage_of[("b", s)] = c

                def commit():
                    groups.append(set(pending))
                    pending.clear()

                def complete_after_wait(keep):
                    done = set()
                    for grp in groups[:len(groups) - keep]:
                        done |= grp
                    return done

                for s in range(STAGES - 1):
                    if s < chunks:
                        load_b(s, s)
                for s in range(STAGES - 1):
                    if s < chunks:
                        load_a(s, s)
                    commit()
                # Each lane's accumulators: acc[warp][lane][i][j][e].
                acc = np.zeros((4, 32, 2, 4, 4), np.float64)
                for c in range(chunks):
                    done = complete_after_wait(STAGES - 2)
                    assert ("a", c) in done and ("b", c) in done, f"chunk {c} used before its group completed"
                    nxt = c + STAGES - 1
                    if nxt < chunks:
                        assert nxt % STAGES != c % STAGES
                        load_a(nxt % STAGES, nxt)
                        load_b(nxt % STAGES, nxt)
                    commit()
                    s = c % STAGES
                    assert stage_of[("a", s)] == c and stage_of[("b", s)] == c, "stage holds another chunk"
                    for warp in range(4):
                        wm, wn = (warp >> 1) * 32, (warp & 1) * 32
                        for kk in range(0, BK, 8):
                            # The lanes' fragments as the 16 x 8 A and 8 x 8 B matrices they form
                            # (PTX ISA, m16n8k8 .tf32: a0 (g, t), a1 (g + 8, t), a2 (g, t + 4),
                            # a3 (g + 8, t + 4); b0 (k t, n g), b1 (k t + 4, n g)).
                            am = np.full((2, 16, 8), np.nan)
                            bm = np.full((4, 8, 8), np.nan)
                            for lane in range(32):
                                g, t = lane >> 2, lane & 3
                                for i in range(2):
                                    p = s * a_tile + (wm + i * 16 + g) * SA + kk + t
                                    am[i, g, t] = tf32(As[p])
                                    am[i, g + 8, t] = tf32(As[p + 8 * SA])
                                    am[i, g, t + 4] = tf32(As[p + 4])
                                    am[i, g + 8, t + 4] = tf32(As[p + 8 * SA + 4])
                                for j in range(4):
                                    if kn:
                                        p = s * b_tile + (kk + t) * sb + wn + j * 8 + g
                                        bm[j, t, g], bm[j, t + 4, g] = tf32(Bs[p]), tf32(Bs[p + 4 * sb])
                                    else:
                                        p = s * b_tile + (wn + j * 8 + g) * sb + kk + t
                                        bm[j, t, g], bm[j, t + 4, g] = tf32(Bs[p]), tf32(Bs[p + 4])
                            for i in range(2):
                                for j in range(4):
                                    d = am[i] @ bm[j]
                                    # C: c0 (g, 2t), c1 (g, 2t + 1), c2 (g + 8, 2t), c3 (g + 8, 2t + 1).
                                    for lane in range(32):
                                        g, t = lane >> 2, lane & 3
                                        for e in range(4):
                                            acc[warp, lane, i, j, e] += d[g + (e >> 1) * 8, 2 * t + (e & 1)]
                assert not pending

                def each_output():
                    for warp in range(4):
                        wm, wn = (warp >> 1) * 32, (warp & 1) * 32
                        for lane in range(32):
                            g, t = lane >> 2, lane & 3
                            for i in range(2):
                                for j in range(4):
                                    for e in range(4):
                                        r = m0 + wm + i * 16 + g + (e >> 1) * 8
                                        col = n0 + wn + j * 8 + 2 * t + (e & 1)
                                        if r < m and col < n:
                                            yield warp, lane, i, j, e, r, col

                if gz > 1:
                    for warp, lane, i, j, e, r, col in each_output():
                        part[bz * m * n + r * n + col] = acc[warp, lane, i, j, e]
                    tile = by * gx + bx
                    count[tile] += 1
                    if count[tile] != gz:
                        continue
                    count[tile] = 0
                    for warp, lane, i, j, e, r, col in each_output():
                        acc[warp, lane, i, j, e] = sum(float(part[(z * m + r) * n + col]) for z in range(gz))
                for warp, lane, i, j, e, r, col in each_output():
                    out[r * n + col] = max(acc[warp, lane, i, j, e] + bias[col], 0.0)
    want = np.maximum(a.astype(np.float64) @ w.astype(np.float64) + bias, 0.0)
    mag = np.abs(a.astype(np.float64)) @ np.abs(w.astype(np.float64)) + np.abs(bias)
    err = np.abs(out.reshape(m, n) - want) / mag
    assert not np.isnan(out).any(), "an output never written, or a value never loaded"
    return gz, float(err.max())


if __name__ == "__main__":
    for m, k, n in [(100, 1000, 100), (77, 100, 36), (5, 36, 20), (130, 64, 200), (64, 4, 64), (70, 512, 72), (64, 512, 128)]:
        for kn in (False, True):
            pieces, err = run(m, k, n, kn)
            bound = 2.0 ** -10 + 2.0 ** -21
            print(f"{m} x {k} x {n} B {'[K, N]' if kn else '[N, K]'}: {pieces} pieces of K, max error {err:.2e} of sum |a||b| (TF32 inputs: <= {bound:.2e})")
            assert err <= bound
