//! The server's slot files (`POST /slots/{id}?action=save|restore`, `--slot-save-path`) keep the
//! guarantees of the library's state files, seen through HTTP: a damaged or cut file is refused
//! with 400 naming it and the slot keeps what it held; a server killed (SIGKILL) while it saves
//! leaves the old file or the new one, each restoring; a save that runs out of room fails with a
//! message and leaves the old file as it was; a conversation saved by one server and restored by
//! another sharing the directory (replicas) continues there exactly as on the first.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use serde_json::{json, Value};

fn slot_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("h2o-slot-files-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn action(server: &Server, id: u64, action: &str, filename: &str) -> (u16, Value) {
    let r = client()
        .post(server.url(&format!("/slots/{id}?action={action}")))
        .json(&json!({ "filename": filename }))
        .send()
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json::<Value>().unwrap())
}

/// Runs a prompt of about `n` tokens on `slot` and returns the tokens it holds.
fn fill(server: &Server, slot: u64, n: usize) -> u64 {
    let (status, v) = post(
        server,
        "/completion",
        &json!({"prompt": long_text(n), "n_predict": 1, "temperature": 0, "id_slot": slot,
                "cache_prompt": true}),
    );
    assert_eq!(status, 200, "{v}");
    n_past(server, slot)
}

