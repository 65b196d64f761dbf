//! The synthetic proof-of-compute task: a seeded, deterministic integer matrix
//! multiplication whose result is bit-identical on every machine.
//!
//! - seed: `SHA-256(block_hash || worker_address)`, the block hash as its 32 bytes and the
//!   address as its `cpc1...` text (the seed's rule).
//! - matrices: the byte stream `SHA-256("cannabis/synthetic/v1" || seed || u64_le(i))` for
//!   `i = 0, 1, 2, ...`; the first `n*n` bytes, read as `i8`, are `A` (row-major), the next
//!   `n*n` are `B`.
//! - result: `C = A * B` with `i32` accumulation. Every entry is at most
//!   `n * 128 * 128 < 2^31` in magnitude for `n <= 131071`, so no sum ever overflows and any
//!   summation order gives the same integers: there is no floating-point reduction order
//!   to pin. (INT8 products with INT32 accumulation are also what GPU integer tensor
//!   instructions compute.)
//! - result hash: SHA-256 of `C`'s entries as little-endian `i32`, row-major.

use crate::{Address, Digest};

/// Largest supported dimension (a 8192x8192 `i32` result is 256 MiB).
pub const MAX_N: u32 = 8192;
const STREAM_DOMAIN: &[u8] = b"cannabis/synthetic/v1";

/// A synthetic task: a seed and a matrix dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SyntheticTask {
    /// The seed.
    pub seed: Digest,
    /// Matrix dimension.
    pub n: u32,
}

/// A dimension outside `1..=MAX_N`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("synthetic task size {0} is outside 1..={MAX_N}")]
pub struct SizeError(pub u32);

impl SyntheticTask {
    /// A task of dimension `n` with the given seed.
    pub fn new(seed: Digest, n: u32) -> Result<Self, SizeError> {
        if n == 0 || n > MAX_N {
            return Err(SizeError(n));
        }
        Ok(Self { seed, n })
    }

    /// The task a worker derives from a block: seed `SHA-256(block_hash || worker_address)`.
    pub fn for_block(block_hash: &Digest, worker: &Address, n: u32) -> Result<Self, SizeError> {
        let seed = Digest::of_parts(&[&block_hash.0, worker.to_string().as_bytes()]);
        Self::new(seed, n)
    }

    /// The input matrices `A` and `B`, row-major.
    pub fn matrices(&self) -> (Vec<i8>, Vec<i8>) {
        let n = self.n as usize;
        let len = n * n;
        let mut bytes = Vec::with_capacity(2 * len + 32);
        let mut counter: u64 = 0;
        while bytes.len() < 2 * len {
            let block = Digest::of_parts(&[STREAM_DOMAIN, &self.seed.0, &counter.to_le_bytes()]);
            bytes.extend_from_slice(&block.0);
            counter += 1;
        }
        let as_i8 = |b: &[u8]| b.iter().map(|&x| x as i8).collect::<Vec<i8>>();
        (as_i8(&bytes[..len]), as_i8(&bytes[len..2 * len]))
    }

    /// Computes `C = A * B`.
    pub fn compute(&self) -> Vec<i32> {
        let (a, b) = self.matrices();
        multiply(&a, &b, self.n as usize)
    }

    /// Computes the task and returns its result hash.
    pub fn run(&self) -> Digest {
        result_hash(&self.compute())
    }
}

/// `C = A * B` for `n x n` row-major `i8` matrices with `i32` accumulation.
pub fn multiply(a: &[i8], b: &[i8], n: usize) -> Vec<i32> {
    assert_eq!(a.len(), n * n, "A must be n*n");
    assert_eq!(b.len(), n * n, "B must be n*n");
    let mut c = vec![0i32; n * n];
    // i-k-j order: the inner loop runs over contiguous rows of B and C and vectorizes.
    for (a_row, c_row) in a.chunks_exact(n).zip(c.chunks_exact_mut(n)) {
        for (&a_ik, b_row) in a_row.iter().zip(b.chunks_exact(n)) {
            let a_ik = i32::from(a_ik);
            for (c_ij, &b_kj) in c_row.iter_mut().zip(b_row) {
                *c_ij += a_ik * i32::from(b_kj);
            }
        }
    }
    c
}

/// SHA-256 of the entries as little-endian `i32`, row-major.
pub fn result_hash(c: &[i32]) -> Digest {
    use sha2::Digest as _;
    let mut h = sha2::Sha256::new();
    for chunk in c.chunks(4096) {
        let bytes: Vec<u8> = chunk.iter().flat_map(|x| x.to_le_bytes()).collect();
        h.update(&bytes);
    }
    Digest(h.finalize().into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_product_by_hand() {
        // [1 2; 3 4] * [5 6; 7 8] = [19 22; 43 50]
        assert_eq!(
            multiply(&[1, 2, 3, 4], &[5, 6, 7, 8], 2),
            vec![19, 22, 43, 50]
        );
        // extremes cannot overflow
        let n = 64;
        let a = vec![-128i8; n * n];
        let c = multiply(&a, &a, n);
        assert!(c.iter().all(|&x| x == 128 * 128 * n as i32));
    }

    #[test]
    fn same_seed_same_hash_different_seed_different_hash() {
        let t1 = SyntheticTask::new(Digest::of(b"seed"), 64).unwrap();
        let t2 = SyntheticTask::new(Digest::of(b"seed"), 64).unwrap();
        let t3 = SyntheticTask::new(Digest::of(b"other"), 64).unwrap();
        assert_eq!(t1.run(), t2.run());
        assert_ne!(t1.run(), t3.run());
    }

    /// The hash is pinned: any build, on any machine, must give exactly this.
    #[test]
    fn a_known_answer_pins_the_result_across_builds() {
        let t = SyntheticTask::new(Digest::of(b"seed"), 64).unwrap();
        assert_eq!(
            t.run().to_string(),
            "1122e93f3fdaa7eec0bcee83ac778b87765425007755a7e32e604c1b4a8e2346"
        );
    }

    /// Another summation order (j-k-i, column by column) gives the same integers.
    #[test]
    fn the_order_of_summation_does_not_matter() {
        for n in [1usize, 7, 33] {
            let t = SyntheticTask::new(Digest::of(&[n as u8]), n as u32).unwrap();
            let (a, b) = t.matrices();
            let mut c = vec![0i32; n * n];
            for j in 0..n {
                for k in (0..n).rev() {
                    for i in 0..n {
                        c[i * n + j] += i32::from(a[i * n + k]) * i32::from(b[k * n + j]);
                    }
                }
            }
            assert_eq!(c, multiply(&a, &b, n), "n = {n}");
        }
    }

    #[test]
    fn sizes_are_checked() {
        assert!(SyntheticTask::new(Digest::of(b""), 0).is_err());
        assert!(SyntheticTask::new(Digest::of(b""), MAX_N + 1).is_err());
    }
}
