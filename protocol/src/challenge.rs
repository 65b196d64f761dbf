//! The capability challenge: a seeded integer matrix workload sized to what a node claims,
//! whose answer is checked far more cheaply than it is computed (Freivalds' algorithm).
//!
//! - The verifier picks a fresh random `seed`, a dimension `n` and a number of `rounds`.
//! - Round `j` uses the synthetic task with seed `SHA-256("cannabis/challenge/v1" || seed ||
//!   u32_le(j))`: `A_j`, `B_j` are `n x n` `i8` matrices (see [`crate::synthetic`]).
//! - The answer is `S = sum_j A_j * B_j`, exact in `i64`. Computing it takes
//!   `2 * rounds * n^3` integer operations and no round can be skipped: each enters the sum.
//! - The verifier draws a secret vector `r` of `n` values below `2^32` and checks
//!   `sum_j A_j (B_j r) == S r` exactly (in `i128`): `rounds * (2 n^2)` multiply-adds for
//!   the left side plus `n^2` for the right, against the prover's `rounds * n^3`. If `S` is
//!   wrong in any entry, a row `d` of the difference is non-zero and `d . r = 0` for at most
//!   one value of the coordinate of `r` where `d` is non-zero, so a wrong answer passes with
//!   probability at most `2^-32`.
//!
//! What it proves, and what not: see `docs/security.md` ("Capability challenge").

use crate::synthetic::{self, SyntheticTask};
use crate::{Digest, Timestamp};

const ROUND_DOMAIN: &[u8] = b"cannabis/challenge/v1";
/// Largest challenge dimension: keeps the answer (`8 n^2` bytes) at 32 MiB.
pub const MAX_CHALLENGE_N: u32 = 2048;
/// Most rounds in one challenge.
pub const MAX_ROUNDS: u32 = 4096;
/// The reference rate: integer operations per second one claimed core is taken to sustain
/// when a prover bounds the work it accepts (the default sizing uses the same rate).
pub const REFERENCE_OPS_PER_CORE_PER_SEC: u64 = 2_000_000_000;
/// Most seconds of work, at the reference rate for the cores it claims, that a prover
/// accepts in one challenge: four times the default target, so verifiers with their own
/// sizing have room, while a request can never buy more than that of the prover's time.
pub const MAX_CHALLENGE_SECS: u64 = 8;

/// A challenge as the verifier sets it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Challenge {
    /// The verifier's fresh random seed.
    pub seed: Digest,
    /// Matrix dimension.
    pub n: u32,
    /// Number of products summed.
    pub rounds: u32,
}

/// The prover's answer: `S` row-major.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    /// Dimension the prover computed.
    pub n: u32,
    /// `S = sum_j A_j * B_j`, row-major.
    pub sum: Vec<i64>,
}

/// Why a challenge answer failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChallengeError {
    /// Dimension or rounds outside the supported range.
    #[error(
        "challenge size n={n}, rounds={rounds} is outside 1..={MAX_CHALLENGE_N} x 1..={MAX_ROUNDS}"
    )]
    BadSize {
        /// Dimension.
        n: u32,
        /// Rounds.
        rounds: u32,
    },
    /// The answer is for another size.
    #[error("answer is {got} entries for n={claimed}; the challenge needs {expected}")]
    WrongSize {
        /// Entries the answer holds.
        got: usize,
        /// Dimension the answer claims.
        claimed: u32,
        /// Entries expected.
        expected: usize,
    },
    /// Freivalds' check failed: the answer is not the product sum.
    #[error("the answer is not the challenge's product sum")]
    WrongAnswer,
    /// Larger than the prover's claim justifies: it answers only challenges sized to it.
    #[error(
        "challenge of {ops} operations is more than {max} ({MAX_CHALLENGE_SECS} s at the reference rate for {cores} claimed cores)"
    )]
    BeyondClaim {
        /// Operations the challenge asks for.
        ops: u128,
        /// The most the claim justifies.
        max: u128,
        /// Cores claimed.
        cores: u32,
    },
    /// The answer came after the deadline.
    #[error("answered after {took_ms} ms; the deadline was {deadline_ms} ms")]
    TooSlow {
        /// Time taken.
        took_ms: u64,
        /// Deadline.
        deadline_ms: u64,
    },
}

impl Challenge {
    /// A challenge; refuses sizes outside the supported range.
    pub fn new(seed: Digest, n: u32, rounds: u32) -> Result<Self, ChallengeError> {
        if n == 0 || n > MAX_CHALLENGE_N || rounds == 0 || rounds > MAX_ROUNDS {
            return Err(ChallengeError::BadSize { n, rounds });
        }
        Ok(Self { seed, n, rounds })
    }

