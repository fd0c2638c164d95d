//! PNG charts (cargo feature `charts`): prefill tok/s against prompt length, where the heavy
//! hitters sit, and retrieval accuracy by length and depth. `h2o-cli` draws them for
//! `bench --png`, `heavy-hitters --png` and `eval --png`.
//!
//! Text is drawn with DejaVu Sans from the `dejavu` crate, registered with plotters at first
//! use, so that charts render the same on a fresh machine that has no system fonts.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint, Ranged};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

pub use crate::bench::Spread;

const FONT: &str = "sans-serif";

/// Why a chart was not drawn.
#[derive(Debug, thiserror::Error)]
pub enum ChartError {
    #[error("the bundled DejaVu Sans font could not be loaded")]
    Font,
    #[error("cannot write the chart to {}: {source}", path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot draw the chart {}: {reason}", path.display())]
    Draw { path: PathBuf, reason: String },
}

pub type Result<T> = std::result::Result<T, ChartError>;

/// A linear f64 axis whose labels sit exactly at the given values (the measured prompt lengths,
/// the first row of every fifth layer) rather than at plotters' round numbers.
#[derive(Clone)]
struct Ticks {
    range: std::ops::Range<f64>,
    at: Vec<f64>,
}

impl Ranged for Ticks {
    type ValueType = f64;
    type FormatOption = DefaultFormatting;

    fn map(&self, v: &f64, limit: (i32, i32)) -> i32 {
        let t = (v - self.range.start) / (self.range.end - self.range.start);
        limit.0 + (t * f64::from(limit.1 - limit.0)).round() as i32
    }

    fn key_points<Hint: KeyPointHint>(&self, _hint: Hint) -> Vec<f64> {
        self.at.clone()
    }

    fn range(&self) -> std::ops::Range<f64> {
        self.range.clone()
    }
}

fn register_font() -> Result<()> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| {
        plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular()).is_ok()
    });
    if !ok {
        return Err(ChartError::Font);
    }
    Ok(())
}

/// Fails now when the chart could not be written to `path` — not after an hour of measuring.
/// Leaves no file behind.
pub fn check_writable(path: &Path) -> Result<()> {
    let existed = path.exists();
    std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(path)
        .map_err(|source| ChartError::Write {
            path: path.to_path_buf(),
            source,
        })?;
    if !existed {
        let _ = std::fs::remove_file(path);
    }
    Ok(())
}

/// Turns plotters' error (which borrows the backend's) into an owned one naming the file.
fn drawing<T, E: std::fmt::Debug>(r: std::result::Result<T, E>, path: &Path) -> Result<T> {
    r.map_err(|e| ChartError::Draw {
        path: path.to_path_buf(),
        reason: format!("{e:?}"),
    })
}

/// One prompt length of a throughput chart.
#[derive(Clone, Copy, Debug)]
pub struct ThroughputPoint {
    pub n_prompt: u32,
    pub baseline: Spread,
    pub h2o: Spread,
}

fn tokens_label(n: u32) -> String {
    if n >= 1024 && n.is_multiple_of(1024) {
        format!("{}K", n / 1024)
    } else {
        n.to_string()
    }
}

