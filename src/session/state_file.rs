//! State files that are never half written and never used damaged.
//!
//! Every state this library writes to disk (a session's state, a prompt cache, a server slot's
//! sequence) goes through [`write_atomic`] and comes back through [`read`] and [`check`]:
//! - **Atomic saves.** The bytes go to a temporary file in the target's directory, which is
//!   flushed to disk (`fsync`) and renamed over the target, and then the directory is flushed,
//!   so that after a crash, a kill or a power cut the target is the old file or the new one,
//!   never a mix. A save that fails removes its temporary file and leaves the target as it was.
//! - **Checksums.** A 32-byte header of our own comes first: the magic `H2OSTATE`, a format
//!   version, the length and the CRC-32 of the state that follows, and a CRC-32 of the header
//!   itself. [`check`] verifies all of it before a byte of the state reaches
//!   llama.cpp, so a damaged file is refused as "damaged" and a cut one as "truncated (N of M
//!   bytes)", naming the file, with the session unchanged. The state after the header is the
//!   format the caller wrote (llama.cpp's session file, or a server slot's sequence file), so
//!   `tail -c +33 FILE` gives llama.cpp's own session file back.
//! - **Older files.** A file without the header (saved before this format) is still read, as
//!   [`Integrity::Unverified`]: nothing can check it, and callers say so.
//!
//! CRC-32 was chosen by measurement (`benches/checksum`, docs/results/saved-states/README.md): the cheapest of
//! CRC-32, XXH3-64 and BLAKE3 next to writing the file, 5 % of a flushed write, and it detects
//! every error confined to 32 consecutive bits, so every flipped byte, with certainty.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crc32fast::{hash as crc32, Hasher};

/// The first bytes of a checked state file.
pub(crate) const MAGIC: &[u8; 8] = b"H2OSTATE";
/// The format [`write_atomic`] writes and [`check`] reads.
const VERSION: u32 = 1;
/// magic, version, reserved (0), state length (u64), state CRC-32, header CRC-32 (of the 28 bytes
/// before it)
pub(crate) const HEADER_BYTES: usize = 32;

/// Whether a state read back could be checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Integrity {
    /// Its checksum matched: the state is the one that was saved.
    Verified,
    /// It was saved without a checksum (by a version before checked state files): it was used
    /// unchecked. Saving it again adds one.
    Unverified,
}

/// A state read from a file or from bytes: where the caller's own format starts, and whether
/// it was checked.
#[derive(Debug)]
pub(crate) struct Checked<'a> {
    pub state: &'a [u8],
    pub integrity: Integrity,
}

/// The header of a state of `len` bytes whose CRC-32 is `checksum`.
fn header(len: usize, checksum: u32) -> [u8; HEADER_BYTES] {
    let mut h = [0u8; HEADER_BYTES];
    h[..8].copy_from_slice(MAGIC);
    h[8..12].copy_from_slice(&VERSION.to_le_bytes());
    h[16..24].copy_from_slice(&(len as u64).to_le_bytes());
    h[24..28].copy_from_slice(&checksum.to_le_bytes());
    let own = crc32(&h[..28]);
    h[28..32].copy_from_slice(&own.to_le_bytes());
    h
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

/// Checks `bytes` (a whole file): the state after a valid header, or all of `bytes`, unverified,
/// when there is no header. The error says "damaged" or "truncated (N of M bytes)".
pub(crate) fn check(bytes: &[u8]) -> Result<Checked<'_>, String> {
    if bytes.is_empty() {
        return Err("truncated (0 bytes): the file is empty".into());
    }
    if bytes.len() < MAGIC.len() && MAGIC.starts_with(bytes) {
        return Err(format!(
            "truncated ({} of at least {HEADER_BYTES} bytes): the file ends inside its header",
            bytes.len()
        ));
    }
    if !bytes.starts_with(MAGIC) {
        return Ok(Checked {
            state: bytes,
            integrity: Integrity::Unverified,
        });
    }
    if bytes.len() < HEADER_BYTES {
        return Err(format!(
            "truncated ({} of at least {HEADER_BYTES} bytes): the file ends inside its header",
            bytes.len()
        ));
    }
    let h = &bytes[..HEADER_BYTES];
    if crc32(&h[..28]) != u32_at(h, 28) {
        return Err("damaged: its header does not match the header's checksum".into());
    }
    let version = u32_at(h, 8);
    if version != VERSION {
        return Err(format!(
            "saved in state-file format {version}, this build reads format {VERSION}: load it with \
             the h2o-llama that saved it"
        ));
    }
    let expected = HEADER_BYTES as u64 + u64_at(h, 16);
    let len = bytes.len() as u64;
    if len < expected {
        return Err(format!(
            "truncated ({len} of {expected} bytes): the file was cut short after it was saved"
        ));
    }
    if len > expected {
        return Err(format!(
            "damaged: {} bytes follow the {expected} bytes its header describes",
            len - expected
        ));
    }
    let state = &bytes[HEADER_BYTES..];
    if crc32(state) != u32_at(h, 24) {
        return Err(
            "damaged: its content does not match its checksum (the file changed after it was saved)"
                .into(),
        );
    }
    Ok(Checked {
        state,
        integrity: Integrity::Verified,
    })
}

