//! Plots (SVG and PNG, with plotters) for the demo and the benchmarks: achieved vs offered
//! throughput with p99 latency on a second axis, latency CDFs, and plain line charts.
//!
//! Text is laid out (both formats) and rasterized (PNG) with a TrueType font read at run time:
//! `$KVATLAS_BENCH_FONT`, else DejaVu Sans or Liberation Sans from the usual system paths
//! (Debian's `fonts-dejavu-core`). Without a font, plots are skipped with a warning.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use hdrhistogram::Histogram;
use plotters::coord::Shift;
use plotters::prelude::*;

/// A few points of a latency distribution, for CDF plots: `(fraction of samples ≤ value, ns)`.
pub type Cdf = Vec<(f64, u64)>;

/// A plot that could not be drawn or written.
#[derive(Debug, thiserror::Error)]
#[error("plotting: {0}")]
pub struct PlotError(String);

type Result<T> = std::result::Result<T, PlotError>;

/// Points of a latency CDF: quantiles from 0 to 1 − 10⁻⁴, denser in the tail.
pub fn cdf_of(histogram: &Histogram<u64>) -> Cdf {
    let mut points = Vec::new();
    for i in 0..=40 {
        let q = f64::from(i) / 40.0 * 0.9;
        points.push((q, histogram.value_at_quantile(q)));
    }
    // 0.9 .. 0.9999, log-spaced in 1 − q.
    for i in 1..=30 {
        let q = 1.0 - 0.1 * 10f64.powf(-3.0 * f64::from(i) / 30.0);
        points.push((q, histogram.value_at_quantile(q)));
    }
    points.push((1.0, histogram.max()));
    points
}

const SIZE: (u32, u32) = (1100, 700);
const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
];

/// Registers a sans-serif font once (plotters needs its metrics for both backends and its glyphs
/// for PNGs); whether one is available.
fn font() -> bool {
    static READY: OnceLock<bool> = OnceLock::new();
    *READY.get_or_init(|| {
        let candidates = std::env::var_os("KVATLAS_BENCH_FONT")
            .map(PathBuf::from)
            .into_iter()
            .chain(FONT_PATHS.iter().map(PathBuf::from));
        for path in candidates {
            if let Ok(bytes) = std::fs::read(&path) {
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return true;
                }
            }
        }
        eprintln!("warning: no TrueType font found (set KVATLAS_BENCH_FONT); plots are skipped");
        false
    })
}

/// A series colour (a qualitative palette readable on white).
fn colour(i: usize) -> RGBColor {
    const PALETTE: [RGBColor; 6] = [
        RGBColor(31, 119, 180),
        RGBColor(214, 39, 40),
        RGBColor(44, 160, 44),
        RGBColor(148, 103, 189),
        RGBColor(255, 127, 14),
        RGBColor(23, 190, 207),
    ];
    PALETTE[i % PALETTE.len()]
}

type Area<'a, DB> = DrawingArea<DB, Shift>;

fn err<E: std::fmt::Display>(error: E) -> PlotError {
    PlotError(error.to_string())
}

/// Renders a drawing function to `stem.svg` and (if a font is available) `stem.png`.
macro_rules! render_both {
    ($stem:expr, $body:ident, $($arg:expr),*) => {{
        let stem: &Path = $stem;
        let mut written = Vec::new();
        // Both backends lay text out with the font's metrics: without one, no plot.
        if font() {
            let svg = stem.with_extension("svg");
            {
                let root = SVGBackend::new(&svg, SIZE).into_drawing_area();
                $body(&root, $($arg),*)?;
                root.present().map_err(err)?;
            }
            written.push(svg);
            let png = stem.with_extension("png");
            {
                let root = BitMapBackend::new(&png, SIZE).into_drawing_area();
                $body(&root, $($arg),*)?;
                root.present().map_err(err)?;
            }
            written.push(png);
        }
        Ok::<Vec<PathBuf>, PlotError>(written)
    }};
}

fn log_range(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::MAX, f64::MIN);
    for v in values.filter(|v| v.is_finite() && *v > 0.0) {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if lo > hi {
        return (1.0, 10.0);
    }
    (lo / 1.5, hi * 1.5)
}

/// One point of a throughput sweep, as plotted.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SweepPoint {
    /// Offered rate (per second).
    pub offered: f64,
    /// Achieved rate.
    pub achieved: f64,
    /// p99 latency in µs.
    pub p99_us: f64,
    /// Whether the point met its criterion (drawn filled).
    pub ok: bool,
}

/// A named series of sweep points.
#[derive(Debug, Clone, PartialEq)]
pub struct SweepSeries {
    /// The legend name.
    pub name: String,
    /// The points, in any order.
    pub points: Vec<SweepPoint>,
}

