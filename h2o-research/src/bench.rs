//! Benchmark bookkeeping shared by the front ends: interleaved runs of a baseline and H2O,
//! medians and ranges, peak memory, and the markdown table `h2o-cli bench` prints.
//!
//! How one run is measured (a fresh process, a session in this one, an HTTP request) is the
//! caller's: [`interleaved`] only decides the order and collects the figures. Engines alternate
//! for every repetition and prompt length, so that a machine that slows down during the run
//! slows both alike; medians absorb the rest of the noise.

use h2o_llama::H2oConfig;

/// The two engines a benchmark compares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Engine {
    /// Stock llama.cpp, or full attention in this build.
    Baseline,
    H2o,
}

impl Engine {
    pub fn label(self) -> &'static str {
        match self {
            Engine::Baseline => "baseline",
            Engine::H2o => "H2O",
        }
    }
}

/// What one run measured.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Measurement {
    pub tokens_per_second: f64,
    pub prefill_ms: f64,
    /// the run's peak resident memory, where the platform reports it
    pub peak_rss_bytes: Option<u64>,
    pub h2o_state_bytes: u64,
    pub kv_cache_bytes: u64,
}

/// One engine at one prompt length: every repetition's figures.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Series {
    pub tokens_per_second: Vec<f64>,
    pub prefill_ms: Vec<f64>,
    pub peak_rss_bytes: Vec<u64>,
    pub h2o_state_bytes: u64,
    pub kv_cache_bytes: u64,
}

impl Series {
    pub fn add(&mut self, m: &Measurement) {
        self.tokens_per_second.push(m.tokens_per_second);
        self.prefill_ms.push(m.prefill_ms);
        self.peak_rss_bytes.extend(m.peak_rss_bytes);
        self.h2o_state_bytes = m.h2o_state_bytes;
        self.kv_cache_bytes = m.kv_cache_bytes;
    }

    /// Median peak resident memory in MiB, `None` if no run reported one.
    pub fn peak_rss_mib(&self) -> Option<f64> {
        let f: Vec<f64> = self.peak_rss_bytes.iter().map(|&b| mib(b)).collect();
        (!f.is_empty()).then(|| median(&f))
    }
}

/// One prompt length to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Point {
    pub n_prompt: u32,
    /// the logical batch (`-b`) used at this length
    pub n_batch: u32,
}

/// One run of [`interleaved`]'s schedule, handed to the measuring closure.
#[derive(Clone, Copy, Debug)]
pub struct Run {
    pub point: Point,
    pub engine: Engine,
    /// 1-based repetition of this engine at this length
    pub repetition: u32,
    /// 0-based index of this run among all runs, out of `total`
    pub index: usize,
    pub total: usize,
}

/// Both engines at one prompt length.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Row {
    pub n_prompt: u32,
    pub n_batch: u32,
    pub baseline: Series,
    pub h2o: Series,
    /// median H2O tok/s over median baseline tok/s
    pub speedup: f64,
}

/// Measures every point `repetitions` times per engine, baseline and H2O alternating, and
/// returns one row per point. The first error stops the schedule and is returned.
pub fn interleaved<E>(
    points: &[Point],
    repetitions: u32,
    mut measure: impl FnMut(&Run) -> Result<Measurement, E>,
) -> Result<Vec<Row>, E> {
    let total = points.len() * repetitions as usize * 2;
    let mut index = 0;
    let mut rows = Vec::with_capacity(points.len());
    for &point in points {
        let mut baseline = Series::default();
        let mut h2o = Series::default();
        for repetition in 1..=repetitions {
            for engine in [Engine::Baseline, Engine::H2o] {
                let m = measure(&Run {
                    point,
                    engine,
                    repetition,
                    index,
                    total,
                })?;
                match engine {
                    Engine::Baseline => baseline.add(&m),
                    Engine::H2o => h2o.add(&m),
                }
                index += 1;
            }
        }
        let speedup = median(&h2o.tokens_per_second) / median(&baseline.tokens_per_second);
        rows.push(Row {
            n_prompt: point.n_prompt,
            n_batch: point.n_batch,
            baseline,
            h2o,
            speedup,
        });
    }
    Ok(rows)
}

/// A whole benchmark: what ran, and its rows.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Report {
    pub model: String,
    pub baseline: String,
    /// "stock" or "full attention", for column headers
    pub baseline_short: &'static str,
    pub threads: u32,
    pub n_gpu_layers: i32,
    pub n_ubatch: u32,
    /// `-ctk` / `-ctv` of both engines (llama.cpp's names)
    pub cache_type_k: &'static str,
    pub cache_type_v: &'static str,
    pub h2o_local: u32,
    pub h2o_heavy: u32,
    pub h2o: H2oConfig,
    pub repetitions: u32,
    pub rows: Vec<Row>,
}

