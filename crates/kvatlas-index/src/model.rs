//! The index's vocabulary: workers, tiers, engine block hashes, mutations, queries and results.

use kvatlas_hash::LocalBlockHash;

/// One data-parallel **rank** of an inference worker: the unit that owns blocks.
///
/// Two ranks of one worker hold separate caches and are separate owners everywhere. The words
/// have one meaning each in kvatlas: a *worker* is an engine instance, named by its `worker_id`
/// ([`crate::KvIndex::remove_worker`] takes one and drops all of its ranks); a *rank* is a value
/// of this type. The type keeps the short name routers know (Dynamo's `WorkerWithDpRank`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Worker {
    /// The worker (engine instance) id.
    pub worker_id: u64,
    /// The data-parallel rank within the worker (0 without data parallelism).
    pub dp_rank: u32,
}

impl Worker {
    /// Rank `dp_rank` of worker `worker_id`.
    pub const fn new(worker_id: u64, dp_rank: u32) -> Self {
        Self { worker_id, dp_rank }
    }
}

/// Where a worker keeps a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tier {
    /// Accelerator memory (GPU HBM): the tier `find_matches` scores by default.
    Device,
    /// Host (CPU) memory, pinned or not.
    Host,
    /// Local disk or NVMe.
    Disk,
    /// A shared or remote pool outside the worker (for example Mooncake store).
    External,
}

impl Tier {
    /// All tiers, in order.
    pub const ALL: [Tier; 4] = [Tier::Device, Tier::Host, Tier::Disk, Tier::External];

    /// Position of the tier in [`Tier::ALL`].
    pub const fn index(self) -> usize {
        self as usize
    }
}

/// Cumulative view level: 0 = device only, 1 = device or host, 2 = any tier.
pub(crate) type Level = u8;
/// The level of a block that is not reachable from a root on any tier.
pub(crate) const UNROOTED: Level = 3;
/// Number of cumulative levels.
pub(crate) const LEVELS: usize = 3;

/// A set of tiers (a 4-bit mask).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct TierSet(u8);

impl TierSet {
    /// The empty set.
    pub const EMPTY: TierSet = TierSet(0);

    /// The set with one tier.
    pub const fn only(tier: Tier) -> Self {
        Self(1 << tier as u8)
    }

    /// Whether `tier` is in the set.
    pub const fn contains(self, tier: Tier) -> bool {
        self.0 & (1 << tier as u8) != 0
    }

    /// The set with `tier` added.
    pub const fn with(self, tier: Tier) -> Self {
        Self(self.0 | (1 << tier as u8))
    }

    /// The set with `tier` removed.
    pub const fn without(self, tier: Tier) -> Self {
        Self(self.0 & !(1 << tier as u8))
    }

    /// Whether the set is empty.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The raw mask (bit `i` = `Tier::ALL[i]`).
    pub const fn bits(self) -> u8 {
        self.0
    }

    /// Builds a set from a raw mask; bits above the four tiers are dropped.
    pub const fn from_bits(bits: u8) -> Self {
        Self(bits & 0b1111)
    }

    /// The lowest cumulative level any tier of the set belongs to ([`UNROOTED`] when empty).
    pub(crate) const fn best_level(self) -> Level {
        if self.0 & 0b0001 != 0 {
            0
        } else if self.0 & 0b0010 != 0 {
            1
        } else if self.0 & 0b1100 != 0 {
            2
        } else {
            UNROOTED
        }
    }

    /// Iterates the tiers in the set.
    pub fn iter(self) -> impl Iterator<Item = Tier> {
        Tier::ALL.into_iter().filter(move |t| self.contains(*t))
    }
}

/// An engine's own identifier of a block (vLLM's or SGLang's block hash), opaque to kvatlas.
///
/// Engines choose these freely: two workers may use different external hashes for the same
/// tokens, and nothing about a block's content may be inferred from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ExternalBlockHash(u64);

impl ExternalBlockHash {
    /// Wraps a raw engine hash.
    pub const fn new(raw: u64) -> Self {
        Self(raw)
    }

    /// The raw value.
    pub const fn get(self) -> u64 {
        self.0
    }
}

