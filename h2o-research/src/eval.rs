//! Long-context retrieval tasks, generated from a seed, and their scoring: what `h2o-cli eval`
//! runs to show whether a memory-selection policy keeps what a later question asks about.
//!
//! Every task is plain text (no chat markup): an instruction, a haystack with one or more
//! needles at a chosen depth, and a question whose answer the model completes greedily. A
//! prompt is scored correct when the generated text contains every expected value, as
//! needle-in-a-haystack suites (RULER and the passkey test) score them.
//!
//! The tasks:
//! - `passkey`, `number`, `word`: one needle (a 5-digit pass key, a 7-digit number, a word);
//! - `multi-key`: four needles of the same form with different keys; the question names one;
//! - `multi-value`: three values for one key; all three must come back;
//! - `variable-tracking`: a value assigned to a variable, then passed along a chain of three
//!   more assignments spread through the text; the question asks for the last variable;
//! - `kv-lookup`: a long JSON-like list of random key/value pairs; the question names one key.

use std::fmt::Write as _;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use h2o_llama::{Error, Result};
use h2o_llama::{H2oConfig, Session, SessionConfig};
use h2o_llama::{Model, Token};
use h2o_llama::{Sampler, SamplerConfig};

/// A task family of the suite.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Task {
    Passkey,
    Number,
    Word,
    MultiKey,
    MultiValue,
    VariableTracking,
    KvLookup,
}

impl Task {
    pub const ALL: [Task; 7] = [
        Task::Passkey,
        Task::Number,
        Task::Word,
        Task::MultiKey,
        Task::MultiValue,
        Task::VariableTracking,
        Task::KvLookup,
    ];

    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Task::Passkey => "passkey",
            Task::Number => "number",
            Task::Word => "word",
            Task::MultiKey => "multi-key",
            Task::MultiValue => "multi-value",
            Task::VariableTracking => "variable-tracking",
            Task::KvLookup => "kv-lookup",
        }
    }

    /// Tokens to generate for the answer.
    fn n_predict(self) -> usize {
        match self {
            Task::MultiValue => 40,
            Task::KvLookup => 16,
            _ => 12,
        }
    }
}

impl std::fmt::Display for Task {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Task {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Task::ALL
            .into_iter()
            .find(|t| t.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Task::ALL.iter().map(|t| t.name()).collect();
                Error::InvalidConfig(format!(
                    "unknown eval task {s:?}: use one of {}",
                    names.join(", ")
                ))
            })
    }
}

/// One generated prompt and what its answer must contain.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Prompt {
    pub task: Task,
    /// the length asked for, in tokens (the prompt is within a sentence of it)
    pub length: usize,
    /// where the (first) needle sits, as a percentage of the haystack
    pub depth: u32,
    #[serde(skip)]
    pub text: String,
    pub expected: Vec<String>,
}

/// SplitMix64: small, seedable, and the same on every platform.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    #[must_use]
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    fn digits(&mut self, n: u32) -> String {
        let lo = 10u64.pow(n - 1);
        (lo + self.below(9 * lo)).to_string()
    }

    fn hex(&mut self, n: usize) -> String {
        (0..n)
            .map(|_| char::from(b"0123456789abcdef"[self.below(16) as usize]))
            .collect()
    }

    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len() as u64) as usize]
    }
}

const FILLER: [&str; 12] = [
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
    "The river runs past the old mill.",
    "A cart rolls slowly down the lane.",
    "Birds sing in the tall trees.",
    "The baker opens his shop at dawn.",
    "Clouds drift over the quiet hills.",
    "Children play near the village well.",
    "The wind turns the sails of the mill.",
];

const WORDS: [&str; 16] = [
    "lantern", "marble", "harbor", "violet", "cobalt", "thimble", "saffron", "glacier", "meadow",
    "falcon", "quartz", "juniper", "copper", "walnut", "ember", "orchid",
];

const KEYS: [&str; 16] = [
    "apple", "river", "castle", "pencil", "garden", "rocket", "window", "tiger", "mirror",
    "candle", "forest", "bottle", "island", "ladder", "planet", "wagon",
];

