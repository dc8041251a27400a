//! kvatlas's native snapshot format: every index of a server — its block size and capacity,
//! its worker registrations, its blocks, and the checkpoint of every source (the last batch
//! applied, with the fingerprints of the batches before it) — as one binary stream, versioned and
//! checksummed, written and read incrementally (never held whole in memory as bytes).
//!
//! ```text
//! stream  := header record* trailer
//! header  := "KVATSNAP" (8 bytes) · version u16 LE · reserved u16 · created, Unix µs, i64 LE
//! record  := kind u8 · fields            (integers are LEB128 varints unless marked "fixed")
//!   1 INDEX        model str · tenant str · block size · capacity (0 = unbounded)
//!   2 REGISTRATION instance · dp rank · source u8 (1 ZMQ, 2 gRPC) · engine u8 · mode u8 ·
//!                  endpoint str · replay endpoint str · topic str · pod name str (version ≥ 2;
//!                  empty = none)                                            (of the last INDEX)
//!   3 MARK         instance · dp rank · position · n · n × (seq delta · fingerprint fixed u64)
//!   4 BLOCKS       n · chains until n entries:
//!                  chain := length · parent of its first entry ·
//!                           length × (engine hash fixed u64 · local hash fixed u64)
//!                  each entry after a chain's first has the entry before it as its parent;
//!                  parent: 0 = none, 1 = an engine hash follows (fixed u64),
//!                          k ≥ 2 = the block k − 1 entries earlier in this table
//!   5 RANK         instance · dp rank · n · runs until n memberships:
//!                  run := (entry delta << 4) | tiers · further entries
//!                  (a run is consecutive entries of the table with the same tiers; the delta
//!                  is from the previous run's last entry)
//! trailer := 255 · indexes · memberships · XXH3-64 of every byte before the trailer (fixed u64)
//! str     := length · UTF-8 bytes
//! ```
//!
//! The block table of an index holds each distinct (engine hash, local hash, parent) once, parents
//! before their children where they are in the table (depth first, so a chain is consecutive
//! entries and is written as one run whose parents are implied), and the ranks that share a prefix
//! (engines with consistent hashes, the usual deployment) share its entries; a rank is then a
//! sorted list of entries written as runs of consecutive entries, delta-coded with the tiers in
//! the low 4 bits — a rank that holds whole chains costs a few bytes per chain, not per block.
//!
//! Versions 1 and 2 wrote one parent per block table entry and one varint per membership
//! (`n × (engine hash · local hash · parent)`, `n × ((entry delta << 4) | tiers)`); they are
//! still read.
//!
//! A reader refuses a stream whose magic is wrong, whose version is newer than
//! [`FORMAT_VERSION`], whose records are malformed or truncated, whose checksum or counts do not
//! match, or that writes a rank of an index twice — before anything is restored. While reading it
//! holds the block tables and each rank as runs of entries (memory in proportion to the bytes
//! read); the ranks' blocks, which a few bytes can multiply (a rank naming a whole table), are
//! materialised only from a verified stream.

use std::collections::BTreeMap;
use std::io::{self, Read, Write};

use kvatlas_events::{EngineKind, SocketMode};
use kvatlas_hash::{BlockSize, LocalBlockHash};
use kvatlas_index::{ExternalBlockHash, Snapshot, SnapshotBlock, TierSet, Worker, WorkerSnapshot};
use rustc_hash::FxHashMap as HashMap;
use xxhash_rust::xxh3::Xxh3;

use crate::registry::{IndexKey, WorkerRegistration};

/// The stream's first bytes.
pub const MAGIC: &[u8; 8] = b"KVATSNAP";
/// The format version this build writes and the newest it reads (2 added the pod name of a
/// registration, and version 1 files are read as registrations without one; 3 writes the block
/// table as chains and the ranks as runs).
pub const FORMAT_VERSION: u16 = 3;

const INDEX: u8 = 1;
const REGISTRATION: u8 = 2;
const MARK: u8 = 3;
const BLOCKS: u8 = 4;
const RANK: u8 = 5;
const TRAILER: u8 = 255;

/// Longest string accepted in a snapshot (names, endpoints).
const MAX_STR: usize = 4096;
/// Most entries accepted per count field before anything is allocated for them (a corrupt count
/// must not allocate gigabytes; larger tables grow as they are read).
const PREALLOC: usize = 1 << 16;

/// Why a snapshot could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SnapshotError {
    /// Reading or writing failed.
    #[error("I/O: {0}")]
    Io(#[from] io::Error),
    /// Not a kvatlas snapshot.
    #[error("not a kvatlas snapshot (the first bytes are not \"KVATSNAP\")")]
    BadMagic,
    /// Written by a newer kvatlas.
    #[error(
        "snapshot format version {found} is newer than this kvatlas reads ({FORMAT_VERSION}); \
         refusing to misread it"
    )]
    NewerVersion {
        /// The version in the file.
        found: u16,
    },
    /// The stream ends early (an interrupted write, a cut download).
    #[error("the snapshot is truncated: it ends {0}")]
    Truncated(&'static str),
    /// A record is malformed.
    #[error("the snapshot is corrupt: {0}")]
    Corrupt(String),
    /// The checksum does not match: the bytes were altered.
    #[error(
        "the snapshot's checksum does not match (stored {stored:#018x}, computed {computed:#018x}): its bytes were altered"
    )]
    Checksum {
        /// The checksum in the trailer.
        stored: u64,
        /// The checksum of the bytes read.
        computed: u64,
    },
    /// An index holds more blocks than this server's capacity bound ([`ReadLimits`]).
    #[error(
        "index {index} of the snapshot holds at least {held} (rank, block) pairs, more than this \
         server's capacity of {capacity} (--capacity): refusing to load it; give this server \
         the capacity of the server that wrote it"
    )]
    OverCapacity {
        /// The index (its model and tenant).
        index: String,
        /// The (rank, block) pairs it holds.
        held: u64,
        /// This server's bound.
        capacity: u64,
    },
}

/// A source's checkpoint: the last batch applied and the fingerprints before it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SourceMark {
    /// The sequence number of the last batch applied.
    pub position: u64,
    /// `(seq, fingerprint)` of the last batches applied, oldest first.
    pub recent: Vec<(u64, u64)>,
}

/// How a registered rank is fed, as a snapshot records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordedFeed {
    /// A ZMQ listener.
    Zmq(WorkerRegistration),
    /// `PublishEvents`.
    Grpc {
        /// The worker rank.
        worker: Worker,
    },
}

/// One index as a snapshot holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexImage {
    /// Which index.
    pub key: IndexKey,
    /// Its block size.
    pub block_size: BlockSize,
    /// Its capacity bound, if any.
    pub capacity: Option<u64>,
    /// Its registered feeds.
    pub feeds: Vec<RecordedFeed>,
    /// The checkpoint of every source, by the source's worker rank.
    pub marks: BTreeMap<Worker, SourceMark>,
    /// Its blocks.
    pub snapshot: Snapshot,
}

impl IndexImage {
    /// (rank, block, tier) memberships.
    pub fn memberships(&self) -> u64 {
        self.snapshot
            .workers
            .iter()
            .flat_map(|w| &w.blocks)
            .map(|b| u64::from(b.tiers.bits().count_ones()))
            .sum()
    }
}