    /// The synthetic task of round `j`.
    pub fn round(&self, j: u32) -> SyntheticTask {
        SyntheticTask {
            seed: Digest::of_parts(&[ROUND_DOMAIN, &self.seed.0, &j.to_le_bytes()]),
            n: self.n,
        }
    }

    /// Integer operations the prover performs: `2 * rounds * n^3`.
    pub fn prover_ops(&self) -> u128 {
        2 * u128::from(self.rounds) * u128::from(self.n).pow(3)
    }

    /// Computes the answer on one thread. (The runtime's prover spreads rounds over cores.)
    pub fn prove(&self) -> Answer {
        let n = self.n as usize;
        let mut sum = vec![0i64; n * n];
        for j in 0..self.rounds {
            add_product(&mut sum, &self.round(j));
        }
        Answer { n: self.n, sum }
    }

    /// Checks `answer` with Freivalds' algorithm, using `r_seed` (the verifier's secret,
    /// drawn fresh for each check) for the random vector.
    pub fn verify(&self, answer: &Answer, r_seed: &Digest) -> Result<(), ChallengeError> {
        self.verify_below(answer, r_seed, 1 << 32)
    }

    /// [`Self::verify`] with the vector's entries below `bound` (at most `2^32`): a wrong
    /// answer passes with probability at most `1 / bound`. Small bounds make that rate
    /// measurable in tests.
    fn verify_below(
        &self,
        answer: &Answer,
        r_seed: &Digest,
        bound: u64,
    ) -> Result<(), ChallengeError> {
        let n = self.n as usize;
        if answer.n != self.n || answer.sum.len() != n * n {
            return Err(ChallengeError::WrongSize {
                got: answer.sum.len(),
                claimed: answer.n,
                expected: n * n,
            });
        }
        let r = random_vector(r_seed, n, bound);
        // Right side: S r.
        let sr: Vec<i128> = answer
            .sum
            .chunks_exact(n)
            .map(|row| {
                row.iter()
                    .zip(&r)
                    .map(|(&s, &x)| i128::from(s) * i128::from(x))
                    .sum()
            })
            .collect();
        // Left side: sum_j A_j (B_j r).
        let mut lhs = vec![0i128; n];
        for j in 0..self.rounds {
            let (a, b) = self.round(j).matrices();
            let br: Vec<i64> = b
                .chunks_exact(n)
                .map(|row| row.iter().zip(&r).map(|(&v, &x)| i64::from(v) * x).sum())
                .collect();
            for (acc, row) in lhs.iter_mut().zip(a.chunks_exact(n)) {
                *acc += row
                    .iter()
                    .zip(&br)
                    .map(|(&v, &x)| i128::from(v) * i128::from(x))
                    .sum::<i128>();
            }
        }
        if lhs == sr {
            Ok(())
        } else {
            Err(ChallengeError::WrongAnswer)
        }
    }
}

/// Adds `A * B` of `task` into `sum`.
pub fn add_product(sum: &mut [i64], task: &SyntheticTask) {
    let n = task.n as usize;
    let (a, b) = task.matrices();
    let c = synthetic::multiply(&a, &b, n);
    for (s, x) in sum.iter_mut().zip(c) {
        *s += i64::from(x);
    }
}

/// The verifier's vector: `n` values uniform below `bound` (at most `2^32`) from the 32-bit
/// little-endian words of `SHA-256(r_seed || u64_le(i))`, each word below the largest
/// multiple of `bound` that fits taken modulo `bound`, the others skipped.
fn random_vector(r_seed: &Digest, n: usize, bound: u64) -> Vec<i64> {
    let limit = (1u64 << 32) / bound * bound;
    let mut out = Vec::with_capacity(n);
    let mut counter = 0u64;
    while out.len() < n {
        let block = Digest::of_parts(&[&r_seed.0, &counter.to_le_bytes()]);
        for chunk in block.0.chunks_exact(4) {
            let w = u64::from(u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]));
            if out.len() < n && w < limit {
                out.push((w % bound) as i64);
            }
        }
        counter += 1;
    }
    out
}

/// A claim to size a challenge against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Claim {
    /// Logical CPU cores claimed.
    pub cpu_cores: u32,
}

impl Claim {
    /// The most work a prover with this claim accepts in one challenge:
    /// `MAX_CHALLENGE_SECS` at the reference rate for its cores.
    pub fn max_prover_ops(&self) -> u128 {
        u128::from(REFERENCE_OPS_PER_CORE_PER_SEC)
            * u128::from(self.cpu_cores.max(1))
            * u128::from(MAX_CHALLENGE_SECS)
    }

    /// Whether a prover with this claim takes `challenge`: it must be sized to the claim,
    /// no larger.
    pub fn admits(&self, challenge: &Challenge) -> Result<(), ChallengeError> {
        let (ops, max) = (challenge.prover_ops(), self.max_prover_ops());
        if ops > max {
            return Err(ChallengeError::BeyondClaim {
                ops,
                max,
                cores: self.cpu_cores,
            });
        }
        Ok(())
    }
}

