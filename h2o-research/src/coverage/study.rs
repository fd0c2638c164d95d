//! What the study programs kept with their records (`docs/results/coverage/*/*.rs`, built as
//! examples of this crate) share: their command line and capture, and the kernel's stage-1
//! proposal in plain Rust (the key sketch, the sampled queries' attention over it, the best
//! positions of a score).

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use h2o_llama::{default_model, models, Error, Model, ModelParams, Result};

use super::{capture_dense, DenseLayer};

pub use super::attention::dot;

/// A study's command line: `TEXT N LAYERS|all [MODEL]`.
#[derive(Debug, Clone, PartialEq)]
pub struct StudyArgs {
    pub text: PathBuf,
    /// Tokens of the text to capture.
    pub n: usize,
    /// The layers to capture, as given (`all`: every layer with an H2O op).
    pub layers: String,
    /// A known model's name or a GGUF file; the default model without it.
    pub model: Option<String>,
}

impl StudyArgs {
    /// Parses the arguments after the program's name.
    ///
    /// # Errors
    /// Not three or four arguments, or N not a number; the message gives `program`'s usage.
    pub fn parse(program: &str, args: &[String]) -> Result<Self> {
        let usage = || Error::InvalidConfig(format!("usage: {program} TEXT N LAYERS|all [MODEL]"));
        let (text, n, layers, model) = match args {
            [t, n, l] => (t, n, l, None),
            [t, n, l, m] => (t, n, l, Some(m.clone())),
            _ => return Err(usage()),
        };
        Ok(Self {
            text: PathBuf::from(text),
            n: n.parse().map_err(|_| usage())?,
            layers: layers.clone(),
            model,
        })
    }

    /// The layers asked for (`None`: all).
    ///
    /// # Errors
    /// A layer that is not a number.
    pub fn wanted(&self) -> Result<Option<Vec<u32>>> {
        if self.layers == "all" {
            return Ok(None);
        }
        self.layers
            .split(',')
            .map(|l| {
                l.parse().map_err(|_| {
                    Error::InvalidConfig(format!(
                        "layer {l:?}: give numbers separated by commas, or all"
                    ))
                })
            })
            .collect::<Result<Vec<u32>>>()
            .map(Some)
    }
}

/// The full-attention prefill a study reads.
pub struct Captured {
    /// The model file's name.
    pub model_file: String,
    pub layers: Vec<DenseLayer>,
    /// When the capture started, for the program's progress lines.
    pub clock: Instant,
}

/// Loads the model, tokenizes the first `args.n` tokens of the text and captures the layers asked
/// for from a full-attention prefill, with progress on stderr under `program`'s name.
///
/// # Errors
/// The model cannot be had or loaded, the text cannot be read or is shorter than N tokens, or the
/// capture failed.
pub fn capture(program: &str, args: &StudyArgs) -> Result<Captured> {
    let log = |m: &str| eprintln!("{m}");
    let path = match &args.model {
        Some(m) => models::resolve(Path::new(m), log, &AtomicBool::new(false))?,
        None => default_model::ensure(log)?,
    };
    let model = Model::load(&path, &ModelParams::default())?;
    let text = std::fs::read_to_string(&args.text)
        .map_err(|e| Error::InvalidConfig(format!("{}: {e}", args.text.display())))?;
    let mut tokens = model.tokenize(&text, true, false)?;
    if tokens.len() < args.n {
        return Err(Error::InvalidConfig(format!(
            "{} has {} tokens, fewer than {}",
            args.text.display(),
            tokens.len(),
            args.n
        )));
    }
    tokens.truncate(args.n);
    let clock = Instant::now();
    eprintln!(
        "{program}: full-attention prefill of {} tokens, capturing {}",
        args.n, args.layers
    );
    let layers = capture_dense(&model, &tokens, args.wanted()?.as_deref(), 2)?;
    eprintln!(
        "{program}: captured in {:.0} s",
        clock.elapsed().as_secs_f64()
    );
    Ok(Captured {
        model_file: path
            .file_name()
            .map_or_else(String::new, |f| f.to_string_lossy().into_owned()),
        layers,
        clock,
    })
}