/// Reads the file at `path` whole; [`check`] then says whether it can be used.
pub(crate) fn read(path: &Path) -> Result<Vec<u8>, String> {
    fs::read(path).map_err(|e| e.to_string())
}

/// Writes `state` (the parts one after another) to `path` behind a checked header, atomically:
/// through a temporary file in the same directory that is flushed to disk and renamed over
/// `path`. Returns the bytes written. On any error before the rename the temporary file is
/// removed and `path` is as it was; the message says which step failed and what `path` holds.
pub(crate) fn write_atomic(path: &Path, parts: &[&[u8]]) -> Result<u64, String> {
    let name = path
        .file_name()
        .ok_or_else(|| format!("{} does not name a file", path.display()))?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = name.to_string_lossy();
    remove_stale_temporaries(&dir, &name);
    // unique among the processes and threads that save the same target at once
    static SAVES: AtomicU64 = AtomicU64::new(0);
    let tmp = dir.join(format!(
        ".{name}.{}-{}.tmp",
        std::process::id(),
        SAVES.fetch_add(1, Ordering::Relaxed)
    ));
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .map_err(|e| {
            format!(
                "cannot create a temporary file in {}: {e}; the file is unchanged",
                dir.display()
            )
        })?;
    let written = write_parts(&mut file, parts).and_then(|n| {
        file.sync_all()?;
        Ok(n)
    });
    drop(file);
    let written = match written {
        Ok(n) => n,
        Err(e) => {
            let _ = fs::remove_file(&tmp);
            return Err(format!(
                "writing the state failed: {e}; the file is unchanged"
            ));
        }
    };
    if let Err(e) = fs::rename(&tmp, path) {
        let _ = fs::remove_file(&tmp);
        return Err(format!("cannot replace it: {e}; the file is unchanged"));
    }
    // the rename itself is durable only once the directory is
    File::open(&dir).and_then(|d| d.sync_all()).map_err(|e| {
        format!(
            "the new state replaced the file, but flushing {} failed: {e} (a power cut could \
                 still undo the replacement)",
            dir.display()
        )
    })?;
    Ok(written)
}

/// Removes the temporary files that saves of `name` in `dir` left when their process was killed
/// (`.NAME.PID-N.tmp` of a PID that no longer runs), so that killed saves do not pile up. Only
/// where /proc tells which processes run; elsewhere they stay.
fn remove_stale_temporaries(dir: &Path, name: &str) {
    if !Path::new("/proc/self").exists() {
        return;
    }
    let prefix = format!(".{name}.");
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let file = entry.file_name();
        let Some(rest) = file
            .to_str()
            .and_then(|f| f.strip_prefix(&prefix))
            .and_then(|f| f.strip_suffix(".tmp"))
        else {
            continue;
        };
        let Some((pid, n)) = rest.split_once('-') else {
            continue;
        };
        let numeric = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        if numeric(pid) && numeric(n) && !Path::new("/proc").join(pid).exists() {
            let _ = fs::remove_file(entry.path());
        }
    }
}

