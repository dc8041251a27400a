//! The records of the replicated event log (`kvatlas.v1.LogRecord`, one NATS JetStream message
//! each): a [`Unit`] an ingest applied, turned into the engine-neutral wire form and back, with
//! the subject and message id it is published under.
//!
//! - **Subject** `PREFIX.MODEL.TENANT.INSTANCE`: one subject per (model, tenant, worker), names
//!   percent-encoded into NATS subject tokens (no `.`, `*`, `>`, whitespace or `%` left raw).
//! - **Message id** (`Nats-Msg-Id`) `MODEL/TENANT/INSTANCE/RANK/SEQ/FINGERPRINT` for a sequenced
//!   batch: two ingests fed by the same engine publish the same id for the same batch, and the
//!   stream keeps the first (JetStream's duplicate window). A record without a sequence number
//!   (a resync's clears alone, an unregistration, an unsequenced `PublishEvents` batch) gets
//!   `MODEL/TENANT/INSTANCE/RANK/once/NONCE`, unique to the record ([`once_id`]) and kept across
//!   its retries: an acknowledgement lost on a NATS restart does not store it twice (with no id
//!   it was, and a second copy of a clear wiped what was stored between them). Two ingests
//!   still publish two such records for one event (their nonces differ).
//!
//! Decoding checks everything a replica relies on (names, block size, ranks of the record's
//! worker, hashes present, tiers known) and says what is wrong; a replica counts and skips a
//! record it cannot decode, it never applies part of one.

use kvatlas_hash::{BlockSize, LocalBlockHash};
use kvatlas_index::{Checkpoint, ExternalBlockHash, Mutation, StoredBlock, Tier, Unit, Worker};
use kvatlas_proto::v1;
use prost::Message as _;

use crate::registry::IndexKey;
use crate::served_index::unix_micros_now;

/// A decoded record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Record {
    /// The index.
    pub(crate) key: IndexKey,
    /// Its block size.
    pub(crate) block_size: BlockSize,
    /// The source (the worker, and the rank it was registered with).
    pub(crate) source: Worker,
    /// What it does.
    pub(crate) body: Body,
}

/// What a record does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Body {
    /// A batch (its mutations all belong to ranks of the source's worker).
    Batch {
        /// Its sequence number (`None`: clears alone, or an unsequenced message).
        seq: Option<u64>,
        /// The engine payload's fingerprint; a sequenced `PublishEvents` message's is a hash of
        /// its mutations ([`crate::publish::fingerprint`]), an unsequenced one's 0.
        fingerprint: u64,
        /// It begins with a resync's clears (see [`Unit::resync`]).
        resync: bool,
        /// The mutations.
        mutations: Vec<Mutation>,
        /// When the engine published the batch (Unix µs on its wall clock), if known.
        published_unix_micros: Option<i64>,
    },
    /// The source was unregistered (`None`: every rank of the worker).
    Unregister {
        /// Only this rank.
        dp_rank: Option<u32>,
    },
}

/// The source of a unit: its checkpoint's; for a resync's clears alone, the first rank cleared
/// (a listener clears its registered rank first).
pub(crate) fn source_of(unit: &Unit) -> Worker {
    unit.checkpoint.map_or_else(
        || {
            Worker::new(
                unit.worker_id,
                unit.mutations.first().map_or(0, |m| m.worker().dp_rank),
            )
        },
        |c| c.source,
    )
}

/// The NATS subject of a record of `key`'s worker `instance_id` under `prefix`.
pub(crate) fn subject(prefix: &str, key: &IndexKey, instance_id: u64) -> String {
    format!(
        "{prefix}.{}.{}.{instance_id}",
        subject_token(&key.model),
        subject_token(&key.tenant)
    )
}

/// The JetStream message id of a sequenced batch; with the `salt` of a rank registered again
/// ([`crate::registry::IdSalts`]) appended.
pub(crate) fn message_id(
    key: &IndexKey,
    source: Worker,
    seq: u64,
    fingerprint: u64,
    salt: Option<u64>,
) -> String {
    let id = format!(
        "{}/{}/{}/{}/{seq}/{fingerprint:016x}",
        subject_token(&key.model),
        subject_token(&key.tenant),
        source.worker_id,
        source.dp_rank
    );
    match salt {
        Some(salt) => format!("{id}/{salt:016x}"),
        None => id,
    }
}

