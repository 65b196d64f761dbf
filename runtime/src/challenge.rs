//! The prover side of the capability challenge: rounds spread over every core.

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicBool, Ordering};

use cannabis_protocol::challenge::{Answer, Challenge, add_product};

/// Computes the challenge's answer on `threads` threads (each takes every `threads`-th round
/// and keeps its own partial sum; the sums are added at the end, so the result does not
/// depend on the thread count).
pub fn prove(challenge: &Challenge, threads: NonZeroUsize) -> Answer {
    let never = AtomicBool::new(false);
    prove_until(challenge, threads, &never).expect("never cancelled")
}

/// Like [`prove`], but every thread stops before its next round once `cancel` is set (the
/// verifier went away): `None` then. A round is the most work done after the cancel.
pub fn prove_until(
    challenge: &Challenge,
    threads: NonZeroUsize,
    cancel: &AtomicBool,
) -> Option<Answer> {
    let n = challenge.n as usize;
    let threads = threads.get().min(challenge.rounds as usize).max(1);
    let partials: Vec<Vec<i64>> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                scope.spawn(move || {
                    let mut sum = vec![0i64; n * n];
                    let mut j = t;
                    while j < challenge.rounds as usize {
                        if cancel.load(Ordering::Relaxed) {
                            break;
                        }
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
    if cancel.load(Ordering::Relaxed) {
        return None;
    }
    let mut sum = vec![0i64; n * n];
    for p in partials {
        for (s, x) in sum.iter_mut().zip(p) {
            *s += x;
        }
    }
    Some(Answer {
        n: challenge.n,
        sum,
    })
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

    #[test]
    fn a_cancelled_proof_stops_and_gives_no_answer() {
        // Minutes of work uncancelled; a round (n = 256) is a few milliseconds.
        let c = Challenge::new(Digest::of(b"s"), 256, 4096).unwrap();
        let cancel = AtomicBool::new(false);
        let answer = std::thread::scope(|s| {
            let proof = s.spawn(|| prove_until(&c, NonZeroUsize::new(2).unwrap(), &cancel));
            std::thread::sleep(std::time::Duration::from_millis(50));
            cancel.store(true, Ordering::Relaxed);
            proof.join().unwrap()
        });
        assert_eq!(answer, None);
    }
}