/// The header, then the parts; the checksum is computed over the parts as they are.
fn write_parts(file: &mut File, parts: &[&[u8]]) -> io::Result<u64> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let mut hasher = Hasher::new();
    for p in parts {
        hasher.update(p);
    }
    file.write_all(&header(len, hasher.finalize()))?;
    for p in parts {
        file.write_all(p)?;
    }
    Ok((HEADER_BYTES + len) as u64)
}

/// `state` with its header, as [`write_atomic`] writes it.
#[cfg(test)]
fn with_header(state: &[u8]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(HEADER_BYTES + state.len());
    bytes.extend_from_slice(&header(state.len(), crc32(state)));
    bytes.extend_from_slice(state);
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> Vec<u8> {
        (0..5000u32).map(|i| (i * 7 + i / 13) as u8).collect()
    }

    #[test]
    fn a_saved_state_reads_back_verified() {
        let s = state();
        let bytes = with_header(&s);
        let c = check(&bytes).unwrap();
        assert_eq!(c.state, &s[..]);
        assert_eq!(c.integrity, Integrity::Verified);
    }

    #[test]
    fn every_flipped_byte_is_refused_as_damaged() {
        let bytes = with_header(&state());
        for at in 0..bytes.len() {
            let mut b = bytes.clone();
            b[at] ^= 0x5a;
            match check(&b) {
                Err(e) => assert!(e.contains("damaged"), "byte {at}: {e}"),
                // a flip in the magic leaves a file without our header, which the caller's own
                // format then refuses: it starts with the rest of our magic
                Ok(c) => {
                    assert!(at < MAGIC.len(), "byte {at} flipped and accepted");
                    assert_eq!(c.integrity, Integrity::Unverified);
                    assert_eq!(c.state.len(), b.len());
                }
            }
        }
    }

    #[test]
    fn every_cut_is_refused_as_truncated() {
        let bytes = with_header(&state());
        for len in 0..bytes.len() {
            let e = check(&bytes[..len]).unwrap_err();
            assert!(e.starts_with("truncated ("), "cut at {len}: {e}");
            if len >= HEADER_BYTES {
                assert!(
                    e.contains(&format!("{len} of {} bytes", bytes.len())),
                    "{e}"
                );
            }
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(check(&longer)
            .unwrap_err()
            .contains("damaged: 1 bytes follow"));
    }

    #[test]
    fn a_file_without_the_header_is_read_unverified() {
        let s = b"ggsn and the rest of an older state".to_vec();
        let c = check(&s).unwrap();
        assert_eq!(c.integrity, Integrity::Unverified);
        assert_eq!(c.state, &s[..]);
    }

    #[test]
    fn another_format_version_is_refused_by_name() {
        let mut bytes = with_header(&state());
        bytes[8] = 2;
        let own = crc32(&bytes[..28]);
        bytes[28..32].copy_from_slice(&own.to_le_bytes());
        let e = check(&bytes).unwrap_err();
        assert!(e.contains("format 2"), "{e}");
    }

    #[test]
    fn an_atomic_save_replaces_the_file_whole_and_leaves_no_temporary_file() {
        let dir = std::env::temp_dir().join(format!("h2o-state-file-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("state.bin");
        fs::write(&path, b"old").unwrap();
        let s = state();
        let n = write_atomic(&path, &[&s[..100], &s[100..]]).unwrap();
        let bytes = fs::read(&path).unwrap();
        assert_eq!(n as usize, bytes.len());
        assert_eq!(bytes, with_header(&s));
        let names: Vec<_> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("state.bin")]);
        // what a killed save left (a process that no longer runs) goes with the next save;
        // another running process's temporary file stays
        let stale = dir.join(".state.bin.4294967-0.tmp");
        let running = dir.join(format!(".state.bin.{}-99.tmp", std::process::id()));
        fs::write(&stale, b"partial").unwrap();
        fs::write(&running, b"partial").unwrap();
        write_atomic(&path, &[&s]).unwrap();
        assert!(!stale.exists());
        assert!(running.exists());
        fs::remove_file(&running).unwrap();
        // a directory that is not there: refused, nothing written
        let e = write_atomic(&dir.join("missing/state.bin"), &[&s]).unwrap_err();
        assert!(e.contains("cannot create a temporary file"), "{e}");
        fs::remove_dir_all(&dir).unwrap();
    }
}
