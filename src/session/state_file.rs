//! State files that are never half written and never used damaged.
//!
//! Every state this library writes to disk (a session's state, a prompt cache, a server slot's
//! sequence) goes through [`write_atomic_with`] and comes back through [`open_checked`]; both
//! stream it in pieces of a few MiB, so that neither holds a copy of a state that reaches
//! several GB at long contexts:
//! - **Atomic saves.** The bytes go to a temporary file in the target's directory, which is
//!   flushed to disk (`fsync`) and renamed over the target, and then the directory is flushed,
//!   so that after a crash, a kill or a power cut the target is the old file or the new one,
//!   never a mix. A save that fails removes its temporary file and leaves the target as it was.
//! - **Checksums.** A 32-byte header of our own comes first: the magic `H2OSTATE`, a format
//!   version, the length and the CRC-32 of the state that follows, and a CRC-32 of the header
//!   itself, written over a placeholder once the state has streamed through the CRC.
//!   [`open_checked`] verifies all of it in one pass over the file before a byte of the state
//!   reaches llama.cpp (a second pass then streams it into the cache, checked once more on the
//!   way), so a damaged file is refused as "damaged" and a cut one as "truncated (N of M
//!   bytes)", naming the file, with the session unchanged. Checking before use costs that
//!   second read; checking section by section as llama.cpp reads would save it, but a damaged
//!   section would then be found after the ones before it had replaced the cache. The state after the header is the
//!   format the caller wrote (llama.cpp's session file, or a server slot's sequence file), so
//!   `tail -c +33 FILE` gives llama.cpp's own session file back.
//! - **Older files.** A file without the header (saved before this format) is still read, as
//!   [`Integrity::Unverified`]: nothing can check it, and callers say so.
//!
//! CRC-32 was chosen by measurement (`benches/checksum`, docs/results/saved-states/README.md): the cheapest of
//! CRC-32, XXH3-64 and BLAKE3 next to writing the file, 5 % of a flushed write, and it detects
//! every error confined to 32 consecutive bits, so every flipped byte, with certainty.

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufReader, BufWriter, Read, Seek, SeekFrom, Write};
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

/// What a file's first bytes say about it.
enum Head {
    /// No header of ours: a state saved before checked state files.
    Unverified,
    /// A valid header for a state of `len` bytes whose CRC-32 is `crc`.
    Checked { len: u64, crc: u32 },
}

/// Reads the header at the start of a file of `file_len` bytes whose first bytes are `head` (all
/// of them, up to [`HEADER_BYTES`]). The error says "damaged" or "truncated (N of M bytes)".
fn read_head(head: &[u8], file_len: u64) -> Result<Head, String> {
    if file_len == 0 {
        return Err("truncated (0 bytes): the file is empty".into());
    }
    if file_len < MAGIC.len() as u64 && MAGIC.starts_with(head) {
        return Err(format!(
            "truncated ({file_len} of at least {HEADER_BYTES} bytes): the file ends inside its header"
        ));
    }
    if !head.starts_with(MAGIC) {
        return Ok(Head::Unverified);
    }
    if file_len < HEADER_BYTES as u64 {
        return Err(format!(
            "truncated ({file_len} of at least {HEADER_BYTES} bytes): the file ends inside its header"
        ));
    }
    let h = &head[..HEADER_BYTES];
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
    let len = u64_at(h, 16);
    let expected = HEADER_BYTES as u64 + len;
    if file_len < expected {
        return Err(format!(
            "truncated ({file_len} of {expected} bytes): the file was cut short after it was saved"
        ));
    }
    if file_len > expected {
        return Err(format!(
            "damaged: {} bytes follow the {expected} bytes its header describes",
            file_len - expected
        ));
    }
    Ok(Head::Checked {
        len,
        crc: u32_at(h, 24),
    })
}

const CONTENT_DAMAGED: &str =
    "damaged: its content does not match its checksum (the file changed after it was saved)";

/// Checks `bytes` (a whole file): the state after a valid header, or all of `bytes`, unverified,
/// when there is no header. The error says "damaged" or "truncated (N of M bytes)".
pub(crate) fn check(bytes: &[u8]) -> Result<Checked<'_>, String> {
    let head = &bytes[..bytes.len().min(HEADER_BYTES)];
    match read_head(head, bytes.len() as u64)? {
        Head::Unverified => Ok(Checked {
            state: bytes,
            integrity: Integrity::Unverified,
        }),
        Head::Checked { crc, .. } => {
            let state = &bytes[HEADER_BYTES..];
            if crc32(state) != crc {
                return Err(CONTENT_DAMAGED.into());
            }
            Ok(Checked {
                state,
                integrity: Integrity::Verified,
            })
        }
    }
}

/// Pieces of at most this size are read or written at a time: what a save or a load holds
/// besides the state itself.
const PIECE_BYTES: usize = 4 << 20;

/// A state file opened for reading after its whole content was checked: the reader starts at
/// the caller's format (after our header), and [`StateReader::finish`] says whether what was
/// read is still what was checked.
pub(crate) struct StateReader {
    file: BufReader<File>,
    /// bytes of the state not read yet
    remaining: u64,
    /// the CRC-32 the header promised, computed again over what the caller reads
    crc: Option<(u32, Hasher)>,
    pub integrity: Integrity,
}

