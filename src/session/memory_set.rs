//! A memory set as the engine stores it ([`MemorySet`]), and the engine's own rule that builds one
//! ([`engine_build_memory_set`]: `ggml_h2o_build_memory_set`, the code the CPU kernel and the KV
//! cache run), callable on plain data, so that tests can hold it against the plain-Rust reference
//! (`h2o_research::reference::build_memory_set`) on inputs no model would produce: ties,
//! all-equal and extreme scores, odd chunk sizes, L or H of zero.

#[cfg(not(feature = "stock"))]
use std::ops::Range;

#[cfg(not(feature = "stock"))]
use crate::error::{Error, Result};

/// A memory set as stored by the engine: `M` slots of ascending positions, unused slots −1.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MemorySet {
    pub slots: Vec<i32>,
}

impl MemorySet {
    /// The positions in use, ascending.
    pub fn positions(&self) -> impl Iterator<Item = usize> + '_ {
        self.slots.iter().filter(|&&p| p >= 0).map(|&p| p as usize)
    }
}

/// Builds `M_c` after the chunk `chunk` the way the engine does. `scores` holds the BF16 score of
/// every position (bits, index = position); `previous` is `M_{c-1}` (L + H slots) or `None` for
/// the first chunk; positions `0 .. sink` are always kept, out of the heavy budget.
///
/// # Errors
/// [`Error::InvalidConfig`] when the inputs are not a state the engine can be in: L + H = 0,
/// the chunk beyond the scores, a previous set of the wrong size or with positions outside
/// `0..chunk.start` (the engine itself only ever hands it valid ones).
#[cfg(not(feature = "stock"))]
pub fn engine_build_memory_set(
    scores: &[u16],
    previous: Option<&MemorySet>,
    local: usize,
    heavy: usize,
    sink: usize,
    chunk: Range<usize>,
) -> Result<MemorySet> {
    let bad = |m: String| Err(Error::InvalidConfig(m));
    let m = local + heavy;
    if m == 0 || i32::try_from(m).is_err() {
        return bad(format!(
            "L + H = {m}: the memory needs 1 ..= i32::MAX slots"
        ));
    }
    if chunk.start > chunk.end || chunk.end > scores.len() || i32::try_from(chunk.end).is_err() {
        return bad(format!(
            "chunk {chunk:?} is not inside the {} scored positions",
            scores.len()
        ));
    }
    if sink > heavy {
        return bad(format!(
            "sink {sink} is larger than the heavy budget {heavy}"
        ));
    }
    let mut slots = vec![-1i32; m];
    if let Some(prev) = previous {
        if prev.slots.len() != m {
            return bad(format!(
                "the previous memory set has {} slots, not L + H = {m}",
                prev.slots.len()
            ));
        }
        if let Some(&p) = prev
            .slots
            .iter()
            .find(|&&p| p < -1 || (p >= 0 && p as usize >= chunk.start))
        {
            return bad(format!(
                "the previous memory set holds {p}, outside 0..{} (or -1)",
                chunk.start
            ));
        }
        slots.copy_from_slice(&prev.slots);
    }
    let bf16: Vec<crate::sys::ggml_bf16_t> = scores
        .iter()
        .map(|&bits| crate::sys::ggml_bf16_t { bits })
        .collect();
    // SAFETY: every position the rule reads is below chunk.end <= scores.len() (the chunk's own)
    // or a previous slot checked above to be below chunk.start; `slots` has the L + H entries it
    // writes. The sizes fit i32 (checked).
    unsafe {
        crate::sys::ggml_h2o_build_memory_set(
            bf16.as_ptr(),
            slots.as_mut_ptr(),
            local as i32,
            heavy as i32,
            sink as i32,
            chunk.start as i32,
            chunk.end as i32,
            previous.is_some(),
        );
    }
    Ok(MemorySet { slots })
}
