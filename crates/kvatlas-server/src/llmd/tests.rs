//! Tests of llm-d's scoring: kvatlas's answers (through [`ReferenceIndex`], the index's naive
//! model) against a port of llm-d's `LongestPrefixScorer` fed the same stored blocks, pods,
//! data-parallel ranks, the pod filter and the documented difference.

use std::collections::{BTreeMap, HashMap};

use kvatlas_hash::{BlockHasher, LocalBlockHash};
use kvatlas_index::{
    ExternalBlockHash, KvIndex, MatchOptions, Matches, Mutation, ReferenceIndex, StoredBlock, Tier,
    Worker, WorkerMatch,
};
use proptest::prelude::*;

use super::*;

const BLOCK: u32 = 2;

/// llm-d's index, as its scorer sees it: each request key's (pod, tier) entries.
type Entries = HashMap<Vec<u32>, Vec<(String, &'static str)>>;

/// llm-d's tier name of a kvatlas tier (its events' `medium`, lower-cased).
fn medium(tier: Tier) -> &'static str {
    match tier {
        Tier::Device => "gpu",
        Tier::Host => "cpu",
        Tier::Disk => "disk",
        Tier::External => "external",
    }
}

/// llm-d's `LongestPrefixScorer.Score` (`pkg/kvcache/kvblock_scorer.go`), ported as written:
/// `keys` are the prompt's block keys in order, `entries` each key's (pod, tier) entries;
/// weights are llm-d's defaults (`gpu` 1.0, `cpu` 0.8, any other tier 1.0).
fn llmd_score(keys: &[Vec<u32>], entries: &Entries) -> BTreeMap<String, f64> {
    let weights: HashMap<&str, f64> = HashMap::from([("gpu", 1.0), ("cpu", 0.8)]);
    let max_weights = |key: &Vec<u32>| {
        let mut current: HashMap<String, f64> = HashMap::new();
        for (pod, tier) in entries.get(key).into_iter().flatten() {
            let weight = weights.get(tier).copied().unwrap_or(1.0);
            let slot = current.entry(pod.clone()).or_insert(weight);
            if weight > *slot {
                *slot = weight;
            }
        }
        current
    };
    let mut scores = BTreeMap::new();
    let Some(first) = keys.first() else {
        return scores;
    };
    let mut active: Vec<String> = Vec::new();
    for (pod, weight) in max_weights(first) {
        scores.insert(pod.clone(), weight);
        active.push(pod);
    }
    for key in &keys[1..] {
        if active.is_empty() {
            break;
        }
        let current = max_weights(key);
        active.retain(|pod| match current.get(pod) {
            Some(weight) => {
                *scores.get_mut(pod).expect("an active pod has a score") += weight;
                true
            }
            None => false,
        });
    }
    scores
}

/// llm-d's request keys of `tokens`: one per full block, standing for the chained hash of every
/// token up to the block's end (the prefix itself, so no hash can collide).
fn request_keys(tokens: &[u32]) -> Vec<Vec<u32>> {
    (1..=tokens.len() / BLOCK as usize)
        .map(|blocks| tokens[..blocks * BLOCK as usize].to_vec())
        .collect()
}

/// One rank's stored chain: its tokens and each block's tiers.
#[derive(Debug, Clone)]
struct Chain {
    worker: Worker,
    tokens: Vec<u32>,
    tiers: Vec<Vec<Tier>>,
}

/// Both models fed the same chains: kvatlas's reference index and llm-d's key → entries map
/// (each rank its own pod, `pod(worker)`).
fn models(chains: &[Chain], pod: impl Fn(Worker) -> String) -> (ReferenceIndex, Entries) {
    let hasher = BlockHasher::new(BLOCK).expect("block size");
    let mut reference = ReferenceIndex::new();
    let mut entries = Entries::new();
    for chain in chains {
        let locals: Vec<LocalBlockHash> = hasher.local_hashes(&chain.tokens).collect();
        let external = |block: usize| {
            ExternalBlockHash::new(chain.worker.worker_id * 1_000_000 + block as u64 + 1)
        };
        for (block, (local, tiers)) in locals.iter().zip(&chain.tiers).enumerate() {
            for &tier in tiers {
                reference.apply(&Mutation::Stored {
                    worker: chain.worker,
                    tier,
                    parent: block.checked_sub(1).map(external),
                    blocks: vec![StoredBlock {
                        external: external(block),
                        local: *local,
                    }],
                });
                entries
                    .entry(chain.tokens[..(block + 1) * BLOCK as usize].to_vec())
                    .or_default()
                    .push((pod(chain.worker), medium(tier)));
            }
        }
    }
    (reference, entries)
}