/// The message id of a record without a sequence number: `MODEL/TENANT/INSTANCE/RANK/once/`
/// then a nonce unique to the record — this process's random 64 bits and a counter — so that
/// its retries carry the same id and no other record does.
pub(crate) fn once_id(key: &IndexKey, source: Worker) -> String {
    use std::hash::BuildHasher as _;
    use std::sync::atomic::{AtomicU64, Ordering};
    static PROCESS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(0);
    // `RandomState` is seeded from the operating system's randomness, per process.
    let process =
        *PROCESS.get_or_init(|| std::collections::hash_map::RandomState::new().hash_one(0u8));
    format!(
        "{}/{}/{}/{}/once/{process:016x}-{}",
        subject_token(&key.model),
        subject_token(&key.tenant),
        source.worker_id,
        source.dp_rank,
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// A record ready to publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Outgoing {
    /// The source it belongs to (records of one source are published one after the other).
    pub(crate) source: (IndexKey, Worker),
    /// The JetStream message id (a sequenced batch's, or a record's own: [`once_id`]).
    pub(crate) message_id: Option<String>,
    /// The wire form.
    pub(crate) payload: bytes::Bytes,
    /// When the ingest queued it (for `kvatlas_log_publish_seconds`).
    pub(crate) queued_at: std::time::Instant,
    /// When the engine published the batch, if known (for `kvatlas_log_sent_age_seconds`).
    pub(crate) published: Option<std::time::Instant>,
    /// An unregistration's record: the ranks it ends (`Some(None)`: every rank of the
    /// source's instance); `None` for a batch.
    pub(crate) unregisters: Option<Option<u32>>,
}

/// The record of a unit an ingest applied for `key`, ready to publish (the unit is not copied).
pub(crate) fn encode_unit(key: &IndexKey, block_size: BlockSize, unit: &Unit) -> Outgoing {
    encode_unit_salted(key, block_size, unit, None)
}

/// [`encode_unit`], a sequenced batch's message id salted with `salt` if given.
pub(crate) fn encode_unit_salted(
    key: &IndexKey,
    block_size: BlockSize,
    unit: &Unit,
    salt: Option<u64>,
) -> Outgoing {
    let source = source_of(unit);
    let batch = v1::LogBatch {
        seq: unit.checkpoint.map(|c| c.position),
        fingerprint: unit.checkpoint.map_or(0, |c| c.fingerprint),
        resync: unit.resync,
        mutations: unit.mutations.iter().map(encode_mutation).collect(),
        published_unix_micros: unit.published.and_then(unix_micros_of),
    };
    Outgoing {
        message_id: Some(unit.checkpoint.map_or_else(
            || once_id(key, source),
            |c| message_id(key, source, c.position, c.fingerprint, salt),
        )),
        payload: wire(key, block_size, source, v1::log_record::Body::Batch(batch)).into(),
        source: (key.clone(), source),
        queued_at: std::time::Instant::now(),
        published: unit.published,
        unregisters: None,
    }
}

/// `instant`, a past instant, on the wall clock (Unix µs); `None` if it is later than now.
fn unix_micros_of(instant: std::time::Instant) -> Option<i64> {
    let ago = std::time::Instant::now().checked_duration_since(instant)?;
    Some(unix_micros_now() - i64::try_from(ago.as_micros()).ok()?)
}

/// The record of an unregistration (`dp_rank` `None`: every rank of `instance_id`).
pub(crate) fn encode_unregister(
    key: &IndexKey,
    block_size: BlockSize,
    instance_id: u64,
    dp_rank: Option<u32>,
) -> Outgoing {
    let source = Worker::new(instance_id, dp_rank.unwrap_or(0));
    let body = v1::log_record::Body::Unregister(v1::LogUnregister { dp_rank });
    Outgoing {
        message_id: Some(once_id(key, source)),
        payload: wire(key, block_size, source, body).into(),
        source: (key.clone(), source),
        queued_at: std::time::Instant::now(),
        published: None,
        unregisters: Some(dp_rank),
    }
}

fn wire(
    key: &IndexKey,
    block_size: BlockSize,
    source: Worker,
    body: v1::log_record::Body,
) -> Vec<u8> {
    v1::LogRecord {
        index: Some(v1::IndexSelector {
            model: key.model.clone(),
            tenant: key.tenant.clone(),
        }),
        block_size: block_size.get(),
        instance_id: source.worker_id,
        dp_rank: source.dp_rank,
        body: Some(body),
    }
    .encode_to_vec()
}

/// Most records in one NATS message.
pub(crate) const MAX_RECORDS_PER_MESSAGE: usize = 64;
/// Most payload bytes in one NATS message (NATS's default limit is 1 MiB).
pub(crate) const MAX_MESSAGE_BYTES: usize = 512 << 10;

/// The header of a live record (`NatsLog::live`): the [`digest`] of the record its ingest
/// published before it for the same source (16 hex digits; `0` for the first).
pub(crate) const LIVE_PREV_HEADER: &str = "Kvatlas-Prev";

/// A record's identity on the live path: the hash of its wire form. Two ingests fed by the same
/// engine encode the same batch to the same bytes, so their records have the same digest.
pub(crate) fn digest(record: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(record)
}

/// What a resync batch does, as a digest of its mutations (0 for any other record). A resync's
/// clears are its ingest's own account of the ranks the source fed (a listener restarted since
/// knows fewer), so two ingests' copies of one resync, alike in sequence number, fingerprint
/// and flag, can clear different ranks: told apart by this, not by the engine's fingerprint.
pub(crate) fn resync_content(body: &Body) -> u64 {
    match body {
        Body::Batch {
            resync: true,
            mutations,
            ..
        } => {
            let mut bytes = Vec::new();
            for mutation in mutations {
                let encoded = encode_mutation(mutation).encode_to_vec();
                prost::encoding::encode_varint(encoded.len() as u64, &mut bytes);
                bytes.extend_from_slice(&encoded);
            }
            // Never 0, which stands for "not a resync".
            digest(&bytes).max(1)
        }
        _ => 0,
    }
}

/// A NATS message's payload: the records, each prefixed with its length (a protobuf varint).
pub(crate) fn frame(records: &[Outgoing]) -> bytes::Bytes {
    let mut payload =
        Vec::with_capacity(records.iter().map(|r| r.payload.len() + 5).sum::<usize>());
    for record in records {
        prost::encoding::encode_varint(record.payload.len() as u64, &mut payload);
        payload.extend_from_slice(&record.payload);
    }
    payload.into()
}

/// The records of a NATS message's payload.
///
/// # Errors
/// If a length is malformed or runs past the end.
pub(crate) fn unframe(mut payload: &[u8]) -> Result<Vec<&[u8]>, String> {
    let mut records = Vec::new();
    while !payload.is_empty() {
        let length = prost::encoding::decode_varint(&mut payload)
            .map_err(|e| format!("a record's length is malformed: {e}"))?;
        let length = usize::try_from(length)
            .ok()
            .filter(|&n| n <= payload.len())
            .ok_or_else(|| format!("a record of {length} bytes runs past the message's end"))?;
        let (record, rest) = payload.split_at(length);
        records.push(record);
        payload = rest;
    }
    Ok(records)
}

/// The message id of records published together (`None` if one has none): a single record's
/// own id, or the first one's with `+COUNT.HASH`, `HASH` the [`digest`] of every record's id in
/// order, so two groups share an id only if they hold the same records. (Two ingests may group a
/// backlog differently; the stream then keeps both groups and the replicas drop the records
/// they hold twice. An id of the first record and the count alone let the stream take a group
/// of other records for a duplicate and drop it, records that no other message carried.)
pub(crate) fn group_id(records: &[Outgoing]) -> Option<String> {
    let first = records.first()?.message_id.as_ref()?;
    if records.len() == 1 {
        return Some(first.clone());
    }
    let mut ids = String::with_capacity(records.len() * (first.len() + 1));
    for record in records {
        ids.push_str(record.message_id.as_ref()?);
        ids.push('\n');
    }
    Some(format!(
        "{first}+{}.{:016x}",
        records.len(),
        digest(ids.as_bytes())
    ))
}

impl Record {
    /// The unit a replica applies (its checkpoint is the source's position); `received`: when
    /// its message arrived (its publication is then carried onto this process's clock).
    pub(crate) fn into_unit(self, received: Option<std::time::Instant>) -> Option<Unit> {
        match self.body {
            Body::Batch {
                seq,
                fingerprint,
                resync,
                mutations,
                published_unix_micros,
            } => Some(Unit {
                worker_id: self.source.worker_id,
                mutations,
                checkpoint: seq.map(|position| Checkpoint {
                    source: self.source,
                    position,
                    fingerprint,
                }),
                resync,
                received,
                published: published_unix_micros
                    .filter(|_| received.is_some())
                    .and_then(|micros| {
                        kvatlas_events::instant_of_wall_clock(
                            micros as f64 / 1e6,
                            std::time::Instant::now(),
                            std::time::SystemTime::now(),
                        )
                    }),
            }),
            Body::Unregister { .. } => None,
        }
    }

    /// Decodes and checks a wire record.
    ///
    /// # Errors
    /// What is wrong with it, for the replica's log and counters.
    pub(crate) fn decode(bytes: &[u8]) -> Result<Self, String> {
        let record =
            v1::LogRecord::decode(bytes).map_err(|e| format!("not a kvatlas.v1.LogRecord: {e}"))?;
        let selector = record.index.ok_or("no index")?;
        let key = IndexKey::new(selector.model, selector.tenant);
        key.validate().map_err(|e| e.to_string())?;
        let block_size = BlockSize::new(record.block_size)
            .map_err(|e| format!("block size {}: {e}", record.block_size))?;
        let source = Worker::new(record.instance_id, record.dp_rank);
        let body = match record.body.ok_or("no body")? {
            v1::log_record::Body::Batch(batch) => Body::Batch {
                seq: batch.seq,
                fingerprint: batch.fingerprint,
                resync: batch.resync,
                published_unix_micros: batch.published_unix_micros,
                mutations: batch
                    .mutations
                    .into_iter()
                    .enumerate()
                    .map(|(i, m)| {
                        decode_mutation(record.instance_id, m)
                            .map_err(|why| format!("mutations[{i}]: {why}"))
                    })
                    .collect::<Result<_, _>>()?,
            },
            v1::log_record::Body::Unregister(unregister) => Body::Unregister {
                dp_rank: unregister.dp_rank,
            },
        };
        Ok(Self {
            key,
            block_size,
            source,
            body,
        })
    }
}

fn tier_value(tier: Tier) -> i32 {
    match tier {
        Tier::Device => v1::StorageTier::Device as i32,
        Tier::Host => v1::StorageTier::Host as i32,
        Tier::Disk => v1::StorageTier::Disk as i32,
        Tier::External => v1::StorageTier::External as i32,
    }
}

fn tier_of(value: i32) -> Result<Tier, String> {
    crate::publish::tier_of(value, "tier").map_err(|e| e.to_string())
}

fn encode_mutation(mutation: &Mutation) -> v1::LogMutation {
    use v1::log_mutation::Event;
    let (dp_rank, event) = match mutation {
        Mutation::Stored {
            worker,
            tier,
            parent,
            blocks,
        } => (
            worker.dp_rank,
            Event::Stored(v1::LogStored {
                parent_hash: parent.map(ExternalBlockHash::get),
                block_hashes: blocks.iter().map(|b| b.external.get()).collect(),
                local_hashes: blocks.iter().map(|b| b.local.get()).collect(),
                tier: tier_value(*tier),
            }),
        ),
        Mutation::Removed {
            worker,
            tier,
            blocks,
        } => (
            worker.dp_rank,
            Event::Removed(v1::LogRemoved {
                block_hashes: blocks.iter().map(|b| b.get()).collect(),
                tier: tier_value(*tier),
            }),
        ),
        Mutation::Cleared { worker } => (worker.dp_rank, Event::Cleared(v1::AllBlocksCleared {})),
    };
    v1::LogMutation {
        dp_rank,
        event: Some(event),
    }
}

fn decode_mutation(instance_id: u64, mutation: v1::LogMutation) -> Result<Mutation, String> {
    use v1::log_mutation::Event;
    let worker = Worker::new(instance_id, mutation.dp_rank);
    match mutation.event.ok_or("no event")? {
        Event::Stored(stored) => {
            if stored.block_hashes.is_empty() {
                return Err("a store without blocks".into());
            }
            if stored.block_hashes.len() != stored.local_hashes.len() {
                return Err(format!(
                    "{} block hashes but {} local hashes",
                    stored.block_hashes.len(),
                    stored.local_hashes.len()
                ));
            }
            Ok(Mutation::Stored {
                worker,
                tier: tier_of(stored.tier)?,
                parent: stored.parent_hash.map(ExternalBlockHash::new),
                blocks: stored
                    .block_hashes
                    .iter()
                    .zip(&stored.local_hashes)
                    .map(|(&external, &local)| StoredBlock {
                        external: ExternalBlockHash::new(external),
                        local: LocalBlockHash::new(local),
                    })
                    .collect(),
            })
        }
        Event::Removed(removed) => {
            if removed.block_hashes.is_empty() {
                return Err("a removal without blocks".into());
            }
            Ok(Mutation::Removed {
                worker,
                tier: tier_of(removed.tier)?,
                blocks: removed
                    .block_hashes
                    .into_iter()
                    .map(ExternalBlockHash::new)
                    .collect(),
            })
        }
        Event::Cleared(_) => Ok(Mutation::Cleared { worker }),
    }
}

/// A name as one NATS subject token: bytes other than ASCII letters, digits, `-` and `_` are
/// percent-encoded (so `.`, `*`, `>`, whitespace and `%` never appear raw); empty becomes `%`.
pub(crate) fn subject_token(name: &str) -> String {
    if name.is_empty() {
        return "%".to_owned();
    }
    let mut token = String::with_capacity(name.len());
    for byte in name.bytes() {
        if byte.is_ascii_alphanumeric() || byte == b'-' || byte == b'_' {
            token.push(char::from(byte));
        } else {
            token.push_str(&format!("%{byte:02X}"));
        }
    }
    token
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(i: u64) -> StoredBlock {
        StoredBlock {
            external: ExternalBlockHash::new(u64::MAX - i),
            local: LocalBlockHash::new(i * 7),
        }
    }

    fn sample() -> Unit {
        let worker = Worker::new(42, 3);
        Unit {
            worker_id: 42,
            mutations: vec![
                Mutation::Cleared { worker },
                Mutation::Stored {
                    worker,
                    tier: Tier::Host,
                    parent: Some(ExternalBlockHash::new(9)),
                    blocks: vec![block(1), block(2)],
                },
                Mutation::Removed {
                    worker: Worker::new(42, 5),
                    tier: Tier::Disk,
                    blocks: vec![ExternalBlockHash::new(1)],
                },
            ],
            checkpoint: Some(Checkpoint {
                source: Worker::new(42, 0),
                position: 17,
                fingerprint: 0xdead_beef,
            }),
            resync: true,
            received: None,
            published: None,
        }
    }

    #[test]
    fn a_resyncs_content_is_its_mutations_not_its_stamp() {
        let key = IndexKey::new("m", "t");
        let size = BlockSize::new(16).expect("a block size");
        let content = |unit: &Unit| {
            let outgoing = encode_unit(&key, size, unit);
            resync_content(&Record::decode(&outgoing.payload).expect("decodes").body)
        };
        let resync = sample();
        let stamped = Unit {
            published: Some(std::time::Instant::now()),
            ..sample()
        };
        assert_ne!(content(&resync), 0);
        assert_eq!(
            content(&resync),
            content(&stamped),
            "another ingest's stamp"
        );
        let mut fewer_clears = sample();
        fewer_clears.mutations.remove(0);
        assert_ne!(content(&resync), content(&fewer_clears));
        let not_a_resync = Unit {
            resync: false,
            ..sample()
        };
        assert_eq!(content(&not_a_resync), 0);
    }

    #[test]
    fn the_engines_publication_time_crosses_the_log() {
        use std::time::{Duration, Instant};
        let key = IndexKey::new("m", "t");
        let size = BlockSize::new(16).expect("valid");
        let Some(published) = Instant::now().checked_sub(Duration::from_millis(3)) else {
            return; // the monotonic clock started under 3 ms ago
        };
        let unit = Unit {
            published: Some(published),
            ..sample()
        };
        let outgoing = encode_unit(&key, size, &unit);
        let decoded = Record::decode(&outgoing.payload).expect("decodes");
        let Body::Batch {
            published_unix_micros,
            ..
        } = decoded.body
        else {
            panic!("a batch");
        };
        let stamped = published_unix_micros.expect("the publication time is in the record");
        let wall_now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after 1970")
            .as_micros() as i64;
        // Recorded as the wall-clock time 3 ms (and the encoding) ago.
        assert!(
            (3_000..1_000_000).contains(&(wall_now - stamped)),
            "{stamped} against {wall_now}"
        );
        // At the replica, on its clock: within a few microseconds of the ingest's instant (one
        // machine, one clock; the two wall-clock readings and micro-second rounding apart).
        let applied = decoded.into_unit(Some(Instant::now())).expect("a unit");
        let carried = applied.published.expect("carried onto the replica's clock");
        let off = carried.max(published) - carried.min(published);
        assert!(off < Duration::from_millis(1), "{off:?}");
        // No publication time without an arrival (a unit the replica did not receive live).
        let decoded = Record::decode(&outgoing.payload).expect("decodes");
        assert_eq!(decoded.into_unit(None).and_then(|u| u.published), None);
        // And none when the unit had none.
        let decoded = Record::decode(&encode_unit(&key, size, &sample()).payload).expect("ok");
        assert_eq!(
            decoded
                .into_unit(Some(Instant::now()))
                .and_then(|u| u.published),
            None
        );
    }

    #[test]
    fn a_unit_round_trips_through_the_wire_form() {
        let key = IndexKey::new("meta/llama 3.1", "team.a");
        let size = BlockSize::new(16).expect("valid");
        let outgoing = encode_unit(&key, size, &sample());
        let decoded = Record::decode(&outgoing.payload).expect("decodes");
        assert_eq!(
            (decoded.key.clone(), decoded.block_size),
            (key.clone(), size)
        );
        assert_eq!(decoded.source, Worker::new(42, 0));
        // The arrival instant is the replica's, not part of the record.
        let arrived = std::time::Instant::now();
        let unit = decoded.into_unit(Some(arrived));
        assert_eq!(unit.as_ref().and_then(|u| u.received), Some(arrived));
        assert_eq!(unit, Some(sample()));
        assert_eq!(
            subject("kv", &key, 42),
            "kv.meta%2Fllama%203%2E1.team%2Ea.42"
        );
        assert_eq!(
            outgoing.message_id.as_deref(),
            Some("meta%2Fllama%203%2E1/team%2Ea/42/0/17/00000000deadbeef")
        );
        let unregister = Record::decode(&encode_unregister(&key, size, 42, Some(3)).payload);
        assert_eq!(
            unregister.map(|r| (r.source, r.body)),
            Ok((Worker::new(42, 3), Body::Unregister { dp_rank: Some(3) }))
        );
    }

    #[test]
    fn records_without_a_sequence_have_an_id_of_their_own_and_name_their_rank() {
        let key = IndexKey::new("m", "t");
        let size = BlockSize::new(16).expect("valid");
        let clears = Unit {
            worker_id: 8,
            mutations: vec![Mutation::Cleared {
                worker: Worker::new(8, 2),
            }],
            checkpoint: None,
            resync: true,
            received: None,
            published: None,
        };
        let outgoing = encode_unit(&key, size, &clears);
        let id = outgoing.message_id.clone().expect("an id");
        assert!(id.starts_with("m/t/8/2/once/"), "{id}");
        // Another record (the same clears again) has another id; a retry re-sends this one.
        let again = encode_unit(&key, size, &clears);
        assert_ne!(again.message_id, Some(id));
        let unregister = encode_unregister(&key, size, 8, None);
        assert!(
            unregister
                .message_id
                .as_ref()
                .is_some_and(|id| id.starts_with("m/t/8/0/once/")),
            "{unregister:?}"
        );
        let record = Record::decode(&outgoing.payload).expect("decodes");
        assert_eq!(record.source, Worker::new(8, 2));
        assert_eq!(record.into_unit(None), Some(clears));
    }

    #[test]
    fn bad_records_are_refused_with_a_reason() {
        assert!(Record::decode(b"\xff\xff\xff").is_err());
        let key = IndexKey::new("m", "t");
        let size = BlockSize::new(16).expect("valid");
        let mut wire =
            v1::LogRecord::decode(&*encode_unit(&key, size, &sample()).payload).expect("decodes");
        if let Some(v1::log_record::Body::Batch(batch)) = &mut wire.body
            && let Some(v1::log_mutation::Event::Stored(stored)) = &mut batch.mutations[1].event
        {
            stored.local_hashes.pop();
        }
        let error = Record::decode(&wire.encode_to_vec()).expect_err("refused");
        assert!(error.contains("mutations[1]"), "{error}");
        wire.block_size = 0;
        assert!(Record::decode(&wire.encode_to_vec()).is_err());
    }

    #[test]
    fn records_are_framed_into_one_message_and_back() {
        let key = IndexKey::new("m", "t");
        let size = BlockSize::new(16).expect("valid");
        let records: Vec<Outgoing> = (0..3)
            .map(|i| {
                let mut unit = sample();
                if let Some(c) = &mut unit.checkpoint {
                    c.position = i;
                }
                encode_unit(&key, size, &unit)
            })
            .collect();
        let payload = frame(&records);
        let parts = unframe(&payload).expect("unframes");
        assert_eq!(parts.len(), 3);
        for (part, record) in parts.iter().zip(&records) {
            assert_eq!(*part, &record.payload[..]);
        }
        assert_eq!(group_id(&records[..1]), records[0].message_id);
        let three = group_id(&records).expect("every record has an id");
        let first = records[0].message_id.as_ref().expect("an id");
        assert!(three.starts_with(&format!("{first}+3.")), "{three}");
        assert_eq!(
            group_id(&records),
            Some(three.clone()),
            "the same records, the same id"
        );
        // Another group of the same first record and count (a backlog grouped differently at a
        // second ingest) has another id: the stream must not take it for a duplicate.
        let mut other = records.clone();
        let mut unit = sample();
        if let Some(c) = &mut unit.checkpoint {
            c.position = 7;
        }
        other[2] = encode_unit(&key, size, &unit);
        assert_ne!(group_id(&other), Some(three));
        other[1].message_id = None;
        assert_eq!(
            group_id(&other),
            None,
            "a record without an id: the group has none"
        );
        assert!(unframe(&payload[..payload.len() - 1]).is_err());
        assert!(unframe(&[0xff; 11]).is_err());
        assert_eq!(unframe(&[]).map(|p| p.len()), Ok(0));
    }

    #[test]
    fn subject_tokens_never_hold_separators_or_wildcards() {
        for name in ["a.b", "a b", "*", ">", "%", "", "ü", "x\ty"] {
            let token = subject_token(name);
            assert!(!token.is_empty());
            assert!(
                !token.contains(['.', '*', '>', ' ', '\t']),
                "{name:?} → {token:?}"
            );
        }
        assert_ne!(subject_token("a.b"), subject_token("a%2Eb"));
    }
}
