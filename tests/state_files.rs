//! Saved states never lose or silently corrupt a conversation (`src/session/state_file.rs`), on a
//! real state of the default model with H2O on:
//! - one byte flipped at 1,000 positions spread over the file (our header, llama.cpp's header and
//!   tokens, the K/V cells, the H2O scores and memory sets at its end): every load is refused,
//!   none used, and the session that was asked to load keeps what it held;
//! - the file cut at 100 lengths: every load refused as "truncated";
//! - a process stopped at random points while it saves again and again, the file looked at while
//!   it stands still (as a kill at that point leaves it), and killed (SIGKILL) at every fifth: the
//!   file on disk is always one of the two states it alternates between, each loading to its own
//!   logits;
//! - a save that runs out of room (RLIMIT_FSIZE): an error that says so, the old file as it was,
//!   no temporary file left.
//!
//! The killed and the size-limited savers are this test binary again, started as a child
//! process that runs an ignored test (`H2O_STATE_CHILD` says which).
#![cfg(all(unix, not(feature = "stock")))]

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use h2o_llama::{Error, H2oConfig, Integrity, Session, SessionConfig, Token};

fn config() -> SessionConfig {
    SessionConfig {
        n_ctx: 1024,
        n_batch: 512,
        n_ubatch: 128,
        n_threads: 2,
        h2o: Some(H2oConfig::new(32, 32)),
        ..SessionConfig::default()
    }
}

fn prompt(n: usize) -> Vec<Token> {
    let tokens = common::model()
        .tokenize(&h2o_llama::demo::prompt(80), true, true)
        .unwrap();
    assert!(tokens.len() >= n, "demo prompt too short: {}", tokens.len());
    tokens[..n].to_vec()
}

/// A session that evaluated the first `n` tokens of the prompt.
fn session_after(n: usize) -> Session<'static> {
    let mut s = Session::new(common::model(), config()).unwrap();
    s.evaluate(&prompt(n)).unwrap();
    s
}

/// The logits after one more token, the proof that a loaded state is the one saved.
fn next_logits(s: &mut Session<'_>) -> Vec<f32> {
    s.evaluate(&[42]).unwrap();
    s.logits().unwrap().to_vec()
}

/// A session holding something else, into which the damaged files are loaded; what it holds is
/// checked after every refusal.
struct Bystander {
    session: Session<'static>,
    tokens: Vec<Token>,
}

impl Bystander {
    fn new() -> Self {
        let session = session_after(100);
        let tokens = session.tokens().to_vec();
        Bystander { session, tokens }
    }

    /// Loads `path`, which must be refused naming it and `needle`, with the session unchanged;
    /// returns the reason given.
    fn refuses(&mut self, path: &Path, needle: &str, what: &str) -> String {
        let named = format!("{}: ", path.display());
        let reason = match self.session.load_state(path) {
            Err(e @ Error::StateLoad { .. }) => {
                let msg = e.to_string();
                assert!(msg.contains(needle), "{what}: {msg}");
                assert!(
                    msg.contains(&named),
                    "{what}: the message does not name the file: {msg}"
                );
                assert!(msg.contains("the session is unchanged"), "{what}: {msg}");
                msg[msg.find(&named).unwrap() + named.len()..].to_string()
            }
            Ok(integrity) => panic!("{what}: a damaged file was loaded ({integrity:?})"),
            Err(e) => panic!("{what}: {e}"),
        };
        assert_eq!(self.session.tokens(), self.tokens.as_slice(), "{what}");
        assert_eq!(self.session.n_past() as usize, self.tokens.len(), "{what}");
        reason
    }

    /// The session continues as a fresh one holding the same tokens: nothing of the refused
    /// files reached it.
    fn still_intact(mut self) {
        let got = next_logits(&mut self.session);
        let mut fresh = session_after(100);
        assert_eq!(
            got,
            next_logits(&mut fresh),
            "the bystander's cache changed"
        );
    }
}