/// The `n` positions of `among` with the largest `score`, best first, ties to the lower position.
#[must_use]
pub fn top(score: &[f32], among: &[usize], n: usize) -> Vec<usize> {
    let mut v: Vec<usize> = among.to_vec();
    v.sort_by(|&x, &y| score[y].total_cmp(&score[x]).then(x.cmp(&y)));
    v.truncate(n);
    v
}

/// Head `h`'s key channels by their energy (sum of squares) over the positions `[0, end)`, most
/// first, ties to the lower channel.
#[must_use]
pub fn energy_order(layer: &DenseLayer, h: usize, end: usize) -> Vec<usize> {
    let d = layer.head_dim;
    let mut energy = vec![0f64; d];
    for j in 0..end {
        for (e, &x) in energy.iter_mut().zip(layer.k_row(j, h)) {
            *e += f64::from(x) * f64::from(x);
        }
    }
    let mut chan: Vec<usize> = (0..d).collect();
    chan.sort_by(|&a, &b| energy[b].total_cmp(&energy[a]).then(a.cmp(&b)));
    chan
}

/// How many channels the kernel's key sketch keeps of `head_dim`: a quarter, half for heads wider
/// than 128.
#[must_use]
pub fn sketch_width(head_dim: usize) -> usize {
    head_dim / if head_dim > 128 { 2 } else { 4 }
}

/// The kernel's key sketch for head `h`'s KV head at the chunk `[start, end)`: its channels (the
/// [`sketch_width`] with the most key energy up to the chunk's end, ascending), and the keys of
/// `[0, start)` in those channels, `start × channels` values.
#[must_use]
pub fn sketch(layer: &DenseLayer, h: usize, start: usize, end: usize) -> (Vec<usize>, Vec<f32>) {
    let mut chan = energy_order(layer, h, end);
    chan.truncate(sketch_width(layer.head_dim));
    chan.sort_unstable();
    let mut keys = Vec::with_capacity(start * chan.len());
    for j in 0..start {
        let k = layer.k_row(j, h);
        keys.extend(chan.iter().map(|&c| k[c]));
    }
    (chan, keys)
}