fn tiered(reference: &ReferenceIndex, tokens: &[u32]) -> Matches {
    let hasher = BlockHasher::new(BLOCK).expect("block size");
    let locals: Vec<LocalBlockHash> = hasher.local_hashes(tokens).collect();
    reference.find_matches(&locals, &MatchOptions::default().with_tiered(true))
}

fn as_map(scores: &[PodScore]) -> BTreeMap<String, f64> {
    scores.iter().map(|s| (s.pod.clone(), s.score)).collect()
}

fn rank_pod(worker: Worker) -> String {
    format!("pod-{}-{}", worker.worker_id, worker.dp_rank)
}

/// Tiers whose best level never goes down along a chain (a device prefix, then host, then disk
/// or external; a device block possibly also on the host, a disk block also external): kvatlas's
/// cumulative scores then weigh every block as llm-d does (the two differences are tested
/// below).
fn monotone_tiers(blocks: usize) -> impl Strategy<Value = Vec<Vec<Tier>>> {
    proptest::collection::vec((0u8..4, any::<bool>()), blocks).prop_map(|steps| {
        let mut level = 0u8;
        steps
            .into_iter()
            .map(|(step, also_slower)| {
                // Levels go up slowly so that chains mix tiers.
                if step == 0 {
                    level = (level + 1).min(3);
                }
                let best = Tier::ALL[usize::from(level)];
                let mut tiers = vec![best];
                // Not a host block also on disk: llm-d weighs it 1.0, kvatlas as host.
                if also_slower && (level == 0 || level == 2) {
                    tiers.push(Tier::ALL[usize::from(level) + 1]);
                }
                tiers
            })
            .collect()
    })
}

/// A few base documents; chains and prompts are prefixes of them, some with a changed tail.
fn chain_tokens() -> impl Strategy<Value = Vec<u32>> {
    (
        0u32..3,
        1usize..=8,
        proptest::option::of((0usize..8, 100u32..110)),
    )
        .prop_map(|(document, blocks, change)| {
            let mut tokens: Vec<u32> = (0..blocks as u32 * BLOCK)
                .map(|i| document * 1000 + i)
                .collect();
            if let Some((at, token)) = change
                && at < tokens.len()
            {
                tokens[at] = token;
            }
            tokens
        })
}

