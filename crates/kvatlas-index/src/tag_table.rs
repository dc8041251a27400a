//! A hash table of 16-bit slot indices in cache-line buckets, each entry beside a 16-bit tag of
//! its hash: the narrow form of [`crate::slot_table::SlotTable`], which ranks use while their
//! slots fit in 16 bits.
//!
//! Why not hashbrown here (measured on the synthetic workload, 1,024-block stores into ranks of
//! 8,192 blocks that were not touched lately):
//! - hashbrown keeps a 7-bit tag per entry in a separate control array, so about one probe in
//!   sixteen finds a tag that matches by chance; rejecting it loads the candidate's entry and
//!   then its engine hash, two dependent cache misses for a cold rank. About 40 % of the table's
//!   time in such a store went there.
//! - Here a bucket is one 64-byte line holding 15 tags, their 15 slot indices and an overflow
//!   count: a probe reads one line, a 16-bit tag matches by chance once in ~4,400 probes, and a
//!   caller that knows its next keys can prefetch their buckets ([`TagTable::prefetch`]).
//!   hashbrown gives no address to prefetch.
//! - Removal leaves no tombstones (hashbrown's pile up and force periodic rehashes under churn).
//!
//! The layout follows folly's F14: an entry goes to the first bucket with a free lane at or after
//! its home bucket (linear, wrapping); every full bucket it passes counts it in its overflow
//! count, and a lookup goes on past a bucket only while that count is non-zero. Removal clears
//! the lane and takes the entry off the counts it added. The bucket count is any number (the home
//! is the hash's high half scaled to it), so growth is by half while a table is small and by a quarter
//! beyond, not doubling.
//!
//! Memory: at most 3/4 of the lanes are used, so 64 bytes hold 11.25 entries at the most (5.7
//! bytes per entry), 4.6 just after growing by a quarter (7.1 bytes per entry); hashbrown with
//! 2-byte entries and 1-byte tags takes 3.4–6.9. The bound is a measured trade: filled to the
//! full 3/4, more entries overflow their home and a cold store of 1,024 blocks took 15 µs,
//! against 10 µs a quarter emptier.
//!
//! Invariants (checked by the tests' `check`):
//! - a lane's tag is 0 iff the lane is empty; a full lane's tag is its slot's `tag_of(hash)`;
//! - every entry lies in its home bucket or, going forward from home (wrapping), after a run of
//!   buckets each of which counts it in its overflow count; each overflow count is exactly the
//!   number of entries that pass its bucket this way;
//! - `len <= max_len == max_entries(bucket count)` (3/4 of the lanes), so a free lane exists.

/// Entry lanes per bucket (the 16th holds the overflow count).
const LANES: usize = 15;

/// How many slots ahead [`TagTable::remove_each`] starts loading the bucket it will clear.
/// (Stores do not prefetch: it made them slower, 9.2 → 10.9 µs for 1,024 blocks, as their
/// probes already overlap.)
const REMOVE_PREFETCH_AHEAD: usize = 12;

/// The bits of a match mask that are entry lanes.
const LANE_MASK: u32 = (1 << LANES) - 1;

/// One cache line: 15 entries and the count of entries that overflowed past it.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
struct Bucket {
    /// `tags[lane]` for the 15 lanes (0 = empty); `tags[LANES]` is the overflow count.
    tags: [u16; LANES + 1],
    /// The slot index in each full lane (`slots[LANES]` is unused).
    slots: [u16; LANES + 1],
}

impl Bucket {
    const EMPTY: Self = Self {
        tags: [0; LANES + 1],
        slots: [0; LANES + 1],
    };

    /// Bit `lane` set for each lane whose tag is `tag` (`0`: each empty lane).
    #[inline]
    fn lanes_tagged(&self, tag: u16) -> u32 {
        #[cfg(target_arch = "x86_64")]
        {
            lanes_equal_sse2(&self.tags, tag) & LANE_MASK
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            lanes_equal_swar(&self.tags, tag) & LANE_MASK
        }
    }