/// One block of a [`Mutation::Stored`] run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StoredBlock {
    /// The engine's hash of the block.
    pub external: ExternalBlockHash,
    /// The local (token) hash of the block, as a router computes it.
    pub local: LocalBlockHash,
}

/// A change to one worker's cache, in the order that worker produced it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mutation {
    /// A contiguous run of blocks became cached: `blocks[0]`'s parent is `parent` (`None` = the
    /// run starts the sequence), each later block's parent is the block before it.
    Stored {
        /// The owner.
        worker: Worker,
        /// Where the blocks are kept.
        tier: Tier,
        /// The engine hash of the block before `blocks[0]`, if any.
        parent: Option<ExternalBlockHash>,
        /// The run of blocks, in sequence order.
        blocks: Vec<StoredBlock>,
    },
    /// Blocks left the worker's cache on `tier`.
    Removed {
        /// The owner.
        worker: Worker,
        /// The tier they left.
        tier: Tier,
        /// Their engine hashes.
        blocks: Vec<ExternalBlockHash>,
    },
    /// The worker rank dropped every block on every tier.
    Cleared {
        /// The owner.
        worker: Worker,
    },
}

impl Mutation {
    /// The worker rank the mutation belongs to.
    pub fn worker(&self) -> Worker {
        match self {
            Mutation::Stored { worker, .. }
            | Mutation::Removed { worker, .. }
            | Mutation::Cleared { worker } => *worker,
        }
    }
}

/// How far an event source's stream has been applied: recorded by an index that tracks it
/// ([`crate::SharedKvIndex::apply_checkpointed`]) in the same step as the mutations before it, so
/// a snapshot never holds part of the mutations up to a checkpoint without the checkpoint.
///
/// Opaque to the index: `position` is typically the source's sequence number of its last
/// applied batch, `fingerprint` a hash of that batch (to tell a replayed batch from a new one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Checkpoint {
    /// The source (for example the worker rank whose engine publishes the events).
    pub source: Worker,
    /// How far its stream is applied.
    pub position: u64,
    /// A fingerprint of the item at `position`.
    pub fingerprint: u64,
}

/// Mutations applied together — a snapshot sees all of them or none — followed by an optional
/// checkpoint. A writer pool never splits a unit.
///
/// Invariant: every mutation belongs to a rank of worker `worker_id` (the pool's lane is chosen
/// by it, so a unit and every other mutation of that worker are applied in order).
#[derive(Debug, Clone)]
pub struct Unit {
    /// The worker all mutations belong to.
    pub worker_id: u64,
    /// The mutations, in order.
    pub mutations: Vec<Mutation>,
    /// Recorded once `mutations` are applied, in the same step.
    pub checkpoint: Option<Checkpoint>,
    /// The unit starts by clearing the source's ranks because its stream broke (the engine
    /// restarted, or batches were lost for good): its checkpoint may then be at or below the
    /// source's last one. A consumer of a replicated log applies such a unit even when its
    /// position is not new (`docs/server.md`, "Scale-out over NATS").
    pub resync: bool,
    /// When the unit's source data reached the process (a listener took its batch off the
    /// socket, a stream message arrived), if known. A [`crate::ThreadPool`] built with
    /// [`crate::ThreadPool::with_delay_observer`] reports the time from here until the unit's
    /// mutations are visible to queries. Not part of the unit's content: two units that differ
    /// only here hold the same events.
    pub received: Option<std::time::Instant>,
    /// When the engine published the unit's source data (its batch's own timestamp, carried
    /// onto this process's monotonic clock), if the batch had a usable one. The delay observer
    /// reports the time from here until visible as well (the event's age when it became
    /// visible). Not part of the unit's content, as `received`.
    pub published: Option<std::time::Instant>,
}

/// Units are equal when they hold the same events: [`Unit::received`] and [`Unit::published`]
/// are not compared.
impl PartialEq for Unit {
    fn eq(&self, other: &Self) -> bool {
        self.worker_id == other.worker_id
            && self.mutations == other.mutations
            && self.checkpoint == other.checkpoint
            && self.resync == other.resync
    }
}

impl Eq for Unit {}

