//! The global generator: Philox4x32-10, counter-based, so that any element of a random stream
//! can be computed independently (in parallel on the host, and in the GPU's kernels) from
//! (seed, offset + element index).

use parking_lot::Mutex;

struct Generator {
    seed: u64,
    /// Counter blocks (of four u32s) handed out so far.
    offset: u64,
}

static GENERATOR: Mutex<Generator> = Mutex::new(Generator { seed: 67280421310721, offset: 0 });

/// Seeds the global generator (`torch.manual_seed`): the same seed gives the same stream.
pub fn manual_seed(seed: u64) {
    let mut g = GENERATOR.lock();
    g.seed = seed;
    g.offset = 0;
}

/// Reserves `blocks` counter blocks; returns (seed, first block).
pub(crate) fn reserve(blocks: u64) -> (u64, u64) {
    let mut g = GENERATOR.lock();
    let start = g.offset;
    g.offset += blocks;
    (g.seed, start)
}

/// (seed, first block) of the next reservation, reserving nothing: what a rehearsal draws
/// with, so that the real run after it gets the numbers it would have had.
pub(crate) fn peek() -> (u64, u64) {
    let g = GENERATOR.lock();
    (g.seed, g.offset)
}

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// Four random u32s for counter `ctr` under `seed`.
pub(crate) fn philox(seed: u64, ctr: u64) -> [u32; 4] {
    let mut c = [ctr as u32, (ctr >> 32) as u32, 0, 0];
    let mut k = [seed as u32, (seed >> 32) as u32];
    for _ in 0..10 {
        let p0 = (M0 as u64) * (c[0] as u64);
        let p1 = (M1 as u64) * (c[2] as u64);
        c = [((p1 >> 32) as u32) ^ c[1] ^ k[0], p1 as u32, ((p0 >> 32) as u32) ^ c[3] ^ k[1], p0 as u32];
        k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
    }
    c
}

/// Uniform in [0, 1) with 24 random bits (exact in f32).
pub(crate) fn uniform_f32(u: u32) -> f64 {
    (u >> 8) as f64 * (1.0 / (1u64 << 24) as f64)
}

/// Uniform in [0, 1) with 53 random bits.
pub(crate) fn uniform_f64(a: u32, b: u32) -> f64 {
    ((((a as u64) << 32) | b as u64) >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn philox_known_answer() {
        // Random123's known-answer test for philox4x32-10 with zero counter and key.
        assert_eq!(philox(0, 0), [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]);
    }
}