/// The axis labels of a sweep plot and the meaning of a filled marker.
#[derive(Debug, Clone, Copy)]
pub struct SweepLabels<'a> {
    /// The x axis (offered rate).
    pub offered: &'a str,
    /// The left y axis (achieved rate).
    pub achieved: &'a str,
    /// What a filled marker means (`kept up`, `p99 <= 1 ms`).
    pub ok: &'a str,
}

fn draw_sweep<DB: DrawingBackend>(
    root: &Area<'_, DB>,
    title: &str,
    series: &[SweepSeries],
    labels: SweepLabels<'_>,
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE).map_err(err)?;
    let all = || series.iter().flat_map(|s| s.points.iter());
    let (x_lo, x_hi) = log_range(all().map(|p| p.offered));
    let (y_lo, y_hi) = log_range(all().flat_map(|p| [p.achieved, p.offered]));
    let (p_lo, p_hi) = log_range(all().map(|p| p.p99_us));
    let mut chart = ChartBuilder::on(root)
        .caption(title, ("sans-serif", 24))
        .margin(16)
        .x_label_area_size(56)
        .y_label_area_size(90)
        .right_y_label_area_size(90)
        .build_cartesian_2d((x_lo..x_hi).log_scale(), (y_lo..y_hi).log_scale())
        .map_err(err)?
        .set_secondary_coord((x_lo..x_hi).log_scale(), (p_lo..p_hi).log_scale());
    chart
        .configure_mesh()
        .x_desc(labels.offered)
        .y_desc(labels.achieved)
        .x_labels(8)
        .y_labels(8)
        .x_label_formatter(&|v| si(*v))
        .y_label_formatter(&|v| si(*v))
        .label_style(("sans-serif", 16))
        .axis_desc_style(("sans-serif", 18))
        .draw()
        .map_err(err)?;
    chart
        .configure_secondary_axes()
        .y_desc("p99 latency from deadline (dashed)")
        .y_labels(8)
        .y_label_formatter(&|v| micros(*v))
        .label_style(("sans-serif", 16))
        .axis_desc_style(("sans-serif", 18))
        .draw()
        .map_err(err)?;
    // The ideal: achieved = offered.
    chart
        .draw_series(LineSeries::new(
            [(x_lo, x_lo), (x_hi, x_hi)],
            ShapeStyle::from(&BLACK.mix(0.3)).stroke_width(1),
        ))
        .map_err(err)?
        .label("achieved = offered")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLACK.mix(0.3)));
    for (i, s) in series.iter().enumerate() {
        let mut points = s.points.clone();
        points.sort_by(|a, b| a.offered.total_cmp(&b.offered));
        let c = colour(i);
        let name = &s.name;
        chart
            .draw_series(LineSeries::new(
                points.iter().map(|p| (p.offered, p.achieved)),
                c.stroke_width(3),
            ))
            .map_err(err)?
            .label(format!("{name}: achieved (filled = {})", labels.ok))
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], c.stroke_width(3)));
        chart
            .draw_series(points.iter().map(|p| {
                let style = if p.ok { c.filled() } else { c.stroke_width(2) };
                Circle::new((p.offered, p.achieved), 6, style)
            }))
            .map_err(err)?;
        chart
            .draw_secondary_series(DashedLineSeries::new(
                points.iter().map(|p| (p.offered, p.p99_us)),
                8,
                5,
                c.stroke_width(2),
            ))
            .map_err(err)?
            .label(format!("{name}: p99 (dashed, right axis)"))
            .legend(move |(x, y)| {
                EmptyElement::at((x, y))
                    + PathElement::new([(0, 0), (7, 0)], c.stroke_width(2))
                    + PathElement::new([(12, 0), (19, 0)], c.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font(("sans-serif", 16))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.4))
        .draw()
        .map_err(err)?;
    Ok(())
}

fn draw_cdf<DB: DrawingBackend>(
    root: &Area<'_, DB>,
    title: &str,
    x_desc: &str,
    curves: &[(String, Cdf)],
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE).map_err(err)?;
    let (x_lo, x_hi) = log_range(
        curves
            .iter()
            .flat_map(|(_, c)| c.iter().map(|&(_, ns)| ns as f64 / 1e3)),
    );
    let mut chart = ChartBuilder::on(root)
        .caption(title, ("sans-serif", 24))
        .margin(16)
        .x_label_area_size(56)
        .y_label_area_size(70)
        .build_cartesian_2d((x_lo..x_hi).log_scale(), 0.0..1.0)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc("fraction of queries")
        .x_labels(8)
        .x_label_formatter(&|v| micros(*v))
        .label_style(("sans-serif", 16))
        .axis_desc_style(("sans-serif", 18))
        .draw()
        .map_err(err)?;
    for (i, (label, cdf)) in curves.iter().enumerate() {
        let c = colour(i);
        chart
            .draw_series(LineSeries::new(
                cdf.iter().map(|&(q, ns)| ((ns as f64 / 1e3).max(x_lo), q)),
                c.stroke_width(3),
            ))
            .map_err(err)?
            .label(label.as_str())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], c.stroke_width(3)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .label_font(("sans-serif", 16))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.4))
        .draw()
        .map_err(err)?;
    Ok(())
}