impl Report {
    /// The table `h2o-cli bench` prints: tok/s as median (min–max), peaks, state sizes.
    pub fn markdown(&self) -> String {
        let mut s = format!(
            "model: {} | baseline: {} | -t {} -ngl {} -ub {} -ctk {} -ctv {} | H2O L = {} H = {} \
             | {} repetitions, tok/s as median (min–max)\n\n",
            self.model,
            self.baseline,
            self.threads,
            self.n_gpu_layers,
            self.n_ubatch,
            self.cache_type_k,
            self.cache_type_v,
            self.h2o_local,
            self.h2o_heavy,
            self.repetitions
        );
        let b = self.baseline_short;
        s.push_str(&format!(
            "| N | -b | {b} tok/s | H2O tok/s | H2O / {b} | {b} peak MiB | H2O peak MiB \
             | H2O state MiB | K+V cache MiB |\n|---:|---:|---|---|---:|---:|---:|---:|---:|\n"
        ));
        let peak = |s: &Series| s.peak_rss_mib().map_or("–".into(), |m| format!("{m:.0}"));
        for row in &self.rows {
            s.push_str(&format!(
                "| {} | {} | {} | {} | {:.2}× | {} | {} | {:.2} | {:.1} |\n",
                row.n_prompt,
                row.n_batch,
                Spread::of(&row.baseline.tokens_per_second),
                Spread::of(&row.h2o.tokens_per_second),
                row.speedup,
                peak(&row.baseline),
                peak(&row.h2o),
                mib(row.h2o.h2o_state_bytes),
                mib(row.h2o.kv_cache_bytes),
            ));
        }
        s
    }

    /// Draws prefill tok/s against N for both engines into a PNG.
    #[cfg(feature = "charts")]
    pub fn draw(&self, png: &std::path::Path) -> crate::chart::Result<()> {
        let points: Vec<crate::chart::ThroughputPoint> = self
            .rows
            .iter()
            .map(|row| crate::chart::ThroughputPoint {
                n_prompt: row.n_prompt,
                baseline: Spread::of(&row.baseline.tokens_per_second),
                h2o: Spread::of(&row.h2o.tokens_per_second),
            })
            .collect();
        let model = std::path::Path::new(&self.model)
            .file_stem()
            .map_or_else(|| self.model.clone(), |f| f.to_string_lossy().into_owned());
        let title = format!(
            "prefill: {model}, -t {} -ub {}, L={} H={} {}, {} runs (median, min–max)",
            self.threads,
            self.n_ubatch,
            self.h2o_local,
            self.h2o_heavy,
            self.h2o.select,
            self.repetitions
        );
        crate::chart::throughput(png, &title, self.baseline_short, &points)
    }
}

/// Median and range of one engine's repetitions.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    pub fn of(v: &[f64]) -> Spread {
        Spread {
            median: median(v),
            min: v.iter().copied().fold(f64::INFINITY, f64::min),
            max: v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        }
    }
}

impl std::fmt::Display for Spread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:.1} ({:.1}–{:.1})", self.median, self.min, self.max)
    }
}

/// The median of `v` (the mean of the middle two for an even count; NaN when empty).
pub fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let m = s.len() / 2;
    if s.len() % 2 == 1 {
        s[m]
    } else {
        (s[m - 1] + s[m]) / 2.0
    }
}

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_and_spreads() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
        let s = Spread::of(&[2.0, 5.0, 1.0]);
        assert_eq!((s.median, s.min, s.max), (2.0, 1.0, 5.0));
        assert_eq!(s.to_string(), "2.0 (1.0–5.0)");
    }

    #[test]
    fn engines_alternate_in_every_repetition_and_rows_keep_their_own_figures() {
        let points = [
            Point {
                n_prompt: 100,
                n_batch: 100,
            },
            Point {
                n_prompt: 200,
                n_batch: 128,
            },
        ];
        let mut order = Vec::new();
        let rows = interleaved(&points, 2, |run| {
            order.push((run.point.n_prompt, run.engine, run.repetition, run.index));
            assert_eq!(run.total, 8);
            let base = f64::from(run.point.n_prompt);
            Ok::<_, ()>(Measurement {
                tokens_per_second: match run.engine {
                    Engine::Baseline => base,
                    Engine::H2o => 2.0 * base + f64::from(run.repetition),
                },
                peak_rss_bytes: (run.engine == Engine::H2o).then_some(1 << 20),
                ..Measurement::default()
            })
        })
        .unwrap();
        let engines: Vec<Engine> = order.iter().map(|o| o.1).collect();
        assert_eq!(
            engines,
            [Engine::Baseline, Engine::H2o].repeat(4),
            "baseline and H2O alternate"
        );
        assert_eq!(
            order.iter().map(|o| o.3).collect::<Vec<_>>(),
            (0..8).collect::<Vec<_>>()
        );
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[1].n_batch, 128);
        assert_eq!(rows[1].h2o.tokens_per_second, [401.0, 402.0]);
        assert_eq!(rows[1].speedup, 401.5 / 200.0);
        assert_eq!(rows[0].baseline.peak_rss_mib(), None);
        assert_eq!(rows[0].h2o.peak_rss_mib(), Some(1.0));
    }

    #[test]
    fn the_first_error_stops_the_schedule() {
        let points = [Point {
            n_prompt: 10,
            n_batch: 10,
        }];
        let mut runs = 0;
        let r = interleaved(&points, 3, |run| {
            runs += 1;
            if run.engine == Engine::H2o {
                Err("h2o failed")
            } else {
                Ok(Measurement::default())
            }
        });
        assert_eq!(r.unwrap_err(), "h2o failed");
        assert_eq!(runs, 2);
    }
}