#[test]
fn a_damaged_state_file_is_never_loaded() {
    let _engine = common::one_engine_at_a_time();
    let dir = common::scratch("state-flips");
    let path = dir.join("good.state");
    session_after(300).save_state(&path).unwrap();
    let good = std::fs::read(&path).unwrap();
    let n = good.len();
    // our header and llama.cpp's header byte by byte, 100 bytes over the tokens, then evenly
    // over the rest, and more densely over the last 5 % (the H2O scores and memory sets follow
    // the K/V cells)
    let tokens_end = 32 + 12 + 4 * 300;
    let mut positions = std::collections::BTreeSet::new();
    positions.extend(0..44);
    positions.extend((0..100).map(|i| 44 + i * (tokens_end - 44) / 100));
    positions.extend((0..448).map(|i| tokens_end + i * (n - tokens_end) / 448));
    let tail = n - n / 20;
    let mut i = 0;
    while positions.len() < 1000 {
        positions.insert(tail + i * (n - tail) / 450);
        i += 1;
    }
    let positions: Vec<usize> = positions.into_iter().collect();
    assert_eq!(positions.len(), 1000);
    assert!(*positions.last().unwrap() < n);

    let damaged = dir.join("damaged.state");
    let mut bystander = Bystander::new();
    let mut reasons = std::collections::BTreeMap::<String, usize>::new();
    for &at in &positions {
        let mut bytes = good.clone();
        bytes[at] ^= 0xff;
        std::fs::write(&damaged, &bytes).unwrap();
        // a flip in the magic leaves no header of ours: the rest is then not a session state
        let needle = if at < 8 {
            "not a llama.cpp session state"
        } else {
            "damaged"
        };
        let reason = bystander.refuses(&damaged, needle, &format!("byte {at} of {n}"));
        let kind: String = reason
            .chars()
            .take_while(|&c| c != '(' && c != ',')
            .collect();
        *reasons.entry(kind.trim().to_string()).or_default() += 1;
    }
    eprintln!("1,000 flips over a {n}-byte state, all refused: {reasons:?}");
    bystander.still_intact();
}

#[test]
fn a_cut_state_file_is_refused_as_truncated() {
    let _engine = common::one_engine_at_a_time();
    let dir = common::scratch("state-cuts");
    let path = dir.join("good.state");
    session_after(300).save_state(&path).unwrap();
    let good = std::fs::read(&path).unwrap();
    let n = good.len();
    let cut = dir.join("cut.state");
    let mut bystander = Bystander::new();
    for i in 0..100 {
        let len = i * n / 100 + i % 7;
        std::fs::write(&cut, &good[..len]).unwrap();
        let needle = if len >= 32 {
            format!("truncated ({len} of {n} bytes)")
        } else {
            "truncated (".to_string()
        };
        bystander.refuses(&cut, &needle, &format!("cut to {len} of {n} bytes"));
    }
    bystander.still_intact();
}

/// What the child savers do, by `H2O_STATE_CHILD`: `alternate DIR` saves the states after 600
/// and after 700 tokens to DIR/state in turn until it is killed, printing "saving" before each;
/// `limited DIR` saves once to DIR/state (under the parent's RLIMIT_FSIZE) and prints the error.
#[test]
#[ignore = "a child process of the kill and disk-full tests"]
fn state_file_child() {
    let _engine = common::one_engine_at_a_time();
    let Ok(job) = std::env::var("H2O_STATE_CHILD") else {
        return;
    };
    let (what, dir) = job.split_once(' ').expect("H2O_STATE_CHILD is 'WHAT DIR'");
    let path = PathBuf::from(dir).join("state");
    match what {
        "alternate" => {
            let mut a = session_after(600);
            let mut b = session_after(700);
            for turn in 0usize.. {
                println!("saving {turn}");
                let s = if turn % 2 == 0 { &mut a } else { &mut b };
                s.save_state(&path).unwrap();
            }
        }
        "limited" => match session_after(700).save_state(&path) {
            Ok(()) => println!("saved"),
            Err(e) => println!("error: {e}"),
        },
        other => panic!("unknown child job {other}"),
    }
}

fn child(job: &str, dir: &Path) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        "state_file_child",
        "--ignored",
        "--nocapture",
        "--test-threads",
        "1",
    ])
    .env("H2O_STATE_CHILD", format!("{job} {}", dir.display()))
    .stdout(Stdio::piped())
    .stderr(Stdio::null());
    cmd
}

/// The temporary files in `dir` (saves in progress, or killed).
fn temporaries(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .ends_with(".tmp")
        })
        .count()
}