/// The kernel's proposal from `queries` (positions) of head `h`: each one's logits on the sketch
/// (`chan`, `keys` from [`sketch`]) for the positions `among`, a softmax over those, summed over
/// the queries; indexed by position, `start` of them.
#[must_use]
pub fn sketch_proposal(
    layer: &DenseLayer,
    h: usize,
    queries: &[usize],
    chan: &[usize],
    keys: &[f32],
    among: &[usize],
    start: usize,
) -> Vec<f32> {
    let r = chan.len();
    let mut mass = vec![0f32; start];
    let mut logits = vec![0f32; among.len()];
    for &i in queries {
        let q = layer.q_row(i, h);
        let qs: Vec<f32> = chan.iter().map(|&c| q[c] * layer.scale).collect();
        for (l, &j) in logits.iter_mut().zip(among) {
            *l = dot(&qs, &keys[j * r..(j + 1) * r]);
        }
        let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut z = 0f64;
        for l in &mut logits {
            *l = (*l - m).exp();
            z += f64::from(*l);
        }
        let inv = (1.0 / z) as f32;
        for (&e, &j) in logits.iter().zip(among) {
            mass[j] += e * inv;
        }
    }
    mass
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny layer of one head: 8 channels, position j's key `j + 1` in channel `j % 8`, plus 3
    /// in channel 5 everywhere, so that channel 5 holds the most energy.
    fn layer(n: usize) -> DenseLayer {
        let d = 8;
        let mut k = vec![0f32; n * d];
        for j in 0..n {
            k[j * d + j % d] = (j + 1) as f32;
            k[j * d + 5] += 3.0;
        }
        let q = (0..n * d).map(|x| (x % 5) as f32 - 2.0).collect();
        DenseLayer {
            layer: 0,
            n_pos: n,
            n_head: 1,
            n_head_kv: 1,
            head_dim: d,
            head_dim_v: d,
            scale: 0.5,
            q,
            k: k.clone(),
            v: k,
        }
    }

    #[test]
    fn the_command_line_names_the_usage_when_it_is_wrong() {
        let a = |v: &[&str]| v.iter().map(|s| (*s).to_string()).collect::<Vec<_>>();
        let ok = StudyArgs::parse("p", &a(&["t.txt", "8192", "2,8", "gemma3-270m"])).unwrap();
        assert_eq!(ok.n, 8192);
        assert_eq!(ok.wanted().unwrap(), Some(vec![2, 8]));
        assert_eq!(ok.model.as_deref(), Some("gemma3-270m"));
        assert_eq!(
            StudyArgs::parse("p", &a(&["t", "1", "all"]))
                .unwrap()
                .wanted()
                .unwrap(),
            None
        );
        for bad in [a(&["t", "1"]), a(&["t", "many", "all"])] {
            let e = StudyArgs::parse("p", &bad).unwrap_err().to_string();
            assert!(e.contains("usage: p TEXT N LAYERS|all [MODEL]"), "{e}");
        }
        let e = StudyArgs::parse("p", &a(&["t", "1", "2,x"]))
            .unwrap()
            .wanted()
            .unwrap_err();
        assert!(e.to_string().contains("layer \"x\""), "{e}");
    }

    #[test]
    fn top_takes_the_highest_ties_to_the_lower_position() {
        let score = [0.5, 2.0, 0.5, 1.0, 2.0];
        assert_eq!(top(&score, &[0, 1, 2, 3, 4], 3), vec![1, 4, 3]);
        assert_eq!(top(&score, &[0, 2, 3], 2), vec![3, 0]);
        assert_eq!(top(&score, &[2, 0], 5), vec![0, 2]);
    }

    #[test]
    fn the_sketch_keeps_the_channels_of_most_energy() {
        let l = layer(16);
        let order = energy_order(&l, 0, 16);
        // channel 5: 16 × 9 plus its own positions; then the channels holding 15 and 16
        assert_eq!(order[..3], [5, 7, 6]);
        assert_eq!(sketch_width(64), 16);
        assert_eq!(sketch_width(256), 128);
        let (chan, keys) = sketch(&l, 0, 4, 16);
        assert_eq!(chan, vec![5, 7]);
        assert_eq!(keys, vec![3.0, 0.0, 3.0, 0.0, 3.0, 0.0, 3.0, 0.0]);
    }

    #[test]
    fn the_proposal_sums_each_querys_softmax_over_the_positions_given() {
        let l = layer(16);
        let (chan, keys) = sketch(&l, 0, 12, 16);
        let among = [1, 3, 7, 9];
        let mass = sketch_proposal(&l, 0, &[12, 13, 15], &chan, &keys, &among, 12);
        assert_eq!(mass.len(), 12);
        let total: f32 = mass.iter().sum();
        assert!(
            (total - 3.0).abs() < 1e-5,
            "three queries' softmaxes: {total}"
        );
        for (j, &m) in mass.iter().enumerate() {
            assert_eq!(m > 0.0, among.contains(&j), "position {j}: {m}");
        }
        // by hand for one query: its logits on channels 5 and 7 of the keys among
        let one = sketch_proposal(&l, 0, &[12], &chan, &keys, &among, 12);
        let q = l.q_row(12, 0);
        let logit = |j: usize| 0.5 * (q[5] * l.k_row(j, 0)[5] + q[7] * l.k_row(j, 0)[7]);
        let z: f32 = among.iter().map(|&j| logit(j).exp()).sum();
        for &j in &among {
            assert!((one[j] - logit(j).exp() / z).abs() < 1e-5, "position {j}");
        }
    }
}
