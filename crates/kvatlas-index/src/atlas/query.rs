//! The query walk: from the root edge down the query's path, scoring every cover on the way
//! (see the parent module's "Query").
use std::cell::RefCell;

use kvatlas_hash::LocalBlockHash;

use crate::model::{LEVELS, MatchOptions, Matches, WorkerMatch};

use super::forest::{Cover, Edge, Forest, NIL};

/// Per-query scratch, reused across queries on the same thread.
#[derive(Default)]
pub(super) struct Scratch {
    /// Per cover of the root edge (in cover order): the scores so far and the levels still
    /// matching (bit `l`).
    pub(super) states: Vec<([u32; LEVELS], u8)>,
    /// Rank index → index into `states`; written only for ranks that continue past the root edge,
    /// read only for covers of deeper edges that hold blocks on a level the query follows. By
    /// prefix closure such a rank holds the whole path to the edge on that level, so it
    /// continued past the root edge: its entry is this query's.
    pub(super) row_of_rank: Vec<u32>,
    /// Device-only walk: per row of the answer, whether the rank still matches.
    pub(super) alive: Vec<bool>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Scores of one cover on an edge whose run matched the query for `m` blocks; returns the
/// levels (among `alive`) that continue past the edge.
#[inline(always)]
pub(super) fn score_cover(
    cover: &Cover,
    depth: u32,
    m: u32,
    continues: bool,
    alive: u8,
    score: &mut [u32; LEVELS],
) -> u8 {
    if alive == 0b001 {
        // Device-only queries (the common case): one level.
        let bound = cover.bounds[0];
        score[0] = depth + bound.min(m);
        return u8::from(bound >= m && continues);
    }
    let mut next = 0u8;
    for (level, (bound, score)) in cover.bounds.iter().zip(score.iter_mut()).enumerate() {
        if alive & (1 << level) != 0 {
            *score = depth + (*bound).min(m);
            if *bound >= m && continues {
                next |= 1 << level;
            }
        }
    }
    next
}

impl Forest {
    /// The walk described in the module docs; fills `out` with every rank's exact scores.
    pub(super) fn walk(&self, query: &[LocalBlockHash], tiered: bool, out: &mut Vec<WorkerMatch>) {
        let Some(first) = query.first() else { return };
        let Some(root) = self.branches.get(&self.edges, NIL, 0, *first) else {
            return;
        };
        if tiered {
            self.walk_tiered(query, root, out);
        } else {
            self.walk_device(query, root, out);
        }
    }

    /// Runs `walk` with this thread's query scratch (its rank index → row map made to cover every
    /// rank index), the root edge, and how far the query matches it (`matched`, `continues`).
    #[inline]
    pub(super) fn at_root<R>(
        &self,
        query: &[LocalBlockHash],
        root: u32,
        walk: impl FnOnce(&mut Scratch, &Edge, u32, bool) -> R,
    ) -> R {
        SCRATCH.with(|scratch| {
            let mut scratch = scratch.borrow_mut();
            let ranks = self.ranks.len();
            if scratch.row_of_rank.len() < ranks {
                scratch.row_of_rank.resize(ranks, 0);
            }
            let (matched, continues) = self.match_run(root, query);
            walk(&mut scratch, &self.edges[root as usize], matched, continues)
        })
    }

    /// The walk for tiered queries: all three levels followed (bits 0b111 of a row's state).
    pub(super) fn walk_tiered(
        &self,
        query: &[LocalBlockHash],
        root: u32,
        out: &mut Vec<WorkerMatch>,
    ) {
        self.at_root(query, root, |scratch, e, m, continues| {
            let Scratch {
                states,
                row_of_rank,
                ..
            } = scratch;
            // The root edge: every rank with a match covers it, so its covers (sorted by rank)
            // are the answer's rows, scored in one sequential pass.
            states.clear();
            states.extend(e.covers.iter().map(|cover| {
                let mut score = [0; LEVELS];
                let next = score_cover(cover, 0, m, continues, 0b111, &mut score);
                (score, next)
            }));
            let goes_on = states.iter().map(|&(_, next)| next != 0);
            // Deeper edges: only ranks that continued past the root edge can cover them.
            if index_rows(&e.covers, goes_on, row_of_rank) {
                self.walk_below(root, m, query, |e, matched, continues| {
                    let mut any_alive = false;
                    for cover in &e.covers {
                        // Every level is followed: a rank covering this edge holds the path to it
                        // on some level, so it continued past the root edge (row of this query).
                        let row = row_of_rank[cover.rank_index as usize] as usize;
                        let Some((score, state)) = states.get_mut(row) else {
                            debug_assert!(false, "a cover without a row");
                            continue;
                        };
                        if *state != 0 {
                            *state = score_cover(cover, e.depth, matched, continues, *state, score);
                            any_alive |= *state != 0;
                        }
                    }
                    any_alive
                });
            }
            // Every cover holds at least the edge's first block on some tier and the query
            // matched it: every row has `disk >= 1`.
            let workers = &self.ranks;
            out.clear();
            out.extend(e.covers.iter().zip(states.iter()).map(
                |(cover, &([device, host, disk], _))| WorkerMatch {
                    worker: workers[cover.rank_index as usize],
                    device,
                    host,
                    disk,
                },
            ));
        });
    }

