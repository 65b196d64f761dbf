//! Checking a delivered product without recomputing it: Freivalds' method in the prime
//! field of `p = 2^31 - 1`.
//!
//! For a claimed `C` the verifier draws a secret vector `r` uniform in `F_p^n` and checks
//! `A (B r) == C r (mod p)`: `3 n^2` multiply-adds against the product's `n^3`. If `C != A B`
//! as integers, every entry of both is below `n * 2^14 <= 2^27 < p / 2` in magnitude (the
//! range check refuses anything larger), so the difference `D = C - A B` is non-zero modulo
//! `p` as well, and some row `d` of it is a non-zero linear form: `d . r = 0 (mod p)` for
//! exactly one value of a coordinate where `d` is non-zero, whatever the others are. One
//! round accepts a wrong product with probability at most `1/p < 2^-30.99`; rounds draw
//! independent vectors, so `k` rounds accept it with probability at most `p^-k`.
//!
//! Without the range check a product off by a multiple of `p` in one entry would pass; the
//! tests show both.

use crate::Digest;

/// The field's prime, `2^31 - 1`.
pub const FIELD_PRIME: u64 = (1 << 31) - 1;
/// Rounds [`super::SyntheticTask::verify`] runs: a wrong product passes with probability at
/// most `1 / (2^31 - 1) < 2^-30.99`.
pub const VERIFY_ROUNDS: u32 = 1;
const VECTOR_DOMAIN: &[u8] = b"cannabis/freivalds/v1";

/// The largest magnitude an entry of an `n x n` product of `i8` matrices can have.
pub fn entry_bound(n: usize) -> i64 {
    n as i64 * 128 * 128
}

/// `A (B r) == C r (mod p)` for `rounds` vectors drawn from `r_seed`, with `p < 2^31`.
/// Callers bound `C`'s entries by `2^27` first (or the sums could overflow).
pub(crate) fn freivalds(
    a: &[i8],
    b: &[i8],
    c: &[i32],
    n: usize,
    r_seed: &Digest,
    rounds: u32,
    p: u64,
) -> bool {
    debug_assert!(p < 1 << 31 && n <= 1 << 13);
    (0..rounds).all(|round| {
        let r = field_vector(r_seed, round, n, p);
        super::kernel::freivalds_round(a, b, c, n, &r, p as i64)
    })
}

/// One round of Freivalds' check with the vector `r` (entries in `[0, p)`); the kernels
/// compile it for the CPU's vector width. Every product is of two values that fit an
/// `i32`, which the vector units multiply to 64 bits in one instruction.
#[inline(always)]
pub(crate) fn round(a: &[i8], b: &[i8], c: &[i32], n: usize, r: &[i32], p: i64) -> bool {
    // Each sum of `dot` is at most n * 2^7 * 2^31 <= 2^51: no reduction inside a row.
    let mut br = Vec::with_capacity(n);
    for row in b.chunks_exact(n) {
        br.push(dot(row, r).rem_euclid(p) as i32);
    }
    // An entry of C is at most 2^27 and r below 2^31: r's 16-bit halves keep each sum below
    // 2^27 * 2^16 * 2^13 = 2^56.
    let r_hi: Vec<i32> = r.iter().map(|&y| y >> 16).collect();
    let r_lo: Vec<i32> = r.iter().map(|&y| y & 0xffff).collect();
    for (a_row, c_row) in a.chunks_exact(n).zip(c.chunks_exact(n)) {
        let left = dot(a_row, &br).rem_euclid(p);
        let (hi, lo) = (dot(c_row, &r_hi), dot(c_row, &r_lo));
        let right = ((hi.rem_euclid(p) << 16) + lo.rem_euclid(p)).rem_euclid(p);
        if left != right {
            return false;
        }
    }
    true
}

/// `x . y` with 64-bit sums, in eight lanes the compiler keeps in vector registers.
#[inline(always)]
fn dot<T: Copy + Into<i64>>(x: &[T], y: &[i32]) -> i64 {
    let mut lanes = [0i64; 8];
    let (xs, ys) = (x.chunks_exact(8), y.chunks_exact(8));
    let tail: i64 = xs
        .remainder()
        .iter()
        .zip(ys.remainder())
        .map(|(&u, &v)| u.into() * i64::from(v))
        .sum();
    for (u, v) in xs.zip(ys) {
        for l in 0..8 {
            lanes[l] += u[l].into() * i64::from(v[l]);
        }
    }
    lanes.iter().sum::<i64>() + tail
}

