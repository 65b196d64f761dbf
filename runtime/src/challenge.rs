//! The prover side of the capability challenge: rounds spread over every core.

use std::num::NonZeroUsize;

use cannabis_protocol::challenge::{Answer, Challenge, add_product};

/// Computes the challenge's answer on `threads` threads (each takes every `threads`-th round
/// and keeps its own partial sum; the sums are added at the end, so the result does not
/// depend on the thread count).
pub fn prove(challenge: &Challenge, threads: NonZeroUsize) -> Answer {
    let n = challenge.n as usize;
    let threads = threads.get().min(challenge.rounds as usize).max(1);
    let partials: Vec<Vec<i64>> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                scope.spawn(move || {
                    let mut sum = vec![0i64; n * n];
                    let mut j = t;
                    while j < challenge.rounds as usize {
                        add_product(&mut sum, &challenge.round(j as u32));
                        j += threads;
                    }
                    sum
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    let mut sum = vec![0i64; n * n];
    for p in partials {
        for (s, x) in sum.iter_mut().zip(p) {
            *s += x;
        }
    }
    Answer {
        n: challenge.n,
        sum,
    }
}

/// Threads the machine offers.
pub fn available_threads() -> NonZeroUsize {
    std::thread::available_parallelism().unwrap_or(NonZeroUsize::MIN)
}

#[cfg(test)]
mod tests {
    use super::*;
    use cannabis_protocol::Digest;

    #[test]
    fn parallel_and_serial_answers_agree_and_verify() {
        let c = Challenge::new(Digest::of(b"s"), 40, 5).unwrap();
        let serial = c.prove();
        for t in [1, 2, 3, 8] {
            let p = prove(&c, NonZeroUsize::new(t).unwrap());
            assert_eq!(p, serial, "{t} threads");
        }
        assert!(c.verify(&serial, &Digest::of(b"r")).is_ok());
    }
}
