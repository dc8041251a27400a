//! Loom model of the left-right synchronization shared by `LeftRight` and `ConcurrentAtlas` (the
//! default backend's concurrent form), run with `RUSTFLAGS="--cfg loom"`, which `cargo xtask ci`
//! does: under every interleaving of a writer and a reader,
//! - a read sees the index after a whole number of mutations (never half of one);
//! - reads never go back in time (a later read never sees fewer mutations than an earlier one);
//! - after the writer is done, both copies hold the final state.
//!
//! And the bound of a `ThreadPool` lane: a producer waiting for room is always woken, by the
//! writer taking a task or by the writer ending, and two producers waiting together each get a
//! place as the writer frees them one at a time (no lost wakeup: loom's condition variable has
//! no timeout here, so a lost one would deadlock the model; the two-producer model fails when
//! the writer does not notify, or reads the waiters' count with a plain load).
#![cfg(loom)]

use std::sync::Arc;

use kvatlas_hash::LocalBlockHash;
use kvatlas_index::{
    ConcurrentAtlas, ExternalBlockHash, LoomRoom, MatchOptions, Mutation, SharedKvIndex,
    StoredBlock, Tier, Worker,
    baseline::{LeftRight, RadixTree},
};

const WORKER: Worker = Worker::new(1, 0);

fn store(i: u64) -> Mutation {
    Mutation::Stored {
        worker: WORKER,
        tier: Tier::Device,
        parent: i.checked_sub(1).map(ExternalBlockHash::new),
        // Two blocks per mutation, so a half-applied mutation would show an odd score.
        blocks: (2 * i..2 * i + 2)
            .map(|b| StoredBlock {
                external: ExternalBlockHash::new(b),
                local: LocalBlockHash::new(100 + b),
            })
            .collect(),
    }
}

fn score(index: &impl SharedKvIndex) -> u32 {
    let query: Vec<LocalBlockHash> = (0..4).map(|b| LocalBlockHash::new(100 + b)).collect();
    index
        .find_matches(&query, &MatchOptions::default())
        .device_score(WORKER)
}

/// The model, over a fresh index from `make`.
fn reads_whole_mutations_in_order<I: SharedKvIndex + 'static>(make: fn() -> I) {
    loom::model(move || {
        let index = Arc::new(make());
        let writer = {
            let index = Arc::clone(&index);
            loom::thread::spawn(move || {
                index.apply(&store(0));
                index.apply(&Mutation::Stored {
                    worker: WORKER,
                    tier: Tier::Device,
                    parent: Some(ExternalBlockHash::new(1)),
                    blocks: (2..4)
                        .map(|b| StoredBlock {
                            external: ExternalBlockHash::new(b),
                            local: LocalBlockHash::new(100 + b),
                        })
                        .collect(),
                });
            })
        };
        let first = score(&*index);
        let second = score(&*index);
        assert!(
            first % 2 == 0 && second % 2 == 0,
            "a half-applied mutation was visible: {first}, {second}"
        );
        assert!(
            first <= second,
            "a read went back in time: {first} then {second}"
        );
        writer.join().expect("writer thread");
        assert_eq!(score(&*index), 4);
        // The next write lands on the other copy first: it must hold the same state too.
        index.apply(&Mutation::Cleared { worker: WORKER });
        assert_eq!(score(&*index), 0);
    });
}

#[test]
fn left_right_reads_whole_mutations_in_order() {
    reads_whole_mutations_in_order(|| LeftRight::new(RadixTree::new(), RadixTree::new()));
}

/// The books (ledgers) are written once, the two forests kept in step by replaying recorded
/// changes: the same protocol, with different contents in the log.
#[test]
fn concurrent_atlas_reads_whole_mutations_in_order() {
    reads_whole_mutations_in_order(ConcurrentAtlas::new);
}

#[test]
fn a_producer_waiting_for_room_is_woken_when_the_writer_takes_a_task() {
    loom::model(|| {
        let room = Arc::new(LoomRoom::new(1));
        assert!(room.try_reserve(), "the lane's one place");
        let producer = {
            let room = Arc::clone(&room);
            loom::thread::spawn(move || room.reserve())
        };
        // The writer takes the queued task.
        room.release(1);
        assert!(
            producer.join().expect("producer"),
            "the producer got the place"
        );
        assert!(!room.try_reserve(), "and holds it");
    });
}

/// Two producers wait for a full lane's one place; the writer gives places back one task at a
/// time, as it takes them: each producer gets a place once, none is lost and none waits forever
/// (a lost wakeup would leave a producer parked; loom reports the deadlock).
#[test]
fn producers_waiting_for_room_each_get_a_place_as_the_writer_frees_them() {
    // Three threads: every interleaving is too many to explore here; up to two preemptions
    // each covers the orders in which a wakeup can be lost (the writer's release between a
    // producer's check and its wait, for either producer).
    let mut model = loom::model::Builder::new();
    model.preemption_bound = Some(2);
    model.check(|| {
        let room = Arc::new(LoomRoom::new(1));
        assert!(room.try_reserve(), "the lane's one place");
        // A producer that got a place sends its task down the lane.
        let (lane, tasks) = loom::sync::mpsc::channel::<()>();
        let producers: Vec<_> = (0..2)
            .map(|_| {
                let room = Arc::clone(&room);
                let lane = lane.clone();
                loom::thread::spawn(move || {
                    let placed = room.reserve();
                    if placed {
                        lane.send(()).expect("the writer is there");
                    }
                    placed
                })
            })
            .collect();
        // The writer takes the first task, then each producer's as it comes.
        room.release(1);
        for _ in 0..2 {
            tasks.recv().expect("a producer's task");
            room.release(1);
        }
        for producer in producers {
            assert!(
                producer.join().expect("producer"),
                "each producer got a place"
            );
        }
        assert!(room.try_reserve(), "every place was given back");
    });
}

#[test]
fn a_producer_waiting_for_room_is_woken_when_the_writer_ends() {
    loom::model(|| {
        let room = Arc::new(LoomRoom::new(1));
        assert!(room.try_reserve());
        let producer = {
            let room = Arc::clone(&room);
            loom::thread::spawn(move || room.reserve())
        };
        room.close();
        assert!(!producer.join().expect("producer"), "told the writer ended");
    });
}