/// Prefill tok/s against N (log₂ axis) for the baseline and H2O, with min–max bars and the
/// ratio of medians written above each H2O point.
pub fn throughput(
    path: &Path,
    title: &str,
    baseline_label: &str,
    points: &[ThroughputPoint],
) -> Result<()> {
    register_font()?;
    let root = BitMapBackend::new(path, (960, 600)).into_drawing_area();
    drawing(root.fill(&WHITE), path)?;
    let log2 = |n: u32| f64::from(n).log2();
    let x_lo = points
        .iter()
        .map(|p| log2(p.n_prompt))
        .fold(f64::MAX, f64::min)
        - 0.4;
    let x_hi = points
        .iter()
        .map(|p| log2(p.n_prompt))
        .fold(f64::MIN, f64::max)
        + 0.4;
    let y_hi = points
        .iter()
        .map(|p| p.baseline.max.max(p.h2o.max))
        .fold(0.0, f64::max)
        * 1.2;
    let keys: Vec<f64> = points.iter().map(|p| log2(p.n_prompt)).collect();
    let mut chart = drawing(
        ChartBuilder::on(&root)
            .caption(title, (FONT, 19))
            .margin(16)
            .x_label_area_size(48)
            .y_label_area_size(64)
            .build_cartesian_2d(
                Ticks {
                    range: x_lo..x_hi,
                    at: keys,
                },
                0.0..y_hi,
            ),
        path,
    )?;
    drawing(
        chart
            .configure_mesh()
            .x_desc("prompt length N (tokens, log scale)")
            .y_desc("prefill tok/s")
            .x_label_formatter(&|x| tokens_label(x.exp2().round() as u32))
            .y_label_formatter(&|y| format!("{y:.0}"))
            .label_style((FONT, 15))
            .axis_desc_style((FONT, 16))
            .light_line_style(WHITE.mix(0.0))
            .draw(),
        path,
    )?;
    type Pick = fn(&ThroughputPoint) -> Spread;
    let series: [(&str, RGBColor, Pick); 2] = [
        (baseline_label, RGBColor(90, 90, 90), |p| p.baseline),
        ("H2O", RGBColor(200, 60, 20), |p| p.h2o),
    ];
    for (label, color, spread) in series {
        let line: Vec<(f64, f64)> = points
            .iter()
            .map(|p| (log2(p.n_prompt), spread(p).median))
            .collect();
        drawing(
            chart.draw_series(LineSeries::new(line.clone(), color.stroke_width(3))),
            path,
        )?
        .label(label)
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(3)));
        drawing(
            chart.draw_series(
                line.iter()
                    .map(|&(x, y)| Circle::new((x, y), 5, color.filled())),
            ),
            path,
        )?;
        drawing(
            chart.draw_series(points.iter().map(|p| {
                let s = spread(p);
                ErrorBar::new_vertical(log2(p.n_prompt), s.min, s.median, s.max, color, 10)
            })),
            path,
        )?;
    }
    drawing(
        chart.draw_series(points.iter().map(|p| {
            let ratio = p.h2o.median / p.baseline.median;
            Text::new(
                format!("{ratio:.2}×"),
                (log2(p.n_prompt) - 0.12, p.h2o.max + y_hi * 0.04),
                (FONT, 17).into_font().color(&RGBColor(200, 60, 20)),
            )
        })),
        path,
    )?;
    drawing(
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .label_font((FONT, 16))
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .draw(),
        path,
    )?;
    drawing(root.present(), path)
}

/// One configuration of a quality/speed chart: its prefill speed-up over full attention and
/// its Δ perplexity against full attention.
#[derive(Clone, Debug)]
pub struct TradeoffPoint {
    pub label: String,
    pub speedup: f64,
    pub delta_ppl_percent: f64,
}

/// Δ ppl against prefill speed-up, one labelled point per configuration, coloured by policy
/// (the label's first word): what each way of choosing the memory buys and costs.
pub fn tradeoff(path: &Path, title: &str, points: &[TradeoffPoint]) -> Result<()> {
    register_font()?;
    let root = BitMapBackend::new(path, (960, 640)).into_drawing_area();
    drawing(root.fill(&WHITE), path)?;
    let x_hi = points.iter().map(|p| p.speedup).fold(1.0, f64::max) * 1.1;
    let x_lo = points
        .iter()
        .map(|p| p.speedup)
        .fold(1.0, f64::min)
        .min(1.0)
        * 0.9;
    let y_hi = points
        .iter()
        .map(|p| p.delta_ppl_percent)
        .fold(0.0, f64::max)
        * 1.15
        + 0.1;
    let y_lo = points
        .iter()
        .map(|p| p.delta_ppl_percent)
        .fold(0.0, f64::min)
        .min(0.0);
    let mut chart = drawing(
        ChartBuilder::on(&root)
            .caption(title, (FONT, 17))
            .margin(16)
            .x_label_area_size(48)
            .y_label_area_size(80)
            .build_cartesian_2d(x_lo..x_hi, y_lo..y_hi),
        path,
    )?;
    drawing(
        chart
            .configure_mesh()
            .x_desc("prefill speed-up over full attention (×)")
            .y_desc("Δ perplexity against full attention, whole window (%)")
            .x_label_formatter(&|x| format!("{x:.2}×"))
            .y_label_formatter(&|y| format!("{y:+.1} %"))
            .label_style((FONT, 15))
            .axis_desc_style((FONT, 16))
            .draw(),
        path,
    )?;
    let color = |label: &str| match label.split(['/', ' ']).next().unwrap_or("") {
        "coverage" => RGBColor(200, 60, 20),
        "hybrid" => RGBColor(30, 110, 200),
        "seed" | "h2o" => RGBColor(90, 90, 90),
        _ => RGBColor(40, 150, 70),
    };
    drawing(
        chart.draw_series(points.iter().map(|p| {
            Circle::new(
                (p.speedup, p.delta_ppl_percent),
                6,
                color(&p.label).filled(),
            )
        })),
        path,
    )?;
    drawing(
        chart.draw_series(points.iter().map(|p| {
            Text::new(
                p.label.clone(),
                (p.speedup, p.delta_ppl_percent),
                (FONT, 14)
                    .into_font()
                    .color(&color(&p.label))
                    .pos(Pos::new(HPos::Left, VPos::Bottom)),
            )
        })),
        path,
    )?;
    drawing(root.present(), path)
}