fn n_past(server: &Server, slot: u64) -> u64 {
    get_json(server, "/slots")[slot as usize]["n_past"]
        .as_u64()
        .unwrap()
}

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
fn damaged_and_cut_slot_files_are_refused_and_the_slot_is_unchanged() {
    let _engine = common::one_engine_at_a_time();
    let dir = slot_dir("damaged");
    let server = Server::start(&[SHAPE, &["--slot-save-path", dir.to_str().unwrap()]].concat());
    fill(&server, 0, 300);
    let (status, saved) = action(&server, 0, "save", "good.bin");
    assert_eq!(status, 200, "{saved}");
    let good = std::fs::read(dir.join("good.bin")).unwrap();
    let n = good.len();
    let held = fill(&server, 1, 100);

    let mut cases: Vec<(Vec<u8>, String)> = Vec::new();
    for i in 0..40 {
        let at = 8 + i * (n - 8) / 40;
        let mut bytes = good.clone();
        bytes[at] ^= 0xff;
        cases.push((bytes, "damaged".into()));
    }
    for i in 1..20 {
        let len = i * n / 20;
        cases.push((
            good[..len].to_vec(),
            format!("truncated ({len} of {n} bytes)"),
        ));
    }
    for (bytes, needle) in cases {
        std::fs::write(dir.join("bad.bin"), &bytes).unwrap();
        let (status, v) = action(&server, 1, "restore", "bad.bin");
        assert_eq!(status, 400, "{needle}: {v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(&needle), "{msg}");
        assert!(msg.contains("bad.bin"), "{msg}");
        assert!(msg.contains("the sequence is unchanged"), "{msg}");
        assert_eq!(n_past(&server, 1), held);
    }
    // the good file still restores, checked
    let (status, v) = action(&server, 1, "restore", "good.bin");
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["verified"], true, "{v}");
    assert_eq!(v["n_restored"], saved["n_saved"]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_server_killed_while_it_saves_leaves_the_old_slot_file_or_the_new_one() {
    let _engine = common::one_engine_at_a_time();
    let dir = slot_dir("killed");
    let args = [SHAPE, &["--slot-save-path", dir.to_str().unwrap()]].concat();
    let mut seen = std::collections::BTreeMap::<u64, usize>::new();
    let mut rng = 0x9e3779b97f4a7c15u64;
    for round in 0..4 {
        let server = Server::start(&args);
        // the old file: a short conversation; then a longer one saved over it, killed
        fill(&server, 0, 150);
        let (status, old) = action(&server, 0, "save", "slot.bin");
        assert_eq!(status, 200, "{old}");
        fill(&server, 0, 900);
        let url = server.url("/slots/0?action=save");
        let saving = std::thread::spawn(move || {
            client()
                .post(url)
                .json(&json!({"filename": "slot.bin"}))
                .send()
        });
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        std::thread::sleep(Duration::from_micros(rng % 40_000));
        drop(server); // SIGKILL
        let _ = saving.join();

        let server = Server::start(&args);
        let (status, v) = action(&server, 2, "restore", "slot.bin");
        assert_eq!(status, 200, "round {round}: {v}");
        assert_eq!(v["verified"], true, "{v}");
        let n = v["n_restored"].as_u64().unwrap();
        assert!(
            n == old["n_saved"].as_u64().unwrap() || n > 600,
            "round {round}: restored {n} tokens, neither the old state nor the new one"
        );
        *seen.entry(n).or_default() += 1;
        // and it serves its conversation
        let (status, r) = post(
            &server,
            "/completion",
            &json!({"prompt": long_text(160), "n_predict": 2, "temperature": 0, "id_slot": 2}),
        );
        assert_eq!(status, 200, "{r}");
    }
    eprintln!("restored token counts after the kills: {seen:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_slot_save_that_runs_out_of_room_fails_and_leaves_the_old_file() {
    let _engine = common::one_engine_at_a_time();
    let dir = slot_dir("full");
    let args = [SHAPE, &["--slot-save-path", dir.to_str().unwrap()]].concat();
    // the size a short conversation's file takes, measured without a limit
    let probe = Server::start(&args);
    fill(&probe, 0, 150);
    let (status, v) = action(&probe, 0, "save", "slot.bin");
    assert_eq!(status, 200, "{v}");
    drop(probe);
    let old = std::fs::read(dir.join("slot.bin")).unwrap();

    // room for that much and a little more: a longer conversation does not fit
    let server = Server::start_limited(&args, Some(old.len() as u64 + 4096));
    fill(&server, 0, 900);
    let (status, v) = action(&server, 0, "save", "slot.bin");
    assert_eq!(status, 400, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("File too large"), "{msg}");
    assert!(msg.contains("the file is unchanged"), "{msg}");
    assert_eq!(std::fs::read(dir.join("slot.bin")).unwrap(), old);
    assert_eq!(temporaries(&dir), 0);
    // the old file still restores
    let (status, v) = action(&server, 1, "restore", "slot.bin");
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["verified"], true, "{v}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Two replicas sharing a slot-save directory (as behind a load balancer): a conversation served
/// by one, saved there and restored by the other continues on the second exactly as on the
/// first (the same text and the same probabilities), reusing the handed-over prefix.
#[test]
fn a_conversation_saved_on_one_replica_continues_on_another() {
    let _engine = common::one_engine_at_a_time();
    let dir = slot_dir("replicas");
    let args = [SHAPE, &["--slot-save-path", dir.to_str().unwrap()]].concat();
    let first = Server::start(&args);
    let second = Server::start(&args);
    let turn1 = long_text(400);
    let (status, v) = post(
        &first,
        "/completion",
        &json!({"prompt": turn1, "n_predict": 12, "temperature": 0, "id_slot": 0,
                "cache_prompt": true}),
    );
    assert_eq!(status, 200, "{v}");
    let answer = v["content"].as_str().unwrap().to_string();
    let (status, saved) = action(&first, 0, "save", "conversation.bin");
    assert_eq!(status, 200, "{saved}");
    let (status, restored) = action(&second, 3, "restore", "conversation.bin");
    assert_eq!(status, 200, "{restored}");
    assert_eq!(restored["verified"], true, "{restored}");
    assert_eq!(restored["n_restored"], saved["n_saved"]);

    let turn2 = json!({
        "prompt": format!("{turn1}{answer} Then the harbour master"),
        "n_predict": 16, "temperature": 0, "n_probs": 3, "cache_prompt": true,
    });
    let on = |server: &Server, slot: u64| {
        let mut body = turn2.clone();
        body["id_slot"] = json!(slot);
        let (status, v) = post(server, "/completion", &body);
        assert_eq!(status, 200, "{v}");
        v
    };
    let (a, b) = (on(&first, 0), on(&second, 3));
    assert_eq!(b["content"], a["content"]);
    assert_eq!(b["completion_probabilities"], a["completion_probabilities"]);
    let cached = b["tokens_cached"].as_u64().unwrap();
    assert_eq!(cached, a["tokens_cached"].as_u64().unwrap());
    assert!(
        cached >= saved["n_saved"].as_u64().unwrap() / 2,
        "the second replica evaluated the handed-over conversation again: {b}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
