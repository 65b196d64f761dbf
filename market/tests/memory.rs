//! What an offer held in the view costs in memory, counted by the allocator.
//!
//! A test binary of its own: the counting allocator sees every allocation of the process,
//! so nothing else may run beside the one test.

// A counting allocator is a `GlobalAlloc`, which only unsafe code implements.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Arc;
use std::sync::atomic::{AtomicIsize, Ordering};

use cannabis_market::testkit;
use cannabis_market::{Signatures, Verdict, View, ViewConfig};
use cannabis_protocol::{JobOffer, Keypair, Signed, Timestamp};

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call is passed to the system allocator unchanged; only the live byte
// count is kept on the side.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's contract is the system allocator's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn live() -> isize {
    LIVE.load(Ordering::Relaxed)
}

#[test]
fn an_offer_held_costs_about_its_wire_size_not_twice_it() {
    let now = Timestamp(1_800_000_000_000);
    let mut view = View::new(ViewConfig::default(), Signatures::Check);
    // 100 offers of about 50 KB from 10 requesters (a signer holds at most its share).
    let wires: Vec<Vec<u8>> = (0..100u64)
        .map(|i| {
            let keys = Keypair::from_secret([1 + (i % 10) as u8; 32]);
            let mut task = testkit::task("t", 1, 0, 0, 1, 1_000);
            task.workload.entrypoint = vec![format!("{i}-{}", "x".repeat(50_000))];
            let offer = testkit::offer(keys.address(), i + 1, vec![task], now, 60_000, 120_000);
            Signed::sign(&keys, &offer).to_bytes()
        })
        .collect();
    let wire: usize = wires.iter().map(Vec::len).sum();
    let before = live();
    for bytes in &wires {
        let item = Signed::<JobOffer>::from_bytes(bytes)
            .unwrap()
            .open()
            .unwrap();
        let verdict = view.on_offer(Arc::new(item), now, 0);
        assert!(matches!(verdict, Verdict::Accept(_)), "{verdict:?}");
    }
    assert_eq!(view.offers().count(), 100);
    let held = (live() - before) as f64;
    let ratio = held / wire as f64;
    println!(
        "{wire} bytes of offers on the wire; the view holds {held} bytes for them ({ratio:.2}x)"
    );
    // The decoded offer and a few hundred bytes of bookkeeping each; the signed bytes are
    // not kept beside it (they were: 2.0x).
    assert!(
        ratio < 1.2,
        "the view holds {ratio:.2}x the offers' wire size"
    );
    // And they come back byte for byte, to serve them to others.
    let mut served: Vec<Vec<u8>> = view.offers().map(|e| e.signed().to_bytes()).collect();
    let mut sent = wires.clone();
    served.sort();
    sent.sort();
    assert!(served == sent, "a held offer re-encodes to other bytes");
}