const VARS: [&str; 12] = [
    "QXR", "BLM", "TZK", "HWD", "NPV", "GFJ", "YCS", "MRA", "DKE", "WUO", "ZHL", "PBT",
];

const INTRO: &str = "There is important info hidden inside a lot of irrelevant text. Find it \
                     and memorize it. I will quiz you about the important information there.\n";

/// The pieces of a task before the haystack is sized: needles (in order, the first at the
/// chosen depth, the others spread after it), the question, and the expected values.
struct Recipe {
    intro: &'static str,
    needles: Vec<String>,
    question: String,
    expected: Vec<String>,
    /// kv-lookup: the haystack is more key/value pairs instead of filler sentences
    kv_haystack: bool,
}

fn recipe(task: Task, rng: &mut Rng) -> Recipe {
    let plain = |needle: String, question: &str, expected: String| Recipe {
        intro: INTRO,
        needles: vec![needle],
        question: question.to_string(),
        expected: vec![expected],
        kv_haystack: false,
    };
    match task {
        Task::Passkey => {
            let key = rng.digits(5);
            plain(
                format!("The pass key is {key}. Remember it. {key} is the pass key."),
                "What is the pass key?\nThe pass key is",
                key,
            )
        }
        Task::Number => {
            let n = rng.digits(7);
            plain(
                format!("The special magic number is {n}. Remember it."),
                "What is the special magic number?\nThe special magic number is",
                n,
            )
        }
        Task::Word => {
            let w = rng.pick(&WORDS).to_string();
            plain(
                format!("The secret word is {w}. Remember it. {w} is the secret word."),
                "What is the secret word?\nThe secret word is",
                w,
            )
        }
        Task::MultiKey => {
            let mut keys: Vec<&str> = Vec::new();
            while keys.len() < 4 {
                let k = rng.pick(&KEYS);
                if !keys.contains(&k) {
                    keys.push(k);
                }
            }
            let values: Vec<String> = keys.iter().map(|_| rng.digits(7)).collect();
            let asked = rng.below(4) as usize;
            // the asked needle goes first, at the chosen depth; the distractors after it
            let mut order: Vec<usize> = vec![asked];
            order.extend((0..4).filter(|&i| i != asked));
            Recipe {
                intro: INTRO,
                needles: order
                    .iter()
                    .map(|&i| format!("The special magic number for {} is {}.", keys[i], values[i]))
                    .collect(),
                question: format!(
                    "What is the special magic number for {}?\nThe special magic number for {} is",
                    keys[asked], keys[asked]
                ),
                expected: vec![values[asked].clone()],
                kv_haystack: false,
            }
        }
        Task::MultiValue => {
            let key = rng.pick(&KEYS);
            let values: Vec<String> = (0..3).map(|_| rng.digits(7)).collect();
            Recipe {
                intro: INTRO,
                needles: values
                    .iter()
                    .map(|v| format!("One of the special magic numbers for {key} is {v}."))
                    .collect(),
                question: format!(
                    "What are all the special magic numbers for {key}?\nThe special magic numbers for {key} are"
                ),
                expected: values,
                kv_haystack: false,
            }
        }
        Task::VariableTracking => {
            let mut names: Vec<&str> = Vec::new();
            while names.len() < 4 {
                let v = rng.pick(&VARS);
                if !names.contains(&v) {
                    names.push(v);
                }
            }
            let value = rng.digits(5);
            let mut needles = vec![format!("VAR {} = {value}.", names[0])];
            for w in names.windows(2) {
                needles.push(format!("VAR {} = VAR {}.", w[1], w[0]));
            }
            Recipe {
                intro: "Memorize the variable assignments hidden in the text below. I will ask \
                        you about their values.\n",
                needles,
                question: format!(
                    "What is the value of VAR {}?\nThe value of VAR {} is",
                    names[3], names[3]
                ),
                expected: vec![value],
                kv_haystack: false,
            }
        }
        Task::KvLookup => {
            let key = rng.hex(8);
            let value = rng.hex(8);
            Recipe {
                intro: "Below is a JSON object of key-value pairs. Remember them.\n{",
                needles: vec![format!("\"{key}\": \"{value}\",")],
                question: format!(
                    "}}\nWhat is the value of key \"{key}\"?\nThe value of key \"{key}\" is \""
                ),
                expected: vec![value],
                kv_haystack: true,
            }
        }
    }
}