    /// The walk for device-only queries (the routing hot path): one level, rows written
    /// straight into `out` (replacing its contents) — one pass over the root edge's covers,
    /// then in-place updates of the ranks that continue.
    pub(super) fn walk_device(
        &self,
        query: &[LocalBlockHash],
        root: u32,
        out: &mut Vec<WorkerMatch>,
    ) {
        self.at_root(query, root, |scratch, e, m, continues| {
            let Scratch {
                row_of_rank, alive, ..
            } = scratch;
            // One row per cover, in two tight passes; a rank holding the edge on lower tiers
            // only (bound 0: score 0, never continuing) is dropped at the end.
            let workers = &self.ranks;
            out.clear();
            out.extend(e.covers.iter().map(|cover| {
                let score = cover.bounds[0].min(m);
                WorkerMatch {
                    worker: workers[cover.rank_index as usize],
                    device: score,
                    host: score,
                    disk: score,
                }
            }));
            alive.clear();
            alive.extend(
                e.covers
                    .iter()
                    .map(|cover| cover.bounds[0] >= m && continues),
            );
            if index_rows(&e.covers, alive.iter().copied(), row_of_rank) {
                self.walk_below(root, m, query, |e, matched, continues| {
                    let mut any_alive = false;
                    for cover in &e.covers {
                        let bound = cover.bounds[0];
                        if bound == 0 {
                            // Lower tiers only: this rank may have stopped at the root
                            // edge, with no row written this query.
                            continue;
                        }
                        // By prefix closure a rank with device blocks here held the whole
                        // path on the device: it continued past every edge so far and has
                        // this query's row.
                        let row = row_of_rank[cover.rank_index as usize] as usize;
                        let (Some(goes_on), Some(answer)) = (alive.get_mut(row), out.get_mut(row))
                        else {
                            debug_assert!(false, "a device cover without a row");
                            continue;
                        };
                        if !*goes_on {
                            continue;
                        }
                        let score = e.depth + bound.min(matched);
                        (answer.device, answer.host, answer.disk) = (score, score, score);
                        *goes_on = bound >= matched && continues;
                        any_alive |= *goes_on;
                    }
                    any_alive
                });
            }
            // The root edge matched at least its first block, so only those ranks scored 0.
            if out.iter().any(|row| row.device == 0) {
                out.retain(|row| row.device > 0);
            }
        });
    }
}

/// Records, for each root-edge cover whose rank goes on past the root edge, its row (the
/// cover's position) under its rank index; returns whether any rank goes on.
#[inline]
pub(super) fn index_rows(
    covers: &[Cover],
    goes_on: impl Iterator<Item = bool>,
    row_of_rank: &mut [u32],
) -> bool {
    let mut any = false;
    for (row, (cover, goes_on)) in covers.iter().zip(goes_on).enumerate() {
        if goes_on {
            row_of_rank[cover.rank_index as usize] = row as u32;
            any = true;
        }
    }
    any
}

/// Length of the common prefix of two equally long runs.
#[inline]
pub(super) fn common_prefix(a: &[LocalBlockHash], b: &[LocalBlockHash]) -> usize {
    // Compare in chunks so the common all-equal case runs as wide comparisons.
    const CHUNK: usize = 16;
    let mut done = 0;
    for (x, y) in a.chunks(CHUNK).zip(b.chunks(CHUNK)) {
        if x == y {
            done += x.len();
        } else {
            return done + x.iter().zip(y).take_while(|(p, q)| p == q).count();
        }
    }
    done
}

impl Forest {
    /// The answer to a query (see the module docs).
    pub(super) fn find_matches(&self, query: &[LocalBlockHash], options: &MatchOptions) -> Matches {
        let mut matches = Matches::default();
        self.walk(query, options.tiered, &mut matches.workers);
        if options.early_exit || options.top_k.is_some() {
            matches.finish(options);
        }
        matches
    }
}
