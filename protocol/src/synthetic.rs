//! The synthetic proof-of-compute task: a seeded, deterministic integer matrix
//! multiplication whose result is bit-identical on every machine.
//!
//! - seed: `SHA-256(block_hash || worker_address)`, the block hash as its 32 bytes and the
//!   address as its `cpc1...` text (the seed's rule).
//! - matrices: the ChaCha20 keystream (RFC 8439: 20 rounds, block counter from 0, a nonce of
//!   twelve zero bytes) under the key `SHA-256("cannabis/synthetic/v2" || seed)`; its first
//!   `n*n` bytes, read as `i8`, are `A` (row-major), the next `n*n` are `B`. (Version 1 took
//!   the bytes from a SHA-256 per 32 bytes: generating the matrices then cost more than
//!   multiplying them with the vectorised kernels, and bound every verifier's cost.)
//! - result: `C = A * B` with `i32` accumulation. Every entry is at most
//!   `n * 128 * 128 < 2^31` in magnitude for `n <= 131071`, so no sum ever overflows and any
//!   summation order gives the same integers: there is no floating-point reduction order
//!   to pin. (INT8 products with INT32 accumulation are also what GPU integer tensor
//!   instructions compute.)
//! - result hash: SHA-256 of `C`'s entries as little-endian `i32`, row-major.

use crate::{Address, Digest};

mod kernel;
mod verify;
pub use kernel::Kernel;
pub use verify::{FIELD_PRIME, VERIFY_ROUNDS, entry_bound};

/// Largest supported dimension (a 8192x8192 `i32` result is 256 MiB).
pub const MAX_N: u32 = 8192;
const STREAM_DOMAIN: &[u8] = b"cannabis/synthetic/v2";

/// A synthetic task: a seed and a matrix dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SyntheticTask {
    /// The seed.
    pub seed: Digest,
    /// Matrix dimension.
    pub n: u32,
}

/// Why a delivered product is not the task's result.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProductError {
    /// Not `n * n` entries.
    #[error("the product has {got} entries; a {n}x{n} task has {expected}")]
    WrongSize {
        /// Entries delivered.
        got: usize,
        /// The task's dimension.
        n: u32,
        /// Entries expected.
        expected: usize,
    },
    /// An entry no product of `i8` matrices of this size can have.
    #[error("entry {index} is {value}; no entry of a {n}x{n} product exceeds {bound}")]
    OutOfRange {
        /// Row-major index.
        index: usize,
        /// The value.
        value: i32,
        /// The task's dimension.
        n: u32,
        /// The largest magnitude possible.
        bound: i64,
    },
    /// The entries do not hash to the claimed result.
    #[error("the product hashes to {actual}, not to the claimed {claimed}")]
    WrongHash {
        /// Hash of the delivered entries.
        actual: Digest,
        /// The claimed result hash.
        claimed: Digest,
    },
    /// Freivalds' check failed: the entries are not `A * B`.
    #[error("the product is not A * B (Freivalds' check)")]
    WrongProduct,
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
        use chacha20::cipher::{KeyIvInit as _, StreamCipher as _};
        let n = self.n as usize;
        let key = Digest::of_parts(&[STREAM_DOMAIN, &self.seed.0]);
        let mut stream = chacha20::ChaCha20::new(&key.0.into(), &[0u8; 12].into());
        let mut bytes = vec![0u8; 2 * n * n];
        // At most 2 * 8192^2 bytes: far inside the 2^32 blocks of one keystream.
        stream.apply_keystream(&mut bytes);
        let b = bytes.split_off(n * n);
        let as_i8 = |v: Vec<u8>| v.into_iter().map(|x| x as i8).collect::<Vec<i8>>();
        (as_i8(bytes), as_i8(b))
    }

    /// Computes `C = A * B`.
    pub fn compute(&self) -> Vec<i32> {
        let (a, b) = self.matrices();
        multiply(&a, &b, self.n as usize)
    }

    /// Checks a delivered product `c` (row-major, as [`Self::compute`] gives it) against the
    /// claimed `result_hash` without recomputing it: size, every entry's range, the hash, and
    /// [`VERIFY_ROUNDS`] rounds of Freivalds' check with vectors drawn from `r_seed`, the
    /// verifier's own secret (fresh for each check). A wrong product passes with probability
    /// at most `1 / (2^31 - 1)`. Costs `O(n^2)`: the matrices, one hash of `c`, and `3 n^2`
    /// multiply-adds per round.
    pub fn verify(&self, c: &[i32], claimed: &Digest, r_seed: &Digest) -> Result<(), ProductError> {
        let n = self.n as usize;
        if c.len() != n * n {
            return Err(ProductError::WrongSize {
                got: c.len(),
                n: self.n,
                expected: n * n,
            });
        }
        let bound = entry_bound(n);
        // The largest magnitude first (a loop the compiler vectorises), the place only when
        // it is out of range.
        let largest = c.iter().fold(0u32, |m, x| m.max(x.unsigned_abs()));
        if i64::from(largest) > bound
            && let Some((index, &value)) = c
                .iter()
                .enumerate()
                .find(|(_, x)| i64::from(**x).abs() > bound)
        {
            return Err(ProductError::OutOfRange {
                index,
                value,
                n: self.n,
                bound,
            });
        }
        let actual = result_hash(c);
        if actual != *claimed {
            return Err(ProductError::WrongHash {
                actual,
                claimed: *claimed,
            });
        }
        let (a, b) = self.matrices();
        if verify::freivalds(&a, &b, c, n, r_seed, VERIFY_ROUNDS, FIELD_PRIME) {
            Ok(())
        } else {
            Err(ProductError::WrongProduct)
        }
    }

    /// Computes the task and returns its result hash.
    pub fn run(&self) -> Digest {
        result_hash(&self.compute())
    }
}

