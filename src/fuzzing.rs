//! Entry points for the fuzz targets (`fuzz/`) and the replay of their corpus in the tests
//! (`tests/fuzz_corpus.rs`): the parsers that read bytes from outside, without a model.

/// Reads `bytes` as a saved state the way a load does before anything reaches llama.cpp: the
/// checked header (`state_file`), then behind it a session file's header and a server slot
/// file's header, for a context of `n_ctx` tokens. Returns what each reader said (the token
/// count it found, or why it refused). It must never panic, hang, or allocate more than the
/// bytes it is given warrant.
pub fn saved_state(bytes: &[u8], n_ctx: u32) -> [Result<usize, String>; 2] {
    crate::session::parse_saved_state(bytes, n_ctx)
}

/// A small deterministic generator (xorshift64), so that a fuzz case is replayed from its seed.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        let mut rng = Rng(seed | 1);
        for _ in 0..4 {
            rng.next_u64();
        }
        rng
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A number in `0..n` (`n` > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// The size of a fuzz run that runs as a test: `H2O_FUZZ_CASES` cases (else `default_cases`),
/// from `H2O_FUZZ_SEED`; `H2O_FUZZ_FINDINGS` names a folder for the cases that fail.
pub struct Budget {
    pub cases: u64,
    pub seed: u64,
}

impl Budget {
    pub fn from_env(default_cases: u64) -> Self {
        let var = |name: &str| std::env::var(name).ok().and_then(|v| v.parse().ok());
        Budget {
            cases: var("H2O_FUZZ_CASES").unwrap_or(default_cases),
            seed: var("H2O_FUZZ_SEED").unwrap_or(0x5eed),
        }
    }

    /// The seed of case `i`.
    pub fn case_seed(&self, i: u64) -> u64 {
        self.seed
            .wrapping_mul(0x9e37_79b9_7f4a_7c15)
            .wrapping_add(i)
    }

    /// Writes each failing case (its bytes, as the corpus keeps it) into `H2O_FUZZ_FINDINGS`,
    /// when that is set, as `NAME-SEED-I.txt`.
    pub fn keep_findings<'a>(&self, name: &str, cases: impl IntoIterator<Item = &'a [u8]>) {
        if let Ok(dir) = std::env::var("H2O_FUZZ_FINDINGS") {
            for (i, case) in cases.into_iter().enumerate() {
                let _ = std::fs::write(format!("{dir}/{name}-{}-{i}.txt", self.seed), case);
            }
        }
    }
}

/// The cases kept in `dir` (a corpus of findings), each file's bytes; none when there is no
/// such folder.
pub fn kept_cases(dir: &std::path::Path) -> Vec<Vec<u8>> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut paths: Vec<_> = entries.flatten().map(|e| e.path()).collect();
    paths.sort();
    paths.iter().filter_map(|p| std::fs::read(p).ok()).collect()
}