    /// The first lane tagged `tag` whose slot satisfies `eq`.
    #[inline]
    fn lane_where(&self, tag: u16, eq: impl Fn(u32) -> bool) -> Option<usize> {
        let mut matches = self.lanes_tagged(tag);
        while matches != 0 {
            let lane = matches.trailing_zeros() as usize;
            if eq(u32::from(self.slots[lane])) {
                return Some(lane);
            }
            matches &= matches - 1;
        }
        None
    }

    #[inline]
    fn overflow(&self) -> u16 {
        self.tags[LANES]
    }

    fn add_overflow(&mut self, delta: i32) {
        let count = i32::from(self.tags[LANES]) + delta;
        self.tags[LANES] = u16::try_from(count).unwrap_or_else(|_| {
            debug_assert!(false, "overflow count out of range: {count}");
            0
        });
    }
}

/// Bit `i` set for each `tags[i] == tag`: two 8-lane compares and one mask extraction.
#[cfg(target_arch = "x86_64")]
#[inline]
#[allow(unsafe_code)]
fn lanes_equal_sse2(tags: &[u16; 16], tag: u16) -> u32 {
    use std::arch::x86_64::{
        __m128i, _mm_cmpeq_epi16, _mm_loadu_si128, _mm_movemask_epi8, _mm_packs_epi16,
        _mm_set1_epi16,
    };
    let lanes = tags.as_ptr().cast::<__m128i>();
    // SAFETY: SSE2 is part of every x86_64 target, so its intrinsics are available; `tags` is 32
    // readable bytes, and the two unaligned 16-byte loads read exactly them (`loadu` has no
    // alignment requirement).
    unsafe {
        let (low, high) = (_mm_loadu_si128(lanes), _mm_loadu_si128(lanes.add(1)));
        let wanted = _mm_set1_epi16(tag as i16);
        // Each equal lane is 0xFFFF; packing to bytes with saturation keeps it 0xFF, one byte
        // per lane, in lane order.
        let bytes = _mm_packs_epi16(_mm_cmpeq_epi16(low, wanted), _mm_cmpeq_epi16(high, wanted));
        _mm_movemask_epi8(bytes) as u32
    }
}

/// [`lanes_equal_sse2`] without SIMD instructions, four lanes per 64-bit word.
#[cfg_attr(target_arch = "x86_64", allow(dead_code))]
fn lanes_equal_swar(tags: &[u16; 16], tag: u16) -> u32 {
    // A lane of `word ^ broadcast` is zero iff it matches, and `!((x & LOW) + LOW | x)` sets
    // exactly a zero lane's top bit (the addition cannot carry between lanes).
    const LOW: u64 = 0x7FFF_7FFF_7FFF_7FFF;
    const TOP: u64 = 0x8000_8000_8000_8000;
    let broadcast = u64::from(tag) * 0x0001_0001_0001_0001;
    let mut mask = 0u32;
    for (i, quad) in tags.chunks_exact(4).enumerate() {
        let word = u64::from(quad[0])
            | u64::from(quad[1]) << 16
            | u64::from(quad[2]) << 32
            | u64::from(quad[3]) << 48;
        let x = word ^ broadcast;
        let zero = !(((x & LOW) + LOW) | x) & TOP;
        // The four top bits (15, 31, 47, 63) land on bits 48..52, in lane order.
        let bits = ((zero >> 15).wrapping_mul(0x0001_0002_0004_0008) >> 48) as u32;
        mask |= bits << (4 * i);
    }
    mask
}

/// The tag of an entry hashed `hash`: 16 of its bits the home bucket does not use, never 0.
#[inline]
fn tag_of(hash: u64) -> u16 {
    match (hash >> 16) as u16 {
        0 => 1,
        tag => tag,
    }
}

/// Most entries `buckets` buckets may hold: `LOAD_NUM / LOAD_DEN` of their lanes.
fn max_entries(buckets: usize) -> usize {
    buckets * LANES * LOAD_NUM / LOAD_DEN
}

