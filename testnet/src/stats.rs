//! Percentiles over measured durations.

use serde::Serialize;

/// Summary of a sample, in microseconds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Summary {
    /// Number of values.
    pub count: usize,
    /// Median.
    pub p50: u64,
    /// 99th percentile (nearest rank).
    pub p99: u64,
    /// Largest.
    pub max: u64,
}

/// Nearest-rank percentiles of `values` (sorted here). `None` when empty.
pub fn summarize(values: &mut [u64]) -> Option<Summary> {
    if values.is_empty() {
        return None;
    }
    values.sort_unstable();
    let rank = |p: usize| {
        // nearest rank: ceil(p/100 * n), 1-based
        let n = values.len();
        let r = (p * n).div_ceil(100).max(1);
        values[r - 1]
    };
    Some(Summary {
        count: values.len(),
        p50: rank(50),
        p99: rank(99),
        max: values[values.len() - 1],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let mut v: Vec<u64> = (1..=100).collect();
        let s = summarize(&mut v).unwrap();
        assert_eq!((s.p50, s.p99, s.max, s.count), (50, 99, 100, 100));
        let mut one = vec![7];
        assert_eq!(summarize(&mut one).unwrap().p99, 7);
        assert!(summarize(&mut []).is_none());
    }
}