/// Generates the prompt of `task` with about `length` tokens and its first needle at `depth`
/// percent of the haystack. `count` gives the token count of a piece of text (the model's
/// tokenizer; pieces are joined with spaces, so their counts add up to within a few tokens).
///
/// # Errors
/// [`Error::InvalidConfig`] for a depth over 100 or a length too short for the task's own text.
pub fn generate(
    task: Task,
    length: usize,
    depth: u32,
    rng: &mut Rng,
    mut count: impl FnMut(&str) -> Result<usize>,
) -> Result<Prompt> {
    if depth > 100 {
        return Err(Error::InvalidConfig(format!(
            "eval depth {depth} %: depths are 0 ..= 100"
        )));
    }
    let r = recipe(task, rng);
    let fixed = count(r.intro)?
        + count(&r.question)?
        + r.needles.iter().map(|n| count(n)).sum::<Result<usize>>()?;
    if fixed + 16 > length {
        return Err(Error::InvalidConfig(format!(
            "eval length {length}: the {task} task needs at least {} tokens",
            fixed + 16
        )));
    }
    // the haystack: filler sentences (or key/value pairs) until the length is reached
    let mut hay: Vec<String> = Vec::new();
    let mut used = fixed;
    while used < length {
        let piece = if r.kv_haystack {
            format!("\"{}\": \"{}\",", rng.hex(8), rng.hex(8))
        } else {
            rng.pick(&FILLER).to_string()
        };
        used += count(&piece)?;
        if used > length {
            break;
        }
        hay.push(piece);
    }
    // the first needle at the depth; the others spread evenly over what follows it
    let first = (hay.len() * depth as usize) / 100;
    let n_more = r.needles.len() - 1;
    let mut at: Vec<usize> = vec![first];
    for k in 1..=n_more {
        at.push(first + (hay.len() - first) * k / (n_more + 1));
    }
    let mut text = String::from(r.intro);
    let mut needle = 0;
    for (i, piece) in hay.iter().enumerate() {
        while needle < at.len() && at[needle] == i {
            text.push_str(&r.needles[needle]);
            text.push(' ');
            needle += 1;
        }
        text.push_str(piece);
        text.push(' ');
    }
    for n in &r.needles[needle..] {
        text.push_str(n);
        text.push(' ');
    }
    text.push('\n');
    text.push_str(&r.question);
    Ok(Prompt {
        task,
        length,
        depth,
        text,
        expected: r.expected,
    })
}

/// The prompts of a suite: every task × length × depth, `samples` each, from one seed.
///
/// # Errors
/// As [`generate`].
pub fn suite(
    model: &Model,
    tasks: &[Task],
    lengths: &[usize],
    depths: &[u32],
    samples: usize,
    seed: u64,
) -> Result<Vec<Prompt>> {
    let mut rng = Rng::new(seed);
    let mut out = Vec::new();
    for &task in tasks {
        for &length in lengths {
            for &depth in depths {
                for _ in 0..samples {
                    out.push(generate(task, length, depth, &mut rng, |t| {
                        Ok(model.tokenize(t, false, false)?.len())
                    })?);
                }
            }
        }
    }
    Ok(out)
}

/// What one configuration answered to one prompt.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Answer {
    pub text: String,
    pub correct: bool,
    pub prompt_tokens: usize,
    pub prefill_ms: f64,
}

/// Correct when `text` contains every expected value.
#[must_use]
pub fn is_correct(text: &str, expected: &[String]) -> bool {
    expected.iter().all(|e| text.contains(e.as_str()))
}