// ---------------------------------------------------------------------------------------------
// Writing
// ---------------------------------------------------------------------------------------------

/// Writes a snapshot stream to `out`, hashing as it goes.
pub struct Writer<W: Write> {
    out: W,
    hash: Xxh3,
    indexes: u64,
    memberships: u64,
    buf: Vec<u8>,
}

impl<W: Write> std::fmt::Debug for Writer<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Writer")
            .field("indexes", &self.indexes)
            .field("memberships", &self.memberships)
            .finish_non_exhaustive()
    }
}

impl<W: Write> Writer<W> {
    /// Writes the header.
    ///
    /// # Errors
    /// The sink's I/O error.
    pub fn new(out: W, created_unix_micros: i64) -> Result<Self, SnapshotError> {
        let mut writer = Self {
            out,
            hash: Xxh3::new(),
            indexes: 0,
            memberships: 0,
            buf: Vec::with_capacity(64 << 10),
        };
        writer.buf.extend_from_slice(MAGIC);
        writer.buf.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        writer.buf.extend_from_slice(&0u16.to_le_bytes());
        writer
            .buf
            .extend_from_slice(&created_unix_micros.to_le_bytes());
        writer.flush_buf()?;
        Ok(writer)
    }

    fn flush_buf(&mut self) -> Result<(), SnapshotError> {
        self.hash.update(&self.buf);
        self.out.write_all(&self.buf)?;
        self.buf.clear();
        Ok(())
    }

    fn maybe_flush(&mut self) -> Result<(), SnapshotError> {
        if self.buf.len() >= 60 << 10 {
            self.flush_buf()?;
        }
        Ok(())
    }

    /// Writes one index.
    ///
    /// # Errors
    /// The sink's I/O error.
    pub fn index(&mut self, image: &IndexImage) -> Result<(), SnapshotError> {
        self.indexes += 1;
        self.buf.push(INDEX);
        put_str(&mut self.buf, &image.key.model);
        put_str(&mut self.buf, &image.key.tenant);
        put_varint(&mut self.buf, u64::from(image.block_size.get()));
        put_varint(&mut self.buf, image.capacity.unwrap_or(0));
        for feed in &image.feeds {
            self.buf.push(REGISTRATION);
            match feed {
                RecordedFeed::Zmq(r) => {
                    put_varint(&mut self.buf, r.instance_id);
                    put_varint(&mut self.buf, u64::from(r.dp_rank));
                    self.buf.push(1);
                    self.buf.push(match r.engine {
                        EngineKind::Vllm => 1,
                        EngineKind::Sglang => 2,
                    });
                    self.buf.push(match r.mode {
                        SocketMode::Connect => 0,
                        SocketMode::Bind => 1,
                    });
                    put_str(&mut self.buf, &r.endpoint);
                    put_str(
                        &mut self.buf,
                        r.replay_endpoint.as_deref().unwrap_or_default(),
                    );
                    put_str(&mut self.buf, &r.topic);
                    put_str(&mut self.buf, r.pod_name.as_deref().unwrap_or_default());
                }
                RecordedFeed::Grpc { worker } => {
                    put_varint(&mut self.buf, worker.worker_id);
                    put_varint(&mut self.buf, u64::from(worker.dp_rank));
                    self.buf.extend_from_slice(&[2, 0, 0]);
                    put_str(&mut self.buf, "");
                    put_str(&mut self.buf, "");
                    put_str(&mut self.buf, "");
                    put_str(&mut self.buf, "");
                }
            }
        }
        for (worker, mark) in &image.marks {
            self.buf.push(MARK);
            put_varint(&mut self.buf, worker.worker_id);
            put_varint(&mut self.buf, u64::from(worker.dp_rank));
            put_varint(&mut self.buf, mark.position);
            put_varint(&mut self.buf, mark.recent.len() as u64);
            let mut previous = 0u64;
            for &(seq, fingerprint) in &mark.recent {
                put_varint(&mut self.buf, seq.wrapping_sub(previous));
                self.buf.extend_from_slice(&fingerprint.to_le_bytes());
                previous = seq;
            }
        }
        self.maybe_flush()?;
        self.blocks(&image.snapshot)
    }

    /// The block table and the ranks of one index.
    fn blocks(&mut self, snapshot: &Snapshot) -> Result<(), SnapshotError> {
        let table = BlockTable::build(snapshot);
        self.buf.push(BLOCKS);
        put_varint(&mut self.buf, table.entries.len() as u64);
        let mut start = 0;
        while start < table.entries.len() {
            // The chain: every next entry whose parent is the entry before it.
            let mut end = start + 1;
            while end < table.entries.len()
                && table.entries[end].parent == Some(table.entries[end - 1].external)
            {
                end += 1;
            }
            put_varint(&mut self.buf, (end - start) as u64);
            match table.entries[start].parent {
                None => self.buf.push(0),
                Some(parent) => match table.position.get(&parent) {
                    Some(&at) if at < start => put_varint(&mut self.buf, (start - at) as u64 + 1),
                    _ => {
                        self.buf.push(1);
                        self.buf.extend_from_slice(&parent.get().to_le_bytes());
                    }
                },
            }
            for entry in &table.entries[start..end] {
                self.buf
                    .extend_from_slice(&entry.external.get().to_le_bytes());
                self.buf.extend_from_slice(&entry.local.get().to_le_bytes());
                self.maybe_flush()?;
            }
            start = end;
        }
        for worker in &snapshot.workers {
            self.buf.push(RANK);
            put_varint(&mut self.buf, worker.worker.worker_id);
            put_varint(&mut self.buf, u64::from(worker.worker.dp_rank));
            let mut entries: Vec<(usize, u8)> = worker
                .blocks
                .iter()
                .map(|b| (table.entry_of(b), b.tiers.bits()))
                .collect();
            entries.sort_unstable();
            put_varint(&mut self.buf, entries.len() as u64);
            let mut previous = 0usize;
            let mut at = 0;
            while at < entries.len() {
                let (entry, tiers) = entries[at];
                let mut end = at + 1;
                while end < entries.len() && entries[end] == (entry + (end - at), tiers) {
                    end += 1;
                }
                self.memberships += u64::from(tiers.count_ones()) * (end - at) as u64;
                put_varint(
                    &mut self.buf,
                    (((entry - previous) as u64) << 4) | u64::from(tiers),
                );
                put_varint(&mut self.buf, (end - at - 1) as u64);
                previous = entry + (end - at - 1);
                at = end;
                self.maybe_flush()?;
            }
        }
        self.maybe_flush()
    }