/// How challenges are sized and timed against a claim.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sizing {
    /// Matrix dimension.
    pub n: u32,
    /// Integer operations per second one claimed core is expected to sustain.
    pub ops_per_core_per_sec: u64,
    /// Target time for an honest node, in milliseconds.
    pub target_ms: u64,
    /// Deadline as a multiple of the target time (slack for load and scheduling).
    pub slack: u64,
    /// Shortest deadline, in milliseconds: covers the round trip and start-up that tiny
    /// challenges would otherwise be dominated by.
    pub min_deadline_ms: u64,
}

impl Default for Sizing {
    fn default() -> Self {
        Self {
            n: 1024,
            // Measured reference (docs/benchmarks.md): a 2-core EPYC VM sustains about
            // 2.7e9 to 4.4e9 integer operations per second per core with the autovectorized
            // loop; the reference is set below that, and the deadline adds slack on top.
            ops_per_core_per_sec: REFERENCE_OPS_PER_CORE_PER_SEC,
            target_ms: 2_000,
            slack: 3,
            min_deadline_ms: 1_000,
        }
    }
}

impl Sizing {
    /// Rounds so that an honest node with the claimed cores needs about `target_ms`.
    pub fn rounds_for(&self, claim: &Claim) -> u32 {
        let per_round = 2 * u128::from(self.n).pow(3);
        let budget = u128::from(self.ops_per_core_per_sec)
            * u128::from(claim.cpu_cores.max(1))
            * u128::from(self.target_ms)
            / 1000;
        let rounds = budget.checked_div(per_round).unwrap_or(1);
        u32::try_from(rounds.clamp(1, u128::from(MAX_ROUNDS))).unwrap_or(MAX_ROUNDS)
    }

    /// The challenge for `claim` with the verifier's `seed`.
    pub fn challenge(&self, seed: Digest, claim: &Claim) -> Result<Challenge, ChallengeError> {
        Challenge::new(seed, self.n, self.rounds_for(claim))
    }

    /// The deadline for a challenge: `slack` times the time the claimed cores need.
    pub fn deadline_ms(&self, challenge: &Challenge, claim: &Claim) -> u64 {
        let rate = u128::from(self.ops_per_core_per_sec) * u128::from(claim.cpu_cores.max(1));
        let ms = challenge.prover_ops() * 1000 / rate.max(1);
        u64::try_from(ms)
            .unwrap_or(u64::MAX)
            .saturating_mul(self.slack)
            .max(self.min_deadline_ms)
    }

