//! PNG line charts of a run's `metrics.jsonl`, drawn with plotters and encoded with `png`.
//!
//! [`plot_run`] writes `RUN_DIR/plots/<name>.png` for each metric (a `/` in the name, or any other
//! character unsafe in a file name, becomes `_`) and `RUN_DIR/plots/overview.png`, a grid of the main
//! metrics the run has ([`OVERVIEW`]). Text is set in DejaVu Sans, which is compiled in, so the charts
//! need no fonts on the machine.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;

use crate::metrics::{read_metrics, METRICS_FILE};

/// The metrics of `overview.png`, in its order, those the run has; when it has none of them, the
/// overview shows its first nine metrics.
pub const OVERVIEW: [&str; 9] = [
    "reward",
    "eval/reward",
    "eval/pass@1",
    "kl",
    "entropy",
    "loss",
    "grad_norm",
    "learning_rate",
    "completions/mean_length",
];

/// The folder of a run's charts.
pub const PLOTS_DIR: &str = "plots";

/// The font family the charts are set in, registered with plotters on first use.
pub(super) const FONT: &str = "sans-serif";
pub(super) const LINE: RGBColor = RGBColor(31, 119, 180);
pub(super) const GRID: RGBColor = RGBColor(225, 225, 225);
pub(super) const AXIS: RGBColor = RGBColor(90, 90, 90);
/// Series with at most this many points also mark each point.
const MARKED_POINTS: usize = 60;
const CHART_SIZE: (u32, u32) = (900, 520);
const PANEL_SIZE: (u32, u32) = (600, 380);
const OVERVIEW_COLUMNS: usize = 3;

/// Draws the charts of `run_dir/metrics.jsonl` into `run_dir/plots/` and returns their paths: one per
/// metric, in name order, then `overview.png`.
///
/// A metric's points are its finite values (a step without it, or with `null`, has none); a metric
/// with no finite value gets no chart. Errors name the file and the problem: `metrics.jsonl` missing
/// or unreadable, a line that does not parse, no metric to plot, a chart that cannot be written.
pub fn plot_run(run_dir: &Path) -> Result<Vec<PathBuf>, String> {
    let metrics_path = run_dir.join(METRICS_FILE);
    if !metrics_path.is_file() {
        return Err(format!(
            "{}: no such file; plot a run folder after it has logged a step",
            metrics_path.display()
        ));
    }
    let rows = read_metrics(&metrics_path)?;
    let mut series: BTreeMap<&str, Vec<(u64, f64)>> = BTreeMap::new();
    for (step, metrics) in &rows {
        for (name, &value) in metrics {
            if value.is_finite() {
                series.entry(name).or_default().push((*step, value));
            }
        }
    }
    if series.is_empty() {
        return Err(format!(
            "{}: no metrics to plot (no line has a finite value besides `step`)",
            metrics_path.display()
        ));
    }
    register_font()?;

    let plots = run_dir.join(PLOTS_DIR);
    fs::create_dir_all(&plots).map_err(|e| format!("{}: {e}", plots.display()))?;
    let mut written = Vec::new();
    // File names taken so far, lowercased for file systems that ignore case.
    let mut taken = BTreeSet::from(["overview".to_string()]);
    for (name, points) in &series {
        let stem = unique_stem(name, &mut taken);
        let path = plots.join(format!("{stem}.png"));
        render(&path, CHART_SIZE, |root| draw(root, name, points, 24))?;
        written.push(path);
    }

    let mut main: Vec<(&str, &Vec<(u64, f64)>)> = OVERVIEW
        .iter()
        .filter_map(|name| series.get_key_value(name).map(|(k, v)| (*k, v)))
        .collect();
    if main.is_empty() {
        main = series
            .iter()
            .take(OVERVIEW.len())
            .map(|(k, v)| (*k, v))
            .collect();
    }
    let columns = main.len().min(OVERVIEW_COLUMNS);
    let rows = main.len().div_ceil(OVERVIEW_COLUMNS);
    let path = plots.join("overview.png");
    let size = (PANEL_SIZE.0 * columns as u32, PANEL_SIZE.1 * rows as u32);
    render(&path, size, |root| {
        // Fill the panels a last row leaves empty.
        root.fill(&WHITE)?;
        let panels = root.split_evenly((rows, columns));
        main.iter()
            .zip(&panels)
            .try_for_each(|((name, points), panel)| draw(panel, name, points, 20))
    })?;
    written.push(path);
    Ok(written)
}

pub(super) type DrawError =
    DrawingAreaErrorKind<<BitMapBackend<'static> as DrawingBackend>::ErrorType>;

/// Draws a `size` image in memory with `paint` and writes it to `path` as an RGB PNG.
pub(super) fn render(
    path: &Path,
    size: (u32, u32),
    paint: impl FnOnce(&DrawingArea<BitMapBackend<'_>, Shift>) -> Result<(), DrawError>,
) -> Result<(), String> {
    let fail = |error: &dyn std::fmt::Display| format!("{}: {error}", path.display());
    let mut pixels = vec![0u8; size.0 as usize * size.1 as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut pixels, size).into_drawing_area();
        paint(&root)
            .and_then(|()| root.present())
            .map_err(|e| fail(&e))?;
    }
    let file = fs::File::create(path).map_err(|e| fail(&e))?;
    let mut encoder = png::Encoder::new(io::BufWriter::new(file), size.0, size.1);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header().map_err(|e| fail(&e))?;
    writer.write_image_data(&pixels).map_err(|e| fail(&e))?;
    writer.finish().map_err(|e| fail(&e))
}