/// Opens the state file at `path` and checks all of it (one pass over the file in pieces of a
/// few MiB, computing its CRC-32) before a byte of it is handed on. Errors as [`check`]'s, or
/// the system's reason the file cannot be read.
pub(crate) fn open_checked(path: &Path) -> Result<StateReader, String> {
    let mut file = File::open(path).map_err(|e| e.to_string())?;
    let file_len = file.metadata().map_err(|e| e.to_string())?.len();
    let mut head = [0u8; HEADER_BYTES];
    let n_head = read_up_to(&mut file, &mut head).map_err(|e| e.to_string())?;
    let (start, remaining, crc, integrity) = match read_head(&head[..n_head], file_len)? {
        Head::Unverified => (0, file_len, None, Integrity::Unverified),
        Head::Checked { len, crc } => {
            let mut hasher = Hasher::new();
            let mut buf = vec![0u8; PIECE_BYTES];
            let mut left = len;
            while left > 0 {
                let n = left.min(PIECE_BYTES as u64) as usize;
                file.read_exact(&mut buf[..n])
                    .map_err(|e| format!("reading it failed after {} bytes: {e}", len - left))?;
                hasher.update(&buf[..n]);
                left -= n as u64;
            }
            if hasher.finalize() != crc {
                return Err(CONTENT_DAMAGED.into());
            }
            (
                HEADER_BYTES as u64,
                len,
                Some((crc, Hasher::new())),
                Integrity::Verified,
            )
        }
    };
    file.seek(SeekFrom::Start(start))
        .map_err(|e| e.to_string())?;
    Ok(StateReader {
        file: BufReader::with_capacity(1 << 20, file),
        remaining,
        crc,
        integrity,
    })
}

/// Fills `buf` as far as the file goes; returns how many bytes were read.
fn read_up_to(file: &mut File, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match file.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

impl StateReader {
    /// Bytes of the state not read yet.
    pub fn remaining(&self) -> u64 {
        self.remaining
    }

    /// Fills `dst` with the next bytes of the state; an error where the state ends first.
    pub fn read(&mut self, dst: &mut [u8]) -> io::Result<()> {
        if dst.len() as u64 > self.remaining {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "the state ends {} bytes before what was asked for",
                    dst.len() as u64 - self.remaining
                ),
            ));
        }
        self.file.read_exact(dst)?;
        if let Some((_, hasher)) = &mut self.crc {
            hasher.update(dst);
        }
        self.remaining -= dst.len() as u64;
        Ok(())
    }

    /// After the whole state was read: an error if it differs from what was checked when the
    /// file was opened (the file was changed in between).
    pub fn finish(self) -> Result<(), String> {
        if self.remaining > 0 {
            return Err(format!(
                "{} bytes of the state were not read",
                self.remaining
            ));
        }
        match self.crc.map(|(crc, hasher)| (crc, hasher.finalize())) {
            Some((crc, got)) if got != crc => Err(
                "damaged: the file changed while it was read (its content no longer matches its \
                 checksum)"
                    .into(),
            ),
            _ => Ok(()),
        }
    }
}

/// Where a save streams its state: the temporary file behind a placeholder header, every byte
/// counted and added to the CRC-32 as it passes.
pub(crate) struct StateWriter {
    file: BufWriter<File>,
    len: u64,
    hasher: Hasher,
}

impl StateWriter {
    /// Appends `bytes` to the state.
    pub fn write(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.hasher.update(bytes);
        self.file.write_all(bytes)?;
        self.len += bytes.len() as u64;
        Ok(())
    }

    /// Writes the real header over the placeholder and flushes the file to disk; returns the
    /// file's length.
    fn finish(self) -> io::Result<u64> {
        let mut file = self.file.into_inner().map_err(|e| e.into_error())?;
        let len = usize::try_from(self.len)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "state too large"))?;
        file.seek(SeekFrom::Start(0))?;
        file.write_all(&header(len, self.hasher.finalize()))?;
        file.sync_all()?;
        Ok(HEADER_BYTES as u64 + self.len)
    }
}

/// Writes `state` (the parts one after another) to `path` as [`write_atomic_with`] does.
#[cfg(test)]
fn write_atomic(path: &Path, parts: &[&[u8]]) -> Result<u64, String> {
    write_atomic_with(path, |w| {
        for p in parts {
            w.write(p).map_err(|e| e.to_string())?;
        }
        Ok(())
    })
}

/// Writes the state that `fill` streams into its [`StateWriter`] to `path` behind a checked
/// header, atomically: through a temporary file in the same directory that is flushed to disk
/// and renamed over `path`. Nothing but pieces of a few MiB is held besides what `fill` hands
/// over. Returns the bytes written. On any error (`fill`'s own included) before the rename the
/// temporary file is removed and `path` is as it was; the message says which step failed and
/// what `path` holds.
pub(crate) fn write_atomic_with(
    path: &Path,
    fill: impl FnOnce(&mut StateWriter) -> Result<(), String>,
) -> Result<u64, String> {
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
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .map_err(|e| {
            format!(
                "cannot create a temporary file in {}: {e}; the file is unchanged",
                dir.display()
            )
        })?;
    let written = write_streamed(file, fill);
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

/// A placeholder header, the state `fill` streams, then the real header: the file's length.
fn write_streamed(
    mut file: File,
    fill: impl FnOnce(&mut StateWriter) -> Result<(), String>,
) -> Result<u64, String> {
    file.write_all(&[0u8; HEADER_BYTES])
        .map_err(|e| e.to_string())?;
    let mut w = StateWriter {
        file: BufWriter::with_capacity(1 << 20, file),
        len: 0,
        hasher: Hasher::new(),
    };
    fill(&mut w)?;
    w.finish().map_err(|e| e.to_string())
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