    /// Writes the trailer and returns the sink.
    ///
    /// # Errors
    /// The sink's I/O error.
    pub fn finish(mut self) -> Result<W, SnapshotError> {
        self.buf.push(TRAILER);
        put_varint(&mut self.buf, self.indexes);
        put_varint(&mut self.buf, self.memberships);
        self.flush_buf()?;
        let digest = self.hash.digest();
        self.out.write_all(&digest.to_le_bytes())?;
        self.out.flush()?;
        Ok(self.out)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Entry {
    external: ExternalBlockHash,
    local: LocalBlockHash,
    parent: Option<ExternalBlockHash>,
}

/// An index's distinct blocks, parents first where possible.
struct BlockTable {
    entries: Vec<Entry>,
    index: HashMap<Entry, usize>,
    /// The first entry of each engine hash: a parent is written as a reference to it (only the
    /// parent's engine hash is needed) when it comes earlier in the table, else explicitly.
    position: HashMap<ExternalBlockHash, usize>,
}

impl BlockTable {
    fn build(snapshot: &Snapshot) -> Self {
        /// The table position of an entry not placed yet.
        const UNPLACED: usize = usize::MAX;
        // Distinct entries (each becomes its table position once placed), and their children.
        let mut index: HashMap<Entry, usize> = HashMap::default();
        for worker in &snapshot.workers {
            for b in &worker.blocks {
                index.insert(
                    Entry {
                        external: b.external,
                        local: b.local,
                        parent: b.parent,
                    },
                    UNPLACED,
                );
            }
        }
        let mut by_external: HashMap<ExternalBlockHash, Vec<Entry>> = HashMap::default();
        let mut children: HashMap<ExternalBlockHash, Vec<Entry>> = HashMap::default();
        for entry in index.keys() {
            by_external.entry(entry.external).or_default().push(*entry);
            if let Some(parent) = entry.parent {
                children.entry(parent).or_default().push(*entry);
            }
        }
        for list in children.values_mut().chain(by_external.values_mut()) {
            list.sort_unstable_by_key(|e| (e.external, e.local, e.parent));
        }
        // Roots: no parent, or a parent not in the table; then depth first, parents first.
        let mut roots: Vec<Entry> = index
            .keys()
            .filter(|e| e.parent.is_none_or(|p| !by_external.contains_key(&p)))
            .copied()
            .collect();
        roots.sort_unstable_by_key(|e| (e.external, e.local, e.parent));
        let mut entries = Vec::with_capacity(index.len());
        let mut stack: Vec<Entry> = roots.into_iter().rev().collect();
        let visit = |stack: &mut Vec<Entry>,
                     entries: &mut Vec<Entry>,
                     index: &mut HashMap<Entry, usize>| {
            while let Some(entry) = stack.pop() {
                let Some(at) = index.get_mut(&entry) else {
                    continue;
                };
                if *at != UNPLACED {
                    continue;
                }
                *at = entries.len();
                entries.push(entry);
                if let Some(kids) = children.get(&entry.external) {
                    stack.extend(kids.iter().rev().copied());
                }
            }
        };
        visit(&mut stack, &mut entries, &mut index);
        // Cycles of parent links (conflicting engine hashes) leave entries unvisited: add them.
        let mut rest: Vec<Entry> = index
            .iter()
            .filter(|(_, at)| **at == UNPLACED)
            .map(|(e, _)| *e)
            .collect();
        rest.sort_unstable_by_key(|e| (e.external, e.local, e.parent));
        for entry in rest {
            stack.push(entry);
            visit(&mut stack, &mut entries, &mut index);
        }
        let mut position = HashMap::with_capacity_and_hasher(entries.len(), Default::default());
        for (i, entry) in entries.iter().enumerate() {
            position.entry(entry.external).or_insert(i);
        }
        Self {
            entries,
            index,
            position,
        }
    }

    fn entry_of(&self, block: &SnapshotBlock) -> usize {
        self.index
            .get(&Entry {
                external: block.external,
                local: block.local,
                parent: block.parent,
            })
            .copied()
            .unwrap_or(0)
    }
}

fn put_varint(buf: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        buf.push((value as u8) | 0x80);
        value >>= 7;
    }
    buf.push(value as u8);
}

fn put_str(buf: &mut Vec<u8>, value: &str) {
    put_varint(buf, value.len() as u64);
    buf.extend_from_slice(value.as_bytes());
}

// ---------------------------------------------------------------------------------------------
// Reading
// ---------------------------------------------------------------------------------------------

/// Reads a snapshot stream, hashing as it goes.
struct Reader<R: Read> {
    input: R,
    hash: Xxh3,
    buf: Vec<u8>,
    at: usize,
    eof: bool,
}

impl<R: Read> Reader<R> {
    fn new(input: R) -> Self {
        Self {
            input,
            hash: Xxh3::new(),
            buf: Vec::with_capacity(64 << 10),
            at: 0,
            eof: false,
        }
    }

    /// Makes `n` bytes available, or fails with `Truncated(what)`.
    fn fill(&mut self, n: usize, what: &'static str) -> Result<(), SnapshotError> {
        while self.buf.len() - self.at < n {
            if self.eof {
                return Err(SnapshotError::Truncated(what));
            }
            if self.at > 0 {
                self.buf.drain(..self.at);
                self.at = 0;
            }
            let len = self.buf.len();
            self.buf.resize(len + (64 << 10), 0);
            let read = loop {
                match self.input.read(&mut self.buf[len..]) {
                    Ok(read) => break read,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        self.buf.truncate(len);
                        return Err(e.into());
                    }
                }
            };
            self.buf.truncate(len + read);
            if read == 0 {
                self.eof = true;
            }
        }
        Ok(())
    }

    fn take(&mut self, n: usize, what: &'static str) -> Result<&[u8], SnapshotError> {
        self.fill(n, what)?;
        let bytes = &self.buf[self.at..self.at + n];
        self.hash.update(bytes);
        self.at += n;
        Ok(bytes)
    }

    fn byte(&mut self, what: &'static str) -> Result<u8, SnapshotError> {
        Ok(self.take(1, what)?[0])
    }

    fn fixed_u64(&mut self, what: &'static str) -> Result<u64, SnapshotError> {
        let bytes = self.take(8, what)?;
        let mut raw = [0u8; 8];
        raw.copy_from_slice(bytes);
        Ok(u64::from_le_bytes(raw))
    }

    fn varint(&mut self, what: &'static str) -> Result<u64, SnapshotError> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = self.byte(what)?;
            value |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(SnapshotError::Corrupt(format!(
            "a varint in {what} runs past 64 bits"
        )))
    }

    fn small(&mut self, what: &'static str) -> Result<u32, SnapshotError> {
        u32::try_from(self.varint(what)?)
            .map_err(|_| SnapshotError::Corrupt(format!("{what} is out of range")))
    }

    fn string(&mut self, what: &'static str) -> Result<String, SnapshotError> {
        let len = self.varint(what)?;
        let len = usize::try_from(len)
            .ok()
            .filter(|l| *l <= MAX_STR)
            .ok_or_else(|| SnapshotError::Corrupt(format!("{what} is {len} bytes long")))?;
        let bytes = self.take(len, what)?.to_vec();
        String::from_utf8(bytes).map_err(|_| SnapshotError::Corrupt(format!("{what} is not UTF-8")))
    }

    /// The trailer's checksum, read without hashing it; then the stream must end.
    fn checksum(&mut self) -> Result<(u64, u64), SnapshotError> {
        let computed = self.hash.digest();
        self.fill(8, "inside the checksum")?;
        let mut raw = [0u8; 8];
        raw.copy_from_slice(&self.buf[self.at..self.at + 8]);
        self.at += 8;
        let stored = u64::from_le_bytes(raw);
        // Anything after the checksum is corruption too.
        if self.fill(1, "").is_ok() {
            return Err(SnapshotError::Corrupt(
                "bytes follow the trailer".to_owned(),
            ));
        }
        Ok((stored, computed))
    }
}

/// Reads a whole snapshot stream, verifying it; nothing is returned unless all of it is sound.
///
/// # Errors
/// [`SnapshotError`] naming what is wrong.
pub fn read(input: impl Read) -> Result<(i64, Vec<IndexImage>), SnapshotError> {
    read_within(input, ReadLimits::default())
}

