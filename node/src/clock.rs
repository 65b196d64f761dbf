//! The node's clock: wall-clock time as the node measures it, from a monotonic clock.
//!
//! Leases, expiries and timers are measured with it, so a step of the machine's wall clock
//! (an administrator's `date -s`, a suspended laptop's NTP correction) does not stretch or
//! cut them at once: the node's time follows the wall clock at most `MAX_SLEW_MS` per
//! `SLEW_EVERY`, the rest of a step being taken up over the following minutes. Signed
//! times from other nodes are judged against it with the view's skew allowance
//! (`ViewConfig::max_clock_skew_ms`, 2 minutes). See docs/security.md ("Clocks").

use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Most the node's time moves toward the wall clock per `SLEW_EVERY`: 10% faster or
/// slower than real time at most.
pub const MAX_SLEW_MS: i64 = 1_000;
/// How often the node's time is brought toward the wall clock.
pub const SLEW_EVERY: Duration = Duration::from_secs(10);

/// A wall-clock reading tied to a monotonic instant.
#[derive(Clone, Copy, Debug)]
pub struct Clock {
    base_us: i128,
    base: Instant,
}

impl Clock {
    /// A clock reading `wall_us` at `at`.
    pub fn new(wall_us: u64, at: Instant) -> Self {
        Self {
            base_us: i128::from(wall_us),
            base: at,
        }
    }

    /// The node's time at `t`, in microseconds since the epoch.
    pub fn at(&self, t: Instant) -> u64 {
        let elapsed = t.saturating_duration_since(self.base).as_micros() as i128;
        u64::try_from((self.base_us + elapsed).max(0)).unwrap_or(u64::MAX)
    }

    /// Moves the node's time toward the wall clock's `wall_us` at `t`, by at most
    /// `MAX_SLEW_MS`; returns the step taken, in microseconds.
    pub fn follow(&mut self, wall_us: u64, t: Instant) -> i64 {
        let diff = i128::from(wall_us) - i128::from(self.at(t));
        let max = i128::from(MAX_SLEW_MS) * 1000;
        let step = diff.clamp(-max, max);
        self.base_us += step;
        step as i64
    }
}

fn wall_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

static CLOCK: Mutex<Option<Clock>> = Mutex::new(None);

fn with<R>(f: impl FnOnce(&mut Clock, Instant) -> R) -> R {
    let t = Instant::now();
    let mut guard = CLOCK.lock().unwrap_or_else(|p| p.into_inner());
    let clock = guard.get_or_insert_with(|| Clock::new(wall_us(), t));
    f(clock, t)
}

/// The node's time, in microseconds since the epoch.
pub fn now_us() -> u64 {
    with(|c, t| c.at(t))
}

/// Brings the node's time toward the wall clock (call every `SLEW_EVERY`); returns how far
/// the wall clock still is from it, in milliseconds, for the log.
pub fn follow_wall() -> i64 {
    let wall = wall_us();
    with(|c, t| {
        c.follow(wall, t);
        ((i128::from(wall) - i128::from(c.at(t))) / 1000) as i64
    })
}

/// A retry timer that waits longer after each try that comes to nothing: `first`, then
/// twice as long each time up to `max`, and `first` again once something works.
#[derive(Debug)]
pub(crate) struct Backoff {
    at: Option<tokio::time::Instant>,
    every: Duration,
    first: Duration,
    max: Duration,
}

impl Backoff {
    pub(crate) const fn new(first: Duration, max: Duration) -> Self {
        Self {
            at: None,
            every: first,
            first,
            max,
        }
    }

    /// When it fires, if armed.
    pub(crate) fn due(&self) -> Option<tokio::time::Instant> {
        self.at
    }

    /// The current wait.
    pub(crate) fn wait(&self) -> Duration {
        self.every
    }

    /// Fires after the current wait, unless it is armed already.
    pub(crate) fn arm(&mut self) {
        if self.at.is_none() {
            self.at = Some(tokio::time::Instant::now() + self.every);
        }
    }

    /// The next wait is twice this one, up to `max`.
    pub(crate) fn double(&mut self) {
        self.every = (self.every * 2).min(self.max);
    }

    /// Disarmed (it fired, or is not wanted now); the wait stays.
    pub(crate) fn disarm(&mut self) {
        self.at = None;
    }

    /// Disarmed, and the wait back to `first`.
    pub(crate) fn reset(&mut self) {
        self.at = None;
        self.every = self.first;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_backoff_waits_twice_as_long_up_to_its_most_and_starts_over_on_reset() {
        let mut b = Backoff::new(Duration::from_secs(2), Duration::from_secs(5));
        assert_eq!(b.due(), None);
        b.arm();
        let at = b.due().unwrap();
        b.arm();
        assert_eq!(b.due(), Some(at), "armed already: the first time stands");
        b.double();
        assert_eq!(b.wait(), Duration::from_secs(4));
        b.double();
        assert_eq!(b.wait(), Duration::from_secs(5), "at most `max`");
        b.disarm();
        assert_eq!((b.due(), b.wait()), (None, Duration::from_secs(5)));
        b.reset();
        assert_eq!((b.due(), b.wait()), (None, Duration::from_secs(2)));
    }

    #[test]
    fn a_wall_clock_step_is_followed_slowly_and_never_at_once() {
        let t0 = Instant::now();
        let start = 1_800_000_000_000_000u64;
        let mut c = Clock::new(start, t0);
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert_eq!(c.at(at(10)), start + 10_000_000);
        // The wall clock jumps an hour ahead: the node's time moves 1 s per 10 s.
        let hour = 3_600_000_000u64;
        for i in 1..=6u64 {
            let step = c.follow(start + hour + i * 10_000_000, at(i * 10));
            assert_eq!(step, 1_000_000);
        }
        assert_eq!(c.at(at(60)), start + 66_000_000);
        // A lease of 60 s measured from 60 s ends no earlier than 54 s of real time later.
        let lease_end = c.at(at(60)) + 60_000_000;
        let mut real = 60;
        while c.at(at(real)) < lease_end {
            real += 10;
            c.follow(start + hour + real * 1_000_000, at(real));
        }
        assert!(real - 60 >= 54, "ended after {} s", real - 60);
        // And back: a step behind is followed as slowly, time never goes back at once.
        let before = c.at(at(real));
        c.follow(start, at(real));
        assert_eq!(c.at(at(real)), before - 1_000_000);
    }
}