/// `C = A * B` for `n x n` row-major `i8` matrices with `i32` accumulation, on the fastest
/// kernel this CPU runs (every kernel gives the same bits).
pub fn multiply(a: &[i8], b: &[i8], n: usize) -> Vec<i32> {
    Kernel::detect().multiply(a, b, n)
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
            "b9b2af3ca138beace20e7daf4569c0c7efe8a4b0e442a6f064534357cbfa7638"
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

    /// Every kernel this CPU runs gives the reference's bits: ragged sizes (padding in
    /// rows, columns and k), sizes across the k and row blocks, and the extreme values.
    #[test]
    fn every_kernel_gives_the_reference_bits() {
        let kernels = [Kernel::Vnni, Kernel::Avx2, Kernel::Portable];
        for k in kernels.iter().filter(|k| !k.available()) {
            eprintln!("skipping the {} kernel: this CPU does not run it", k.name());
        }
        let sizes = [
            1usize, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 257,
        ];
        for n in sizes.into_iter().chain([520, 600]) {
            let t = SyntheticTask::new(Digest::of(&(n as u64).to_le_bytes()), n as u32).unwrap();
            let (a, b) = t.matrices();
            let reference = kernel::portable(&a, &b, n);
            let low = vec![-128i8; n * n];
            let high = vec![127i8; n * n];
            for k in kernels.iter().filter(|k| k.available()) {
                assert_eq!(k.multiply(&a, &b, n), reference, "{} n={n}", k.name());
                if n <= 100 || n == 600 {
                    for (x, y) in [(&low, &low), (&low, &high), (&high, &low)] {
                        let want = i32::from(x[0]) * i32::from(y[0]) * n as i32;
                        let got = k.multiply(x, y, n);
                        assert!(got.iter().all(|&v| v == want), "{} n={n}", k.name());
                    }
                }
            }
        }
    }

    #[test]
    fn verify_passes_the_honest_product_and_names_what_is_wrong() {
        let t = SyntheticTask::new(Digest::of(b"verify"), 48).unwrap();
        let c = t.compute();
        let claimed = result_hash(&c);
        let r = Digest::of(b"the verifier's secret");
        assert_eq!(t.verify(&c, &claimed, &r), Ok(()));
        // Short.
        assert!(matches!(
            t.verify(&c[1..], &claimed, &r),
            Err(ProductError::WrongSize { .. })
        ));
        // The hash of other entries.
        let mut wrong = c.clone();
        wrong[100] += 1;
        assert!(matches!(
            t.verify(&wrong, &claimed, &r),
            Err(ProductError::WrongHash { .. })
        ));
        // Consistent with its own hash, but not the product: Freivalds catches it.
        assert_eq!(
            t.verify(&wrong, &result_hash(&wrong), &r),
            Err(ProductError::WrongProduct)
        );
        // Off by the field's prime: invisible to the field check, refused by the range.
        let mut off = c.clone();
        let i = off.iter().position(|&x| x >= 0).unwrap();
        off[i] -= FIELD_PRIME as i32;
        assert!(matches!(
            t.verify(&off, &result_hash(&off), &r),
            Err(ProductError::OutOfRange { index, .. }) if index == i
        ));
        // Another task's product.
        let other = SyntheticTask::new(Digest::of(b"other"), 48)
            .unwrap()
            .compute();
        assert_eq!(
            t.verify(&other, &result_hash(&other), &r),
            Err(ProductError::WrongProduct)
        );
    }

    #[test]
    fn sizes_are_checked() {
        assert!(SyntheticTask::new(Digest::of(b""), 0).is_err());
        assert!(SyntheticTask::new(Digest::of(b""), MAX_N + 1).is_err());
    }
}