/// Bounds a reader holds a snapshot from elsewhere (a peer, the NATS bucket) to: a sound
/// stream, by its checksum, can still claim more than this server would ever hold.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReadLimits {
    /// Most (rank, block) pairs an index may hold (this server's `--capacity`): checked before
    /// any block is materialised (the blocks would be held here, then evicted to the bound).
    pub capacity: Option<u64>,
    /// Most registrations the whole stream may record (this server's
    /// `--max-registered-ranks`): each is a few bytes that name a copy of its index's key.
    pub registrations: Option<usize>,
    /// Most indexes the stream may hold (this server's `--max-indexes`), checked as each is
    /// read: `capacity` bounds one index, so without this a stream of many small indexes each
    /// naming a large table again could make the reader materialise without bound (only
    /// `Registry::check_images` counted them, after materialising).
    pub indexes: Option<usize>,
}

/// [`read`] within `limits`.
///
/// # Errors
/// [`SnapshotError`] naming what is wrong; [`SnapshotError::OverCapacity`] for an index
/// beyond `limits.capacity`, [`SnapshotError::Corrupt`] for more registrations than
/// `limits.registrations`.
pub fn read_within(
    input: impl Read,
    limits: ReadLimits,
) -> Result<(i64, Vec<IndexImage>), SnapshotError> {
    let mut registrations = 0usize;
    let mut marks = 0usize;
    let mut reader = Reader::new(input);
    let magic = reader.take(8, "in the header")?;
    if magic != MAGIC {
        return Err(SnapshotError::BadMagic);
    }
    let version = reader.take(2, "in the header")?;
    let version = u16::from_le_bytes([version[0], version[1]]);
    if version > FORMAT_VERSION {
        return Err(SnapshotError::NewerVersion { found: version });
    }
    reader.take(2, "in the header")?;
    let created = reader.fixed_u64("in the header")? as i64;
    let mut images: Vec<IndexImage> = Vec::new();
    // Every block table read (a rank names entries of its index's latest one) and the ranks as
    // runs of their entries: the ranks' blocks are materialised only once the whole stream is
    // verified, because a rank of a few bytes can name a table of millions of entries (and a
    // damaged count or run could name it again and again).
    let mut tables: Vec<Vec<Entry>> = Vec::new();
    let mut current_table: Option<usize> = None;
    let mut ranks: Vec<RankRuns> = Vec::new();
    let mut memberships = 0u64;
    // (rank, block) pairs per index, as `images`.
    let mut pairs: Vec<u64> = Vec::new();
    loop {
        let kind = reader.byte("before its trailer")?;
        match kind {
            INDEX => {
                let model = reader.string("an index's model")?;
                let tenant = reader.string("an index's tenant")?;
                let block_size = reader.small("a block size")?;
                let block_size = BlockSize::new(block_size).map_err(|_| {
                    SnapshotError::Corrupt(format!("block size {block_size} is invalid"))
                })?;
                let capacity = reader.varint("a capacity")?;
                let key = IndexKey::new(model, tenant);
                // Names a server accepts (at most 256 bytes each), so that the copies of the key
                // the registrations hold stay small.
                key.validate()
                    .map_err(|e| SnapshotError::Corrupt(format!("an index's name: {e}")))?;
                if let Some(most) = limits.indexes
                    && images.len() >= most
                {
                    return Err(SnapshotError::Corrupt(format!(
                        "it holds more than {most} indexes, this server's limit (--max-indexes)"
                    )));
                }
                images.push(IndexImage {
                    key,
                    block_size,
                    capacity: (capacity > 0).then_some(capacity),
                    feeds: Vec::new(),
                    marks: BTreeMap::new(),
                    snapshot: Snapshot::default(),
                });
                pairs.push(0);
                current_table = None;
            }
            REGISTRATION => {
                registrations += 1;
                if let Some(most) = limits.registrations
                    && registrations > most
                {
                    return Err(SnapshotError::Corrupt(format!(
                        "more than {most} registrations, this server's limit of registered \
                         ranks (--max-registered-ranks)"
                    )));
                }
                let instance_id = reader.varint("a registration")?;
                let dp_rank = reader.small("a registration")?;
                let source = reader.byte("a registration")?;
                let engine = reader.byte("a registration")?;
                let mode = reader.byte("a registration")?;
                let endpoint = reader.string("an endpoint")?;
                let replay = reader.string("a replay endpoint")?;
                let topic = reader.string("a topic")?;
                let pod_name = if version >= 2 {
                    Some(reader.string("a pod name")?).filter(|p| !p.is_empty())
                } else {
                    None
                };
                let image = images.last_mut().ok_or_else(|| {
                    SnapshotError::Corrupt("a registration before any index".into())
                })?;
                let feed = match source {
                    1 => RecordedFeed::Zmq(WorkerRegistration {
                        index: image.key.clone(),
                        instance_id,
                        dp_rank,
                        block_size: image.block_size,
                        engine: match engine {
                            1 => EngineKind::Vllm,
                            2 => EngineKind::Sglang,
                            other => {
                                return Err(SnapshotError::Corrupt(format!(
                                    "unknown engine kind {other}"
                                )));
                            }
                        },
                        endpoint,
                        replay_endpoint: Some(replay).filter(|r| !r.is_empty()),
                        topic,
                        pod_name,
                        mode: match mode {
                            0 => SocketMode::Connect,
                            1 => SocketMode::Bind,
                            other => {
                                return Err(SnapshotError::Corrupt(format!(
                                    "unknown socket mode {other}"
                                )));
                            }
                        },
                    }),
                    2 => RecordedFeed::Grpc {
                        worker: Worker::new(instance_id, dp_rank),
                    },
                    other => {
                        return Err(SnapshotError::Corrupt(format!("unknown feed kind {other}")));
                    }
                };
                image.feeds.push(feed);
            }
            MARK => {
                // A mark is the checkpoint of a rank this server would hold, and it holds at
                // most `--max-registered-ranks` (a replica's sources too): a stream of marks
                // of a few bytes each, beyond it, was held whole.
                marks += 1;
                if let Some(most) = limits.registrations
                    && marks > most
                {
                    return Err(SnapshotError::Corrupt(format!(
                        "more than {most} checkpoints, this server's limit of registered \
                         ranks (--max-registered-ranks)"
                    )));
                }
                let worker = Worker::new(reader.varint("a mark")?, reader.small("a mark")?);
                let position = reader.varint("a mark")?;
                let n = reader.varint("a mark")?;
                // The newest `RECENT_KEPT` are what a server keeps: a writer writes no more, and
                // a stream naming more is read past them in constant memory.
                let kept = crate::served_index::RECENT_KEPT;
                let mut recent =
                    std::collections::VecDeque::with_capacity((n as usize).min(PREALLOC).min(kept));
                let mut seq = 0u64;
                for _ in 0..n {
                    seq = seq.wrapping_add(reader.varint("a mark's fingerprints")?);
                    if recent.len() == kept {
                        recent.pop_front();
                    }
                    recent.push_back((seq, reader.fixed_u64("a mark's fingerprints")?));
                }
                let recent = Vec::from(recent);
                let image = images
                    .last_mut()
                    .ok_or_else(|| SnapshotError::Corrupt("a mark before any index".into()))?;
                image.marks.insert(worker, SourceMark { position, recent });
            }
            BLOCKS => {
                let n = reader.varint("a block table")?;
                let mut table = Vec::with_capacity((n as usize).min(PREALLOC));
                if version >= 3 {
                    read_chains(&mut reader, n, &mut table)?;
                } else {
                    for _ in 0..n {
                        let (external, local) = read_hashes(&mut reader)?;
                        let parent = read_parent(&mut reader, &table)?;
                        table.push(Entry {
                            external,
                            local,
                            parent,
                        });
                    }
                }
                // An empty table is kept as none (a stream of empty tables, two bytes each, was
                // a vector held per record); a rank naming any entry of it is refused alike.
                if table.is_empty() {
                    current_table = None;
                } else {
                    current_table = Some(tables.len());
                    tables.push(table);
                }
            }
            RANK => {
                let worker = Worker::new(reader.varint("a rank")?, reader.small("a rank")?);
                let image = images
                    .len()
                    .checked_sub(1)
                    .ok_or_else(|| SnapshotError::Corrupt("a rank before any index".into()))?;
                let table_len = current_table.map_or(0, |t| tables[t].len());
                let n = reader.varint("a rank")?;
                let mut runs = Vec::new();
                let mut read = 0u64;
                let mut entry = 0u64;
                while read < n {
                    let packed = reader.varint("a rank's blocks")?;
                    // A rank's entries are distinct and in order: a run after the first starts
                    // past the one before it (a run over the same entries again made one
                    // block of the wire many pairs in memory).
                    if read > 0 && packed >> 4 == 0 {
                        return Err(SnapshotError::Corrupt(
                            "a rank's run starts within the run before it".into(),
                        ));
                    }
                    // Versions before 3: every membership is a run of one.
                    let further = if version >= 3 {
                        reader.varint("a rank's blocks")?
                    } else {
                        0
                    };
                    if further >= n - read {
                        return Err(SnapshotError::Corrupt(format!(
                            "a rank's run of {} blocks passes its count of {n}",
                            further.saturating_add(1)
                        )));
                    }
                    entry = entry
                        .checked_add(packed >> 4)
                        .ok_or_else(|| SnapshotError::Corrupt("a rank's entry overflows".into()))?;
                    let tiers = TierSet::from_bits((packed & 0b1111) as u8);
                    if tiers.is_empty() {
                        return Err(SnapshotError::Corrupt("a membership without a tier".into()));
                    }
                    let last = entry
                        .checked_add(further)
                        .ok_or_else(|| SnapshotError::Corrupt("a rank's entry overflows".into()))?;
                    if last >= table_len as u64 {
                        return Err(SnapshotError::Corrupt(format!(
                            "a rank names block {last} of a table of {table_len}"
                        )));
                    }
                    // Both below the table's length, so they fit a usize.
                    runs.push((entry as usize, last as usize, tiers));
                    memberships += u64::from(tiers.bits().count_ones()) * (further + 1);
                    pairs[image] = pairs[image].saturating_add(further + 1);
                    // As read, not at the trailer: what is beyond the bound is not held first.
                    if let Some(capacity) = limits.capacity
                        && pairs[image] > capacity
                    {
                        return Err(SnapshotError::OverCapacity {
                            index: images[image].key.to_string(),
                            held: pairs[image],
                            capacity,
                        });
                    }
                    read += further + 1;
                    entry = last;
                }
                // A rank of no blocks holds nothing (a writer writes none): not kept, or a
                // stream of them, a few bytes each, was held as a rank per record.
                if !runs.is_empty() {
                    ranks.push(RankRuns {
                        image,
                        table: current_table,
                        worker,
                        runs,
                    });
                }
            }
            TRAILER => {
                let indexes = reader.varint("in the trailer")?;
                let counted = reader.varint("in the trailer")?;
                let (stored, computed) = reader.checksum()?;
                if stored != computed {
                    return Err(SnapshotError::Checksum { stored, computed });
                }
                if indexes != images.len() as u64 || counted != memberships {
                    return Err(SnapshotError::Corrupt(format!(
                        "the trailer counts {indexes} indexes and {counted} memberships; the \
                         stream holds {} and {memberships}",
                        images.len()
                    )));
                }
                // (Each index's pairs were checked against the capacity as its ranks were read.)
                materialise(&mut images, &tables, ranks)?;
                return Ok((created, images));
            }
            other => {
                return Err(SnapshotError::Corrupt(format!(
                    "unknown record kind {other}"
                )));
            }
        }
    }
}

