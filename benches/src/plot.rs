//! The harness's plots, drawn by `kvatlas_fleet::plot`: an open-loop sweep of the index
//! benchmark (achieved vs offered ops/s, p99 on the right axis) and latency CDFs.

use std::path::{Path, PathBuf};

use anyhow::Result;
pub use kvatlas_fleet::plot::{Cdf, SweepLabels, SweepPoint, SweepSeries, cdf, cdf_of};

use crate::openloop::OpenLoopResult;

/// Writes `stem.svg` and `stem.png`: achieved vs offered ops/s per backend (filled markers = kept
/// up), p99 (dashed) on the right axis. Returns the files written.
///
/// # Errors
/// If a file cannot be written.
pub fn sweep(stem: &Path, title: &str, runs: &[OpenLoopResult]) -> Result<Vec<PathBuf>> {
    let mut series: Vec<SweepSeries> = Vec::new();
    for r in runs {
        let point = SweepPoint {
            offered: r.offered_ops_per_s,
            achieved: r.achieved_ops_per_s,
            p99_us: r.latency.p99_ns as f64 / 1e3,
            ok: r.kept_up,
        };
        match series.iter_mut().find(|s| s.name == r.backend) {
            Some(s) => s.points.push(point),
            None => series.push(SweepSeries {
                name: r.backend.clone(),
                points: vec![point],
            }),
        }
    }
    let labels = SweepLabels {
        offered: "offered ops/s (queries + events)",
        achieved: "achieved ops/s",
        ok: "kept up",
    };
    Ok(kvatlas_fleet::plot::sweep(stem, title, labels, &series)?)
}

/// Writes `stem.svg` and `stem.png`: achieved vs offered queries/s per series (filled markers =
/// the point passed), p99 (dashed) on the right axis. Returns the files written.
///
/// # Errors
/// If a file cannot be written.
pub fn query_sweep(stem: &Path, title: &str, series: &[SweepSeries]) -> Result<Vec<PathBuf>> {
    let labels = SweepLabels {
        offered: "offered queries/s",
        achieved: "achieved queries/s",
        ok: "p99 <= 1 ms",
    };
    Ok(kvatlas_fleet::plot::sweep(stem, title, labels, series)?)
}