/// How often each position was a heavy hitter: one row per (layer, head), one column per bin of
/// positions; `counts[row][bin]` is the number of chunks whose memory set held a heavy hitter
/// in that bin, out of `n_sets` sets per row.
pub struct SelectionMap<'a> {
    pub title: &'a str,
    /// the model layer of each group of `n_head` rows
    pub layers: &'a [u32],
    pub n_head: usize,
    pub n_positions: usize,
    pub bin: usize,
    pub counts: &'a [Vec<u32>],
    pub n_sets: u32,
}

/// Draws a [`SelectionMap`]: darker = kept in more of the memory sets.
pub fn selection_map(path: &Path, map: &SelectionMap<'_>) -> Result<()> {
    register_font()?;
    let n_layer = map.layers.len();
    let n_rows = n_layer * map.n_head;
    let root = BitMapBackend::new(path, (1100, 860)).into_drawing_area();
    drawing(root.fill(&WHITE), path)?;
    let mut chart = drawing(
        ChartBuilder::on(&root)
            .caption(map.title, (FONT, 20))
            .margin(16)
            .x_label_area_size(48)
            .y_label_area_size(64)
            .build_cartesian_2d(
                0.0..map.n_positions as f64,
                Ticks {
                    range: 0.0..n_rows as f64,
                    at: (0..n_layer)
                        .step_by(n_layer.div_ceil(6).max(1))
                        .map(|l| (l * map.n_head) as f64)
                        .collect(),
                },
            ),
        path,
    )?;
    let (n_head, layers) = (map.n_head, map.layers);
    drawing(
        chart
            .configure_mesh()
            .disable_mesh()
            .x_desc("token position")
            .y_desc("layer (each layer is one row per query head)")
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|r| {
                layers
                    .get(*r as usize / n_head)
                    .map_or(String::new(), u32::to_string)
            })
            .label_style((FONT, 15))
            .axis_desc_style((FONT, 16))
            .draw(),
        path,
    )?;
    let shade = |count: u32| {
        // white → deep blue, by the share of memory sets that kept the position
        let t = f64::from(count) / f64::from(map.n_sets.max(1));
        let mix = |a: f64, b: f64| (a + (b - a) * t.sqrt()).round() as u8;
        RGBColor(mix(235.0, 8.0), mix(240.0, 48.0), mix(250.0, 107.0))
    };
    drawing(
        chart.draw_series(map.counts.iter().enumerate().flat_map(|(row, bins)| {
            bins.iter()
                .enumerate()
                .filter(|(_, &c)| c > 0)
                .map(move |(b, &c)| {
                    let x0 = b * map.bin;
                    let x1 = (x0 + map.bin).min(map.n_positions);
                    Rectangle::new(
                        [(x0 as f64, row as f64), (x1 as f64, (row + 1) as f64)],
                        shade(c).filled(),
                    )
                })
        })),
        path,
    )?;
    // thin lines between layers
    drawing(
        chart.draw_series((1..n_layer).map(|l| {
            let y = (l * map.n_head) as f64;
            PathElement::new(
                vec![(0.0, y), (map.n_positions as f64, y)],
                RGBColor(200, 200, 200),
            )
        })),
        path,
    )?;
    drawing(root.present(), path)
}