/// A rank as read: runs of entries of one of the stream's block tables, not yet materialised.
struct RankRuns {
    /// Its index: a position in the images read.
    image: usize,
    /// The block table its runs name (`None`: its index had none, and it names no entry).
    table: Option<usize>,
    worker: Worker,
    /// Runs of table entries (first, last, both included) with their tiers, each checked to lie
    /// in the table.
    runs: Vec<(usize, usize, TierSet)>,
}

/// Gives each index its ranks' blocks, once the stream is verified (checksum and counts): the
/// memberships made are the trailer's count. A rank written twice in one index is refused.
fn materialise(
    images: &mut [IndexImage],
    tables: &[Vec<Entry>],
    mut ranks: Vec<RankRuns>,
) -> Result<(), SnapshotError> {
    ranks.sort_by_key(|rank| (rank.image, rank.worker));
    if let Some(pair) = ranks
        .windows(2)
        .find(|pair| (pair[0].image, pair[0].worker) == (pair[1].image, pair[1].worker))
    {
        return Err(SnapshotError::Corrupt(format!(
            "worker {} rank {} is written twice in index {}",
            pair[0].worker.worker_id, pair[0].worker.dp_rank, images[pair[0].image].key
        )));
    }
    for rank in ranks {
        let table = rank.table.map_or(&[][..], |t| &tables[t][..]);
        let count = rank
            .runs
            .iter()
            .map(|(first, last, _)| last - first + 1)
            .sum();
        let mut blocks = Vec::with_capacity(count);
        for (first, last, tiers) in rank.runs {
            blocks.extend(table[first..=last].iter().map(|e| SnapshotBlock {
                external: e.external,
                local: e.local,
                parent: e.parent,
                tiers,
            }));
        }
        blocks.sort_unstable_by_key(|b| b.external);
        images[rank.image].snapshot.workers.push(WorkerSnapshot {
            worker: rank.worker,
            blocks,
        });
    }
    Ok(())
}

/// A block table entry's two hashes.
fn read_hashes<R: Read>(
    reader: &mut Reader<R>,
) -> Result<(ExternalBlockHash, LocalBlockHash), SnapshotError> {
    let external = ExternalBlockHash::new(reader.fixed_u64("a block table")?);
    let local = LocalBlockHash::new(reader.fixed_u64("a block table")?);
    Ok((external, local))
}

/// A parent as coded in the block table, for the entry about to be appended to `table`.
fn read_parent<R: Read>(
    reader: &mut Reader<R>,
    table: &[Entry],
) -> Result<Option<ExternalBlockHash>, SnapshotError> {
    let i = table.len() as u64;
    Ok(match reader.varint("a block table")? {
        0 => None,
        1 => Some(ExternalBlockHash::new(reader.fixed_u64("a block table")?)),
        back => {
            let at = i.checked_sub(back - 1).ok_or_else(|| {
                SnapshotError::Corrupt(format!(
                    "block {i} names a parent {} entries before the table",
                    back - 1
                ))
            })?;
            Some(table[at as usize].external)
        }
    })
}