    /// Full check of a timed answer: on time, and correct.
    pub fn check(
        &self,
        challenge: &Challenge,
        claim: &Claim,
        answer: &Answer,
        issued_at: Timestamp,
        answered_at: Timestamp,
        r_seed: &Digest,
    ) -> Result<(), ChallengeError> {
        let took_ms = answered_at.ms_since(issued_at);
        let deadline_ms = self.deadline_ms(challenge, claim);
        if took_ms > deadline_ms {
            return Err(ChallengeError::TooSlow {
                took_ms,
                deadline_ms,
            });
        }
        challenge.verify(answer, r_seed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn challenge(seed: &[u8], n: u32, rounds: u32) -> Challenge {
        Challenge::new(Digest::of(seed), n, rounds).unwrap()
    }

    #[test]
    fn an_honest_answer_passes() {
        let c = challenge(b"seed", 48, 3);
        let a = c.prove();
        for r in [b"r1".as_slice(), b"r2", b"r3"] {
            assert_eq!(c.verify(&a, &Digest::of(r)), Ok(()));
        }
    }

    #[test]
    fn one_changed_element_fails() {
        let c = challenge(b"seed", 48, 3);
        let honest = c.prove();
        for i in [0, 1, 47, 48 * 20 + 7, 48 * 48 - 1] {
            let mut a = honest.clone();
            a.sum[i] += 1;
            assert_eq!(
                c.verify(&a, &Digest::of(b"r")),
                Err(ChallengeError::WrongAnswer),
                "{i}"
            );
        }
    }

    /// The stated rate, measured: with the vector's entries below 97, an answer with one
    /// entry off by one passes exactly when the entry of `r` at its column is 0, so about
    /// 20,000 / 97 = 206 of 20,000 checks pass (standard deviation 14.3). With the real
    /// bound, `2^32`, none does.
    #[test]
    fn one_wrong_entry_passes_at_the_stated_rate() {
        let c = challenge(b"seed", 6, 2);
        let mut a = c.prove();
        a.sum[9] += 1;
        let passed = |bound| {
            (0u32..20_000)
                .filter(|s| {
                    c.verify_below(&a, &Digest::of(&s.to_le_bytes()), bound)
                        .is_ok()
                })
                .count()
        };
        let small = passed(97);
        assert!(
            (135..=278).contains(&small),
            "{small} of 20,000 passed at bound 97"
        );
        assert_eq!(passed(1 << 32), 0);
    }

    #[test]
    fn a_reused_seeds_answer_fails() {
        let old = challenge(b"old seed", 32, 2).prove();
        let new = challenge(b"new seed", 32, 2);
        assert_eq!(
            new.verify(&old, &Digest::of(b"r")),
            Err(ChallengeError::WrongAnswer)
        );
    }

    #[test]
    fn fewer_rounds_fail() {
        // A prover that skips a round (claims the work, does less of it).
        let c = challenge(b"seed", 32, 4);
        let lazy = challenge(b"seed", 32, 3).prove();
        assert_eq!(
            c.verify(&lazy, &Digest::of(b"r")),
            Err(ChallengeError::WrongAnswer)
        );
    }

    #[test]
    fn an_answer_for_a_smaller_size_fails() {
        let c = challenge(b"seed", 48, 2);
        let small = challenge(b"seed", 32, 2).prove();
        assert!(matches!(
            c.verify(&small, &Digest::of(b"r")),
            Err(ChallengeError::WrongSize { .. })
        ));
        // Padded to the right length, it is still wrong.
        let mut padded = small.clone();
        padded.n = 48;
        padded.sum.resize(48 * 48, 0);
        assert_eq!(
            c.verify(&padded, &Digest::of(b"r")),
            Err(ChallengeError::WrongAnswer)
        );
    }

    #[test]
    fn sizing_scales_with_the_claim_and_sets_a_deadline() {
        let s = Sizing {
            n: 64,
            ops_per_core_per_sec: 10_000_000,
            target_ms: 1000,
            slack: 3,
            min_deadline_ms: 1000,
        };
        let small = Claim { cpu_cores: 2 };
        let big = Claim { cpu_cores: 64 };
        assert!(s.rounds_for(&big) >= s.rounds_for(&small) * 30);
        let c = s.challenge(Digest::of(b"x"), &small).unwrap();
        let deadline = s.deadline_ms(&c, &small);
        // About a second of work for two honest cores; the deadline gives three.
        assert!((2_000..=3_100).contains(&deadline), "{deadline}");
        let answer = c.prove();
        let t0 = Timestamp(0);
        assert!(matches!(
            s.check(
                &c,
                &small,
                &answer,
                t0,
                t0.plus_ms(deadline + 1),
                &Digest::of(b"r")
            ),
            Err(ChallengeError::TooSlow { .. })
        ));
        assert_eq!(
            s.check(
                &c,
                &small,
                &answer,
                t0,
                t0.plus_ms(deadline),
                &Digest::of(b"r")
            ),
            Ok(())
        );
        // Claiming 64 cores earns 32 times the work in the same deadline.
        let big_c = s.challenge(Digest::of(b"x"), &big).unwrap();
        assert!(s.deadline_ms(&big_c, &big) <= deadline + 100);
    }

    #[test]
    fn sizes_are_bounded() {
        assert!(Challenge::new(Digest::of(b""), 0, 1).is_err());
        assert!(Challenge::new(Digest::of(b""), MAX_CHALLENGE_N + 1, 1).is_err());
        assert!(Challenge::new(Digest::of(b""), 8, 0).is_err());
        assert!(Challenge::new(Digest::of(b""), 8, MAX_ROUNDS + 1).is_err());
    }

    #[test]
    fn a_prover_takes_only_challenges_sized_to_its_claim() {
        let sizing = Sizing::default();
        for cores in [1, 2, 16, 128, 1024] {
            let claim = Claim { cpu_cores: cores };
            let c = sizing.challenge(Digest::of(b"s"), &claim).unwrap();
            assert_eq!(claim.admits(&c), Ok(()), "{cores} cores, default sizing");
        }
        // The largest request there is: hours of work on every core of a small machine.
        let huge = Challenge::new(Digest::of(b"s"), MAX_CHALLENGE_N, MAX_ROUNDS).unwrap();
        let two = Claim { cpu_cores: 2 };
        assert!(matches!(
            two.admits(&huge),
            Err(ChallengeError::BeyondClaim { cores: 2, .. })
        ));
        // Just over the bound is refused, at it taken.
        let at = Challenge::new(Digest::of(b"s"), 1000, 16).unwrap();
        assert_eq!(at.prover_ops(), two.max_prover_ops());
        assert_eq!(two.admits(&at), Ok(()));
        let over = Challenge::new(Digest::of(b"s"), 1000, 17).unwrap();
        assert!(two.admits(&over).is_err());
    }
}