/// A configuration under test: full attention (`h2o: None`) or an H2O policy.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Contender {
    pub name: String,
    pub h2o: Option<H2oConfig>,
}

/// Runs every prompt through every contender (greedy), one session per contender, reset
/// between prompts. `progress(done, total, contender)` is called after every prompt; setting
/// `interrupt` stops the run at the next `llama_decode` call with [`Error::Interrupted`].
///
/// # Errors
/// Session creation or evaluation failures (a prompt longer than `base.n_ctx`, interrupts).
pub fn run(
    model: &Model,
    base: &SessionConfig,
    contenders: &[Contender],
    prompts: &[Prompt],
    interrupt: Option<&Arc<AtomicBool>>,
    mut progress: impl FnMut(usize, usize, &str),
) -> Result<Vec<Vec<Answer>>> {
    let total = prompts.len() * contenders.len();
    let mut done = 0;
    let mut all = Vec::with_capacity(contenders.len());
    for c in contenders {
        let mut session = Session::new(
            model,
            SessionConfig {
                h2o: c.h2o,
                ..base.clone()
            },
        )?;
        if let Some(flag) = interrupt {
            session.set_interrupt_flag(flag.clone());
        }
        let mut sampler = Sampler::new(&SamplerConfig::greedy())?;
        let mut answers = Vec::with_capacity(prompts.len());
        for p in prompts {
            session.reset();
            sampler.reset();
            let tokens: Vec<Token> = model.tokenize(&p.text, true, false)?;
            let g = session.generate(&tokens, &mut sampler, p.task.n_predict(), |_| true)?;
            answers.push(Answer {
                correct: is_correct(&g.text, &p.expected),
                text: g.text,
                prompt_tokens: tokens.len(),
                prefill_ms: g.timings.prefill.as_secs_f64() * 1e3,
            });
            done += 1;
            progress(done, total, &c.name);
        }
        all.push(answers);
    }
    Ok(all)
}

/// One prompt and every contender's answer to it.
#[derive(Debug, serde::Serialize)]
pub struct Record<'a> {
    pub prompt: &'a Prompt,
    pub answers: Vec<&'a Answer>,
}

/// A run's JSON record (`h2o-cli eval --json`): the contenders, their totals and every answer.
#[derive(Debug, serde::Serialize)]
pub struct Report<'a> {
    pub model: String,
    pub seed: u64,
    pub n_ubatch: u32,
    pub contenders: &'a [Contender],
    /// correct answers per contender, over all prompts
    pub correct: Vec<usize>,
    pub prompts: Vec<Record<'a>>,
}

impl<'a> Report<'a> {
    /// `answers[c][p]` is contender `c`'s answer to prompt `p`, as [`run`] returns them.
    #[must_use]
    pub fn new(
        model: String,
        seed: u64,
        n_ubatch: u32,
        contenders: &'a [Contender],
        prompts: &'a [Prompt],
        answers: &'a [Vec<Answer>],
    ) -> Self {
        Self {
            model,
            seed,
            n_ubatch,
            contenders,
            correct: answers
                .iter()
                .map(|a| score(a, 0..prompts.len()).0)
                .collect(),
            prompts: prompts
                .iter()
                .enumerate()
                .map(|(i, p)| Record {
                    prompt: p,
                    answers: answers.iter().map(|a| &a[i]).collect(),
                })
                .collect(),
        }
    }
}

/// Correct answers out of prompts, for the prompts of `rows`.
#[must_use]
pub fn score(answers: &[Answer], rows: impl IntoIterator<Item = usize>) -> (usize, usize) {
    rows.into_iter().fold((0, 0), |(ok, n), i| {
        (ok + usize::from(answers[i].correct), n + 1)
    })
}