/// Needle-in-a-haystack accuracy of one configuration: one cell per (depth, length), green
/// (all answered) to red (none), grey where nothing ran; the share is written in each cell.
/// Depth 0 % is the top row, as needle-in-a-haystack charts draw it.
pub fn accuracy_heatmap(
    path: &Path,
    title: &str,
    depths: &[u32],
    lengths: &[usize],
    cells: &[Vec<Option<f64>>],
) -> Result<()> {
    register_font()?;
    let (n_x, n_y) = (lengths.len(), depths.len());
    let width = (180 + 110 * n_x as u32).max(560);
    let root = BitMapBackend::new(path, (width, 150 + 56 * n_y as u32)).into_drawing_area();
    drawing(root.fill(&WHITE), path)?;
    let mut chart = drawing(
        ChartBuilder::on(&root)
            .caption(title, (FONT, 18))
            .margin(12)
            .x_label_area_size(44)
            .y_label_area_size(64)
            .build_cartesian_2d(
                Ticks {
                    range: 0.0..n_x as f64,
                    at: (0..n_x).map(|i| i as f64 + 0.5).collect(),
                },
                Ticks {
                    range: 0.0..n_y as f64,
                    at: (0..n_y).map(|i| i as f64 + 0.5).collect(),
                },
            ),
        path,
    )?;
    // cell i spans [i, i + 1); row r (from the bottom) shows depths[n_y - 1 - r]
    let center = |v: &f64| (*v >= 0.0).then_some(*v as usize);
    drawing(
        chart
            .configure_mesh()
            .disable_mesh()
            .x_desc("prompt length (tokens)")
            .y_desc("needle depth")
            .x_label_formatter(&|v| {
                center(v)
                    .and_then(|i| lengths.get(i))
                    .map_or(String::new(), |&l| tokens_label(l as u32))
            })
            .y_label_formatter(&|v| {
                center(v)
                    .filter(|&r| r < n_y)
                    .map_or(String::new(), |r| format!("{} %", depths[n_y - 1 - r]))
            })
            .label_style((FONT, 15))
            .axis_desc_style((FONT, 16))
            .draw(),
        path,
    )?;
    let color = |v: Option<f64>| match v {
        // red → yellow → green
        Some(t) if t < 0.5 => RGBColor(220, (60.0 + 280.0 * t) as u8, 60),
        Some(t) => RGBColor((220.0 - 300.0 * (t - 0.5)) as u8, 200, 80),
        None => RGBColor(210, 210, 210),
    };
    let row = |d: usize| n_y - 1 - d;
    drawing(
        chart.draw_series(cells.iter().enumerate().flat_map(|(d, by_length)| {
            by_length.iter().enumerate().map(move |(l, &v)| {
                Rectangle::new(
                    [
                        (l as f64, row(d) as f64),
                        ((l + 1) as f64, (row(d) + 1) as f64),
                    ],
                    color(v).filled(),
                )
            })
        })),
        path,
    )?;
    drawing(
        chart.draw_series(cells.iter().enumerate().flat_map(|(d, by_length)| {
            by_length.iter().enumerate().filter_map(move |(l, v)| {
                v.map(|v| {
                    Text::new(
                        format!("{:.0} %", v * 100.0),
                        (l as f64 + 0.5, row(d) as f64 + 0.5),
                        TextStyle::from((FONT, 15).into_font())
                            .pos(Pos::new(HPos::Center, VPos::Center)),
                    )
                })
            })
        })),
        path,
    )?;
    drawing(root.present(), path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_labels_read_like_llama_bench() {
        assert_eq!(tokens_label(1024), "1K");
        assert_eq!(tokens_label(16384), "16K");
        assert_eq!(tokens_label(1000), "1000");
    }
}