/// What applying mutations did, including every anomaly (nothing is dropped silently).
///
/// Anomalies never corrupt other workers' answers; see `docs/index.md` for the exact semantics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ApplyReport {
    /// Blocks newly held (or newly held on another tier).
    pub stored: u64,
    /// Block-tier memberships that ended through `Removed`.
    pub removed: u64,
    /// Blocks that ended through `Cleared` or worker removal (all tiers at once).
    pub cleared: u64,
    /// Stores of a block already held on that tier with the same content and parent: no-ops.
    pub duplicate_stores: u64,
    /// Stores reusing a held block's engine hash with a different local hash or parent: ignored
    /// (the first store wins).
    pub conflicting_stores: u64,
    /// Stored runs whose parent the worker does not hold: kept, but unreachable until the parent
    /// is stored.
    pub unknown_parents: u64,
    /// Removes of blocks the worker does not hold on that tier: no-ops.
    pub unknown_removes: u64,
    /// Block-tier pairs the index evicted to stay within its capacity bound (not an anomaly).
    pub evicted: u64,
}

impl ApplyReport {
    /// Adds another report's counts to this one.
    pub fn merge(&mut self, other: &ApplyReport) {
        self.stored += other.stored;
        self.removed += other.removed;
        self.cleared += other.cleared;
        self.duplicate_stores += other.duplicate_stores;
        self.conflicting_stores += other.conflicting_stores;
        self.unknown_parents += other.unknown_parents;
        self.unknown_removes += other.unknown_removes;
        self.evicted += other.evicted;
    }

    /// Number of anomalies counted: duplicate and conflicting stores, unknown parents and
    /// removes.
    pub fn anomalies(&self) -> u64 {
        self.duplicate_stores
            + self.conflicting_stores
            + self.unknown_parents
            + self.unknown_removes
    }

    /// Whether any anomaly was counted.
    pub fn has_anomalies(&self) -> bool {
        self.anomalies() > 0
    }
}

/// How `find_matches` should answer.
///
/// Built from [`MatchOptions::default`] (device scores of every matching rank) and the
/// `with_*` methods; new options may be added, so the type is `#[non_exhaustive]`.
///
/// ```
/// use kvatlas_index::MatchOptions;
///
/// let options = MatchOptions::default().with_tiered(true).with_top_k(Some(4));
/// assert!(options.tiered && !options.early_exit);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct MatchOptions {
    /// Also compute the cumulative host and disk boundaries (otherwise they equal the device
    /// score and only workers with a device match are returned).
    pub tiered: bool,
    /// Stop when at most one worker still matches on the device tier: that worker's device score
    /// is then the depth reached (`min(true score, second-best score + 1)`); others are exact.
    pub early_exit: bool,
    /// Keep only the `k` workers with the best device scores (ties: lower worker first).
    pub top_k: Option<usize>,
}

impl MatchOptions {
    /// With [`MatchOptions::tiered`] set to `tiered`.
    pub fn with_tiered(mut self, tiered: bool) -> Self {
        self.tiered = tiered;
        self
    }

    /// With [`MatchOptions::early_exit`] set to `early_exit`.
    pub fn with_early_exit(mut self, early_exit: bool) -> Self {
        self.early_exit = early_exit;
        self
    }

    /// With [`MatchOptions::top_k`] set to `top_k`.
    pub fn with_top_k(mut self, top_k: Option<usize>) -> Self {
        self.top_k = top_k;
        self
    }
}

/// One worker rank's match for a query (`#[non_exhaustive]`: read its fields, build one with
/// [`WorkerMatch::new`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct WorkerMatch {
    /// The worker rank.
    pub worker: Worker,
    /// Leading query blocks held on the device tier.
    pub device: u32,
    /// Leading query blocks each held on the device or host tier (`device <= host`).
    pub host: u32,
    /// Leading query blocks each held on any tier (`host <= disk`): the longest match.
    pub disk: u32,
}

impl WorkerMatch {
    /// A rank's match: `device <= host <= disk` leading blocks (the caller keeps that order).
    pub fn new(worker: Worker, device: u32, host: u32, disk: u32) -> Self {
        debug_assert!(device <= host && host <= disk);
        Self {
            worker,
            device,
            host,
            disk,
        }
    }
}

/// The answer to one query: the workers with a non-zero match, sorted by worker.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Matches {
    /// Per worker rank, sorted by `worker`.
    pub workers: Vec<WorkerMatch>,
}