/// Below this many buckets (1,440 entries at the load bound) a table grows by half, above by a
/// quarter. Rehashing on the way up was 11 % of the peer harness's Workload A apply, whose
/// ranks hold a few hundred blocks each (fresh indexes: every table grows from empty); growing
/// small tables by half took 8 % off it (+7.7 % events/s at W=128, +8 % at W=16, alternated
/// runs) for +1.5 % heap. Growing every table by half also cost the synthetic workload's
/// 8,192-entry tables +6 % heap; doubling, measured earlier, +13 % events for +3.9 % heap on
/// Workload A.
const SMALL_TABLE_BUCKETS: usize = 128;

/// The load bound, as a fraction of the lanes.
const LOAD_NUM: usize = 3;
const LOAD_DEN: usize = 4;

/// Slot indices (`0..=65535`) hashed by a caller-given 64-bit hash, in buckets (module docs).
/// The hash must be well mixed in its high half and in bits 16..32.
#[derive(Debug, Clone, Default)]
pub(crate) struct TagTable {
    buckets: Vec<Bucket>,
    len: usize,
    /// `max_entries(buckets.len())`, kept because every insert compares `len` with it.
    max_len: usize,
}

impl TagTable {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Heap bytes held.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.buckets.capacity() * size_of::<Bucket>()
    }

    /// The bucket an entry hashed `hash` belongs to (there must be buckets).
    #[inline]
    fn home(&self, hash: u64) -> usize {
        (((hash >> 32) * self.buckets.len() as u64) >> 32) as usize
    }

    #[inline]
    fn next(&self, bucket: usize) -> usize {
        if bucket + 1 == self.buckets.len() {
            0
        } else {
            bucket + 1
        }
    }

    /// Starts loading the home bucket of `hash` into the cache, without waiting for it.
    #[inline]
    pub(crate) fn prefetch(&self, hash: u64) {
        if self.buckets.is_empty() {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
            let bucket = std::ptr::from_ref(&self.buckets[self.home(hash)]);
            // SAFETY: a prefetch only hints the cache (it reads nothing the program sees and
            // cannot fault), the address is a live bucket, and SSE is part of every x86_64
            // target.
            #[allow(unsafe_code)]
            unsafe {
                _mm_prefetch::<_MM_HINT_T0>(bucket.cast());
            }
        }
    }

    /// The slot index whose entry satisfies `eq`.
    #[inline]
    pub(crate) fn find(&self, hash: u64, eq: impl Fn(u32) -> bool) -> Option<u32> {
        if self.len == 0 {
            return None;
        }
        let tag = tag_of(hash);
        let mut b = self.home(hash);
        // (Overflow counts may all be non-zero after removals: stop after one round.)
        for _ in 0..self.buckets.len() {
            let bucket = &self.buckets[b];
            if let Some(lane) = bucket.lane_where(tag, &eq) {
                return Some(u32::from(bucket.slots[lane]));
            }
            if bucket.overflow() == 0 {
                break;
            }
            b = self.next(b);
        }
        None
    }

    /// In one probe: the slot whose entry satisfies `eq`, or else `slot` added (it must not be
    /// in the table yet) and `None`. `rehash` gives any present slot's hash; `more` (at least
    /// one) is how many entries the caller may add from this one on, so that a table that must
    /// grow grows once for all of them.
    #[inline]
    pub(crate) fn find_or_insert(
        &mut self,
        hash: u64,
        slot: u16,
        more: usize,
        eq: impl Fn(u32) -> bool,
        rehash: impl Fn(u32) -> u64,
    ) -> Option<u32> {
        if self.len >= self.max_len {
            return self.find_or_insert_growing(hash, slot, more, eq, rehash);
        }
        let tag = tag_of(hash);
        let home = self.home(hash);
        let bucket = &mut self.buckets[home];
        if let Some(lane) = bucket.lane_where(tag, &eq) {
            return Some(u32::from(bucket.slots[lane]));
        }
        let free = bucket.lanes_tagged(0);
        if bucket.overflow() == 0 && free != 0 {
            // The common case: not in the table (nothing overflowed from here) and room at home.
            let lane = free.trailing_zeros() as usize;
            bucket.tags[lane] = tag;
            bucket.slots[lane] = slot;
            self.len += 1;
            return None;
        }
        self.find_or_insert_past_home(home, tag, slot, eq)
    }

    /// [`TagTable::find_or_insert`] when the table must grow first.
    #[cold]
    fn find_or_insert_growing(
        &mut self,
        hash: u64,
        slot: u16,
        more: usize,
        eq: impl Fn(u32) -> bool,
        rehash: impl Fn(u32) -> u64,
    ) -> Option<u32> {
        if let Some(found) = self.find(hash, &eq) {
            return Some(found);
        }
        self.grow_to(self.len + more.max(1), rehash);
        self.place(hash, slot);
        None
    }

    /// [`TagTable::find_or_insert`] when the home bucket is full or has overflowed (its tags
    /// were checked): looks along the chain for the entry, then adds it at the first free lane
    /// on the way, or past the chain's end.
    fn find_or_insert_past_home(
        &mut self,
        home: usize,
        tag: u16,
        slot: u16,
        eq: impl Fn(u32) -> bool,
    ) -> Option<u32> {
        let mut free = (self.buckets[home].lanes_tagged(0) != 0).then_some(home);
        let mut b = home;
        for _ in 1..self.buckets.len() {
            if self.buckets[b].overflow() == 0 {
                break;
            }
            b = self.next(b);
            let bucket = &self.buckets[b];
            if let Some(lane) = bucket.lane_where(tag, &eq) {
                return Some(u32::from(bucket.slots[lane]));
            }
            if free.is_none() && bucket.lanes_tagged(0) != 0 {
                free = Some(b);
            }
        }
        let mut at = free.unwrap_or(b);
        while self.buckets[at].lanes_tagged(0) == 0 {
            at = self.next(at);
        }
        self.place_at(home, at, tag, slot);
        None
    }

    /// Adds `slot` (not yet in the table); `rehash` gives any present slot's hash.
    pub(crate) fn insert(&mut self, hash: u64, slot: u16, rehash: impl Fn(u32) -> u64) {
        if self.len >= self.max_len {
            self.grow_to(self.len + 1, rehash);
        }
        self.place(hash, slot);
    }

    /// Puts an entry in the first free lane from its home on (there is room).
    fn place(&mut self, hash: u64, slot: u16) {
        let home = self.home(hash);
        let mut b = home;
        while self.buckets[b].lanes_tagged(0) == 0 {
            b = self.next(b);
        }
        self.place_at(home, b, tag_of(hash), slot);
    }

    /// Puts an entry homed at `home` in a free lane of bucket `at`, counting it in the overflow
    /// count of every bucket from `home` up to `at` (all full).
    #[inline(always)]
    fn place_at(&mut self, home: usize, at: usize, tag: u16, slot: u16) {
        let mut b = home;
        while b != at {
            self.buckets[b].add_overflow(1);
            b = self.next(b);
        }
        let bucket = &mut self.buckets[at];
        let lane = bucket.lanes_tagged(0).trailing_zeros() as usize;
        bucket.tags[lane] = tag;
        bucket.slots[lane] = slot;
        self.len += 1;
    }

    /// Removes the entries of the slots `slots` (nothing for one that is not there), slot `s`
    /// hashed `hash_at(s)`: the removals of a deleted run, in one loop. Each removal waits on its
    /// bucket, so the home bucket of the slot [`REMOVE_PREFETCH_AHEAD`] further on is loaded
    /// first (synthetic remove p50 15–34 µs without, bimodal, against 12.0–12.7 µs with), and
    /// each slot's hash is computed once, for its prefetch, and kept until its removal.
    pub(crate) fn remove_each(
        &mut self,
        slots: std::ops::Range<u32>,
        hash_at: impl Fn(u32) -> u64,
    ) {
        const RING: usize = 16;
        const { assert!(REMOVE_PREFETCH_AHEAD < RING) };
        let (start, end) = (slots.start, slots.end);
        let mut ring = [0u64; RING];
        for s in start..end.min(start.saturating_add(REMOVE_PREFETCH_AHEAD as u32)) {
            ring[s as usize % RING] = hash_at(s);
        }
        for s in start..end {
            if let Some(next) = s.checked_add(REMOVE_PREFETCH_AHEAD as u32)
                && next < end
            {
                let hash = hash_at(next);
                self.prefetch(hash);
                ring[next as usize % RING] = hash;
            }
            self.remove(ring[s as usize % RING], s);
        }
    }

    /// Removes the entry of `slot`, hashed `hash` (nothing if it is not there).
    #[inline]
    pub(crate) fn remove(&mut self, hash: u64, slot: u32) {
        if self.len == 0 {
            return;
        }
        let tag = tag_of(hash);
        let home = self.home(hash);
        let mut b = home;
        for _ in 0..self.buckets.len() {
            let bucket = &mut self.buckets[b];
            if let Some(lane) = bucket.lane_where(tag, |found| found == slot) {
                bucket.tags[lane] = 0;
                self.len -= 1;
                let mut passed = home;
                while passed != b {
                    self.buckets[passed].add_overflow(-1);
                    passed = self.next(passed);
                }
                return;
            }
            if bucket.overflow() == 0 {
                return;
            }
            b = self.next(b);
        }
    }

    /// Rebuilds the table with room for `entries`, and at least half more buckets than now while
    /// it is small ([`SMALL_TABLE_BUCKETS`]), a quarter more beyond: growth one entry at a time
    /// stays amortized, and the load after growing stays low enough that most entries find room
    /// in their home bucket (measured: at the full 3/4 load, a cold store of 1,024 blocks took
    /// 15 µs; a quarter lower, 10 µs). The factor trades rehashing for room: a table grown by
    /// ×1.25 steps re-places each entry about 4 times on its way up, by ×1.5 about twice.
    fn grow_to(&mut self, entries: usize, rehash: impl Fn(u32) -> u64) {
        let mut needed = (entries * LOAD_DEN).div_ceil(LANES * LOAD_NUM);
        while max_entries(needed) < entries {
            needed += 1;
        }
        let current = self.buckets.len();
        // Small tables grow by half (few bytes either way, and fewer rehashes while a rank's
        // table fills), large ones by a quarter (room that is not used costs real memory).
        let step = if current < SMALL_TABLE_BUCKETS {
            current / 2
        } else {
            current / 4
        };
        let buckets = needed.max(current + step + 1);
        let old = std::mem::replace(&mut self.buckets, vec![Bucket::EMPTY; buckets]);
        self.len = 0;
        self.max_len = max_entries(buckets);
        for bucket in &old {
            for lane in 0..LANES {
                if bucket.tags[lane] != 0 {
                    let slot = bucket.slots[lane];
                    self.place(rehash(u32::from(slot)), slot);
                }
            }
        }
    }

    /// Reads every bucket once, front to back (see [`crate::slot_table::SlotTable::warm`]).
    pub(crate) fn warm(&self) {
        let sum = self
            .buckets
            .iter()
            .fold(0u16, |a, b| a.wrapping_add(b.tags[0]));
        std::hint::black_box(sum);
    }

    /// Every slot index in the table.
    pub(crate) fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.buckets.iter().flat_map(|bucket| {
            (0..LANES)
                .filter(|&lane| bucket.tags[lane] != 0)
                .map(|lane| u32::from(bucket.slots[lane]))
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use proptest::prelude::*;

    use super::*;
    use crate::model::ExternalBlockHash;
    use crate::slot_table::hash_of;

    /// Checks the module's invariants, given each present slot's hash.
    fn check(t: &TagTable, hash: &impl Fn(u32) -> u64) {
        let n = t.buckets.len();
        assert!(t.len <= max_entries(n));
        let mut overflow = vec![0u32; n];
        let mut count = 0;
        for (b, bucket) in t.buckets.iter().enumerate() {
            for lane in 0..LANES {
                if bucket.tags[lane] == 0 {
                    continue;
                }
                count += 1;
                let h = hash(u32::from(bucket.slots[lane]));
                assert_eq!(
                    bucket.tags[lane],
                    tag_of(h),
                    "tag of bucket {b} lane {lane}"
                );
                let mut passed = t.home(h);
                while passed != b {
                    overflow[passed] += 1;
                    passed = t.next(passed);
                }
            }
        }
        assert_eq!(count, t.len);
        for (b, bucket) in t.buckets.iter().enumerate() {
            assert_eq!(
                u32::from(bucket.overflow()),
                overflow[b],
                "overflow count of {b}"
            );
        }
    }

    /// A model run: slots keyed by arbitrary 64-bit hashes (`spread` distinct ones at most, so
    /// a small spread forces full collisions), inserted, found and removed; the table must agree
    /// with a set and keep its invariants.
    fn run_ops(ops: &[(u8, u16)], spread: u64) {
        let hash_of_slot = |p: u32| {
            let x = u64::from(p) % spread;
            x.wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(17)
        };
        let mut table = TagTable::default();
        let mut model = HashSet::new();
        for &(op, slot) in ops {
            let hash = hash_of_slot(u32::from(slot));
            let key = u32::from(slot);
            match op % 4 {
                0 => {
                    let found = table.find_or_insert(hash, slot, 1, |i| i == key, hash_of_slot);
                    assert_eq!(found, model.contains(&key).then_some(key));
                    model.insert(key);
                }
                1 => {
                    if !model.contains(&key) {
                        table.insert(hash, slot, hash_of_slot);
                        model.insert(key);
                    }
                }
                2 => {
                    table.remove(hash, key);
                    model.remove(&key);
                }
                _ => {
                    let found = table.find(hash, |i| i == key);
                    assert_eq!(found, model.contains(&key).then_some(key));
                }
            }
            assert_eq!(table.len(), model.len());
            check(&table, &hash_of_slot);
        }
        let mut listed: Vec<u32> = table.iter().collect();
        listed.sort_unstable();
        let mut expected: Vec<u32> = model.into_iter().collect();
        expected.sort_unstable();
        assert_eq!(listed, expected);
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

        #[test]
        fn agrees_with_a_set(ops in prop::collection::vec((0u8..4, 0u16..600), 0..1500)) {
            run_ops(&ops, u64::MAX);
        }

        #[test]
        fn agrees_with_a_set_under_heavy_collisions(
            ops in prop::collection::vec((0u8..4, 0u16..300), 0..800),
            spread in 1u64..40,
        ) {
            run_ops(&ops, spread);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

        /// Removing a range of slots in one call leaves the table that removing them one by one
        /// does, for ranges shorter and longer than the prefetch distance, with slots that are
        /// not there, and under colliding hashes.
        #[test]
        fn removing_a_range_equals_removing_each(
            held in prop::collection::vec(proptest::bool::weighted(0.8), 0..300),
            from in 0u32..320,
            len in 0u32..80,
            spread in prop::sample::select(vec![u64::MAX, 7]),
        ) {
            let hash = |p: u32| hash_of(ExternalBlockHash::new(u64::from(p) % spread));
            let mut one_by_one = TagTable::default();
            for (p, _) in held.iter().enumerate().filter(|(_, h)| **h) {
                one_by_one.insert(hash(p as u32), p as u16, hash);
            }
            let mut ranged = one_by_one.clone();
            for p in from..from + len {
                one_by_one.remove(hash(p), p);
            }
            ranged.remove_each(from..from + len, hash);
            check(&ranged, &hash);
            let listed = |t: &TagTable| {
                let mut v: Vec<u32> = t.iter().collect();
                v.sort_unstable();
                v
            };
            prop_assert_eq!(listed(&ranged), listed(&one_by_one));
            prop_assert_eq!(ranged.len(), one_by_one.len());
        }
    }

    /// A store announcing its length grows the table once, to room for all of it.
    #[test]
    fn a_long_run_grows_the_table_once() {
        let hash = |p: u32| hash_of(ExternalBlockHash::new(u64::from(p)));
        let mut table = TagTable::default();
        for p in 0..3000u32 {
            assert!(
                table
                    .find_or_insert(hash(p), p as u16, 3000 - p as usize, |_| false, hash)
                    .is_none()
            );
            assert!(table.buckets.len() * LANES * LOAD_NUM / LOAD_DEN >= 3000);
        }
        check(&table, &hash);
        assert!(
            table.heap_bytes() * 10 <= 3000 * 57 + 640,
            "{} bytes",
            table.heap_bytes()
        );
    }

    proptest! {
        /// The portable lane compare agrees with the SSE2 one (which x86_64 builds use).
        #[test]
        fn swar_lanes_agree_with_sse2(tags in prop::array::uniform16(0u16..4), tag in 0u16..4) {
            #[cfg(target_arch = "x86_64")]
            prop_assert_eq!(lanes_equal_swar(&tags, tag), lanes_equal_sse2(&tags, tag));
            let expected = (0..16).filter(|&i| tags[i] == tag).fold(0u32, |m, i| m | 1 << i);
            prop_assert_eq!(lanes_equal_swar(&tags, tag), expected);
        }
    }

    /// Removals leave no tombstones: a table filled and emptied over and over keeps its size,
    /// and its overflow counts return to zero.
    #[test]
    fn churn_does_not_grow_the_table_or_leave_overflow() {
        let hash = |p: u32| hash_of(ExternalBlockHash::new(u64::from(p)));
        let mut table = TagTable::default();
        for p in 0..4000u32 {
            table.insert(hash(p), p as u16, hash);
        }
        let buckets = table.buckets.len();
        for round in 0..20u32 {
            let (old, new) = (round * 1000, (round + 1) * 1000);
            for p in old..old + 4000 {
                table.remove(hash(p), p);
            }
            assert_eq!(table.len(), 0);
            assert!(table.buckets.iter().all(|b| b.overflow() == 0));
            for q in new..new + 4000 {
                assert!(
                    table
                        .find_or_insert(hash(q), q as u16, 1, |i| i == q, hash)
                        .is_none()
                );
            }
            check(&table, &hash);
        }
        assert_eq!(table.buckets.len(), buckets);
    }

    /// Grown by a quarter once large: 8,192 entries added one at a time take at most 7.2 bytes
    /// each (a quarter over the 3/4 load bound, module docs), and hashes crafted to share one
    /// home do not grow the table beyond its load bound.
    #[test]
    fn grows_by_a_quarter_when_large_and_colliding_hashes_stay_in_bounds() {
        let hash = |p: u32| hash_of(ExternalBlockHash::new(u64::from(p) * 7919 + 1));
        let mut table = TagTable::default();
        for p in 0..8192u32 {
            assert!(
                table
                    .find_or_insert(hash(p), p as u16, 1, |_| false, hash)
                    .is_none()
            );
        }
        check(&table, &hash);
        assert!(
            table.heap_bytes() * 10 <= 8192 * 72,
            "{} bytes",
            table.heap_bytes()
        );
        for p in 0..8192u32 {
            assert_eq!(table.find(hash(p), |i| i == p), Some(p));
        }
        let same = |_: u32| 0x1234_5678_9ABC_DEF0_u64;
        let mut table = TagTable::default();
        for p in 0..1000u32 {
            assert!(
                table
                    .find_or_insert(same(p), p as u16, 1, |i| i == p, same)
                    .is_none()
            );
        }
        check(&table, &same);
        assert!(
            table.heap_bytes() * 10 <= 1000 * 72 + 640,
            "{} bytes",
            table.heap_bytes()
        );
        for p in (0..1000u32).step_by(3) {
            table.remove(same(p), p);
        }
        check(&table, &same);
        for p in 0..1000u32 {
            assert_eq!(table.find(same(p), |i| i == p), (p % 3 != 0).then_some(p));
        }
    }
}
