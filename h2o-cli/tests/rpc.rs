//! Layers on other machines: every layer of the default model offloaded to two h2o-rpc-server
//! processes on localhost (started here, ended by pid) gives the same logits, bit for bit, as the
//! same run on this process's CPU with the same (plain) buffers, for every policy, with the same
//! scores and memory sets read back, the same sparse decode steps and the same saved states (a
//! context's and a sequence's); and a server that is not there, of another protocol, silent,
//! short of memory or killed mid-prefill gets a clear error naming it.

// The root package's shared test helpers (the default model).
#[path = "../../tests/common/mod.rs"]
mod common;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use h2o_llama::{
    rpc, Error, H2oConfig, Model, ModelParams, ParallelSession, Selection, Session, SessionConfig,
    Token,
};

/// An h2o-rpc-server child process on a free localhost port, killed when dropped.
struct RpcServer {
    child: Child,
    endpoint: String,
}

impl RpcServer {
    fn start() -> Self {
        Self::start_within(None)
    }

    /// A server whose address space is limited to `kib` KiB (`ulimit -v`), where given.
    fn start_within(kib: Option<u64>) -> Self {
        let port = free_port();
        let server = format!("{} -p {port} -t 1", env!("CARGO_BIN_EXE_h2o-rpc-server"));
        let limit = kib.map_or(String::new(), |k| format!("ulimit -v {k}; "));
        // exec: the shell becomes the server, so its pid is the server's
        let child = Command::new("bash")
            .args(["-c", &format!("{limit}exec {server}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("h2o-rpc-server starts");
        let endpoint = format!("127.0.0.1:{port}");
        let start = Instant::now();
        // the handshake answers once the server listens
        while let Err(e) = rpc::check_server(&endpoint) {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "h2o-rpc-server on {endpoint} did not answer: {e}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Self { child, endpoint }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for RpcServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The tests of this file one at a time: a port `free_port` finds free is bound later by a server
/// process, and a test running beside it could be given the same port for a listener of its own
/// in between (its peer would then take the other test's connection).
fn one_at_a_time() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// 600 tokens of varied text: the project's architecture document.
fn prompt(model: &Model) -> Vec<Token> {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/architecture.md"
    ))
    .unwrap();
    model.tokenize(&text, true, false).unwrap()[..600].to_vec()
}

fn config(h2o: Option<H2oConfig>) -> SessionConfig {
    SessionConfig {
        n_ctx: 1024,
        n_batch: 1024,
        n_ubatch: 256,
        n_threads: 2,
        h2o,
        ..SessionConfig::default()
    }
}

/// The prompt's last logits, bit for bit, and (with H2O) the state read back.
fn assert_same_prefill(local: &Model, remote: &Model, h2o: Option<H2oConfig>, what: &str) {
    let tokens = prompt(local);
    let mut a = Session::new(local, config(h2o)).unwrap();
    let mut b = Session::new(remote, config(h2o)).unwrap();
    a.evaluate(&tokens).unwrap();
    b.evaluate(&tokens).unwrap();
    let (la, lb) = (a.logits().unwrap(), b.logits().unwrap());
    assert!(
        la.iter().zip(lb).all(|(x, y)| x.to_bits() == y.to_bits()),
        "{what}: logits over RPC differ from the local CPU's (max |diff| {})",
        common::max_abs_diff(la, lb)
    );
    if h2o.is_some() {
        assert!(
            common::h2o_snapshot(&a) == common::h2o_snapshot(&b),
            "{what}: scores or memory sets read back over RPC differ from the local CPU's"
        );
    }
}

#[test]
fn every_layer_over_two_rpc_servers_gives_the_local_cpus_results_bit_for_bit() {
    let _serial = one_at_a_time();
    let _engine = common::one_engine_at_a_time();
    let (s1, s2) = (RpcServer::start(), RpcServer::start());
    let plain = ModelParams {
        no_repack: true,
        ..ModelParams::default()
    };
    let local = Model::load(common::model_path(), &plain).unwrap();
    let remote = Model::load(
        common::model_path(),
        &ModelParams {
            n_gpu_layers: 99,
            rpc_servers: vec![s1.endpoint.clone(), s2.endpoint.clone()],
            ..plain
        },
    )
    .unwrap();

    assert_same_prefill(&local, &remote, None, "full attention");
    for select in Selection::ALL {
        let h2o = H2oConfig {
            select,
            ..H2oConfig::new(64, 64)
        };
        assert_same_prefill(&local, &remote, Some(h2o), select.name());
    }

    // sparse decode: 40 greedy steps after the prompt, each step's logits equal
    let h2o = Some(H2oConfig {
        decode_budget: 64,
        ..H2oConfig::new(64, 64)
    });
    let tokens = prompt(&local);
    let mut a = Session::new(&local, config(h2o)).unwrap();
    let mut b = Session::new(&remote, config(h2o)).unwrap();
    a.evaluate(&tokens).unwrap();
    b.evaluate(&tokens).unwrap();
    for step in 0..40 {
        let next = common::argmax(a.logits().unwrap()) as Token;
        a.evaluate(&[next]).unwrap();
        b.evaluate(&[next]).unwrap();
        assert_eq!(
            a.logits().unwrap(),
            b.logits().unwrap(),
            "sparse decode step {step} over RPC differs from the local CPU's"
        );
    }

    // a saved state: the same bytes from both, and restored over RPC it continues as restored
    // on the local CPU (sparse decode rebuilds its block sketches after a restore, so neither
    // continues exactly as the session that never saved once it has decoded past a block)
    let saved = b.state_bytes().unwrap();
    assert!(
        saved == a.state_bytes().unwrap(),
        "the state saved over RPC differs from the local CPU's"
    );
    let mut c = Session::new(&remote, config(h2o)).unwrap();
    let mut d = Session::new(&local, config(h2o)).unwrap();
    c.load_state_bytes(&saved).unwrap();
    d.load_state_bytes(&saved).unwrap();
    for step in 0..8 {
        let next = common::argmax(d.logits().unwrap_or(a.logits().unwrap())) as Token;
        c.evaluate(&[next]).unwrap();
        d.evaluate(&[next]).unwrap();
        assert!(
            c.logits().unwrap() == d.logits().unwrap(),
            "step {step} after a state restored over RPC differs from the local CPU's (max |diff| {})",
            common::max_abs_diff(c.logits().unwrap(), d.logits().unwrap())
        );
    }
    assert!(common::h2o_snapshot(&c) == common::h2o_snapshot(&d));

    // one sequence's state (what h2o-server's slot files hold): saved from sequence 0 of a
    // two-sequence context over RPC and of the same local one, the same bytes; restored into
    // sequence 1 of each, the next step gives the same logits
    let dir = common::scratch("rpc-seq-state");
    let h2o = Some(H2oConfig::new(64, 64));
    let mut r = ParallelSession::new(&remote, config(h2o), 2).unwrap();
    let mut l = ParallelSession::new(&local, config(h2o), 2).unwrap();
    for (p, file) in [(&mut r, "remote"), (&mut l, "local")] {
        p.start_prompt(0, &tokens, None).unwrap();
        let mut done = 0;
        while done < tokens.len() {
            done += p.prefill(0, &tokens[done..], usize::MAX).unwrap();
        }
        p.save_seq(0, &dir.join(file)).unwrap();
        p.load_seq(1, &dir.join("remote")).unwrap();
        p.decode(&[(1, tokens[1])]).unwrap();
    }
    assert!(
        std::fs::read(dir.join("remote")).unwrap() == std::fs::read(dir.join("local")).unwrap(),
        "a sequence's state saved over RPC differs from the local CPU's"
    );
    assert!(
        r.logits(Some(0)).unwrap() == l.logits(Some(0)).unwrap(),
        "a sequence restored over RPC continues differently from one restored locally"
    );
}

/// The error loading the default model over `server` gives.
fn load_error(server: &str) -> String {
    let params = ModelParams {
        n_gpu_layers: 99,
        rpc_servers: vec![server.to_string()],
        ..ModelParams::default()
    };
    match Model::load(common::model_path(), &params) {
        Err(e @ Error::Rpc { .. }) => e.to_string(),
        Err(e) => panic!("loading over {server}: not an RPC error: {e}"),
        Ok(_) => panic!("loading over {server} succeeded"),
    }
}

/// A peer that answers the handshake as a server of `version` would (or, with None, accepts
/// and says nothing), once.
fn fake_peer(version: Option<[u8; 3]>) -> (String, std::thread::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = listener.local_addr().unwrap().to_string();
    let handle = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut hello = [0u8; 1 + 8 + 24];
        s.read_exact(&mut hello).unwrap();
        assert_eq!(hello[0], 14, "the handshake's command");
        if let Some([major, minor, patch]) = version {
            // rpc_msg_hello_rsp: major, minor, patch, padding, 24 bytes of transport caps
            let mut answer = 28u64.to_le_bytes().to_vec();
            answer.extend_from_slice(&[major, minor, patch, 0]);
            answer.extend_from_slice(&[0u8; 24]);
            s.write_all(&answer).unwrap();
        }
        // hold the connection until the client gives up
        let _ = s.read(&mut [0u8; 1]);
    });
    (endpoint, handle)
}

#[test]
fn servers_that_are_not_there_or_speak_another_protocol_are_refused_naming_them() {
    let _serial = one_at_a_time();
    // nothing listening
    let port = free_port();
    let e = load_error(&format!("127.0.0.1:{port}"));
    assert!(
        e.contains(&format!("127.0.0.1:{port}")) && e.contains("cannot connect"),
        "{e}"
    );

    // a stock llama.cpp rpc-server answers protocol 7.0.0
    let (endpoint, peer) = fake_peer(Some([7, 0, 0]));
    let e = load_error(&endpoint);
    assert!(
        e.contains(&endpoint) && e.contains("7.0.0") && e.contains("stock llama.cpp rpc-server"),
        "{e}"
    );
    peer.join().unwrap();

    // a server busy with another client accepts and does not answer
    let (endpoint, peer) = fake_peer(None);
    let e = load_error(&endpoint);
    assert!(
        e.contains(&endpoint) && e.contains("did not answer the handshake"),
        "{e}"
    );
    peer.join().unwrap();

    // not HOST:PORT
    for bad in ["localhost", "host:0", ":50052", "host:port"] {
        let e = rpc::parse_servers(&format!("127.0.0.1:50052,{bad}")).unwrap_err();
        assert!(e.to_string().contains(bad), "{e}");
    }

    // h2o-cli: exit 3, the server named
    let o = Command::new(env!("CARGO_BIN_EXE_h2o-cli"))
        .arg("-m")
        .arg(common::model_path())
        .args([
            "--rpc",
            &format!("127.0.0.1:{port}"),
            "--n-gpu-layers",
            "99",
        ])
        .args(["-p", "Hello", "-n", "1"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert!(
        err.contains(&format!("RPC server 127.0.0.1:{port}")),
        "{err}"
    );
}

#[test]
fn a_server_without_enough_memory_is_named() {
    let _serial = one_at_a_time();
    let _engine = common::one_engine_at_a_time();
    // room for the weights (~100 MB) and the server itself, not for a 64K-token KV cache (1.5 GB)
    let server = RpcServer::start_within(Some(1_200_000));
    let remote = Model::load(
        common::model_path(),
        &ModelParams {
            n_gpu_layers: 99,
            rpc_servers: vec![server.endpoint.clone()],
            ..ModelParams::default()
        },
    )
    .unwrap();
    let config = SessionConfig {
        n_ctx: 65536,
        ..config(None)
    };
    match Session::new(&remote, config) {
        Err(Error::Rpc {
            server: name,
            reason,
        }) => {
            assert_eq!(name, server.endpoint);
            assert!(
                reason.contains("not enough memory") && reason.contains("kv cache"),
                "{reason}"
            );
        }
        Err(e) => panic!("not an RPC error: {e}"),
        Ok(_) => panic!("a 64K-token context fit in 1.2 GB"),
    };
}

#[test]
fn a_server_killed_mid_prefill_ends_the_client_with_a_message() {
    let _serial = one_at_a_time();
    let _engine = common::one_engine_at_a_time();
    let (s1, s2) = (RpcServer::start(), RpcServer::start());
    let mut cli = Command::new(env!("CARGO_BIN_EXE_h2o-cli"))
        .arg("-m")
        .arg(common::model_path())
        .args(["--rpc", &format!("{},{}", s1.endpoint, s2.endpoint)])
        .args(["--n-gpu-layers", "99", "-t", "2"])
        .args(["--synthetic-prompt", "4096", "-c", "4200", "-n", "1"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // the prefill of 4K tokens on two one-thread servers takes far longer than this (28 s)
    std::thread::sleep(Duration::from_secs(4));
    assert!(
        cli.try_wait().unwrap().is_none(),
        "h2o-cli ended before the server was killed"
    );
    let status = Command::new("kill")
        .args(["-9", &s2.pid().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let start = Instant::now();
    let status = loop {
        if let Some(status) = cli.try_wait().unwrap() {
            break status;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "h2o-cli still runs 60 s after its RPC server was killed"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut err = String::new();
    cli.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(!status.success());
    assert!(
        err.contains("stopped answering") && err.contains(&s2.endpoint),
        "{err}"
    );
}
