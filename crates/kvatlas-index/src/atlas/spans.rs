//! Span arithmetic: a rank's per-level counts over an edge as run-length encoded spans, and
//! the cover-list edits that keep covers sorted and small.

use crate::model::{LEVELS, Level};

use super::forest::{Cover, Covers, Span};

/// The counts a cover's bounds imply: one block per position, at the lowest level whose bound
/// covers it.
pub(super) fn spans_of_bounds(bounds: [u32; LEVELS], into: &mut Vec<Span>) {
    let mut lo = 0;
    for (level, &hi) in bounds.iter().enumerate() {
        if hi > lo {
            let mut counts = [0; LEVELS];
            counts[level] = 1;
            into.push(Span { lo, hi, counts });
            lo = hi;
        }
    }
}

/// `spans` with one block more (or fewer) at `level` over `lo..hi`, written to `into`, still
/// sorted, merged and without zero runs.
pub(super) fn change_spans(
    spans: &[Span],
    lo: u32,
    hi: u32,
    level: Level,
    add: bool,
    into: &mut Vec<Span>,
) {
    into.clear();
    let push = |into: &mut Vec<Span>, span: Span| {
        if span.lo >= span.hi || span.counts == [0; LEVELS] {
            return;
        }
        match into.last_mut() {
            Some(last) if last.hi == span.lo && last.counts == span.counts => last.hi = span.hi,
            _ => into.push(span),
        }
    };
    let changed = |mut counts: [u32; LEVELS]| {
        let count = &mut counts[level as usize];
        // The ledger only removes memberships it added; saturate rather than underflow.
        *count = if add {
            *count + 1
        } else {
            count.saturating_sub(1)
        };
        counts
    };
    // `lo..cursor` of the changed range is written.
    let mut cursor = lo;
    for span in spans {
        let gap_end = span.lo.min(hi);
        if cursor < gap_end {
            push(
                into,
                Span {
                    lo: cursor,
                    hi: gap_end,
                    counts: changed([0; LEVELS]),
                },
            );
            cursor = gap_end;
        }
        let from = span.lo.max(lo).min(span.hi);
        let to = span.hi.min(hi).max(from);
        push(
            into,
            Span {
                lo: span.lo,
                hi: from,
                counts: span.counts,
            },
        );
        push(
            into,
            Span {
                lo: from,
                hi: to,
                counts: changed(span.counts),
            },
        );
        push(
            into,
            Span {
                lo: to,
                hi: span.hi,
                counts: span.counts,
            },
        );
        cursor = cursor.max(to);
    }
    if cursor < hi {
        push(
            into,
            Span {
                lo: cursor,
                hi,
                counts: changed([0; LEVELS]),
            },
        );
    }
}

/// A cover's bounds from exact counts: per level, the leading positions held at or below it.
pub(super) fn bounds_of_spans(spans: &[Span]) -> [u32; LEVELS] {
    let mut bounds = [0; LEVELS];
    for (level, bound) in bounds.iter_mut().enumerate() {
        for span in spans {
            if span.lo != *bound || span.counts[..=level].iter().all(|&c| c == 0) {
                break;
            }
            *bound = span.hi;
        }
    }
    bounds
}

/// Inserts a cover, growing small cover lists one at a time (most edges are covered by one or
/// two ranks; doubling would leave most of each list's allocation unused).
#[inline]
pub(super) fn insert_cover(covers: &mut Covers, at: usize, cover: Cover) {
    if covers.len() == covers.capacity() && covers.len() < 8 {
        covers.reserve_exact(1);
    }
    covers.insert(at, cover);
}

/// Removes a cover, giving memory back when the list is mostly unused.
#[inline]
pub(super) fn remove_cover(covers: &mut Covers, at: usize) {
    covers.remove(at);
    if covers.capacity() > 2 * covers.len() + 2 {
        covers.shrink_to_fit();
    }
}
