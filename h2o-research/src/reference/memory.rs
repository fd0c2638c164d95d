//! The seed rule's memory sets (seed rule item 5): how `M_c` is built from the scores after chunk `c`.

use std::ops::Range;

use super::H2oParams;

/// The engine's memory set, which the reference builds as well.
pub use h2o_llama::MemorySet;

/// Builds `M_c` after a chunk ending at `chunk_end` (seed rule item 5): `Local = [max(end − L, 0), end)`;
/// `Sink = [0, sink)` minus Local; candidates = (previous memory ∪ this chunk) \ (Local ∪ Sink);
/// `Heavy` = the `H − |Sink|` candidates with the highest score, ties to the lower position;
/// result sorted, padded with −1 to `M` slots.
#[must_use]
pub fn build_memory_set(
    params: &H2oParams,
    previous: Option<&MemorySet>,
    chunk: Range<usize>,
    scores: &[f64],
) -> MemorySet {
    let local = chunk.end.saturating_sub(params.local)..chunk.end;
    let sink = 0..params.sink.min(local.start);
    let mut candidates: Vec<usize> = previous
        .into_iter()
        .flat_map(MemorySet::positions)
        .chain(chunk.clone())
        .collect();
    candidates.sort_unstable();
    candidates.dedup();
    candidates.retain(|p| !local.contains(p) && !sink.contains(p));
    // Highest score first; equal scores: lower position first.
    candidates.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    candidates.truncate(params.heavy - sink.len());
    let mut positions: Vec<usize> = local.chain(sink).chain(candidates).collect();
    positions.sort_unstable();
    let mut slots: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
    slots.resize(params.memory_size(), -1);
    MemorySet { slots }
}