/// Registers DejaVu Sans as plotters' `sans-serif`, once per process.
pub(super) fn register_font() -> Result<(), String> {
    static REGISTERED: OnceLock<Result<(), String>> = OnceLock::new();
    REGISTERED
        .get_or_init(|| {
            plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular())
                .map_err(|_| "the compiled-in DejaVu Sans font does not load".to_string())
        })
        .clone()
}

/// A file name for `name` that no earlier metric took: unsafe characters become `_`, and a clash
/// gets a numbered suffix.
fn unique_stem(name: &str, taken: &mut BTreeSet<String>) -> String {
    let base: String = name
        .chars()
        .map(|c| {
            if c.is_alphanumeric() || "-_.@+=".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    let base = if base.starts_with('.') || base.is_empty() {
        format!("_{base}")
    } else {
        base
    };
    let mut stem = base.clone();
    let mut n = 2;
    while !taken.insert(stem.to_lowercase()) {
        stem = format!("{base}_{n}");
        n += 1;
    }
    stem
}

/// One line chart of `points` (at least one, all finite) on `area`, titled `name`.
fn draw(
    area: &DrawingArea<BitMapBackend<'_>, Shift>,
    name: &str,
    points: &[(u64, f64)],
    title_size: u32,
) -> Result<(), DrawError> {
    area.fill(&WHITE)?;
    let first = points.iter().map(|p| p.0).min().unwrap_or(0);
    let last = points.iter().map(|p| p.0).max().unwrap_or(0);
    // One step gets an axis around it.
    let (first, last) = if first == last {
        (first.saturating_sub(1), last.saturating_add(1))
    } else {
        (first, last)
    };
    let (low, high) = value_range(points.iter().map(|p| p.1));
    let label = |value: &f64| tick(*value, high - low);

    let mut chart = ChartBuilder::on(area)
        .caption(name, (FONT, title_size).into_font().color(&BLACK))
        .margin(14)
        .x_label_area_size(44)
        .y_label_area_size(78)
        .build_cartesian_2d(first..last, low..high)?;
    chart
        .configure_mesh()
        .light_line_style(WHITE)
        .bold_line_style(GRID)
        .axis_style(AXIS)
        .x_labels(8)
        .y_labels(6)
        .x_desc("step")
        .label_style((FONT, 14).into_font().color(&AXIS))
        .axis_desc_style((FONT, 15).into_font().color(&AXIS))
        .y_label_formatter(&label)
        .draw()?;
    chart.draw_series(LineSeries::new(
        points.iter().copied(),
        LINE.stroke_width(2),
    ))?;
    if points.len() <= MARKED_POINTS {
        chart.draw_series(
            points
                .iter()
                .map(|&point| Circle::new(point, 3, LINE.filled())),
        )?;
    }
    Ok(())
}

/// The y range of a chart: the values' range padded by 5%, or around a constant value.
fn value_range(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (low, high) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(low, high), v| {
        (low.min(v), high.max(v))
    });
    let span = high - low;
    let pad = if span > 0.0 {
        span * 0.05
    } else if low != 0.0 {
        low.abs() * 0.1
    } else {
        1.0
    };
    (low - pad, high + pad)
}

/// A y axis label on an axis spanning `span`: four significant digits, or scientific notation for very
/// large or small values; `0` for a value that only rounding keeps from zero.
fn tick(value: f64, span: f64) -> String {
    let magnitude = value.abs();
    if magnitude <= span * 1e-9 {
        return "0".to_string();
    }
    if !(1e-3..1e5).contains(&magnitude) {
        return format!("{value:.2e}");
    }
    let decimals = (3 - magnitude.log10().floor() as i32).clamp(0, 6) as usize;
    let text = format!("{value:.decimals$}");
    if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_short() {
        assert_eq!(tick(0.0, 1.0), "0");
        assert_eq!(tick(3.47e-18, 0.04), "0");
        assert_eq!(tick(0.30000000000000004, 1.0), "0.3");
        assert_eq!(tick(-12.5, 1.0), "-12.5");
        assert_eq!(tick(1234.5678, 1.0), "1235");
        assert_eq!(tick(0.000001, 1e-6), "1.00e-6");
        assert_eq!(tick(250000.0, 1.0), "2.50e5");
    }

    #[test]
    fn file_names_are_safe_and_distinct() {
        let mut taken = BTreeSet::from(["overview".to_string()]);
        assert_eq!(unique_stem("eval/pass@1", &mut taken), "eval_pass@1");
        assert_eq!(unique_stem("eval_pass@1", &mut taken), "eval_pass@1_2");
        assert_eq!(unique_stem("overview", &mut taken), "overview_2");
        assert_eq!(unique_stem("../x", &mut taken), "_.._x");
    }

    #[test]
    fn a_constant_series_gets_a_range() {
        assert_eq!(value_range([0.0].into_iter()), (-1.0, 1.0));
        let (low, high) = value_range([2.0, 2.0].into_iter());
        assert!(low < 2.0 && high > 2.0);
    }
}