fn chains() -> impl Strategy<Value = Vec<Chain>> {
    proptest::collection::vec((0u64..4, 0u32..2, chain_tokens()), 1..6)
        .prop_flat_map(|specs| {
            let tiers: Vec<_> = specs
                .iter()
                .map(|(_, _, tokens)| monotone_tiers(tokens.len() / BLOCK as usize))
                .collect();
            (Just(specs), tiers)
        })
        .prop_map(|(specs, tiers)| {
            let mut seen = std::collections::BTreeSet::new();
            specs
                .into_iter()
                .zip(tiers)
                .filter(|((worker, rank, _), _)| seen.insert((*worker, *rank)))
                .map(|((worker, rank, tokens), tiers)| Chain {
                    worker: Worker::new(worker, rank),
                    tokens,
                    tiers,
                })
                .collect()
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// With one pod per rank, kvatlas's scores equal llm-d's scorer fed the same blocks, with
    /// and without a pod filter.
    #[test]
    fn scores_equal_llmds_scorer(
        chains in chains(),
        prompt in chain_tokens(),
        filter_mask in any::<u8>(),
    ) {
        let (reference, entries) = models(&chains, rank_pod);
        let matches = tiered(&reference, &prompt);
        let expected = llmd_score(&request_keys(&prompt), &entries);
        let answer = pod_scores(&matches, rank_pod, &[]);
        prop_assert_eq!(as_map(&answer), expected.clone());
        // Every rank answers with its own rank.
        for score in &answer {
            let worker = chains
                .iter()
                .map(|c| c.worker)
                .find(|w| rank_pod(*w) == score.pod)
                .expect("a known pod");
            prop_assert_eq!(score.data_parallel_rank, Some(worker.dp_rank as i32));
        }
        // A filter keeps exactly the named pods (llm-d filters the entries before scoring).
        let mut filter: Vec<String> = chains
            .iter()
            .enumerate()
            .filter(|(i, _)| filter_mask & (1 << i) != 0)
            .map(|(_, c)| rank_pod(c.worker))
            .collect();
        filter.push("a-pod-nobody-registered".into());
        let filtered_entries: Entries = entries
            .iter()
            .map(|(k, v)| {
                (k.clone(), v.iter().filter(|(p, _)| filter.contains(p)).cloned().collect())
            })
            .collect();
        let expected = llmd_score(&request_keys(&prompt), &filtered_entries);
        prop_assert_eq!(as_map(&pod_scores(&matches, rank_pod, &filter)), expected);
    }
}

#[test]
fn tier_weights_are_added_block_by_block() {
    let m = |device, host, disk| WorkerMatch::new(Worker::new(1, 0), device, host, disk);
    assert_eq!(rank_score(&m(0, 0, 0)), 0.0);
    assert_eq!(rank_score(&m(3, 3, 3)), 3.0);
    // 1 + 1 + 0.8 + 0.8 + 1 (a disk block weighs 1.0: llm-d's weight of a tier it does not list).
    assert_eq!(rank_score(&m(2, 4, 5)), 1.0 + 1.0 + 0.8 + 0.8 + 1.0);
    assert_eq!(rank_score(&m(0, 3, 3)), 0.8 + 0.8 + 0.8);
}

#[test]
fn pods_fall_back_to_the_instance_then_its_id() {
    let ranks: BTreeMap<Worker, Option<&str>> = BTreeMap::from([
        (Worker::new(1, 0), Some("10.0.0.1:8000")),
        (Worker::new(1, 1), Some("10.0.0.1:8001")),
        (Worker::new(2, 1), Some("vllm-pod2")),
        (Worker::new(2, 3), None),
        (Worker::new(3, 0), None),
    ]);
    let pod = |worker| pod_of(&ranks, |name| *name, worker);
    assert_eq!(pod(Worker::new(1, 1)), "10.0.0.1:8001", "its own");
    assert_eq!(
        pod(Worker::new(2, 3)),
        "vllm-pod2",
        "registered without a name"
    );
    assert_eq!(pod(Worker::new(2, 0)), "vllm-pod2", "a batch's rank");
    assert_eq!(
        pod(Worker::new(1, 7)),
        "10.0.0.1:8000",
        "the lowest named rank"
    );
    assert_eq!(pod(Worker::new(3, 0)), "3", "no name in the instance");
    assert_eq!(pod(Worker::new(9, 2)), "9", "not registered at all");
}

#[test]
fn a_pod_with_several_ranks_answers_with_its_best_rank() {
    let m = |worker: u64, rank: u32, device: u32, host: u32| {
        WorkerMatch::new(Worker::new(worker, rank), device, host, host)
    };
    let matches = Matches {
        workers: vec![
            m(1, 0, 2, 2),
            m(1, 1, 1, 4),
            m(1, 2, 1, 4),
            m(2, 0, 3, 3),
            m(3, 0, 0, 1),
        ],
    };
    let pod = |w: Worker| {
        if w.worker_id == 1 {
            "a".into()
        } else {
            w.worker_id.to_string()
        }
    };
    let scores = pod_scores(&matches, pod, &[]);
    let rows: Vec<(&str, f64, Option<i32>)> = scores
        .iter()
        .map(|s| (s.pod.as_str(), s.score, s.data_parallel_rank))
        .collect();
    // Pod "a": rank 1 scores 1 + 0.8 × 3 (beats rank 0's 2; rank 2 ties and the lower stays).
    // Sorted best first.
    assert_eq!(
        rows,
        [
            ("a", 1.0 + 0.8 + 0.8 + 0.8, Some(1)),
            ("2", 3.0, Some(0)),
            ("3", 0.8, Some(0)),
        ]
    );
    let filtered = pod_scores(&matches, pod, &["3".into(), "zz".into()]);
    assert_eq!(filtered.len(), 1);
    assert_eq!(filtered[0].pod, "3");
}

/// The documented difference: a block held on the device again after the prefix's first device
/// miss weighs as host in kvatlas (its scores are cumulative), as the device in llm-d.
#[test]
fn a_device_block_after_a_host_block_weighs_as_host() {
    let chain = Chain {
        worker: Worker::new(1, 0),
        tokens: (0..3 * BLOCK).collect(),
        tiers: vec![vec![Tier::Device], vec![Tier::Host], vec![Tier::Device]],
    };
    let (reference, entries) = models(std::slice::from_ref(&chain), rank_pod);
    let prompt = chain.tokens.clone();
    let kvatlas = as_map(&pod_scores(&tiered(&reference, &prompt), rank_pod, &[]));
    let llmd = llmd_score(&request_keys(&prompt), &entries);
    assert_eq!(kvatlas["pod-1-0"], 1.0 + 0.8 + 0.8);
    assert_eq!(llmd["pod-1-0"], 1.0 + 0.8 + 1.0);
}

/// The other documented difference: a block on several tiers weighs as its fastest tier in
/// kvatlas; llm-d takes the largest weight, and with its defaults an unlisted tier (disk, 1.0)
/// outweighs the host (0.8).
#[test]
fn a_host_block_also_on_disk_weighs_as_host() {
    let chain = Chain {
        worker: Worker::new(1, 0),
        tokens: (0..2 * BLOCK).collect(),
        tiers: vec![vec![Tier::Device], vec![Tier::Host, Tier::Disk]],
    };
    let (reference, entries) = models(std::slice::from_ref(&chain), rank_pod);
    let prompt = chain.tokens.clone();
    let kvatlas = as_map(&pod_scores(&tiered(&reference, &prompt), rank_pod, &[]));
    let llmd = llmd_score(&request_keys(&prompt), &entries);
    assert_eq!(kvatlas["pod-1-0"], 1.0 + 0.8);
    assert_eq!(llmd["pod-1-0"], 1.0 + 1.0);
}

#[test]
fn prompts_shorter_than_a_block_score_nothing() {
    let chain = Chain {
        worker: Worker::new(1, 0),
        tokens: (0..2 * BLOCK).collect(),
        tiers: vec![vec![Tier::Device]; 2],
    };
    let (reference, _) = models(&[chain], rank_pod);
    for prompt in [vec![], vec![0]] {
        assert!(pod_scores(&tiered(&reference, &prompt), rank_pod, &[]).is_empty());
    }
}

/// A rank a restore recorded as fed by a ZMQ listener registered with a pod name, and could not
/// feed again (the rank limit), still answers as that pod (it answered as its instance id).
#[test]
fn a_rank_not_fed_since_a_restore_answers_as_its_registered_pod() {
    use crate::registry::{DEFAULT_TENANT, WorkerRegistration};
    use crate::snapshot::{IndexImage, RecordedFeed};
    use kvatlas_index::{Snapshot, SnapshotBlock, TierSet, WorkerSnapshot};

    let block_size = kvatlas_hash::BlockSize::new(4).expect("4");
    let tokens: Vec<u32> = (1..=8).collect();
    let locals: Vec<LocalBlockHash> = BlockHasher::with_block_size(block_size)
        .local_hashes(&tokens)
        .collect();
    let holding = |worker: Worker| WorkerSnapshot {
        worker,
        blocks: locals
            .iter()
            .enumerate()
            .map(|(i, local)| SnapshotBlock {
                external: ExternalBlockHash::new(worker.worker_id * 100 + i as u64),
                local: *local,
                parent: i
                    .checked_sub(1)
                    .map(|p| ExternalBlockHash::new(worker.worker_id * 100 + p as u64)),
                tiers: TierSet::only(Tier::Device),
            })
            .collect(),
    };
    let key = IndexKey::new("m", DEFAULT_TENANT);
    let (fed, unfed) = (Worker::new(1, 0), Worker::new(2, 0));
    let image = IndexImage {
        key: key.clone(),
        block_size,
        capacity: None,
        feeds: vec![
            RecordedFeed::Grpc { worker: fed },
            RecordedFeed::Zmq(WorkerRegistration {
                pod_name: Some("vllm-pod-two".into()),
                ..crate::registry::vllm_rank(&key, 2, block_size, "tcp://127.0.0.1:1")
            }),
        ],
        marks: BTreeMap::new(),
        snapshot: Snapshot {
            workers: vec![holding(fed), holding(unfed)],
        },
    };
    let (registry, failed) = crate::registry::restored_within_one_rank(image);
    assert_eq!(failed, 1, "the listener does not fit the rank limit");
    let entry = registry.get(&key).expect("the index");
    let scores = score_tokens(&entry, &tokens, &[], 1 << 10).expect("scored");
    assert_eq!(
        as_map(&scores),
        BTreeMap::from([("1".to_owned(), 2.0), ("vllm-pod-two".to_owned(), 2.0)])
    );
}