/// Indices of the prompts matching a task (all when `None`), a length and a depth.
pub fn select<'a>(
    prompts: &'a [Prompt],
    task: Option<Task>,
    length: Option<usize>,
    depth: Option<u32>,
) -> impl Iterator<Item = usize> + 'a {
    prompts.iter().enumerate().filter_map(move |(i, p)| {
        (task.is_none_or(|t| t == p.task)
            && length.is_none_or(|l| l == p.length)
            && depth.is_none_or(|d| d == p.depth))
        .then_some(i)
    })
}

/// The markdown table: one row per task (and a total), one column per contender, `ok/n`.
#[must_use]
pub fn markdown(prompts: &[Prompt], contenders: &[Contender], answers: &[Vec<Answer>]) -> String {
    let mut tasks: Vec<Task> = Vec::new();
    for p in prompts {
        if !tasks.contains(&p.task) {
            tasks.push(p.task);
        }
    }
    let mut s = String::from("| task |");
    for c in contenders {
        let _ = write!(s, " {} |", c.name);
    }
    s.push_str("\n|---|");
    s.push_str(&"---:|".repeat(contenders.len()));
    s.push('\n');
    let mut row = |label: &str, rows: Vec<usize>| {
        let _ = write!(s, "| {label} |");
        for a in answers {
            let (ok, n) = score(a, rows.iter().copied());
            let _ = write!(s, " {ok}/{n} |");
        }
        s.push('\n');
    };
    for &t in &tasks {
        row(t.name(), select(prompts, Some(t), None, None).collect());
    }
    row("**all**", (0..prompts.len()).collect());
    s
}

/// Accuracy per (depth, length) cell of one contender, for a heatmap: `cells[d][l]` is
/// `Some(fraction correct)` over `depths[d]` × `lengths[l]`, `None` where no prompt was run.
#[must_use]
pub fn grid(
    prompts: &[Prompt],
    answers: &[Answer],
    depths: &[u32],
    lengths: &[usize],
) -> Vec<Vec<Option<f64>>> {
    depths
        .iter()
        .map(|&d| {
            lengths
                .iter()
                .map(|&l| {
                    let (ok, n) = score(answers, select(prompts, None, Some(l), Some(d)));
                    (n > 0).then(|| ok as f64 / n as f64)
                })
                .collect()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(t: &str) -> Result<usize> {
        Ok(t.split_whitespace().count())
    }

    #[test]
    fn same_seed_same_prompts() {
        for task in Task::ALL {
            let a = generate(task, 300, 50, &mut Rng::new(7), words).unwrap();
            let b = generate(task, 300, 50, &mut Rng::new(7), words).unwrap();
            assert_eq!(a.text, b.text);
            assert_eq!(a.expected, b.expected);
        }
    }

    #[test]
    fn prompts_hold_their_needles_at_the_depth_and_fit_the_length() {
        for task in Task::ALL {
            for depth in [0, 50, 100] {
                let p = generate(task, 400, depth, &mut Rng::new(u64::from(depth)), words).unwrap();
                let n = words(&p.text).unwrap();
                assert!((360..=400).contains(&n), "{task} {depth}: {n} words");
                for e in &p.expected {
                    assert!(p.text.contains(e.as_str()), "{task}: {e} not in the prompt");
                }
                // the first expected value's needle sits near the depth asked for
                let at = p.text.find(p.expected[0].as_str()).unwrap() as f64 / p.text.len() as f64;
                if task != Task::VariableTracking {
                    assert!(
                        (at - f64::from(depth) / 100.0).abs() < 0.15,
                        "{task} depth {depth}: needle at {at:.2}"
                    );
                }
            }
        }
    }

    #[test]
    fn scoring_needs_every_value() {
        let e = vec!["123".to_string(), "456".to_string()];
        assert!(is_correct(" 123, 456 and", &e));
        assert!(!is_correct(" 123 only", &e));
    }

    #[test]
    fn bad_depth_and_short_length_are_refused() {
        assert!(generate(Task::Passkey, 400, 101, &mut Rng::new(1), words).is_err());
        assert!(generate(Task::Passkey, 20, 50, &mut Rng::new(1), words).is_err());
        assert!("needle".parse::<Task>().is_err());
    }
}
