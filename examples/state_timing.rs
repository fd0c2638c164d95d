//! How long saving and loading a session's state takes against the disk's own floor, and how much
//! memory they take: a prompt of N tokens of the demo ledger with H2O on (L = H = 256, chunks of
//! 1,024), then REPS rounds, interleaved (each pair in turn in both orders), of
//! - `save_state` to a file, and two floors: writing as many bytes from a buffer of 4 MiB and
//!   flushing them to disk (`fsync`) over the same file, and the same to a new file renamed over
//!   the old one (what an atomic save must do at least);
//! - `load_state` of it into a fresh session, and the floor: reading the file in pieces of 4 MiB
//!   and computing their CRC-32;
//!
//! and, on Linux, the peak resident memory of each save and load above the process's memory
//! before it (`/proc/self/status` VmHWM, reset through `/proc/self/clear_refs`). With `cold`,
//! the file's pages are dropped from the page cache (`dd iflag=nocache`) before every load and
//! every floor read, so that both read the disk. Medians printed as JSON.
//!
//!   cargo run --release --example state_timing -- [N] [REPS] [DIR] [cold]
//!
//! Uses the public API only, so that the same file times an older build (docs/library.md, "Saved states").

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use h2o_llama::{default_model, demo, H2oConfig, Model, ModelParams, Session, SessionConfig};