impl Matches {
    /// The device score of `worker` (0 if absent).
    pub fn device_score(&self, worker: Worker) -> u32 {
        self.get(worker).map_or(0, |m| m.device)
    }

    /// The match of `worker`, if any.
    pub fn get(&self, worker: Worker) -> Option<&WorkerMatch> {
        self.workers
            .binary_search_by_key(&worker, |m| m.worker)
            .ok()
            .map(|i| &self.workers[i])
    }

    /// Applies `early_exit` and `top_k` to exact scores and sorts by worker (the options'
    /// semantics in one place, shared by every backend).
    pub fn finish(&mut self, options: &MatchOptions) {
        self.workers.retain(|m| m.disk > 0 || m.device > 0);
        if !options.tiered {
            self.workers.retain(|m| m.device > 0);
            for m in &mut self.workers {
                m.host = m.device;
                m.disk = m.device;
            }
        }
        if options.early_exit {
            let mut best = (0u32, None);
            let mut second = 0u32;
            for m in &self.workers {
                if m.device > best.0 || (m.device == best.0 && best.1.is_none_or(|w| m.worker < w))
                {
                    second = second.max(best.0);
                    best = (m.device, Some(m.worker));
                } else {
                    second = second.max(m.device);
                }
            }
            if let (score, Some(leader)) = best
                && score > second + 1
            {
                for m in &mut self.workers {
                    if m.worker == leader {
                        m.device = second + 1;
                        if !options.tiered {
                            m.host = m.device;
                            m.disk = m.device;
                        }
                    }
                }
            }
        }
        if let Some(k) = options.top_k {
            self.workers
                .sort_by(|a, b| b.device.cmp(&a.device).then(a.worker.cmp(&b.worker)));
            self.workers.truncate(k);
        }
        self.workers.sort_unstable_by_key(|m| m.worker);
    }
}

/// Per worker rank: how many blocks it holds on each tier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerBlocks {
    /// The worker rank.
    pub worker: Worker,
    /// Blocks held per tier, indexed by [`Tier::index`].
    pub per_tier: [u64; 4],
}

/// Size and occupancy figures of an index.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct IndexStats {
    /// Per worker rank with at least one block, sorted by worker.
    pub workers: Vec<WorkerBlocks>,
    /// Total (worker, block, tier) memberships.
    pub memberships: u64,
    /// Heap bytes the index estimates it uses (allocated capacity of its tables).
    pub heap_bytes: u64,
}

/// Heap bytes of a `hashbrown` table (or a `HashMap`) that can hold `capacity` entries of `entry`
/// bytes without growing: buckets are a power of two of which at most 7/8 are used (all but one
/// below 8 buckets), each with one control byte, plus one 16-byte control group at the end.
pub(crate) fn table_bytes(capacity: usize, entry: usize) -> usize {
    if capacity == 0 {
        return 0;
    }
    let buckets = if capacity < 8 {
        (capacity + 1).next_power_of_two()
    } else {
        (capacity * 8 / 7).next_power_of_two()
    };
    buckets * (entry + 1) + 16
}

#[cfg(test)]
mod table_bytes_tests {
    use super::table_bytes;

    /// The bucket counts hashbrown reports as capacities: 3 → 4, 7 → 8, 14 → 16, 896 → 1024.
    #[test]
    fn bucket_counts_follow_hashbrown() {
        assert_eq!(table_bytes(0, 4), 0);
        assert_eq!(table_bytes(3, 4), 4 * 5 + 16);
        assert_eq!(table_bytes(7, 4), 8 * 5 + 16);
        assert_eq!(table_bytes(14, 4), 16 * 5 + 16);
        assert_eq!(table_bytes(896, 2), 1024 * 3 + 16);
        // 800 entries fit in 1024 buckets (896 usable); 1000 need 2048.
        for (entries, buckets) in [(800u32, 1024), (1000, 2048)] {
            let mut table = hashbrown::HashTable::<u32>::new();
            for i in 0..entries {
                table.insert_unique(u64::from(i), i, |&v| u64::from(v));
            }
            assert_eq!(table_bytes(table.capacity(), 4), buckets * 5 + 16);
        }
    }
}