/// A duration given in µs as `250 µs`, `2.5 ms`, `1.2 s`.
fn micros(v: f64) -> String {
    if v >= 1e6 {
        format!("{} s", trim(v / 1e6))
    } else if v >= 1e3 {
        format!("{} ms", trim(v / 1e3))
    } else {
        format!("{} µs", trim(v))
    }
}

fn trim(v: f64) -> String {
    if v >= 10.0 || (v - v.round()).abs() < 0.05 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

/// `1.5k`, `2M`-style labels.
fn si(v: f64) -> String {
    let (scaled, unit) = if v >= 1e9 {
        (v / 1e9, "G")
    } else if v >= 1e6 {
        (v / 1e6, "M")
    } else if v >= 1e3 {
        (v / 1e3, "k")
    } else {
        (v, "")
    };
    if scaled >= 10.0 || (scaled - scaled.round()).abs() < 0.05 {
        format!("{scaled:.0}{unit}")
    } else {
        format!("{scaled:.1}{unit}")
    }
}

/// Writes `stem.svg` and `stem.png`: achieved vs offered rate per series (filled markers = the
/// point met its criterion), p99 (dashed) on the right axis. Returns the files written (none
/// without a font).
///
/// # Errors
/// If a file cannot be written.
pub fn sweep(
    stem: &Path,
    title: &str,
    labels: SweepLabels<'_>,
    series: &[SweepSeries],
) -> Result<Vec<PathBuf>> {
    render_both!(stem, draw_sweep, title, series, labels)
}

/// A named line of `(x, y)` points.
pub type Line = (String, Vec<(f64, f64)>);

/// Axis labels of a line chart.
#[derive(Debug, Clone, Copy)]
pub struct Axes<'a> {
    /// The x axis.
    pub x: &'a str,
    /// The y axis.
    pub y: &'a str,
}

fn draw_lines<DB: DrawingBackend>(
    root: &Area<'_, DB>,
    title: &str,
    axes: Axes<'_>,
    lines: &[Line],
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE).map_err(err)?;
    let points = || lines.iter().flat_map(|(_, p)| p.iter());
    let x_hi = points().map(|p| p.0).fold(1.0, f64::max);
    let y_hi = points().map(|p| p.1).fold(1.0, f64::max) * 1.1;
    let mut chart = ChartBuilder::on(root)
        .caption(title, ("sans-serif", 24))
        .margin(16)
        .x_label_area_size(56)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..x_hi, 0.0..y_hi)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(axes.x)
        .y_desc(axes.y)
        .x_labels(8)
        .y_labels(8)
        .label_style(("sans-serif", 16))
        .axis_desc_style(("sans-serif", 18))
        .draw()
        .map_err(err)?;
    for (i, (name, line)) in lines.iter().enumerate() {
        let c = colour(i);
        chart
            .draw_series(LineSeries::new(line.iter().copied(), c.stroke_width(3)))
            .map_err(err)?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], c.stroke_width(3)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .label_font(("sans-serif", 16))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.4))
        .draw()
        .map_err(err)?;
    Ok(())
}

/// Writes `stem.svg` and `stem.png`: one line per named series. Returns the files written (none
/// without a font).
///
/// # Errors
/// If a file cannot be written.
pub fn lines(stem: &Path, title: &str, axes: Axes<'_>, lines: &[Line]) -> Result<Vec<PathBuf>> {
    render_both!(stem, draw_lines, title, axes, lines)
}

/// Writes `stem.svg` and `stem.png`: one latency CDF per labelled curve, the latency axis
/// described by `x_desc`. Returns the files.
///
/// # Errors
/// If a file cannot be written.
pub fn cdf(
    stem: &Path,
    title: &str,
    x_desc: &str,
    curves: &[(String, Cdf)],
) -> Result<Vec<PathBuf>> {
    render_both!(stem, draw_cdf, title, x_desc, curves)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn si_labels() {
        assert_eq!(si(1500.0), "1.5k");
        assert_eq!(si(2_000_000.0), "2M");
        assert_eq!(si(25_000.0), "25k");
        assert_eq!(si(3.0), "3");
        assert_eq!(micros(2500.0), "2.5 ms");
        assert_eq!(micros(40.0), "40 µs");
    }
}