const PIECE: usize = 4 << 20;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// A field of /proc/self/status in KiB (0 where there is none).
fn status_kib(field: &str) -> u64 {
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// Runs `f`; returns its seconds and its peak resident memory above the memory before it, MiB.
fn measured<T>(f: impl FnOnce() -> T) -> (T, f64, f64) {
    // "5" resets the peak (VmHWM) to the current resident size
    let _ = fs::write("/proc/self/clear_refs", "5");
    let before = status_kib("VmRSS:");
    let t = Instant::now();
    let out = f();
    let secs = t.elapsed().as_secs_f64();
    let peak = status_kib("VmHWM:");
    (out, secs, peak.saturating_sub(before) as f64 / 1024.0)
}

fn drop_cached(path: &Path) {
    let ok = Command::new("dd")
        .arg(format!("if={}", path.display()))
        .args(["iflag=nocache", "count=0", "status=none"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "dd iflag=nocache failed on {}", path.display());
}

/// Writes `len` bytes from one buffer of 4 MiB and flushes them to disk.
fn floor_write(path: &Path, len: u64, piece: &[u8]) -> std::io::Result<()> {
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)?;
    let mut left = len;
    while left > 0 {
        let n = left.min(piece.len() as u64) as usize;
        f.write_all(&piece[..n])?;
        left -= n as u64;
    }
    f.sync_all()
}

/// The floor of an atomic save: `len` bytes written to a new file, flushed, renamed over `path`,
/// and the directory flushed.
fn floor_write_new(path: &Path, tmp: &Path, len: u64, piece: &[u8]) -> std::io::Result<()> {
    floor_write(tmp, len, piece)?;
    fs::rename(tmp, path)?;
    File::open(path.parent().unwrap_or(Path::new(".")))?.sync_all()
}

/// The length of the session's state file (one save, not timed).
fn session_state_len(session: &mut Session<'_>, path: &Path) -> h2o_llama::Result<u64> {
    session.save_state(path)?;
    Ok(fs::metadata(path).map_or(0, |m| m.len()))
}

/// Reads the file in pieces of 4 MiB and computes its CRC-32.
fn floor_read(path: &Path, buf: &mut [u8]) -> std::io::Result<u32> {
    let mut f = File::open(path)?;
    let mut h = crc32fast::Hasher::new();
    loop {
        let n = f.read(buf)?;
        if n == 0 {
            return Ok(h.finalize());
        }
        h.update(&buf[..n]);
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let n: usize = args.first().map_or(Ok(16384), |a| a.parse())?;
    let reps: usize = args.get(1).map_or(Ok(5), |a| a.parse())?;
    let dir = args.get(2).map_or_else(std::env::temp_dir, PathBuf::from);
    let cold = args.get(3).is_some_and(|a| a == "cold");
    let model = Model::load(
        default_model::ensure(|m| eprintln!("{m}"))?,
        &ModelParams::default(),
    )?;
    let config = SessionConfig {
        n_ctx: n as u32,
        n_batch: 4096,
        n_ubatch: 1024,
        h2o: Some(H2oConfig::new(256, 256)),
        ..SessionConfig::default()
    };
    let tokens = demo::prompt_tokens(&model, n)?;
    let mut session = Session::new(&model, config.clone())?;
    eprintln!("state_timing: prefill of {n} tokens");
    session.evaluate(&tokens)?;
    let path = dir.join(format!("state-timing-{}.state", std::process::id()));
    let floor_path = dir.join(format!("state-timing-{}.floor", std::process::id()));
    let mut buf = vec![0x5au8; PIECE];
    let (mut save, mut load, mut write, mut read) = (vec![], vec![], vec![], vec![]);
    let mut write_new = vec![];
    let tmp_path = dir.join(format!("state-timing-{}.floor.tmp", std::process::id()));
    let (mut save_mib, mut load_mib) = (0f64, 0f64);
    let mut bytes = session_state_len(&mut session, &path)?;
    for rep in 0..reps {
        // the writes and the reads in turn in every order, so that none always runs after
        // another's aftermath (a VM hands out pages that were just freed faster than others)
        for k in 0..3 {
            match (rep + k) % 3 {
                0 => {
                    let (saved, s, mib) = measured(|| session.save_state(&path));
                    saved?;
                    save.push(s);
                    save_mib = save_mib.max(mib);
                    bytes = fs::metadata(&path)?.len();
                }
                1 => {
                    let (written, s, _) = measured(|| floor_write(&floor_path, bytes, &buf));
                    written?;
                    write.push(s);
                }
                _ => {
                    let (written, s, _) =
                        measured(|| floor_write_new(&floor_path, &tmp_path, bytes, &buf));
                    written?;
                    write_new.push(s);
                }
            }
        }
        let floor_first = rep % 2 == 1;
        if floor_first {
            if cold {
                drop_cached(&path);
            }
            let (crc, s, _) = measured(|| floor_read(&path, &mut buf));
            crc?;
            read.push(s);
        }
        let mut fresh = Session::new(&model, config.clone())?;
        if cold {
            drop_cached(&path);
        }
        let (loaded, s, mib) = measured(|| fresh.load_state(&path));
        loaded?;
        load.push(s);
        load_mib = load_mib.max(mib);
        assert_eq!(fresh.n_past() as usize, n);
        drop(fresh);
        if !floor_first {
            if cold {
                drop_cached(&path);
            }
            let (crc, s, _) = measured(|| floor_read(&path, &mut buf));
            crc?;
            read.push(s);
        }
        eprintln!(
            "state_timing: rep {}/{reps}: save {:.3} s (floors {:.3} in place, {:.3} new file), \
             load {:.3} s (floor {:.3})",
            rep + 1,
            save[rep],
            write[rep],
            write_new[rep],
            load[rep],
            read[rep]
        );
    }
    fs::remove_file(&path)?;
    fs::remove_file(&floor_path)?;
    let (save, load, write, read) = (median(save), median(load), median(write), median(read));
    let write_new = median(write_new);
    println!(
        "{{\"n_tokens\":{n},\"state_bytes\":{bytes},\"reps\":{reps},\"cold\":{cold},\
         \"save_s\":{save:.4},\"floor_write_s\":{write:.4},\"save_over_floor\":{:.3},\
         \"floor_write_new_file_s\":{write_new:.4},\"save_over_new_file_floor\":{:.3},\
         \"load_s\":{load:.4},\"floor_read_s\":{read:.4},\"load_over_floor\":{:.3},\
         \"save_peak_mib\":{save_mib:.1},\"load_peak_mib\":{load_mib:.1}}}",
        save / write,
        save / write_new,
        load / read
    );
    Ok(())
}