/// The verifier's vector for one round: `n` values uniform in `[0, p)`, from the 32-bit
/// little-endian words of `SHA-256("cannabis/freivalds/v1" || r_seed || u32_le(round) ||
/// u64_le(i))` for `i = 0, 1, ...`, each word below the largest multiple of `p` that fits
/// taken modulo `p`, the others skipped (so every value is equally likely).
fn field_vector(r_seed: &Digest, round: u32, n: usize, p: u64) -> Vec<i32> {
    let limit = (1u64 << 32) / p * p;
    let mut out = Vec::with_capacity(n);
    let mut counter = 0u64;
    while out.len() < n {
        let block = Digest::of_parts(&[
            VECTOR_DOMAIN,
            &r_seed.0,
            &round.to_le_bytes(),
            &counter.to_le_bytes(),
        ]);
        for w in block.0.chunks_exact(4) {
            let w = u64::from(u32::from_le_bytes([w[0], w[1], w[2], w[3]]));
            if w < limit && out.len() < n {
                out.push((w % p) as i32);
            }
        }
        counter += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic::{SyntheticTask, multiply};

    fn task(n: usize) -> (Vec<i8>, Vec<i8>, Vec<i32>) {
        let t = SyntheticTask::new(Digest::of(&(n as u64).to_le_bytes()), n as u32).unwrap();
        let (a, b) = t.matrices();
        let c = multiply(&a, &b, n);
        (a, b, c)
    }

    #[test]
    fn the_vector_is_uniform_below_p() {
        let r = field_vector(&Digest::of(b"r"), 0, 20_000, 7);
        assert!(r.iter().all(|&x| (0..7).contains(&x)));
        let mut counts = [0u32; 7];
        r.iter().for_each(|&x| counts[x as usize] += 1);
        // 20,000 / 7 = 2857 each, standard deviation about 49.
        assert!(
            counts.iter().all(|&k| (2_600..3_100).contains(&k)),
            "{counts:?}"
        );
        let big = field_vector(&Digest::of(b"r"), 0, 1_000, FIELD_PRIME);
        assert!(big.iter().all(|&x| (0..FIELD_PRIME as i32).contains(&x)));
        assert_ne!(big, field_vector(&Digest::of(b"r"), 1, 1_000, FIELD_PRIME));
    }

    #[test]
    fn an_honest_product_passes_every_round() {
        for n in [1, 2, 17, 64] {
            let (a, b, c) = task(n);
            for s in 0u8..20 {
                assert!(
                    freivalds(&a, &b, &c, n, &Digest::of(&[s]), 3, FIELD_PRIME),
                    "n={n}"
                );
            }
        }
    }

    /// With a small prime the false-accept rate is measurable: one wrong entry (off by one)
    /// passes exactly when the vector's coordinate at its column is 0, probability `1/p`.
    /// Over 20,000 vectors at `p = 97` that is 206 expected, standard deviation 14.3.
    #[test]
    fn one_wrong_entry_passes_at_the_stated_rate() {
        let n = 6;
        let (a, b, mut c) = task(n);
        c[2 * n + 3] += 1;
        let passed = (0u32..20_000)
            .filter(|s| freivalds(&a, &b, &c, n, &Digest::of(&s.to_le_bytes()), 1, 97))
            .count();
        assert!(
            (135..=278).contains(&passed),
            "{passed} of 20,000 passed at p = 97"
        );
        // Two rounds: at most p^-2 = 1/9409, about 2 expected.
        let passed = (0u32..20_000)
            .filter(|s| freivalds(&a, &b, &c, n, &Digest::of(&s.to_le_bytes()), 2, 97))
            .count();
        assert!(
            passed <= 12,
            "{passed} of 20,000 passed two rounds at p = 97"
        );
        // In the real field none of 20,000 passes (expected 20,000 / 2^31).
        let passed = (0u32..20_000)
            .filter(|s| freivalds(&a, &b, &c, n, &Digest::of(&s.to_le_bytes()), 1, FIELD_PRIME))
            .count();
        assert_eq!(passed, 0);
    }

    /// A whole wrong row (a common cheat: skip work, guess) fails at most as often.
    #[test]
    fn a_guessed_row_passes_no_more_often() {
        let n = 6;
        let (a, b, mut c) = task(n);
        for (j, x) in c[n..2 * n].iter_mut().enumerate() {
            *x = j as i32;
        }
        let passed = (0u32..20_000)
            .filter(|s| freivalds(&a, &b, &c, n, &Digest::of(&s.to_le_bytes()), 1, 97))
            .count();
        assert!(passed <= 278, "{passed} of 20,000 passed at p = 97");
    }

    /// Off by `p` in one entry is invisible modulo `p`, for every vector: that is why
    /// [`super::super::SyntheticTask::verify`] checks every entry's range first.
    #[test]
    fn an_entry_off_by_p_passes_the_field_check_alone() {
        let n = 8;
        let (a, b, mut c) = task(n);
        c[5] += 97;
        assert!((0u8..50).all(|s| freivalds(&a, &b, &c, n, &Digest::of(&[s]), 2, 97)));
    }
}