#[test]
fn a_save_killed_at_any_point_leaves_the_old_state_or_the_new_one() {
    let _engine = common::one_engine_at_a_time();
    let dir = common::scratch("state-kills");
    let path = dir.join("state");
    // what each of the two states continues with
    let want = [600, 700].map(|n| (prompt(n), next_logits(&mut session_after(n))));

    let mut rng = 0x2545f4914f6cdd1du64;
    let mut random = |below: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % below
    };
    let (mut kills, mut mid_save, mut seen) = (0, 0, [0, 0]);
    for round in 0..4 {
        let mut saver = child("alternate", &dir).spawn().unwrap();
        let mut lines = BufReader::new(saver.stdout.take().unwrap()).lines();
        // from its second save on, every point of a save is a place to be killed
        let mut saves = 0;
        let start = Instant::now();
        while saves < 2 {
            let line = lines.next().expect("the saver ended").unwrap();
            if line.starts_with("saving") {
                saves += 1;
            }
            assert!(
                start.elapsed() < Duration::from_secs(300),
                "the saver hangs"
            );
        }
        for _ in 0..5 {
            // a save of this state takes some tens of ms: kill anywhere within a few of them
            std::thread::sleep(Duration::from_micros(random(150_000)));
            let _ = lines.next();
            std::thread::sleep(Duration::from_micros(random(60_000)));
            if kills % 5 == 4 {
                saver.kill().unwrap(); // SIGKILL
                saver.wait().unwrap();
            } else {
                // stop it where it is, look, and let it go on
                signal(saver.id(), "STOP");
            }
            kills += 1;
            mid_save += usize::from(temporaries(&dir) > 0);
            let mut s = Session::new(common::model(), config()).unwrap();
            assert_eq!(
                s.load_state(&path)
                    .unwrap_or_else(|e| panic!("round {round}: {e}")),
                Integrity::Verified
            );
            let which = want
                .iter()
                .position(|(tokens, _)| s.tokens() == tokens.as_slice())
                .unwrap_or_else(|| panic!("round {round}: the file holds neither state"));
            assert_eq!(next_logits(&mut s), want[which].1, "round {round}");
            seen[which] += 1;
            if saver.try_wait().unwrap().is_some() {
                break;
            }
            signal(saver.id(), "CONT");
        }
        let _ = saver.kill();
        let _ = saver.wait();
    }
    eprintln!(
        "{kills} stops and kills: {mid_save} inside a save (a temporary file present); the file \
         held the first state {} times, the second {} times",
        seen[0], seen[1]
    );
    assert!(mid_save > 0, "no stop landed inside a save");
    assert!(seen[0] > 0 && seen[1] > 0, "{seen:?}");
    // the next save clears what the killed ones left
    session_after(600).save_state(&path).unwrap();
    assert_eq!(temporaries(&dir), 0);
}

/// `kill -SIG pid`.
fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([format!("-{sig}"), pid.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -{sig} {pid}");
}

#[test]
fn a_save_that_runs_out_of_room_fails_and_leaves_the_old_file() {
    let _engine = common::one_engine_at_a_time();
    let dir = common::scratch("state-full");
    let path = dir.join("state");
    session_after(300).save_state(&path).unwrap();
    let old = std::fs::read(&path).unwrap();
    // the new state (700 tokens) is larger than the old one: a file size limit between the
    // two lets the old one stand and stops the new one, as a full disk would
    let limit = old.len() as u64 + 4096;
    let mut cmd = child("limited", &dir);
    let out = cmd
        .with_file_size_limit(limit)
        .output()
        .expect("the size-limited saver runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    // (libtest prints the test's name on the same line)
    let line = stdout
        .lines()
        .find_map(|l| {
            l.find("error: ")
                .or_else(|| l.find("saved"))
                .map(|at| &l[at..])
        })
        .unwrap_or_else(|| panic!("the saver said nothing: {stdout}"));
    assert!(
        line.starts_with("error: cannot save the session state to"),
        "{line}"
    );
    assert!(line.contains("File too large"), "{line}");
    assert!(line.contains("the file is unchanged"), "{line}");
    assert_eq!(std::fs::read(&path).unwrap(), old, "the old state changed");
    assert_eq!(
        temporaries(&dir),
        0,
        "the failed save left its temporary file"
    );
    let mut s = Session::new(common::model(), config()).unwrap();
    assert_eq!(s.load_state(&path).unwrap(), Integrity::Verified);
    assert_eq!(s.n_past(), 300);
}

/// Runs a command under a file size limit (`prlimit --fsize`, in bytes), with SIGXFSZ ignored so
/// that a write past it fails with EFBIG as a write to a full disk fails with ENOSPC, instead of
/// killing the process.
trait FileSizeLimit {
    fn with_file_size_limit(&mut self, bytes: u64) -> &mut Command;
}

impl FileSizeLimit for Command {
    fn with_file_size_limit(&mut self, bytes: u64) -> &mut Command {
        let program = self.get_program().to_owned();
        let args: Vec<_> = self.get_args().map(|a| a.to_owned()).collect();
        let envs: Vec<_> = self
            .get_envs()
            .filter_map(|(k, v)| Some((k.to_owned(), v?.to_owned())))
            .collect();
        let mut sh = Command::new("sh");
        sh.arg("-c")
            .arg(format!(
                "trap '' XFSZ; exec prlimit --fsize={bytes}:{bytes} \"$0\" \"$@\""
            ))
            .arg(program)
            .args(args)
            .envs(envs)
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        *self = sh;
        self
    }
}
