//! The int8 x int8 -> i32 product, fast and bit-exact.
//!
//! Integer sums do not depend on their order, so any kernel that computes every dot product
//! exactly gives the reference's bits; the tests hold each kernel to the portable one.
//!
//! - `Vnni` (x86-64 with AVX-512 VNNI): `vpdpbusd` multiplies unsigned by signed bytes, four
//!   pairs per 32-bit lane, 64 products per instruction. `A` is read as `A + 128` (its bytes
//!   with the top bit flipped: unsigned), and `128 * colsum(B)` is taken off at the end:
//!   `(A + 128) B - 128 * 1 colsum(B) = A B`. No lane can overflow: a lane's sum is at most
//!   `n * 255 * 128 < 2^31` for `n <= 65791`.
//! - `Avx2` (x86-64 with AVX2): `vpmaddwd` on sign-extended pairs, 16 products per
//!   instruction; a pair's sum is at most `2 * 128 * 128`, well inside `i32`.
//! - `Portable`: the i-k-j loop, everywhere else.
//!
//! The fast kernels pack `B` into panels of columns with `k` interleaved the way the
//! instruction reads it, pack `A` with its rows padded, and block `k` so that a panel's slice
//! stays in L1 while the rows of `A` stream from L2 (GotoBLAS order: k block, then rows, then
//! panels, then a small tile of rows).
#![allow(unsafe_code)]

/// The kernel this machine uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// AVX-512 VNNI (`vpdpbusd`).
    Vnni,
    /// AVX2 (`vpmaddwd`).
    Avx2,
    /// Plain loops; the reference.
    Portable,
}

impl Kernel {
    /// The fastest kernel this CPU runs.
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vnni")
            {
                return Self::Vnni;
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                return Self::Avx2;
            }
        }
        Self::Portable
    }

    /// Whether this CPU can run the kernel.
    pub fn available(self) -> bool {
        matches!(
            (self, Self::detect()),
            (Self::Portable, _) | (Self::Avx2, Self::Vnni | Self::Avx2) | (Self::Vnni, Self::Vnni)
        )
    }

    /// The kernel's name, as benchmarks print it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Vnni => "avx512-vnni",
            Self::Avx2 => "avx2",
            Self::Portable => "portable",
        }
    }

    /// `C = A * B` for `n x n` row-major matrices. Falls back to the portable kernel when
    /// this CPU cannot run `self`.
    pub fn multiply(self, a: &[i8], b: &[i8], n: usize) -> Vec<i32> {
        assert_eq!(a.len(), n * n, "A must be n*n");
        assert_eq!(b.len(), n * n, "B must be n*n");
        if !self.available() {
            return portable(a, b, n);
        }
        match self {
            #[cfg(target_arch = "x86_64")]
            Self::Vnni => x86::vnni(a, b, n),
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => x86::avx2(a, b, n),
            _ => portable(a, b, n),
        }
    }
}

/// One round of Freivalds' check ([`super::verify`]), compiled for the widest vectors this
/// CPU has.
pub(crate) fn freivalds_round(a: &[i8], b: &[i8], c: &[i32], n: usize, r: &[i32], p: i64) -> bool {
    #[cfg(target_arch = "x86_64")]
    match Kernel::detect() {
        // SAFETY: the CPU has the features each function is compiled for.
        Kernel::Vnni => return unsafe { x86::freivalds_avx512(a, b, c, n, r, p) },
        // SAFETY: as above.
        Kernel::Avx2 => return unsafe { x86::freivalds_avx2(a, b, c, n, r, p) },
        Kernel::Portable => {}
    }
    super::verify::round(a, b, c, n, r, p)
}

