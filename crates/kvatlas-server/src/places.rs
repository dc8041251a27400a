//! A count of places under a bound, taken and given back without a lock: the whole-state
//! reads (`State::admit_dump`), the requests in flight (`--max-concurrent-requests`) and each
//! token's share of them (`RequestQuota`).

use std::sync::atomic::{AtomicUsize, Ordering};

/// Places held out of a bound the taker names.
///
/// Invariant: while every taker names the same `limit`, at most `limit` places are held once
/// [`Places::take`] returned (a take beyond it is undone before it returns `false`; the count
/// may pass `limit` only between the two).
#[derive(Debug, Default)]
pub(crate) struct Places {
    held: AtomicUsize,
}

impl Places {
    /// Takes one of `limit` places; `false` (nothing taken) when all are held.
    pub(crate) fn take(&self, limit: usize) -> bool {
        let before = self.held.fetch_add(1, Ordering::AcqRel);
        if before >= limit {
            self.held.fetch_sub(1, Ordering::AcqRel);
            return false;
        }
        true
    }

    /// Gives back a place [`Places::take`] took.
    pub(crate) fn give_back(&self) {
        self.held.fetch_sub(1, Ordering::AcqRel);
    }

    /// The places held now.
    pub(crate) fn held(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// At most `limit` places are taken; a place given back can be taken again.
    #[test]
    fn places_are_bounded_and_given_back() {
        let places = Places::default();
        assert!(places.take(2));
        assert!(places.take(2));
        assert!(!places.take(2), "both are held");
        assert_eq!(places.held(), 2, "a refused take leaves nothing held");
        places.give_back();
        assert!(places.take(2));
        assert!(!places.take(0), "a bound of 0 admits nothing");
    }
}