/// A version 3 block table of `n` entries: chains, each entry after a chain's first the child of
/// the entry before it.
fn read_chains<R: Read>(
    reader: &mut Reader<R>,
    n: u64,
    table: &mut Vec<Entry>,
) -> Result<(), SnapshotError> {
    while (table.len() as u64) < n {
        let length = reader.varint("a block table")?;
        if length == 0 || length > n - table.len() as u64 {
            return Err(SnapshotError::Corrupt(format!(
                "a chain of {length} blocks in a table of {n} with {} read",
                table.len()
            )));
        }
        let mut parent = read_parent(reader, table)?;
        for _ in 0..length {
            let (external, local) = read_hashes(reader)?;
            table.push(Entry {
                external,
                local,
                parent,
            });
            parent = Some(external);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn image(workers: Vec<WorkerSnapshot>) -> IndexImage {
        keyed(IndexKey::new("m", "t"), workers)
    }

    fn keyed(key: IndexKey, workers: Vec<WorkerSnapshot>) -> IndexImage {
        IndexImage {
            key: key.clone(),
            block_size: BlockSize::new(16).expect("16"),
            capacity: Some(1000),
            feeds: vec![
                RecordedFeed::Zmq(WorkerRegistration {
                    index: key,
                    instance_id: 1,
                    dp_rank: 0,
                    block_size: BlockSize::new(16).expect("16"),
                    engine: EngineKind::Sglang,
                    endpoint: "tcp://h:1".into(),
                    replay_endpoint: Some("tcp://h:2".into()),
                    topic: "kv".into(),
                    mode: SocketMode::Bind,
                    pod_name: Some("10.0.0.5:8000".into()),
                }),
                RecordedFeed::Grpc {
                    worker: Worker::new(2, 1),
                },
            ],
            marks: BTreeMap::from([(
                Worker::new(1, 0),
                SourceMark {
                    position: 41,
                    recent: vec![(39, 7), (40, 8), (41, u64::MAX)],
                },
            )]),
            snapshot: Snapshot { workers },
        }
    }

    fn encode(images: &[IndexImage]) -> Vec<u8> {
        let mut writer = Writer::new(Vec::new(), 123).expect("header");
        for image in images {
            writer.index(image).expect("index");
        }
        writer.finish().expect("finish")
    }

    /// Ranks holding random chains over a small token space (shared prefixes, holes, tiers).
    fn workers() -> impl Strategy<Value = Vec<WorkerSnapshot>> {
        proptest::collection::btree_map(
            (0u64..4, 0u32..2),
            proptest::collection::vec(
                (
                    0u64..40,
                    0u8..16,
                    // Random parents, and chains (the parent is the block before).
                    prop_oneof![proptest::option::of(0u64..40), Just(Some(u64::MAX))],
                ),
                0..30,
            ),
            0..5,
        )
        .prop_map(|ranks| {
            ranks
                .into_iter()
                .map(|((id, rank), blocks)| {
                    let mut blocks: Vec<SnapshotBlock> = blocks
                        .into_iter()
                        .map(|(h, tiers, parent)| SnapshotBlock {
                            external: ExternalBlockHash::new(h * 1_000_003 + id % 2),
                            local: LocalBlockHash::new(h.wrapping_mul(0x9e37_79b9)),
                            parent: parent.map(|p| {
                                let p = if p == u64::MAX {
                                    h.saturating_sub(1)
                                } else {
                                    p
                                };
                                ExternalBlockHash::new(p * 1_000_003 + id % 2)
                            }),
                            tiers: TierSet::from_bits(tiers.max(1)),
                        })
                        .collect();
                    blocks.sort_unstable_by_key(|b| b.external);
                    blocks.dedup_by_key(|b| b.external);
                    WorkerSnapshot {
                        worker: Worker::new(id, rank),
                        blocks,
                    }
                })
                .filter(|w| !w.blocks.is_empty())
                .collect()
        })
    }

    proptest! {
        #[test]
        fn images_round_trip(workers in workers(), others in workers()) {
            let images = vec![image(workers), keyed(IndexKey::new("m2", ""), others)];
            let bytes = encode(&images);
            let (created, read_back) = read(&bytes[..]).expect("reads");
            prop_assert_eq!(created, 123);
            prop_assert_eq!(read_back, images);
        }

        #[test]
        fn any_single_altered_byte_is_refused(workers in workers(), at in any::<prop::sample::Index>(), flip in 1u8..=255) {
            let mut bytes = encode(&[image(workers)]);
            let i = at.index(bytes.len());
            bytes[i] ^= flip;
            prop_assert!(read(&bytes[..]).is_err());
        }

        #[test]
        fn any_truncation_is_refused(workers in workers(), at in any::<prop::sample::Index>()) {
            let bytes = encode(&[image(workers)]);
            let cut = at.index(bytes.len());
            prop_assert!(read(&bytes[..cut]).is_err());
        }
    }

    /// A fixed image with what the block table and the ranks encode: shared chains, a chain
    /// that branches, a hole (a parent outside the table), runs of one tier and tier changes.
    fn fixture_image() -> IndexImage {
        let block = |h: u64, parent: Option<u64>, tiers: u8| SnapshotBlock {
            external: ExternalBlockHash::new(h),
            local: LocalBlockHash::new(h ^ 0x5555),
            parent: parent.map(ExternalBlockHash::new),
            tiers: TierSet::from_bits(tiers),
        };
        let chain = |from: u64, len: u64, tiers: u8| {
            (from..from + len)
                .map(move |h| block(h, (h > from).then(|| h - 1), tiers))
                .collect::<Vec<_>>()
        };
        let mut one = chain(100, 20, 1);
        one.extend(chain(500, 3, 3));
        let mut two = chain(100, 12, 1);
        two.extend((0..5).map(|i| block(200 + i, Some(if i == 0 { 111 } else { 199 + i }), 2)));
        two.push(block(900, Some(777), 1));
        let mut three = chain(100, 20, 1);
        three[7].tiers = TierSet::from_bits(5);
        let workers = [(1, 0, one), (2, 1, two), (3, 0, three)]
            .into_iter()
            .map(|(id, rank, mut blocks)| {
                blocks.sort_unstable_by_key(|b| b.external);
                WorkerSnapshot {
                    worker: Worker::new(id, rank),
                    blocks,
                }
            })
            .collect();
        image(workers)
    }

    /// A mark naming more recent batches than a server keeps is read to its newest
    /// `RECENT_KEPT` (a stream could name millions at a few bytes each, all held before).
    #[test]
    fn a_marks_recent_batches_are_read_to_the_newest_kept() {
        let kept = crate::served_index::RECENT_KEPT;
        let mut image = image(Vec::new());
        let worker = Worker::new(1, 0);
        let recent: Vec<(u64, u64)> = (0..3 * kept as u64).map(|s| (s, s ^ 7)).collect();
        image.marks = BTreeMap::from([(
            worker,
            SourceMark {
                position: 3 * kept as u64 - 1,
                recent: recent.clone(),
            },
        )]);
        let (_, images) = read(&encode(std::slice::from_ref(&image))[..]).expect("reads");
        assert_eq!(images[0].marks[&worker].recent, recent[2 * kept..]);
    }

    /// A version 2 file (one parent per table entry, one varint per membership), written by
    /// this module before version 3: still read, equal to the image it was written from.
    #[test]
    fn version_2_files_are_read() {
        let bytes = include_bytes!("../tests/data/snapshot-v2.kvs");
        assert_eq!(u16::from_le_bytes([bytes[8], bytes[9]]), 2);
        let (created, images) = read(&bytes[..]).expect("a version 2 file is read");
        assert_eq!(created, 123);
        assert_eq!(images, vec![fixture_image()]);
        let again = encode(&images);
        assert!(
            again.len() < bytes.len(),
            "{} ≥ {}",
            again.len(),
            bytes.len()
        );
        assert_eq!(read(&again[..]).expect("reads").1, images);
    }

    /// Chains and runs are what version 3 writes for the fixture: its table is four chains (the
    /// shared chain, its branch, the 500s, the hole's child) and its ranks are runs.
    #[test]
    fn chains_and_runs_are_written_as_such() {
        let bytes = encode(&[fixture_image()]);
        let v2 = include_bytes!("../tests/data/snapshot-v2.kvs");
        // 20 + 5 + 3 + 1 table entries save one parent byte each but the four chains' first,
        // and pay one length byte per chain; the ranks' 61 blocks in 8 runs save a byte each
        // but the runs' first, and pay one length byte per run (every delta keeps its width).
        let table_saved = 29 - 4 - 4;
        let ranks_saved = 61 - 8 - 8;
        assert_eq!(bytes.len(), v2.len() - table_saved - ranks_saved);
    }

    /// A version 1 stream (registrations without a pod name) written by hand: still read.
    #[test]
    fn version_1_registrations_have_no_pod_name() {
        let mut bytes = Vec::new();
        bytes.extend_from_slice(MAGIC);
        bytes.extend_from_slice(&1u16.to_le_bytes());
        bytes.extend_from_slice(&[0, 0]);
        bytes.extend_from_slice(&7i64.to_le_bytes());
        bytes.push(INDEX);
        put_str(&mut bytes, "m");
        put_str(&mut bytes, "t");
        put_varint(&mut bytes, 16);
        put_varint(&mut bytes, 0);
        bytes.push(REGISTRATION);
        put_varint(&mut bytes, 1);
        put_varint(&mut bytes, 0);
        bytes.extend_from_slice(&[1, 1, 0]);
        put_str(&mut bytes, "tcp://h:1");
        put_str(&mut bytes, "");
        put_str(&mut bytes, "kv");
        bytes.push(TRAILER);
        put_varint(&mut bytes, 1);
        put_varint(&mut bytes, 0);
        let digest = xxhash_rust::xxh3::xxh3_64(&bytes);
        bytes.extend_from_slice(&digest.to_le_bytes());
        let (created, images) = read(&bytes[..]).expect("a version 1 stream is read");
        assert_eq!(created, 7);
        let [RecordedFeed::Zmq(registration)] = images[0].feeds.as_slice() else {
            panic!("one ZMQ registration: {:?}", images[0].feeds);
        };
        assert_eq!(registration.topic, "kv");
        assert_eq!(registration.pod_name, None);
        // Written again, it is a version 2 stream that reads back the same.
        let again = encode(&images);
        assert_eq!(u16::from_le_bytes([again[8], again[9]]), FORMAT_VERSION);
        let (_, reread) = read(&again[..]).expect("reads");
        assert_eq!(reread[0].feeds, images[0].feeds);
    }

    /// A stream's header and an INDEX record (model `m`, tenant `t`, block size 16, unbounded).
    fn header_and_index() -> Vec<u8> {
        let mut bytes = Vec::new();
        bytes.extend_from_slice(MAGIC);
        bytes.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        bytes.extend_from_slice(&[0, 0]);
        bytes.extend_from_slice(&7i64.to_le_bytes());
        bytes.push(INDEX);
        put_str(&mut bytes, "m");
        put_str(&mut bytes, "t");
        put_varint(&mut bytes, 16);
        put_varint(&mut bytes, 0);
        bytes
    }

    /// Records that hold nothing (empty ranks, empty tables) are not kept, and checkpoints
    /// count against the rank limit: a stream of such records, a few bytes each, is read in
    /// memory bounded by the server's limits, not by its length.
    #[test]
    fn records_that_hold_nothing_are_not_kept_and_checkpoints_are_bounded() {
        let mut bytes = header_and_index();
        for worker in 0..3u64 {
            bytes.push(BLOCKS);
            put_varint(&mut bytes, 0);
            bytes.push(RANK);
            put_varint(&mut bytes, worker);
            put_varint(&mut bytes, 0);
            put_varint(&mut bytes, 0);
            bytes.push(MARK);
            put_varint(&mut bytes, worker);
            put_varint(&mut bytes, 0);
            put_varint(&mut bytes, 5);
            put_varint(&mut bytes, 0);
        }
        bytes.push(TRAILER);
        put_varint(&mut bytes, 1);
        put_varint(&mut bytes, 0);
        let digest = xxhash_rust::xxh3::xxh3_64(&bytes);
        bytes.extend_from_slice(&digest.to_le_bytes());
        let (_, images) = read(&bytes[..]).expect("sound");
        assert!(images[0].snapshot.workers.is_empty(), "no empty rank kept");
        assert_eq!(images[0].marks.len(), 3);
        let within = |registrations| {
            read_within(
                &bytes[..],
                ReadLimits {
                    registrations: Some(registrations),
                    ..ReadLimits::default()
                },
            )
        };
        assert!(within(3).is_ok());
        assert!(
            matches!(within(2), Err(SnapshotError::Corrupt(m)) if m.contains("more than 2 checkpoints")),
        );
    }

    /// A run reaching past the largest entry number is refused, not overflowed.
    #[test]
    fn a_run_past_the_largest_entry_is_refused() {
        let mut bytes = header_and_index();
        bytes.push(RANK);
        put_varint(&mut bytes, 1);
        put_varint(&mut bytes, 0);
        // A count of u64::MAX admits a run of u64::MAX − 1 further entries after entry 2^60 − 1.
        put_varint(&mut bytes, u64::MAX);
        put_varint(&mut bytes, ((u64::MAX >> 4) << 4) | 1);
        put_varint(&mut bytes, u64::MAX - 1);
        assert!(matches!(read(&bytes[..]), Err(SnapshotError::Corrupt(_))));
    }

    /// A stream of one index whose block table has `entries` entries (one chain) and `ranks`
    /// ranks of worker `worker_of(i)`, each holding the whole table; its trailer counts
    /// `counted` memberships and carries a checksum that is right when `sound`.
    fn whole_table_ranks(
        entries: u64,
        ranks: u64,
        worker_of: impl Fn(u64) -> u64,
        counted: u64,
        sound: bool,
    ) -> Vec<u8> {
        let mut bytes = header_and_index();
        bytes.push(BLOCKS);
        put_varint(&mut bytes, entries);
        put_varint(&mut bytes, entries);
        put_varint(&mut bytes, 0);
        for e in 0..entries {
            bytes.extend_from_slice(&(e + 1).to_le_bytes());
            bytes.extend_from_slice(&(e + 1).to_le_bytes());
        }
        for i in 0..ranks {
            bytes.push(RANK);
            put_varint(&mut bytes, worker_of(i));
            put_varint(&mut bytes, 0);
            put_varint(&mut bytes, entries);
            put_varint(&mut bytes, 1);
            put_varint(&mut bytes, entries - 1);
        }
        bytes.push(TRAILER);
        put_varint(&mut bytes, 1);
        put_varint(&mut bytes, counted);
        let digest = xxhash_rust::xxh3::xxh3_64(&bytes) ^ u64::from(!sound);
        bytes.extend_from_slice(&digest.to_le_bytes());
        bytes
    }

    /// A rank of a few bytes names a whole block table: 2^16 of them over a table of 2^16
    /// entries would be 2^32 blocks (≈ 160 GiB) if materialised as read. They are materialised
    /// only once the stream is verified, so a damaged stream is refused first.
    #[test]
    fn ranks_are_materialised_only_from_a_verified_stream() {
        let (entries, ranks) = (1 << 16, 1 << 16);
        let bad = whole_table_ranks(entries, ranks, |i| i, entries * ranks, false);
        assert!(bad.len() < 2 << 20, "a small stream: {} bytes", bad.len());
        assert!(matches!(
            read(&bad[..]),
            Err(SnapshotError::Checksum { .. })
        ));
        // A sound stream with the same shape, small: every rank holds the whole table.
        let good = whole_table_ranks(4, 3, |i| i, 12, true);
        let (_, images) = read(&good[..]).expect("reads");
        let held: Vec<usize> = images[0]
            .snapshot
            .workers
            .iter()
            .map(|w| w.blocks.len())
            .collect();
        assert_eq!(held, vec![4, 4, 4]);
    }

    /// A server with a capacity bound refuses a sound stream whose index holds more (rank,
    /// block) pairs than it, and reads one at the bound.
    #[test]
    fn a_snapshot_beyond_the_capacity_is_refused_before_it_is_materialised() {
        let within = |capacity| ReadLimits {
            capacity: Some(capacity),
            ..ReadLimits::default()
        };
        let stream = whole_table_ranks(4, 3, |i| i, 12, true);
        let (_, images) = read_within(&stream[..], within(12)).expect("at the bound");
        assert_eq!(images[0].memberships(), 12);
        let Err(error) = read_within(&stream[..], within(11)) else {
            panic!("12 pairs exceed a capacity of 11");
        };
        assert!(
            matches!(
                error,
                SnapshotError::OverCapacity {
                    held: 12,
                    capacity: 11,
                    ..
                }
            ),
            "{error}"
        );
        assert!(error.to_string().contains("--capacity"), "{error}");
        // Refused as the ranks are read, not once every one is held: the second rank of four
        // blocks passes a capacity of 5.
        assert!(
            matches!(
                read_within(&stream[..], within(5)),
                Err(SnapshotError::OverCapacity { held: 8, .. })
            ),
            "refused at the rank that passes the bound"
        );
    }

    /// A rank's run that starts within the run before it is refused: a writer writes a rank's
    /// entries distinct and in order, and overlapping runs made a few bytes of the wire name
    /// the same blocks again and again (a block held twice by one rank).
    #[test]
    fn a_run_within_the_run_before_it_is_refused() {
        let stream = |second_delta: u64| {
            let mut bytes = header_and_index();
            bytes.push(BLOCKS);
            put_varint(&mut bytes, 8);
            put_varint(&mut bytes, 8);
            put_varint(&mut bytes, 0);
            for e in 0..8u64 {
                bytes.extend_from_slice(&(e + 1).to_le_bytes());
                bytes.extend_from_slice(&(e + 1).to_le_bytes());
            }
            bytes.push(RANK);
            put_varint(&mut bytes, 1);
            put_varint(&mut bytes, 0);
            put_varint(&mut bytes, 8);
            // Entries 0-3, then four more from `second_delta` past entry 3.
            put_varint(&mut bytes, 1);
            put_varint(&mut bytes, 3);
            put_varint(&mut bytes, (second_delta << 4) | 1);
            put_varint(&mut bytes, 3);
            bytes.push(TRAILER);
            put_varint(&mut bytes, 1);
            put_varint(&mut bytes, 8);
            let digest = xxhash_rust::xxh3::xxh3_64(&bytes);
            bytes.extend_from_slice(&digest.to_le_bytes());
            bytes
        };
        let (_, images) = read(&stream(1)[..]).expect("entries 0-7 read");
        assert_eq!(images[0].snapshot.workers[0].blocks.len(), 8);
        let Err(SnapshotError::Corrupt(why)) = read(&stream(0)[..]) else {
            panic!("entry 3 named twice is refused");
        };
        assert!(why.contains("within the run before it"), "{why}");
    }

    /// A stream recording more registrations than the reader's limit is refused (each names a
    /// copy of its index's key); at the limit it reads.
    #[test]
    fn registrations_beyond_the_limit_are_refused() {
        let stream = encode(&[image(Vec::new())]); // two recorded feeds
        let within = |most| ReadLimits {
            registrations: Some(most),
            ..ReadLimits::default()
        };
        let (_, images) = read_within(&stream[..], within(2)).expect("at the limit");
        assert_eq!(images[0].feeds.len(), 2);
        let Err(SnapshotError::Corrupt(why)) = read_within(&stream[..], within(1)) else {
            panic!("two registrations exceed a limit of one");
        };
        assert!(why.contains("--max-registered-ranks"), "{why}");
    }

    /// A stream holding more indexes than the reader's limit is refused as each index is read
    /// (before anything is materialised); at the limit it reads.
    #[test]
    fn indexes_beyond_the_limit_are_refused() {
        let mut second = image(Vec::new());
        second.key = IndexKey::new("another", "t");
        let stream = encode(&[image(Vec::new()), second]);
        let within = |most| ReadLimits {
            indexes: Some(most),
            ..ReadLimits::default()
        };
        let (_, images) = read_within(&stream[..], within(2)).expect("at the limit");
        assert_eq!(images.len(), 2);
        let Err(SnapshotError::Corrupt(why)) = read_within(&stream[..], within(1)) else {
            panic!("two indexes exceed a limit of one");
        };
        assert!(why.contains("--max-indexes"), "{why}");
    }

    /// A writer writes each rank of an index once; a stream naming one twice is refused.
    #[test]
    fn a_rank_written_twice_is_refused() {
        let twice = whole_table_ranks(4, 2, |_| 9, 8, true);
        let Err(SnapshotError::Corrupt(why)) = read(&twice[..]) else {
            panic!("a rank written twice is corrupt");
        };
        assert!(why.contains("worker 9 rank 0 is written twice"), "{why}");
    }

    #[test]
    fn errors_name_the_problem() {
        let bytes = encode(&[image(Vec::new())]);
        let mut newer = bytes.clone();
        newer[8] = 4;
        assert!(matches!(
            read(&newer[..]),
            Err(SnapshotError::NewerVersion { found: 4 })
        ));
        assert!(matches!(
            read(&b"NOTASNAPxxxxxxxx"[..]),
            Err(SnapshotError::BadMagic)
        ));
        assert!(matches!(
            read(&bytes[..bytes.len() - 3]),
            Err(SnapshotError::Truncated(_))
        ));
        let mut flipped = bytes.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        assert!(matches!(
            read(&flipped[..]),
            Err(SnapshotError::Checksum { .. })
        ));
    }
}