/// The reference: i-k-j loops, whose inner loop runs over contiguous rows of `B` and `C`.
pub(crate) fn portable(a: &[i8], b: &[i8], n: usize) -> Vec<i32> {
    let mut c = vec![0i32; n * n];
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

fn round_up(x: usize, m: usize) -> usize {
    x.div_ceil(m) * m
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::round_up;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl")]
    pub(super) unsafe fn freivalds_avx512(
        a: &[i8],
        b: &[i8],
        c: &[i32],
        n: usize,
        r: &[i32],
        p: i64,
    ) -> bool {
        super::super::verify::round(a, b, c, n, r, p)
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn freivalds_avx2(
        a: &[i8],
        b: &[i8],
        c: &[i32],
        n: usize,
        r: &[i32],
        p: i64,
    ) -> bool {
        super::super::verify::round(a, b, c, n, r, p)
    }

    /// Rows per tile.
    const MR: usize = 8;
    /// Columns per panel (two registers of 16 lanes, or four of 8).
    const NR: usize = 32;
    /// `k` per block: a panel's block is `KC * NR` bytes (16 KiB), in L1.
    const KC: usize = 512;
    /// Rows per block of `A`: `MC * KC` bytes (128 KiB), in L2.
    const MC: usize = 256;

    /// The shapes every kernel shares: `k` padded to `step`, rows to `MR`, columns to `NR`;
    /// `C` computed into a padded buffer (the output itself when nothing is padded).
    struct Shape {
        n: usize,
        kp: usize,
        rows: usize,
        cols: usize,
    }

    impl Shape {
        fn new(n: usize, step: usize) -> Self {
            Self {
                n,
                kp: round_up(n, step),
                rows: round_up(n, MR),
                cols: round_up(n, NR),
            }
        }

        /// `A` as `f` maps its entries, rows of `kp` padded with zeros.
        fn pack_a<T: Copy + Default>(&self, a: &[i8], f: impl Fn(i8) -> T) -> Vec<T> {
            let mut packed = vec![T::default(); self.rows * self.kp];
            for (dst, src) in packed.chunks_exact_mut(self.kp).zip(a.chunks_exact(self.n)) {
                for (d, &x) in dst.iter_mut().zip(src) {
                    *d = f(x);
                }
            }
            packed
        }

        /// `B` as `f` maps its entries, in panels of NR columns; within one, runs of `step`
        /// consecutive k, each `step * NR` long, column c's run at `step * c`.
        fn pack_b<T: Copy + Default>(&self, b: &[i8], step: usize, f: impl Fn(i8) -> T) -> Vec<T> {
            let mut packed = vec![T::default(); self.cols * self.kp];
            for (k, row) in b.chunks_exact(self.n).enumerate() {
                let (g, t) = (k / step, k % step);
                for (j, &x) in row.iter().enumerate() {
                    let (p, c) = (j / NR, j % NR);
                    packed[p * self.kp * NR + g * step * NR + step * c + t] = f(x);
                }
            }
            packed
        }

        /// `C` from the padded result, less `minus[j]` in every column.
        fn finish(&self, mut c: Vec<i32>, minus: &[i32]) -> Vec<i32> {
            let n = self.n;
            if self.rows == n && self.cols == n {
                for row in c.chunks_exact_mut(n) {
                    for (x, m) in row.iter_mut().zip(minus) {
                        *x -= m;
                    }
                }
                c.truncate(n * n);
                return c;
            }
            let mut out = Vec::with_capacity(n * n);
            for row in c.chunks_exact(self.cols).take(n) {
                out.extend(row[..n].iter().zip(minus).map(|(x, m)| x - m));
            }
            out
        }

        /// `C = A B` over packed `a` and `b` (from [`Shape::pack_a`] and
        /// [`Shape::pack_b`] with this `step`), in blocked order: `tile(a, b, groups, c,
        /// first)` adds one MR x NR tile over `groups` runs of `step` k, with `a` starting at
        /// the tile's first row (rows `kp` apart), `b` exactly its `groups` runs, and `c` at
        /// its first entry (rows `cols` apart); `first` when `c` holds nothing yet.
        fn blocked<T>(
            &self,
            step: usize,
            a: &[T],
            b: &[T],
            mut tile: impl FnMut(&[T], &[T], usize, &mut [i32], bool),
        ) -> Vec<i32> {
            let mut c = vec![0i32; self.rows * self.cols];
            for k0 in (0..self.kp).step_by(KC) {
                let kc = KC.min(self.kp - k0);
                let groups = kc / step;
                for i0 in (0..self.rows).step_by(MC) {
                    let mc = MC.min(self.rows - i0);
                    for j0 in (0..self.cols).step_by(NR) {
                        let bo = j0 * self.kp + k0 * NR;
                        let b_tile = &b[bo..bo + kc * NR];
                        for i in (i0..i0 + mc).step_by(MR) {
                            let a_tile = &a[i * self.kp + k0..];
                            let c_tile = &mut c[i * self.cols + j0..];
                            // What the unsafe tiles rely on.
                            assert!(a_tile.len() >= (MR - 1) * self.kp + kc);
                            assert!(c_tile.len() >= (MR - 1) * self.cols + NR);
                            tile(a_tile, b_tile, groups, c_tile, k0 == 0);
                        }
                    }
                }
            }
            c
        }
    }

    /// `colsum(B)[j] * scale`, for the correction.
    fn column_sums(b: &[i8], n: usize, scale: i32) -> Vec<i32> {
        let mut sums = vec![0i32; n];
        for row in b.chunks_exact(n) {
            for (s, &x) in sums.iter_mut().zip(row) {
                *s += i32::from(x);
            }
        }
        sums.iter_mut().for_each(|s| *s *= scale);
        sums
    }

    pub(super) fn vnni(a: &[i8], b: &[i8], n: usize) -> Vec<i32> {
        let s = Shape::new(n, 4);
        // A + 128 as bytes; B in groups of four k, column c's four bytes at 4c (a 32-bit
        // lane of the first or second register).
        let ap = s.pack_a(a, |x| (x as u8) ^ 0x80);
        let bp = s.pack_b(b, 4, |x| x as u8);
        let c = s.blocked(4, &ap, &bp, |a, b, groups, c, first| {
            // SAFETY: `Kernel::multiply` calls this only where the CPU has AVX-512F, BW and
            // VNNI; `blocked` asserts the bounds of every offset the tile reads and writes.
            unsafe { vnni_tile(a, s.kp, b, groups, c, s.cols, first) }
        });
        s.finish(c, &column_sums(b, n, 128))
    }

    /// One MR x NR tile over `groups` groups of four k.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn vnni_tile(
        a: &[u8],
        a_stride: usize,
        b: &[u8],
        groups: usize,
        c: &mut [i32],
        c_stride: usize,
        first: bool,
    ) {
        let mut acc = [[_mm512_setzero_si512(); 2]; MR];
        if !first {
            for (r, row) in acc.iter_mut().enumerate() {
                for (h, v) in row.iter_mut().enumerate() {
                    // SAFETY: within `c` (asserted by the caller).
                    *v =
                        unsafe { _mm512_loadu_si512(c.as_ptr().add(r * c_stride + 16 * h).cast()) };
                }
            }
        }
        let (ap, bp) = (a.as_ptr(), b.as_ptr());
        for g in 0..groups {
            // SAFETY: `b` holds `groups * 128` bytes, `a` rows `MR` of `a_stride` bytes with
            // at least `groups * 4` each (asserted by the caller).
            unsafe {
                let b0 = _mm512_loadu_si512(bp.add(g * 128).cast());
                let b1 = _mm512_loadu_si512(bp.add(g * 128 + 64).cast());
                for (r, row) in acc.iter_mut().enumerate() {
                    let x = ap.add(r * a_stride + g * 4).cast::<i32>().read_unaligned();
                    let x = _mm512_set1_epi32(x);
                    row[0] = _mm512_dpbusd_epi32(row[0], x, b0);
                    row[1] = _mm512_dpbusd_epi32(row[1], x, b1);
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            for (h, v) in row.iter().enumerate() {
                // SAFETY: within `c` (asserted by the caller).
                unsafe {
                    _mm512_storeu_si512(c.as_mut_ptr().add(r * c_stride + 16 * h).cast(), *v)
                };
            }
        }
    }

    pub(super) fn avx2(a: &[i8], b: &[i8], n: usize) -> Vec<i32> {
        let s = Shape::new(n, 2);
        // A and B as i16; B in pairs of k, column c's pair at 2c.
        let ap = s.pack_a(a, i16::from);
        let bp = s.pack_b(b, 2, i16::from);
        let c = s.blocked(2, &ap, &bp, |a, b, pairs, c, first| {
            // SAFETY: `Kernel::multiply` calls this only where the CPU has AVX2; `blocked`
            // asserts the bounds of every offset the tile reads and writes.
            unsafe { avx2_tile(a, s.kp, b, pairs, c, s.cols, first) }
        });
        s.finish(c, &vec![0; n])
    }

    /// Rows per AVX2 tile: two tiles of four rows share one MR-row tile of `A`.
    const MR2: usize = 4;

    /// One MR x NR tile over `pairs` pairs of k, as two tiles of MR2 rows (16 registers).
    #[target_feature(enable = "avx2")]
    unsafe fn avx2_tile(
        a: &[i16],
        a_stride: usize,
        b: &[i16],
        pairs: usize,
        c: &mut [i32],
        c_stride: usize,
        first: bool,
    ) {
        for half in 0..MR / MR2 {
            let mut acc = [[_mm256_setzero_si256(); 4]; MR2];
            let r0 = half * MR2;
            if !first {
                for (r, row) in acc.iter_mut().enumerate() {
                    for (q, v) in row.iter_mut().enumerate() {
                        // SAFETY: within `c` (asserted by the caller).
                        *v = unsafe {
                            _mm256_loadu_si256(c.as_ptr().add((r0 + r) * c_stride + 8 * q).cast())
                        };
                    }
                }
            }
            let (ap, bp) = (a.as_ptr(), b.as_ptr());
            for h in 0..pairs {
                // SAFETY: `b` holds `pairs * 64` i16, `a` rows `MR` of `a_stride` i16 with at
                // least `pairs * 2` each (asserted by the caller).
                unsafe {
                    let bv = [
                        _mm256_loadu_si256(bp.add(h * 64).cast()),
                        _mm256_loadu_si256(bp.add(h * 64 + 16).cast()),
                        _mm256_loadu_si256(bp.add(h * 64 + 32).cast()),
                        _mm256_loadu_si256(bp.add(h * 64 + 48).cast()),
                    ];
                    for (r, row) in acc.iter_mut().enumerate() {
                        let x = ap
                            .add((r0 + r) * a_stride + h * 2)
                            .cast::<i32>()
                            .read_unaligned();
                        let x = _mm256_set1_epi32(x);
                        for (v, bq) in row.iter_mut().zip(&bv) {
                            *v = _mm256_add_epi32(*v, _mm256_madd_epi16(x, *bq));
                        }
                    }
                }
            }
            for (r, row) in acc.iter().enumerate() {
                for (q, v) in row.iter().enumerate() {
                    // SAFETY: within `c` (asserted by the caller).
                    unsafe {
                        _mm256_storeu_si256(
                            c.as_mut_ptr().add((r0 + r) * c_stride + 8 * q).cast(),
                            *v,
                        )
                    };
                }
            }
        }
    }
}
