//! No input panics the decoder or the converter, and memory stays proportional to the input:
//! random bytes, random mutations of every real-format fixture, and forged 32-bit length
//! headers, with the heap measured by a counting allocator.
//!
//! This file holds a single test so nothing else allocates on another thread while it measures.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use kvatlas_events::{Converter, DropCounters, EngineKind, Source, decode_batch};
use kvatlas_hash::BlockSize;
use proptest::prelude::*;

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

/// The system allocator, counting live bytes and their peak.
struct Counting;

// SAFETY: every method forwards to `System` with the caller's arguments unchanged, so
// `System`'s guarantees hold; the counters are plain atomics.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract, which we pass on.
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            let now = CURRENT.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `System` (through `alloc` above) with `layout`.
        unsafe { System.dealloc(ptr, layout) };
        CURRENT.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Heap bytes a call may hold at its peak: linear in the input, never header-driven.
fn budget(input_len: usize) -> usize {
    256 * input_len + (1 << 20)
}

fn exercise(bytes: &[u8]) -> usize {
    let base = CURRENT.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let _ = std::hint::black_box(decode_batch(bytes));
    for engine in [EngineKind::Vllm, EngineKind::Sglang] {
        for block_size in [4, 16] {
            let conv = Converter::new(Source {
                worker_id: 1,
                dp_rank: 0,
                block_size: BlockSize::new(block_size).expect("valid"),
                engine,
            });
            let (mut out, mut drops) = (Vec::new(), DropCounters::new());
            let _ = conv.ingest(bytes, &mut out, &mut drops);
            std::hint::black_box((out, drops));
        }
    }
    PEAK.load(Ordering::Relaxed).saturating_sub(base)
}

#[derive(Debug, Clone)]
enum Edit {
    Set(usize, u8),
    Insert(usize, Vec<u8>),
    Remove(usize, usize),
    Truncate(usize),
    /// A forged 32-bit length header (array32, map32, bin32, str32) with a huge length.
    Forge(usize, u8),
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Edit::Set(i, b)),
        (any::<usize>(), proptest::collection::vec(any::<u8>(), 1..8))
            .prop_map(|(i, b)| Edit::Insert(i, b)),
        (any::<usize>(), 1usize..16).prop_map(|(i, n)| Edit::Remove(i, n)),
        any::<usize>().prop_map(Edit::Truncate),
        (
            any::<usize>(),
            prop::sample::select(vec![0xdd_u8, 0xdf, 0xc6, 0xdb, 0xdc, 0xde])
        )
            .prop_map(|(i, m)| Edit::Forge(i, m)),
    ]
}

fn apply(mut bytes: Vec<u8>, edits: &[Edit]) -> Vec<u8> {
    for e in edits {
        let len = bytes.len().max(1);
        match e {
            Edit::Set(i, b) => {
                if let Some(slot) = bytes.get_mut(i % len) {
                    *slot = *b;
                }
            }
            Edit::Insert(i, b) => {
                let at = (i % len).min(bytes.len());
                bytes.splice(at..at, b.iter().copied());
            }
            Edit::Remove(i, n) => {
                let at = (i % len).min(bytes.len());
                let end = (at + n).min(bytes.len());
                bytes.drain(at..end);
            }
            Edit::Truncate(i) => bytes.truncate(i % len),
            Edit::Forge(i, marker) => {
                let at = (i % len).min(bytes.len());
                bytes.splice(at..at, [*marker, 0xff, 0xff, 0xff, 0xf0]);
            }
        }
    }
    bytes
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(20_000))]

    #[test]
    fn no_input_panics_or_allocates_beyond_a_linear_budget(
        input in prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..600),
            (0..common::all().len(), proptest::collection::vec(edit(), 1..6))
                .prop_map(|(i, edits)| apply(common::all()[i].1.clone(), &edits)),
        ]
    ) {
        let peak = exercise(&input);
        prop_assert!(
            peak <= budget(input.len()),
            "{} bytes of input held {} bytes of heap", input.len(), peak
        );
    }
}
